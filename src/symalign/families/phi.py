r"""Phi (phi-1, phi-1.5, phi-2): partial rotary, parallel attention + FF behind one LayerNorm, biases.

Layout (``model.`` prefix): ``layers.{i}.self_attn.{q,k,v}_proj`` (biases),
``self_attn.dense`` (O, bias), ``mlp.fc1``/``mlp.fc2`` (biases), ``input_layernorm``
read by both branches, ``final_layernorm``, ``embed_tokens``, ``lm_head`` (bias).
RoPE ``rotate_half`` on ``r = 2 len(inv_freq)`` dimensions (``partial_rotary_factor``):
``H(r) (+) GL(d - r)`` on Q-K. Residual ``O_1(D)`` after folding the LayerNorms.

``qk_layernorm=True`` puts a LayerNorm ``self_attn.{q,k}_layernorm`` (centring, gain and
bias over ``head_dim``, shared by the heads) on every Q and K head before RoPE:
``q = RoPE(g_q * C W_Q^i x / sigma + beta_q)``. The exact group (docs/symmetry.md, "A
centring QK-norm"): head permutations (nothing else moves), the identity on each
head's pre-norm Q-K rows (:class:`~symalign.groups.PlaneIdentity`), ``GL(d)`` on V-O,
and per-plane rescalings of the *affine* norms, ``(g_q, beta_q) -> c (g_q, beta_q)``,
``(g_k, beta_k) -> (g_k, beta_k) / c`` (``qkgain.i``, one element per layer). Not group
orbits on the spec's axes, named by :meth:`PhiFamily.gauge_nullity`: the centring gauge
``W_Q^i -> W_Q^i + 1 v^T``, ``b_Q^i -> b_Q^i + c 1`` (``D + 1`` per Q and per K head,
removed exactly by ``C``) and the unrotated part of ``beta_k`` (a per-query constant on
the scores, ``d - r``). ``--scope model``'s exact rewrite (:meth:`PhiFamily.prepare`) fixes
the centring gauge canonically -- every Q/K head's rows and bias centred along ``1``
(``W^i -> C W^i``, ``b^i -> C b^i``) -- in both models, so the aligned pair agrees in it
(the distance's exact minimum over the gauge); ``--scope attention`` leaves it as it is.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Iterable, Mapping

import torch
from torch import Tensor

from symalign.arch.base import AttentionLayout, find_prefix
from symalign.families.base import Decoder, Family
from symalign.families.common import Prepared
from symalign.families.declared import DECODER, Case, Tiny
from symalign.groups import MatrixGroup, PlaneIdentity
from symalign.spec import SymmetrySpec

QK_LN = ("self_attn.q_layernorm", "self_attn.k_layernorm")


def _qk_layernorm(config: Any) -> bool:
    return bool(getattr(config, "qk_layernorm", False))


class PhiFamily(Family):
    family = "Phi"
    model_types = ("phi",)
    decl = Decoder(o="self_attn.dense", gate=None, up=None, ff_in="mlp.fc1", down="mlp.fc2", norm="layer",
                   pre_attn_norm="input_layernorm", pre_ff_norm="input_layernorm", final_norm="final_layernorm")
    tiny = Tiny("PhiForCausalLM", "PhiConfig", dict(DECODER))
    cases = (Case(probe=True, groups={"qk.0": "H(4,half)+GL(4)^4"}, residual="O_1(32)",
                  row="Phi (partial 0.5, biases)"),
             Case({"partial_rotary_factor": 1.0}),
             Case({"qk_layernorm": True}, exact=False, residual="O_1(32)", streamed=("big", "merge"),
                  row="Phi + qk_layernorm (affine QK-norm)"))

    def declaration(self, config: Any) -> Decoder:
        """With ``qk_layernorm``, the Q/K norms are declared (``q_norm``/``k_norm``; over ``head_dim``, shared)."""
        return replace(self.decl, q_norm=QK_LN[0], k_norm=QK_LN[1]) if _qk_layernorm(config) else self.decl

    def qk_group(self, config: Any, d: int, r: int | None) -> MatrixGroup:
        if _qk_layernorm(config):
            return PlaneIdentity(d, "half", r if r is not None else 0)
        return super().qk_group(config, d, r)

    def extra_spaces(self, spec: SymmetrySpec, config: Any, prefix: str, layouts: list[AttentionLayout]) -> None:
        """``qkgain.i`` on both LayerNorms' gains *and* biases (``q`` side covariant, ``k`` contravariant)."""
        if not _qk_layernorm(config):
            return
        self._gain_spaces(spec, config, prefix, layouts)
        dec = self.declaration(config)
        for i in range(len(layouts)):
            p = prefix + dec.layer.format(i=i)
            spec.act_on(p + QK_LN[0] + ".bias", f"qkgain.{i}", 0, "co")
            spec.act_on(p + QK_LN[1] + ".bias", f"qkgain.{i}", 0, "contra")

    def layer_spaces(self, i: int) -> list[str]:
        return [f"heads.{i}", f"qk.{i}", f"vo.{i}", f"qkgain.{i}"]  # qkgain.i only where declared (qk_layernorm)

    def gauge_nullity(self, config: Any, keys: Iterable[str], i: int) -> dict[str, int]:
        """:func:`~symalign.families.base.bias_gauge`, and with ``qk_layernorm`` the centring gauge of every Q and
        K head (``D`` row directions ``+ 1`` with its bias) and the unrotated part of ``k_layernorm.bias``."""
        keys = set(keys)
        out = super().gauge_nullity(config, keys, i)
        if not _qk_layernorm(config):
            return out
        prefix = find_prefix(keys, self.probe, self.family)
        lay = self.layouts(config, prefix, keys)[i]
        D = int(config.hidden_size)
        out["Q/K centring (rows + 1 v^T, bias + c 1)"] = (lay.n_heads * (D + bool(lay.q.bias))
                                                          + lay.n_kv_heads * (D + bool(lay.k.bias)))
        k_bias = prefix + self.decl.layer.format(i=i) + QK_LN[1] + ".bias"
        r = lay.qk.r  # type: ignore[attr-defined]
        if k_bias in keys and lay.head_dim - r:
            out["key norm bias (softmax shift)"] = lay.head_dim - r
        return out

    def rows_independent(self, config: Any) -> bool:
        """``qk_layernorm``: the Q/K head centring mixes the rows of each head."""
        return not _qk_layernorm(config)

    def prepare(self, config: Any, state: Mapping[str, Tensor], att: SymmetrySpec,
                arch: str | None = None) -> Prepared:
        """The base rewrite; with ``qk_layernorm``, also every Q/K head's rows and bias centred along ``1``
        (:func:`centre_heads`: exact, the norm centres them anyway)."""
        out = super().prepare(config, state, att, arch)
        if _qk_layernorm(config):
            keys = set(out.state)
            for lay in self.layouts(config, find_prefix(keys, self.probe, self.family), keys):
                for proj in (lay.q, lay.k):
                    for t in (proj.weight, proj.bias):
                        if t is not None and t in out.state:
                            out.state[t] = centre_heads(out.state[t], lay.head_dim)
            out.notes.append("Q/K heads centred along 1 (the gauge qk_layernorm removes)")
        return out


def centre_heads(x: Tensor, d: int) -> Tensor:
    """``x`` (rows ``(n d, ...)`` or a bias ``(n d,)``) with every block of ``d`` rows centred: ``C x^i``,
    ``C = I - 1 1^T / d`` (computed in float64, returned in ``x``'s dtype)."""
    blocks = x.to(torch.float64).reshape(-1, d, *x.shape[1:])
    return (blocks - blocks.mean(1, keepdim=True)).reshape(x.shape).to(x.dtype)
