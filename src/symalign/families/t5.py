r"""T5 (encoder-decoder): per-head relative position bias shared by a stack, cross-attention, tied embedding.

Layout as transformers writes it (``T5ForConditionalGeneration``, ``T5Model``,
``T5EncoderModel``; ``nn.Linear`` weights ``(out, in)``, no biases anywhere):

* encoder block ``i``: ``encoder.block.{i}.layer.0.SelfAttention.{q,k,v,o}`` (Q/K/V
  ``h d_kv`` rows, O ``h d_kv`` columns; ``d_kv`` need not be ``D / h``), then
  ``layer.1.DenseReluDense`` (FF); ``layer.{0,1}.layer_norm`` pre-norms;
* decoder block ``j``: ``decoder.block.{j}.layer.0.SelfAttention`` (causal),
  ``layer.1.EncDecAttention`` (cross-attention: Q reads the decoder stream, K/V the
  encoder's output after ``encoder.final_layer_norm``), ``layer.2.DenseReluDense``;
  ``layer.{0,1,2}.layer_norm`` pre-norms; ``final_layer_norm`` closes each stack;
* ``relative_attention_bias`` ``(num_buckets, h)``: only in block 0 of each stack's
  self-attention; its output ``position_bias[h, q, k]`` is computed once and **reused
  by every self-attention layer of that stack** (added to the unscaled scores
  ``q^T k``; T5 does not divide by ``sqrt(d)``). Cross-attention has no learned bias.
* ``shared.weight``: the one embedding of both stacks; transformers 5 always ties
  ``lm_head`` to it (``tie_word_embeddings`` only says whether the decoder output is
  scaled by ``D^{-1/2}`` before the head: a scalar).

**Attention group.** Head ``i`` of every self-attention layer of a stack reads row
``i`` of the same position-bias table, so permuting the heads of one layer alone
pairs its heads with the wrong bias columns: a head permutation is exact only when
**the same** ``pi`` acts on every self-attention layer of the stack and on the table's
columns. Declared: one space ``heads.encoder`` (``S_h``) acting on every encoder
self-attention layer and on ``encoder...relative_attention_bias.weight`` axis 1 (one
entry per head, ``rep="head"``), likewise ``heads.decoder`` for the decoder's
self-attention; each cross-attention layer has its own ``heads.{i}``. Inside every
head, Q-K ``GL(d_kv)`` (no RoPE, no scaling: ``q^T k`` is preserved by
``q -> U q, k -> U^{-T} k``) and V-O ``GL(d_kv)``, per layer (``qk.{i}``, ``vo.{i}``).

Layer numbers (the ``i`` of ``qk.{i}``, ``vo.{i}``, ``ff.{i}``): encoder blocks
``0 .. L_e - 1``; decoder self-attention (and the decoder block's FF)
``L_e + j``; decoder cross-attention ``L_e + L_d + j``.

**Whole model** (``--scope model``, ``T5ForConditionalGeneration``). The encoder and
decoder streams are separate spaces, but both start from ``shared.weight``, so one
map must act on both (``E -> E T^T`` for both stacks); the head is that same matrix,
read after the decoder's ``final_layer_norm``: ``logits = c E (g * RMS(x))``. A map
``T`` with ``E T^T`` at the input and ``E T^T (g' * RMS(T x))`` at the output needs
``RMS(T x) = RMS(x)`` (``T`` orthogonal) and ``T^T diag(g') T = diag(g)``: for a
generic gain, a signed permutation. Declared: ``residual`` = ``S_D`` on both streams,
every norm gain (all pre-norms and both final norms) permuted with it, nothing
folded (``P (g * RMS(x)) = (P g) * RMS(P x)``); sign flips are exact too but not
declared. Cross-attention K/V read the encoder stream: same ``P``.
FF ``ff.{i}``: ``feed_forward_proj = "relu"`` -> ``wi``/``wo`` with ReLU: ``S_{d_ff}``
with positive per-unit scales; another plain activation (``"gelu"``): ``S_{d_ff}``;
gated (``"gated-gelu"``, T5 v1.1 / Flan-T5: ``act(wi_0 x) * wi_1 x``): ``S_{d_ff}``
on ``wi_0``, ``wi_1`` rows and ``wo`` columns. ``T5Model`` and ``T5EncoderModel``
output the stream itself: no residual space (FF and attention only).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import Tensor, nn

from symalign.arch.base import AttentionLayout, Proj, _AllKeys, find_prefix
from symalign.errors import ConfigError
from symalign.families.base import Family
from symalign.families.declared import Case, Scopes, Tiny
from symalign.families.common import RESIDUAL, Prepared, back, copy_spec, ff_group, headless_note, to_f64
from symalign.groups import GeneralLinear, Permutation
from symalign.spec import SymmetrySpec

SELF = "layer.0.SelfAttention."
CROSS = "layer.1.EncDecAttention."
TABLE = "relative_attention_bias.weight"
SHARED_HEADS = {"encoder": "heads.encoder", "decoder": "heads.decoder"}
LM = "T5ForConditionalGeneration"


def _has_decoder(config: Any, prefix: str, keys: set[str]) -> bool:
    """Whether the checkpoint has the decoder stack (config only: unless it is an encoder-only class)."""
    if isinstance(keys, _AllKeys):
        archs = getattr(config, "architectures", None) or []
        return not (archs and ("Encoder" in archs[0] or "TokenClassification" in archs[0]))
    return prefix + "decoder.block.0." + SELF + "q.weight" in keys


class T5Family(Family):
    family = "T5"
    model_types = ("t5",)
    pairing = None  # relative position bias, no RoPE
    auto_classes = ("AutoModelForSeq2SeqLM", "AutoModel")
    scopes = Scopes(stream=())
    tiny = Tiny("T5ForConditionalGeneration", "T5Config", {
        "vocab_size": 64, "d_model": 16, "d_kv": 4, "d_ff": 24, "num_layers": 2, "num_decoder_layers": 3,
        "num_heads": 4, "decoder_start_token_id": 0, "pad_token_id": 0,
        "eos_token_id": 1})  # its tests: tests/test_family_t5.py
    probe_kw = {"num_heads": 2, "d_ff": 16, "num_layers": 1, "num_decoder_layers": 1}
    # docs/symmetry.md's rows: every attention site of a one-block encoder-decoder (probe_sites' order)
    cases = tuple(Case(exact=False, row=f"T5 ({site})", layer=i) for i, site in enumerate(
        ["encoder self-attention", "decoder self-attention, causal", "cross-attention"]))
    no_stream = ("T5 shares one head permutation across all self-attention layers of a stack (their common "
                 "relative position bias), so its layers cannot be aligned one at a time; align without --stream")

    @property
    def precision_floor(self) -> float:  # type: ignore[override]
        """``T5LayerNorm`` takes the mean of squares in float32 whatever the weights' dtype."""
        return 1e-6

    @property
    def probe(self) -> str:  # type: ignore[override]
        return "encoder.block.0." + SELF + "q.weight"

    # -- where the attention sites are -------------------------------------
    def depths(self, config: Any) -> tuple[int, int]:
        """``(L_e, L_d)``: encoder and decoder blocks."""
        n_enc = int(config.num_layers)
        return n_enc, int(getattr(config, "num_decoder_layers", None) or n_enc)

    def sites(self, config: Any, decoder: bool = True) -> list[tuple[str, str | None]]:
        """Per attention layer (in layer-number order): its module path and its shared head space (or None)."""
        n_enc, n_dec = self.depths(config)
        out: list[tuple[str, str | None]] = [(f"encoder.block.{i}.{SELF}", SHARED_HEADS["encoder"])
                                             for i in range(n_enc)]
        if decoder:
            out += [(f"decoder.block.{j}.{SELF}", SHARED_HEADS["decoder"]) for j in range(n_dec)]
            out += [(f"decoder.block.{j}.{CROSS}", None) for j in range(n_dec)]
        return out

    def layouts(self, config: Any, prefix: str, keys: set[str]) -> list[AttentionLayout]:
        _, h, d, _ = self.heads(config)  # transformers maps hidden_size -> d_model, head_dim -> d_kv
        gl = GeneralLinear(d)
        out = []
        for site, shared in self.sites(config, _has_decoder(config, prefix, keys)):
            q, k, v = (Proj(prefix + site + n + ".weight", 0) for n in ("q", "k", "v"))
            out.append(AttentionLayout(q, k, v, Proj(prefix + site + "o.weight", 1), h, d, h, gl, gl, shared))
        return out

    def extra_spaces(self, spec: SymmetrySpec, config: Any, prefix: str, layouts: list[AttentionLayout]) -> None:
        """Each stack's bias table ``(num_buckets, h)``: its columns permuted by the stack's head space."""
        for stack, heads in SHARED_HEADS.items():
            if heads in spec.spaces:
                spec.act_on(prefix + f"{stack}.block.0.{SELF}{TABLE}", heads, 1, "co", "head")

    def layer_spaces(self, i: int) -> list[str]:
        """Layer ``i``'s per-layer spaces: ``qk.i``, ``vo.i`` and ``heads.i``, which only a cross-attention
        layer has (a self-attention layer's head permutation is its stack's, declared once for all of them)."""
        return [f"heads.{i}", f"qk.{i}", f"vo.{i}"]

    # -- probe --------------------------------------------------------------
    probe_sites = (("encoder", False), ("decoder", False), ("decoder", True))
    """The kinds of attention site ``probe --hf`` reaches, as ``(stack, cross)``: encoder self-attention,
    decoder self-attention (causal), decoder cross-attention."""

    def probe_site(self, config: Any, layer: int, stack: str | None = None,
                   cross: bool = False) -> tuple[int, str]:
        """``symalign probe --hf --layer [STACK.]I [--cross]``: block ``I`` of the encoder (the default
        stack) or of the decoder, its self-attention or (decoder, ``cross``) its cross-attention.

        Trims ``config`` in place to blocks ``0..I`` of the named stack and one block of the
        other (the decoder's inputs are generic states either way) and returns the layer
        number of the site's spaces (module doc: encoder ``I``, decoder self-attention
        ``L_e + I``, cross-attention ``L_e + L_d + I``, with the trimmed depths) and the stack.
        """
        stack = stack or "encoder"
        if stack not in SHARED_HEADS:
            raise ConfigError(f"--layer {stack}.{layer}: T5 has the stacks {', '.join(SHARED_HEADS)}; "
                              f"use --layer encoder.I or --layer decoder.I")
        if cross and stack != "decoder":
            raise ConfigError(f"--cross: T5's cross-attention is in the decoder's blocks; use --layer decoder.{layer} "
                              "--cross")
        if stack == "decoder" and not _has_decoder(config, "", _AllKeys()):
            archs = ", ".join(getattr(config, "architectures", None) or [])
            raise ConfigError(f"--layer decoder.{layer}: this T5 checkpoint ({archs}) has no decoder; probe "
                              f"--layer encoder.I")
        n_enc, n_dec = self.depths(config)
        n = n_enc if stack == "encoder" else n_dec
        if not 0 <= layer < n:
            raise ConfigError(f"--layer {stack}.{layer} is out of range: the {stack} has {n} blocks (0..{n - 1})")
        config.num_layers, config.num_decoder_layers = (layer + 1, 1) if stack == "encoder" else (1, layer + 1)
        n_enc, n_dec = self.depths(config)
        if stack == "encoder":
            return layer, stack
        return (n_enc + n_dec + layer if cross else n_enc + layer), stack

    def attention_module(self, model: nn.Module, i: int) -> nn.Module:
        """Layer ``i`` as ``x -> attn(x)`` through the real ``T5Attention`` (see :class:`AttentionSite`)."""
        base = model.base_model
        config = model.config
        has_dec = hasattr(base, "decoder")
        site = self.sites(config, has_dec)[i][0]
        attn = base.get_submodule(site[:-1])
        stack = site.split(".")[0]
        table = base.get_submodule(f"{stack}.block.0.{SELF[:-1]}")
        return AttentionSite(attn, table, cross=CROSS in site, causal=stack == "decoder")

    def dummy_inputs(self, config: Any, batch: int = 2, seq: int = 8, seed: int = 0) -> dict[str, torch.Tensor]:
        """Token ids for the encoder and, unless the class is encoder-only, ``decoder_input_ids``."""
        out = super().dummy_inputs(config, batch, seq, seed)
        if _has_decoder(config, "", _AllKeys()):
            g = torch.Generator().manual_seed(seed + 1)
            out["decoder_input_ids"] = torch.randint(0, int(config.vocab_size), (batch, max(1, seq - 2)), generator=g)
        return out

    # -- whole model --------------------------------------------------------
    def prepare(self, config: Any, state: Mapping[str, Tensor], att: SymmetrySpec,
                arch: str | None = None) -> Prepared:
        """FF spaces and (``T5ForConditionalGeneration``) the permuted stream; nothing is rewritten."""
        s, dt = to_f64(state)
        p = find_prefix(s.keys(), self.probe, self.family)
        spec = copy_spec(att)
        decoder = p + "decoder.block.0." + SELF + "q.weight" in s
        self._ff_spaces(spec, config, s, p)
        notes = []
        if decoder and (arch is None or arch == LM):
            self._stream(spec, config, s, p)
            notes.append(f"residual stream: permutations S_{int(config.d_model)} on both stacks (one embedding "
                         "feeds both and is the head: norm gains are permuted with the stream, not folded)")
        else:
            notes.append(headless_note(arch, self.family, [LM]))
        return Prepared(back(s, dt, torch.float32), spec, False, notes)

    def _blocks(self, config: Any, s: Mapping[str, Tensor], p: str) -> list[tuple[str, int, int]]:
        """``(block prefix, index of its FF sub-layer, layer number)`` of every block present."""
        n_enc, n_dec = self.depths(config)
        out = [(f"{p}encoder.block.{i}.", 1, i) for i in range(n_enc)]
        if p + "decoder.block.0." + SELF + "q.weight" in s:
            out += [(f"{p}decoder.block.{j}.", 2, n_enc + j) for j in range(n_dec)]
        return out

    def _ff_spaces(self, spec: SymmetrySpec, config: Any, s: Mapping[str, Tensor], p: str) -> None:
        gated = bool(getattr(config, "is_gated_act", False))
        for bp, ff_at, i in self._blocks(config, s, p):
            ffp = f"{bp}layer.{ff_at}.DenseReluDense."
            down = ffp + "wo.weight"
            f = int(s[down].shape[1])
            name = f"ff.{i}"
            spec.add_space(name, Permutation(f) if gated else ff_group(config.dense_act_fn, f), "ff", i)
            for n in (("wi_0", "wi_1") if gated else ("wi",)):
                spec.act_on(ffp + n + ".weight", name, 0)
            spec.act_on(down, name, 1, "contra")

    def _stream(self, spec: SymmetrySpec, config: Any, s: Mapping[str, Tensor], p: str) -> None:
        spec.add_space(RESIDUAL, Permutation(int(config.d_model)), "residual")
        for t in ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight"):
            if p + t in s:  # the tied copies and the head, where a checkpoint lists them
                spec.act_on(p + t, RESIDUAL, 1)
        gated = bool(getattr(config, "is_gated_act", False))
        norms = [p + "encoder.final_layer_norm.weight", p + "decoder.final_layer_norm.weight"]
        for bp, ff_at, _ in self._blocks(config, s, p):
            subs = [SELF] + ([CROSS] if ff_at == 2 else [])
            ffp = f"{bp}layer.{ff_at}.DenseReluDense."
            readers = [bp + a + n + ".weight" for a in subs for n in ("q", "k", "v")]
            readers += [ffp + n + ".weight" for n in (("wi_0", "wi_1") if gated else ("wi",))]
            for t in readers:  # cross-attention K/V read the encoder's stream: the same permutation
                spec.act_on(t, RESIDUAL, 1)
            for t in [bp + a + "o.weight" for a in subs] + [ffp + "wo.weight"]:
                spec.act_on(t, RESIDUAL, 0)
            norms += [f"{bp}layer.{k}.layer_norm.weight" for k in range(ff_at + 1)]
        for t in norms:
            if t in s:
                spec.act_on(t, RESIDUAL, 0)


