r"""Mixture-of-experts decoders: Mixtral, Qwen2-MoE and OLMoE (transformers' fused 3-D expert tensors).

A sparse layer ``i`` (under ``layers.{i}.mlp``) holds

* ``gate.weight`` ``(E, D)``: the router. ``z = W_r x``, ``p = softmax(z)`` over the ``E``
  experts, the top-``k`` experts by ``p``, weighted by ``p_e`` or, renormalised, by
  ``p_e / sum_{top-k} p`` (Mixtral always; Qwen2-MoE and OLMoE with ``norm_topk_prob``);
* ``experts.gate_up_proj`` ``(E, 2F, D)`` (rows ``[gate | up]``: ``chunk(2)`` of the output)
  and ``experts.down_proj`` ``(E, D, F)``: expert ``e`` computes
  ``D_e (act(G_e x) * (U_e x))``;
* Qwen2-MoE only: ``shared_expert.{gate,up,down}_proj`` (a plain gated FF of width
  ``F_s``, every token) scaled by ``sigmoid(shared_expert_gate.weight x)`` (``(1, D)``).

The block's output is ``sum_{e in top-k} w_e D_e h_e(x)`` (plus the gated shared expert).

**Exact group of the block** (besides the residual stream):

* ``experts.i``: ``S_E``, one permutation ``pi`` on the router's rows and on axis 0 of
  both expert tensors (softmax, top-``k`` and the renormalisation are equivariant, so
  ``norm_topk_prob`` either way keeps it);
* ``expert_ff.i``: ``(S_F)^E`` (:class:`~symalign.groups.BlockPermutations`), the units of
  each expert: the same permutation on the rows of the gate half and of the up half of
  ``gate_up_proj[e]`` and on the columns of ``down_proj[e]``; coupled to ``experts.i``
  (``W'[e] = sigma_e W[pi(e)]``);
* ``shared_ff.i``: ``S_{F_s}`` on the shared expert's units (Qwen2-MoE).

Routing is discrete: the group has dimension 0 and the probe sees no continuous
direction from it. Two continuous symmetries of the block are not declared (they do not
help alignment; :meth:`MoEFamily.block_gauge` names them for the probe): the router's
softmax shift ``W_r -> W_r + 1 c^T`` (``D``) and the rescaling of a gated unit's up row
by ``c`` and its down column by ``1 / c`` (``E F + F_s``).

**Residual stream**: RMSNorm pre-norms, so the gains fold into their readers (the
router's columns, ``gate_up_proj``'s last axis, the shared expert's gate/up and
``shared_expert_gate``) and the stream has ``O(D)``, acting on those readers' ``D`` axes
and on the writers' (``down_proj`` axis 1, the shared ``down_proj`` rows); a tied head
gives ``S_D`` with the gains permuted. Qwen2-MoE's dense layers (``mlp_only_layers``,
``decoder_sparse_step``) are Llama's gated FF (``ff.i``). Attention is Llama's (Mixtral,
Qwen2-MoE with ``qkv_bias``) or OLMo 2's QK-norm over all heads (OLMoE; pre-norms).
OLMoE's ``clip_qkv`` (``q, k, v <- clamp(., -c, c)`` entrywise, after the QK-norm, before
RoPE) keeps only what commutes with a clamp, i.e. signed coordinate permutations: the head
permutations (with the gains), the QK-norm's plane signs on Q-K, and a signed permutation
of each head's ``d`` value coordinates on V-O (:class:`~symalign.groups.SignedPermutations`
instead of ``GL(d)``); the gain scales ``qkgain.i`` are not declared (a scale does not
commute with the clamp).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

import torch
from torch import Tensor

from symalign.errors import CheckpointError
from symalign.arch.base import AttentionLayout
from symalign.families.base import Decoder, Family
from symalign.families.common import RESIDUAL, Prepared, meet
from symalign.families.declared import TOKENS, Case, Tiny
from symalign.groups import BlockPermutations, GeneralLinear, MatrixGroup, Orthogonal, Permutation, \
    SignedPermutations
from symalign.spec import SymmetrySpec


@dataclass(frozen=True)
class Experts:
    """Where a sparse layer's tensors live (relative to the layer; ``None``: absent).

    ``router``/``shared_gate``: ``nn.Linear`` modules (``.weight`` appended);
    ``gate_up``/``down``: the stacked parameters themselves; ``shared``: the module of a
    plain gated FF (``gate_proj``, ``up_proj``, ``down_proj``). On disk (what
    ``save_pretrained`` writes) the block is ``disk_block`` (Mixtral: ``block_sparse_moe``) and
    each expert ``e`` is three matrices ``experts.{e}.{gate,up,down}`` named ``disk_ffn``.
    """

    router: str = "mlp.gate"
    gate_up: str = "mlp.experts.gate_up_proj"
    down: str = "mlp.experts.down_proj"
    shared: str | None = None
    shared_gate: str | None = None
    disk_block: str = "mlp"
    disk_ffn: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    n_experts: str = "num_experts"  # the config's expert count ``E``
    top_k: str = "num_experts_per_tok"  # the config's ``k``


class MoEFamily(Family):
    """A :class:`Family` whose FF blocks are (some or all) mixtures of experts (module docstring)."""

    moe: ClassVar[Experts] = Experts()

    @property
    def precision_floor(self) -> float:  # type: ignore[override]
        """transformers' routers take the softmax (and the top-k weights) in float32 whatever the weights' dtype,
        on top of the float32 RMSNorm: ``~1e-7`` per layer (measured up to ``8e-7`` on 2-layer models)."""
        return 1e-5

    def function_check_config(self, config: Any) -> Any:
        """Every expert routed in the function checks (``k = E``; whole-model and streamed per-layer): the block is
        then ``sum_e w_e D_e h_e(x)`` with ``w = softmax(W_r x)`` (renormalised over all ``E``: the same
        weights), continuous in the weights. With ``k < E``, rounding the aligned layer to a
        low-precision dtype flips the choice of the tokens whose ``k``-th and ``k+1``-th router
        probabilities are closer than the rounding: a jump of the block's output, not an error of the
        transform (measured ``9.6e-2`` on a random bfloat16 Mixtral-shaped layer with ``k = 2``, above
        the stored check's bound). The transform is a symmetry for every ``k`` (the expert permutation
        commutes with top-``k``), so an exact one passes either way; with ``k = E`` the check also reads
        every expert's weights, where top-``k`` reads only the chosen ones."""
        setattr(config, self.moe.top_k, int(getattr(config, self.moe.n_experts)))
        return config

    def fused(self, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """``state`` with the experts in transformers' in-memory layout (exact; unchanged if already so).

        A checkpoint stores expert ``e`` of a layer as ``{disk_block}.experts.{e}.{gate,up,down}.weight``
        (``(F, D)``, ``(F, D)``, ``(D, F)``); the model holds ``gate_up_proj[e] = [gate; up]`` (``(E, 2F, D)``)
        and ``down_proj[e] = down`` (``(E, D, F)``), and the block under ``mlp``. Written back by
        :func:`symalign.checkpoint.config.saved_names` (transformers' own reverse conversion), or one expert at a time
        by :meth:`unfused`.
        """
        m = self.moe
        mark = "." + m.disk_block + "."
        out: dict[str, Tensor] = {}
        experts: dict[str, dict[tuple[int, str], Tensor]] = {}
        for k, v in state.items():
            key = self.expert_key(k)
            if key is not None:
                experts.setdefault(key[0], {})[key[1:]] = v
                continue
            lp, sep, tail = k.partition(mark)
            out[lp + ".mlp." + tail if sep else k] = v
        gate, up, down = m.disk_ffn
        for lp, parts in experts.items():
            n = 1 + max(e for e, _ in parts)
            missing = [self.expert_name(lp, e, w) for e in range(n) for w in m.disk_ffn if (e, w) not in parts]
            if missing:
                raise CheckpointError(f"{self.family}: expert tensor {missing[0]!r} is missing")
            out[lp + m.gate_up] = torch.stack([torch.cat([parts[(e, gate)], parts[(e, up)]]) for e in range(n)])
            out[lp + m.down] = torch.stack([parts[(e, down)] for e in range(n)])
        return out

    def expert_key(self, name: str) -> tuple[str, int, str] | None:
        """``(layer prefix, expert, tensor)`` of a tensor stored one per expert, ``tensor`` one of
        ``disk_ffn`` (gate, up, down); ``None`` for any other name. The layer prefix ends with ``.``."""
        m = self.moe
        lp, sep, tail = name.partition("." + m.disk_block + ".")
        hit = re.match(r"^experts\.(\d+)\.(" + "|".join(map(re.escape, m.disk_ffn)) + r")\.weight$", tail) \
            if sep else None
        return (lp + ".", int(hit.group(1)), hit.group(2)) if hit else None

    def expert_name(self, lp: str, e: int, tensor: str) -> str:
        """The stored name of expert ``e``'s ``tensor`` (one of ``disk_ffn``) in the layer at prefix ``lp``."""
        return f"{lp}{self.moe.disk_block}.experts.{e}.{tensor}.weight"

    def unfused(self, lp: str, e: int, gate_up: Tensor, down: Tensor) -> dict[str, Tensor]:
        """Expert ``e``'s stored tensors (views) from its slices ``gate_up_proj[e]`` (``(2F, D)``) and
        ``down_proj[e]`` (``(D, F)``) of the layer at ``lp``: the inverse of :meth:`fused` for one expert."""
        gate, up, down_name = self.moe.disk_ffn
        f = gate_up.shape[0] // 2
        return {self.expert_name(lp, e, gate): gate_up[:f], self.expert_name(lp, e, up): gate_up[f:],
                self.expert_name(lp, e, down_name): down}

    def prepare(self, config: Any, state: Mapping[str, Tensor], att: SymmetrySpec,
                arch: str | None = None) -> Prepared:
        """:meth:`Family.prepare` on the in-memory expert layout (:meth:`fused`)."""
        return super().prepare(config, self.fused(state), att, arch)

    def sparse(self, s: Mapping[str, Tensor], lp: str) -> bool:
        """Whether the layer at prefix ``lp`` is a mixture of experts (its router is in the state)."""
        return lp + self.moe.router + ".weight" in s

    def _reads_writes(self, config: Any, s: Mapping[str, Tensor], lp: str):
        """``(attention readers, FF readers, writers)``: ``(tensor, D axis)`` lists of the layer at ``lp``."""
        dec, m = self.declaration(config), self.moe
        attn = [(lp + n + ".weight", 1) for n in dec.readers_attn()]
        writers = [(t, 0) for t in (lp + dec.o + ".weight", lp + dec.o + ".bias") if t in s]
        if self.sparse(s, lp):
            ff = [(lp + m.router + ".weight", 1), (lp + m.gate_up, 2)]
            writers.append((lp + m.down, 1))
            if m.shared and lp + m.shared + ".down_proj.weight" in s:
                ff += [(lp + m.shared + n, 1) for n in (".gate_proj.weight", ".up_proj.weight")]
                ff.append((lp + m.shared_gate + ".weight", 1))  # type: ignore[operator]
                writers.append((lp + m.shared + ".down_proj.weight", 0))
        else:
            ff = [(lp + n + ".weight", 1) for n in (dec.gate, dec.up)]  # type: ignore[operator]
            writers.append((lp + dec.down + ".weight", 0))
        return attn, ff, writers

    def _permuted_stream(self, spec: SymmetrySpec, config: Any, s: Mapping[str, Tensor], p: str,
                         head: str | None) -> None:
        dec = self.declaration(config)
        spec.add_space(RESIDUAL, Permutation(int(config.hidden_size)), "residual")
        spec.act_on(p + dec.embed + ".weight", RESIDUAL, 1)
        if head is not None:
            spec.act_on(head, RESIDUAL, 1)
        norms = [p + dec.final_norm]
        for i in range(int(config.num_hidden_layers)):
            lp = p + dec.layer.format(i=i)
            attn, ff, writers = self._reads_writes(config, s, lp)
            for t, axis in attn + ff + writers:
                spec.act_on(t, RESIDUAL, axis)
            norms += [lp + n for n in (dec.pre_attn_norm, dec.pre_ff_norm) if n]
        for n in norms:
            spec.act_on(n + ".weight", RESIDUAL, 0)

    def _folded_stream(self, spec: SymmetrySpec, config: Any, s: dict[str, Tensor], p: str, head: str) -> None:
        dec = self.declaration(config)
        spec.add_space(RESIDUAL, Orthogonal(int(config.hidden_size)), "residual")
        spec.act_on(p + dec.embed + ".weight", RESIDUAL, 1, "co")
        folds = [(p + dec.final_norm, [(head, 1)])]
        for i in range(int(config.num_hidden_layers)):
            lp = p + dec.layer.format(i=i)
            attn, ff, writers = self._reads_writes(config, s, lp)
            folds += [(lp + dec.pre_attn_norm, attn), (lp + dec.pre_ff_norm, ff)]  # type: ignore[operator]
            for t, axis in writers:
                spec.act_on(t, RESIDUAL, axis, "co")
        for norm, readers in folds:  # RMS(x) * g read by W: W diag(g) on W's D axis, the gain set to 1
            g = s[norm + ".weight"]
            for t, axis in readers:
                shape = [1] * s[t].dim()
                shape[axis] = -1
                w_t, g_t = meet(s[t], g)
                s[t] = w_t * g_t.view(shape)
                spec.act_on(t, RESIDUAL, axis, "contra")
            s[norm + ".weight"] = torch.ones_like(g)

    def _ff_spaces(self, spec: SymmetrySpec, config: Any, s: Mapping[str, Tensor], p: str) -> None:
        dec, m = self.declaration(config), self.moe
        for i in range(int(config.num_hidden_layers)):
            lp = p + dec.layer.format(i=i)
            if not self.sparse(s, lp):  # a dense gated FF (Qwen2-MoE's mlp_only_layers)
                f = int(s[lp + dec.down + ".weight"].shape[1])
                spec.add_space(f"ff.{i}", Permutation(f), "ff", i)
                for n in (dec.gate, dec.up):
                    spec.act_on(lp + n + ".weight", f"ff.{i}", 0)  # type: ignore[operator]
                spec.act_on(lp + dec.down + ".weight", f"ff.{i}", 1, "contra")
                continue
            gate_up, down = lp + m.gate_up, lp + m.down
            E, f = int(s[down].shape[0]), int(s[down].shape[2])
            ex, units = f"experts.{i}", f"expert_ff.{i}"
            spec.add_space(ex, Permutation(E), "experts", i)
            spec.add_space(units, BlockPermutations(E, f), "ff", i)
            for t in (lp + m.router + ".weight", gate_up, down):  # experts first, then the units inside each
                spec.act_on(t, ex, 0)
            for seg in ((0, f), (f, f)):  # the same unit permutation on the gate and the up half
                spec.act_on(gate_up, units, 1, "co", None, seg)
            spec.act_on(down, units, 2, "contra")
            spec.couple(ex, units)
            if m.shared and lp + m.shared + ".down_proj.weight" in s:
                sh = f"shared_ff.{i}"
                fs = int(s[lp + m.shared + ".down_proj.weight"].shape[1])
                spec.add_space(sh, Permutation(fs), "ff", i)
                for n in (".gate_proj.weight", ".up_proj.weight"):
                    spec.act_on(lp + m.shared + n, sh, 0)
                spec.act_on(lp + m.shared + ".down_proj.weight", sh, 1, "contra")

    def block_gauge(self, config: Any, s: Mapping[str, Tensor], i: int) -> dict[str, int]:
        """Continuous null directions of sparse layer ``i``'s FF block that no declared space covers (module doc):
        the router's softmax shift (``D``) and the gated units' up/down rescalings (``E F + F_s``)."""
        dec, m = self.declaration(config), self.moe
        lp = self.prefix(set(s)) + dec.layer.format(i=i)
        down = s[lp + m.down]
        units = int(down.shape[0]) * int(down.shape[2])
        if m.shared and lp + m.shared + ".down_proj.weight" in s:
            units += int(s[lp + m.shared + ".down_proj.weight"].shape[1])
        return {"router softmax shift": int(config.hidden_size), "gated unit rescaling (up row, down column)": units}


# tiny mixtures of experts (the special-case tests, tests/test_family_moe.py): D = 16, 4 experts, top-2
_TINY = {"hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 256, "max_position_embeddings": 64, "num_experts_per_tok": 2, **TOKENS}
# the docs tables' rows: layer 0's attention at probe widths (one K/V head), and layer 0's MoE block at D = 8
_PROBE = {"head_dim": 4, "num_key_value_heads": 1}
_BLOCK = {"hidden_size": 8, "intermediate_size": 4}


class MixtralFamily(MoEFamily):
    family = "Mixtral"
    model_types = ("mixtral",)
    decl = Decoder()
    moe = Experts(disk_block="block_sparse_moe", disk_ffn=("w1", "w3", "w2"), n_experts="num_local_experts")
    tiny = Tiny("MixtralForCausalLM", "MixtralConfig", {**_TINY, "intermediate_size": 8, "num_local_experts": 4})
    probe_kw = _PROBE
    cases = (Case(exact=False, row="Mixtral (GQA)"),
             Case(_BLOCK, exact=False, moe=True, row="Mixtral (renormalised top-2)"))


class Qwen2MoeFamily(MoEFamily):
    family = "Qwen2-MoE"
    model_types = ("qwen2_moe",)
    decl = Decoder(qkv_bias=True)
    moe = Experts(shared="mlp.shared_expert", shared_gate="mlp.shared_expert_gate")
    tiny = Tiny("Qwen2MoeForCausalLM", "Qwen2MoeConfig", {**_TINY, "intermediate_size": 12, "moe_intermediate_size": 8,
                                                           "shared_expert_intermediate_size": 6, "num_experts": 4})
    probe_kw = {**_PROBE, "moe_intermediate_size": 4, "shared_expert_intermediate_size": 4}
    cases = (Case(exact=False, row="Qwen2-MoE (GQA, Q/K/V biases)"),
             Case(_BLOCK, exact=False, moe=True, row="Qwen2-MoE (shared expert F_s = 4)"),
             Case({**_BLOCK, "norm_topk_prob": True}, exact=False, moe=True, row="Qwen2-MoE, norm_topk_prob"))

    def declaration(self, config: Any) -> Decoder:
        """Q/K/V biases follow ``qkv_bias`` (not ``attention_bias``)."""
        return dataclasses.replace(self.decl, qkv_bias=bool(getattr(config, "qkv_bias", True)))


class OlmoeFamily(MoEFamily):
    family = "OLMoE"
    model_types = ("olmoe",)
    decl = Decoder(q_norm="self_attn.q_norm", k_norm="self_attn.k_norm", qk_norm_over="all")
    tiny = Tiny("OlmoeForCausalLM", "OlmoeConfig", {**_TINY, "intermediate_size": 8, "num_experts": 4})
    probe_kw = {"num_key_value_heads": 1, "rms_norm_eps": 1e-2}  # eps: declared.PROBE
    cases = (Case(exact=False, row="OLMoE (QK-norm over all heads)"),
             Case(_BLOCK, exact=False, moe=True, row="OLMoE"))

    def vo_group(self, config: Any, d: int) -> MatrixGroup:
        """``clip_qkv`` clamps every V entry: only signed permutations of a head's ``d`` value coordinates commute."""
        return SignedPermutations(d) if _clip(config) is not None else GeneralLinear(d)

    def extra_spaces(self, spec: SymmetrySpec, config: Any, prefix: str, layouts: list[AttentionLayout]) -> None:
        """The QK-norm gains, permuted with the heads, and their scales ``qkgain.i`` except under ``clip_qkv``
        (a positive scale does not commute with the clamp that follows the gain)."""
        self._gain_spaces(spec, config, prefix, layouts, scales=_clip(config) is None)


def _clip(config: Any) -> float | None:
    return getattr(config, "clip_qkv", None)


__all__ = ["Experts", "MixtralFamily", "MoEFamily", "OlmoeFamily", "Qwen2MoeFamily"]
