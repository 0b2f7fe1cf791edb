r"""A model family as declared data plus small functions: :class:`Decoder` and :class:`Family`.

A family module declares one :class:`Decoder` (where every tensor of a layer lives,
which norm it uses and where it sits, how Q/K/V and the FF input are fused, whether
Q and K are normalised) and a :class:`Family` subclass with its ``model_type`` values.
Everything else is derived here, once for every family:

* **Attention** (``--scope attention``): :meth:`Family.layouts` -> per layer
  ``heads.i`` (``S_{h_kv} wr S_g``; none when :attr:`Decoder.pinned_heads`: ALiBi), ``qk.i``
  and ``vo.i`` exactly as :mod:`symalign.arch.base` labels them. Q-K is ``GL(d)`` without RoPE,
  ``H(r) (+) GL(d - r)`` under RoPE (``r`` read from the family's own rotary module,
  per layer: :meth:`Family.rotary_layers`),
  and :class:`~symalign.groups.PlaneSigns` under QK-norm, whose gains then carry a
  space ``qkgain.i`` of :class:`~symalign.groups.PlaneScales` (docs/symmetry.md,
  "QK-norm"; Phi's centring ``qk_layernorm``: :class:`~symalign.groups.PlaneIdentity`,
  the gains' scales acting on the norms' biases too: Phi's ``qk_layernorm``).
  V-O is ``GL(d)`` (:meth:`Family.vo_group`; OLMoE's ``clip_qkv`` narrows it to signed
  permutations and drops ``qkgain.i``). Fused Q|K|V tensors are labelled by segments:
  ``[Q | K | V]`` blocks (Phi-3 ``qkv_proj``) or per-head interleaved
  ``(head, [q | k | v])`` (GPT-NeoX ``query_key_value``, ``segment=(start, d, 3 d)``).
  ``Conv1D`` weights (GPT-2, ``conv1d=True``) store ``W^T``: every declared axis is
  transposed (Q/K/V heads on axis 1, O on axis 0), in both scopes.
* **Whole model** (``--scope model``): :meth:`Family.prepare` rewrites the checkpoint
  exactly and adds ``ff.i`` (FF unit permutations; gated, fused gate|up, or plain with
  biases) and the residual stream's group ``residual``:

  - pre-norms only, untied head: every norm gain folded into its readers
    (``RMS``: ``O(D)``; ``LayerNorm``: gains and biases folded, ``O_1(D)``, a bias
    behind a bias-free reader kept as ``b / g``, covariant);
  - LayerNorm with a tied head: as above, the head untied (``tie_word_embeddings=false``);
  - post-norms on the branches (OLMo 2, Gemma 2/3) or an RMSNorm family with a tied
    head: ``S_D`` (permutations), every norm gain (and bias) permuted with the stream,
    nothing folded (a permutation commutes with the normalisation and moves the gain
    entries; the sign flips of the full signed-permutation group are not declared).

  A checkpoint without a language-model head (the bare model), or with cross-attention
  (its layers read an external stream), gets no residual space. Encoders (embeddings
  written on several axes, norms on the stream, a head per model class) declare an
  :class:`~symalign.families.encoder.Encoder` instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Iterable, Mapping

import torch
from torch import Tensor, nn

from symalign.arch.base import Adapter, AttentionLayout, Proj, UnsupportedArchitectureError, _AllKeys, \
    find_prefix, heads_of
from symalign.arch.rope import rotary_dims
from symalign.errors import ConfigError
from symalign.groups import GeneralLinear, MatrixGroup, OffsetPerHead, Orthogonal, Permutation, \
    PlaneScales, PlaneSigns, RotaryPlanes
from symalign.families.declared import Case, Experiment, Scopes, Tiny
from symalign.families.common import RESIDUAL, Prepared, back, copy_spec, ff_group, fold_layernorm, meet, to_f64
from symalign.groups import CenteredOrthogonal
from symalign.nn.sites import ActivationSite, linear_heads_site
from symalign.spec import SymmetrySpec
from symalign.tolerance import FLOAT32_COMPUTE_FLOOR

NORMS = ("rms", "rms1p", "layer")


@dataclass(frozen=True)
class Decoder:
    """Declared layout of one decoder-only family.

    Names are relative to the base model's prefix (``model.``, ``transformer.``) and the
    layer's ``layer`` (``{i}`` = index); each names a module (``.weight``/``.bias`` are
    appended). ``None`` = absent. ``heads``: top-level names of the LM head, the name
    written when a tied head is untied first. ``norm``: ``"rms"`` (gain ``g``),
    ``"rms1p"`` (Gemma: gain ``1 + w``) or ``"layer"`` (LayerNorm with bias).
    ``qk_norm_over``: ``"head"`` (a gain over ``head_dim`` shared by every head) or
    ``"all"`` (one RMSNorm over all heads' concatenation, a gain per entry).
    ``ff_act``: the config attribute naming the FF activation (ReLU units get scales).
    ``qkv_bias``: whether Q/K/V have biases when only a config is known (``None``: the
    config's ``attention_bias``); with a checkpoint, the tensors present decide.
    ``conv1d``: the layer's 2-d weights are ``Conv1D`` (GPT-2: stored ``(in, out)``,
    ``y = x W + b``), so every axis is the transpose of the ``nn.Linear`` one.
    ``positions``: other input tables written into the stream beside ``embed`` (GPT-2's
    learned ``wpe``; columns on the stream). ``ff_size``: the config attribute holding
    the FF width. ``rope``: ``False`` declares no RoPE although the family has a rotary
    module (Falcon with ``alibi``): Q-K is ``GL(d)``. ``pinned_heads``: a fixed additive
    score bias of its own in every head (ALiBi's slope) tells the heads apart, so no head
    permutation is declared (:attr:`~symalign.arch.base.AttentionLayout.pinned`).
    """

    layer: str = "layers.{i}."
    q: str | None = "self_attn.q_proj"
    k: str | None = "self_attn.k_proj"
    v: str | None = "self_attn.v_proj"
    o: str = "self_attn.o_proj"
    qkv: str | None = None
    qkv_interleaved: bool = False
    qkv_grouped: bool = False
    qkv_bias: bool | None = None
    q_norm: str | None = None
    k_norm: str | None = None
    qk_norm_over: str = "head"
    gate: str | None = "mlp.gate_proj"
    up: str | None = "mlp.up_proj"
    gate_up: str | None = None
    ff_in: str | None = None
    down: str = "mlp.down_proj"
    ff_act: str = "hidden_act"
    norm: str = "rms"
    pre_attn_norm: str | None = "input_layernorm"
    post_attn_norm: str | None = None
    pre_ff_norm: str | None = "post_attention_layernorm"
    post_ff_norm: str | None = None
    embed: str = "embed_tokens"
    final_norm: str = "norm"
    heads: tuple[str, ...] = ("lm_head",)
    base: str = "model."
    conv1d: bool = False
    positions: tuple[str, ...] = ()
    ff_size: str = "intermediate_size"
    rope: bool = True
    pinned_heads: bool = False

    @property
    def first_q(self) -> str:
        return self.layer.format(i=0) + (self.qkv or self.q) + ".weight"  # type: ignore[operator]

    def readers_attn(self) -> list[str]:
        return [self.qkv] if self.qkv else [self.q, self.k, self.v]  # type: ignore[list-item]

    def readers_ff(self) -> list[str]:
        if self.gate_up:
            return [self.gate_up]
        if self.ff_in:
            return [self.ff_in]
        return [self.gate, self.up]  # type: ignore[list-item]


class Family(Adapter):
    """An :class:`~symalign.arch.base.Adapter` that also knows the whole model (see the module docstring)."""

    decl: ClassVar[Decoder] = Decoder()
    pairing: ClassVar[str | None] = "half"
    auto_classes: ClassVar[tuple[str, ...]] = ("AutoModelForCausalLM", "AutoModel")
    # what the tests, benchmarks, docs tables and experiments read (symalign.families.declared)
    tiny: ClassVar[Tiny | None] = None
    probe_kw: ClassVar[Mapping[str, Any]] = {}
    cases: ClassVar[tuple[Case, ...]] = ()
    scopes: ClassVar[Scopes] = Scopes()
    experiment: ClassVar[Experiment | None] = None
    refusals: ClassVar[tuple[Mapping[str, Any], ...]] = ()  # config overrides refused in one line

    @property
    def precision_floor(self) -> float:  # type: ignore[override]
        """transformers' RMSNorm (and QK-norm) normalises in float32 whatever the weights' dtype."""
        return FLOAT32_COMPUTE_FLOOR if self.decl.norm != "layer" or self.decl.q_norm else 0.0

    @property
    def probe(self) -> str:  # type: ignore[override]
        return self.decl.first_q

    def declaration(self, config: Any) -> Decoder:
        """The declared layout for ``config`` (:attr:`decl`; a family whose layout depends on the config overrides)."""
        return self.decl

    def named(self, dec: Decoder, prefix: str, keys: set[str]) -> Decoder:
        """``dec`` under the names ``keys`` use (a family saved under older names overrides; e.g. ViT)."""
        return dec

    def rows_independent(self, config: Any) -> bool:
        """Whether :meth:`prepare` rewrites each row of a stored tensor from that row alone (and the norm
        tensors), so that a block of rows folds on its own (the streamed merge folds row chunks); a family
        that mixes rows (Phi's Q/K head centring) says ``False``."""
        return True

    def heads(self, config: Any) -> tuple[int, int, int, int]:
        """``(hidden, n_heads, head_dim, n_kv_heads)``."""
        return heads_of(config)

    # -- attention ----------------------------------------------------------
    def rotary(self, config: Any, d: int) -> int | None:
        """Rotated width per head (``None``: no RoPE, by class or by the declaration's ``rope``)."""
        return rotary_dims(config, d) if self.pairing and self.declaration(config).rope else None

    def rotary_layers(self, config: Any, d: int) -> list[int | None]:
        """Rotated width per head of every layer: :meth:`rotary` for each (a family whose layer types rotate
        different widths overrides: Gemma 3), so that each layer gets the Q-K group of its own width."""
        return [self.rotary(config, d)] * int(config.num_hidden_layers)

    def qk_group(self, config: Any, d: int, r: int | None):
        """The Q-K group inside each K/V block of a layer rotating ``r`` of ``d`` dimensions (``None``: no RoPE)."""
        if self.decl.q_norm:
            return PlaneSigns(d, self.pairing or "half", r if r is not None else 0)
        return RotaryPlanes(d, self.pairing, r) if r is not None else GeneralLinear(d)

    def vo_group(self, config: Any, d: int) -> MatrixGroup:
        """The V-O group inside each K/V block: ``GL(d)`` (a family whose ``V`` passes an elementwise map overrides)."""
        return GeneralLinear(d)

    def layouts(self, config: Any, prefix: str, keys: set[str]) -> list[AttentionLayout]:
        _, h, d, kv = self.heads(config)
        dec = self.named(self.declaration(config), prefix, keys)
        vo = self.vo_group(config, d)
        widths = self.rotary_layers(config, d)
        groups = {r: self.qk_group(config, d, r) for r in dict.fromkeys(widths)}
        out = []
        for i in range(int(config.num_hidden_layers)):
            p = prefix + dec.layer.format(i=i)
            qk = groups[widths[i]]

            def bias(name: str) -> str | None:
                b = p + name + ".bias"
                if isinstance(keys, _AllKeys):  # config only: the declaration, else the config's flag
                    flag = dec.qkv_bias if dec.qkv_bias is not None else getattr(config, "attention_bias", False)
                    return b if bool(flag) else None
                return b if b in keys else None

            if dec.qkv and dec.qkv_interleaved:
                w, b = p + dec.qkv + ".weight", bias(dec.qkv)
                q, k, v = (Proj(w, 0, (j * d, d, 3 * d), b) for j in range(3))
            elif dec.qkv and dec.qkv_grouped:  # per K/V group [q_1 .. q_g | k | v] (Falcon's new layout)
                w, b, g = p + dec.qkv + ".weight", bias(dec.qkv), h // kv
                segs = ((0, g * d, (g + 2) * d), (g * d, d, (g + 2) * d), ((g + 1) * d, d, (g + 2) * d))
                q, k, v = (Proj(w, 0, s_, b) for s_ in segs)
            elif dec.qkv:
                w, b = p + dec.qkv + ".weight", bias(dec.qkv)
                segs = ((0, h * d), (h * d, kv * d), (h * d + kv * d, kv * d))
                q, k, v = (Proj(w, 0, s, b) for s in segs)
            else:
                q, k, v = (Proj(p + n + ".weight", 0, None, bias(n)) for n in (dec.q, dec.k, dec.v))  # type: ignore
            o = Proj(p + dec.o + ".weight", 1)
            if dec.conv1d:  # Conv1D stores W^T: the head axis of Q/K/V is 1, of O 0
                q, k, v, o = (Proj(x.weight, 1 - x.axis, x.segment, x.bias) for x in (q, k, v, o))
            out.append(AttentionLayout(q, k, v, o, h, d, kv, qk, vo, pinned=dec.pinned_heads))
        return out

    def extra_spaces(self, spec: SymmetrySpec, config: Any, prefix: str, layouts: list[AttentionLayout]) -> None:
        """QK-norm families: the gain-scale spaces ``qkgain.i`` (see :meth:`_gain_spaces`)."""
        if self.decl.q_norm:
            self._gain_spaces(spec, config, prefix, layouts)

    def _gain_spaces(self, spec: SymmetrySpec, config: Any, prefix: str, lays: list[AttentionLayout],
                     scales: bool = True) -> None:
        """``qkgain.i``: per-plane rescalings of the Q/K norm gains (shared over heads, or per K/V block).
        A norm over all heads has its gains permuted with the heads as well; ``scales=False`` declares that
        action only (no ``qkgain.i``: OLMoE's ``clip_qkv``)."""
        dec = self.declaration(config)
        for i, lay in enumerate(lays):
            p = prefix + dec.layer.format(i=i)
            qn, kn = p + dec.q_norm + ".weight", p + dec.k_norm + ".weight"  # type: ignore[operator]
            inner = self.gain_group(lay.qk)
            name = f"qkgain.{i}"
            off = 1.0 if dec.norm == "rms1p" else 0.0
            if dec.qk_norm_over == "all":
                spec.act_on(qn, f"heads.{i}", 0, "co", "query")
                spec.act_on(kn, f"heads.{i}", 0, "co", "kv")
                if not scales:
                    continue
                spec.add_space(name, OffsetPerHead(inner, lay.n_kv_heads, off), None, i)
                spec.couple(f"heads.{i}", name)
                spec.act_on(qn, name, 0, "co", "query")
                spec.act_on(kn, name, 0, "contra", "kv")
            elif scales:
                spec.add_space(name, OffsetPerHead(inner, 1, off), None, i)
                spec.act_on(qn, name, 0, "co")
                spec.act_on(kn, name, 0, "contra")

    def gain_group(self, signs: PlaneSigns) -> PlaneScales:
        return PlaneScales(signs.n, signs.pairing, signs.r, signs.proportional)

    def layer_spaces(self, i: int) -> list[str]:
        """The attention spaces of layer ``i`` (the group the probe of that layer measures)."""
        return [f"heads.{i}", f"qk.{i}", f"vo.{i}"] + ([f"qkgain.{i}"] if self.decl.q_norm else [])

    # -- probe --------------------------------------------------------------
    def attention_module(self, model: nn.Module, i: int) -> nn.Module:
        """The real attention module of layer ``i`` of a transformers model."""
        base = model.base_model
        layer = base.layers[i] if hasattr(base, "layers") else base.h[i]
        names = ("self_attn", "self_attention", "attention", "attn")
        return next(getattr(layer, n) for n in names if hasattr(layer, n))

    def position_embeddings(self, model: nn.Module, i: int, x: Tensor, positions: Tensor) -> Any:
        """What layer ``i``'s attention gets as ``position_embeddings`` (``(cos, sin)``; ``None`` without RoPE)."""
        rot = getattr(model.base_model, "rotary_emb", None)
        return rot(x, positions) if rot is not None else None

    def attention_kwargs(self, x: Tensor, config: Any = None) -> dict[str, Any]:
        """Other keyword arguments of the attention module's forward for an unmasked call on ``x``
        (``config``: the model's, for a family whose attention takes per-head inputs such as ALiBi)."""
        return {"attention_mask": None}

    def gauge_nullity(self, config: Any, keys: Iterable[str], i: int) -> dict[str, int]:
        """Null directions of layer ``i``'s Jacobian that are not group orbits (:func:`bias_gauge`)."""
        keys = set(keys)
        return bias_gauge(self.layouts(config, find_prefix(keys, self.probe, self.family), keys)[i], keys)

    # -- activation sites ---------------------------------------------------
    def activation_sites(self, model: nn.Module) -> list[ActivationSite]:
        """Activation matching's sites on a transformers ``model`` (:mod:`symalign.nn.sites`), from the
        declared names: ``residual`` at the input of every layer and of the final norm, ``ff.i`` at the
        input of the FF output projection (``down``), ``heads.i`` at the input of the attention output
        projection (``o``; a ``Conv1D`` stores it transposed)."""
        config = model.config
        dec = self.declaration(config)
        p = self.prefix(set(model.state_dict().keys()))
        _, h, _, _ = self.heads(config)

        def module(name: str) -> nn.Module:
            return model.get_submodule((p + name).rstrip("."))

        sites = []
        for i in range(int(config.num_hidden_layers)):
            lp = dec.layer.format(i=i)
            sites.append(ActivationSite(RESIDUAL, module(lp)))
            sites.append(ActivationSite(f"ff.{i}", module(lp + dec.down)))
            sites.append(linear_heads_site(f"heads.{i}", module(lp + dec.o), h, transposed=dec.conv1d))
        sites.append(ActivationSite(RESIDUAL, module(dec.final_norm)))
        return sites

    # -- whole model --------------------------------------------------------
    def prepare(self, config: Any, state: Mapping[str, Tensor], att: SymmetrySpec,
                arch: str | None = None) -> Prepared:
        """Rewrite ``state`` exactly and build the whole-model spec (see the module docstring).

        ``Conv1D`` layers (:attr:`Decoder.conv1d`) are rewritten in their ``nn.Linear``
        view (every ``Conv1D`` weight transposed) and stored back: the spec's actions on
        those weights move to the other axis (:func:`transpose_actions`).
        """
        dec = self.declaration(config)
        if not dec.conv1d:
            return self._prepare(config, state, att, arch)
        p = find_prefix(state.keys(), dec.first_q, self.family)
        names = {p + dec.layer.format(i=i) + n + ".weight" for i in range(int(config.num_hidden_layers))
                 for n in (*dec.readers_attn(), dec.o, *dec.readers_ff(), dec.down)}
        names &= set(state)
        view = {k: (v.t() if k in names else v) for k, v in state.items()}
        out = self._prepare(config, view, transpose_actions(att, names), arch)
        out.state = {k: (v.t().contiguous() if k in names else v) for k, v in out.state.items()}
        out.spec = transpose_actions(out.spec, names)
        return out

    def _prepare(self, config: Any, state: Mapping[str, Tensor], att: SymmetrySpec, arch: str | None) -> Prepared:
        dec = self.declaration(config)
        if dec.norm not in NORMS:
            raise ConfigError(f"{self.family}: unknown norm kind {dec.norm!r}")
        s, dt = to_f64(state)
        p = find_prefix(s.keys(), dec.first_q, self.family)
        spec = copy_spec(att)
        D = int(config.hidden_size)
        notes: list[str] = []
        head = next((h + ".weight" for h in dec.heads if h + ".weight" in s), None)
        tied = bool(getattr(config, "tie_word_embeddings", False))  # an in-memory state lists the head anyway
        lm = arch is None or arch.endswith(("ForCausalLM", "LMHeadModel"))
        bare = arch is not None and arch.endswith("Model") and not arch.endswith("LMHeadModel")
        cross = bool(getattr(config, "add_cross_attention", False))
        if bare or not lm or (head is None and not tied) or cross:
            from symalign.families.common import headless_note

            # a bare model outputs the stream itself; any other head (classification...) is not mapped
            notes.append(CROSS_NOTE if cross else headless_note(arch, self.family, [arch] if bare else
                                                                 ["...ForCausalLM"]))
            self._ff_spaces(spec, config, s, p)
            return Prepared(back(s, dt, torch.float32), spec, False, notes)
        post = dec.post_attn_norm or dec.post_ff_norm
        untied = False
        if post or (tied and dec.norm != "layer"):
            why = "post-norms on the branches" if post else "a head tied to the embedding"
            self._permuted_stream(spec, config, s, p, head)
            notes.append(f"residual stream: permutations S_{D} ({why}: norm gains are permuted with the stream, "
                         "not folded)")
        else:
            if tied:
                head = head or dec.heads[0] + ".weight"
                s[head] = s[p + dec.embed + ".weight"].clone()
                dt[head] = dt[p + dec.embed + ".weight"]
                untied = True
                notes.append(f"{head} untied from {dec.embed} (tie_word_embeddings=false) to fold the final norm")
            self._folded_stream(spec, config, s, p, head)
            notes.append("norm gains folded into the next linear maps")
        self._ff_spaces(spec, config, s, p)
        return Prepared(back(s, dt, torch.float32), spec, untied, notes)

    def _ff_spaces(self, spec: SymmetrySpec, config: Any, s: Mapping[str, Tensor], p: str) -> None:
        dec = self.declaration(config)
        for i in range(int(config.num_hidden_layers)):
            lp = p + dec.layer.format(i=i)
            down = lp + dec.down + ".weight"
            f = int(s[down].shape[1])
            ff = f"ff.{i}"
            gated = not dec.ff_in
            spec.add_space(ff, Permutation(f) if gated else ff_group(getattr(config, dec.ff_act, None), f), "ff", i)
            if dec.gate_up:
                for seg in ((0, f), (f, f)):
                    for t in (lp + dec.gate_up + ".weight", lp + dec.gate_up + ".bias"):
                        if t in s:
                            spec.act_on(t, ff, 0, "co", None, seg)
            else:
                for n in dec.readers_ff():
                    for t in (lp + n + ".weight", lp + n + ".bias"):
                        if t in s:
                            spec.act_on(t, ff, 0)
            spec.act_on(down, ff, 1, "contra")

    def _writers(self, s: Mapping[str, Tensor], lp: str) -> list[str]:
        dec = self.decl
        return [t for n in (dec.o, dec.down) for t in (lp + n + ".weight", lp + n + ".bias") if t in s]

    def _permuted_stream(self, spec: SymmetrySpec, config: Any, s: Mapping[str, Tensor], p: str,
                         head: str | None) -> None:
        dec = self.declaration(config)
        spec.add_space(RESIDUAL, Permutation(int(config.hidden_size)), "residual")
        for e in (dec.embed, *dec.positions):
            spec.act_on(p + e + ".weight", RESIDUAL, 1)
        if head is not None:
            spec.act_on(head, RESIDUAL, 1)
        norms = [p + dec.final_norm]
        for i in range(int(config.num_hidden_layers)):
            lp = p + dec.layer.format(i=i)
            for n in dec.readers_attn() + dec.readers_ff():
                spec.act_on(lp + n + ".weight", RESIDUAL, 1)
            for t in self._writers(s, lp):
                spec.act_on(t, RESIDUAL, 0)
            norms += [lp + n for n in (dec.pre_attn_norm, dec.post_attn_norm, dec.pre_ff_norm, dec.post_ff_norm) if n]
        for n in dict.fromkeys(norms):  # a norm shared by both branches is listed once
            for t in (n + ".weight", n + ".bias"):
                if t in s:
                    spec.act_on(t, RESIDUAL, 0)

    def _folded_stream(self, spec: SymmetrySpec, config: Any, s: dict[str, Tensor], p: str, head: str) -> None:
        dec = self.declaration(config)
        D = int(config.hidden_size)
        layer_norm = dec.norm == "layer"
        spec.add_space(RESIDUAL, CenteredOrthogonal(D) if layer_norm else Orthogonal(D), "residual")
        for e in (dec.embed, *dec.positions):
            spec.act_on(p + e + ".weight", RESIDUAL, 1, "co")
        folds = [(p + dec.final_norm, [head[: -len(".weight")]])]
        for i in range(int(config.num_hidden_layers)):
            lp = p + dec.layer.format(i=i)
            attn, ff = [lp + n for n in dec.readers_attn()], [lp + n for n in dec.readers_ff()]
            if dec.pre_attn_norm == dec.pre_ff_norm:  # one norm read by both branches (GPT-J, Phi)
                folds.append((lp + dec.pre_attn_norm, attn + ff))  # type: ignore[operator]
            else:
                folds.append((lp + dec.pre_attn_norm, attn))  # type: ignore[operator]
                folds.append((lp + dec.pre_ff_norm, ff))  # type: ignore[operator]
            for t in self._writers(s, lp):
                spec.act_on(t, RESIDUAL, 0, "co")
        for norm, readers in folds:
            if layer_norm:
                if fold_layernorm(s, norm, readers):
                    spec.act_on(norm + ".bias", RESIDUAL, 0, "co")
            else:
                w = s[norm + ".weight"]
                g = w + 1.0 if dec.norm == "rms1p" else w
                for r in readers:
                    w_r, g_r = meet(s[r + ".weight"], g)
                    s[r + ".weight"] = w_r * g_r
                s[norm + ".weight"] = torch.zeros_like(w) if dec.norm == "rms1p" else torch.ones_like(w)
            for r in readers:
                spec.act_on(r + ".weight", RESIDUAL, 1, "contra")


def bias_gauge(lay: AttentionLayout, keys: Iterable[str]) -> dict[str, int]:
    """Null directions of an attention layer's Jacobian that are not orbits of its group: bias shifts.

    ``key bias``: without QK-norm, the unrotated part of the key bias adds ``q^T b_K`` to
    every score of a query, which the softmax ignores (``h_kv (d - r)`` directions).
    ``value bias``: with an output bias, a shift ``delta`` of the value bias moves the
    output by ``W_O delta`` whatever the attention pattern, which the output bias cancels
    (``h_kv d``). Keys: the layer's tensor names (the output bias is looked up there).
    """
    keys = set(keys)
    d, kv = lay.head_dim, lay.n_kv_heads
    shift = lay.qk.key_bias_shift  # the unrotated width d - r (QK-norm: none)
    out = {}
    if lay.k.bias and shift:
        out["key bias (softmax shift)"] = kv * shift
    o_bias = lay.o.weight[: -len("weight")] + "bias"
    if lay.v.bias and o_bias in keys:
        out["value bias -> output bias"] = kv * d
    return out


CROSS_NOTE = "residual stream not aligned: cross-attention layers read an external stream; FF units and attention only"


def transpose_actions(spec: SymmetrySpec, names: set[str]) -> SymmetrySpec:
    """``spec`` with every action on a 2-d weight in ``names`` moved to the other axis (``W -> W^T``)."""
    from dataclasses import replace

    out = copy_spec(spec)
    for t in names & set(out.tensors):
        out.tensors[t] = [replace(a, axis=1 - a.axis) for a in out.tensors[t]]
    return out


def refuse(family: str, option: str, why: str) -> UnsupportedArchitectureError:
    """The refusal of a config option that leaves no exact symmetry to declare."""
    return UnsupportedArchitectureError(f"{family}: {option} is not supported: {why}")


__all__ = ["CROSS_NOTE", "Decoder", "Family", "bias_gauge", "refuse", "transpose_actions"]