class AttentionSite(nn.Module):
    """One T5 attention layer as ``x -> attn(x)`` for the probe: the real ``T5Attention`` with its
    projections ``q, k, v, o`` as the only parameters.

    Self-attention adds its stack's position bias, computed from the stack's table (held
    fixed: it is not a parameter of the layer) and, in the decoder, the causal mask;
    cross-attention attends to fixed generic encoder states (a deterministic pseudo-random
    sequence of unit variance, one more token than the queries).
    """

    def __init__(self, attn: nn.Module, table: nn.Module, cross: bool, causal: bool):
        super().__init__()
        self.q, self.k, self.v, self.o = attn.q, attn.k, attn.v, attn.o  # the same modules: probed in place
        self._real = [attn, table]  # not registered: no other parameters
        self.cross, self.causal = cross, causal

    def forward(self, hidden_states: Tensor, **_: Any):
        attn, table = self._real
        b, n, D = hidden_states.shape
        if self.cross:
            idx = torch.arange(b * (n + 1) * D, dtype=hidden_states.dtype, device=hidden_states.device)
            kv = (2 ** 0.5) * torch.sin(1.618 * idx * idx + 0.5 * idx + 0.3)  # generic, no RNG (vmap-safe)
            return attn(hidden_states, key_value_states=kv.reshape(b, n + 1, D))
        with torch.no_grad():
            bias = table.compute_bias(n, n, device=hidden_states.device).detach().to(hidden_states.dtype)
        mask = None
        if self.causal:
            mask = torch.full((n, n), torch.finfo(hidden_states.dtype).min, dtype=hidden_states.dtype).triu(1)
            mask = mask[None, None]
        return attn(hidden_states, mask=mask, position_bias=bias)


__all__ = ["AttentionSite", "T5Family"]
