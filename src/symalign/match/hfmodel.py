r"""Whole-model alignment of Hugging Face checkpoints (``symalign align --scope model``).

Supported: Llama-style (``llama``, ``mistral``, ``qwen2``: RMSNorm) and GPT-2
(LayerNorm, tied embeddings). Both are first rewritten, exactly and in their own
format, so that every norm gain is 1:

* **RMSNorm** (Llama): ``RMS(x) * g`` read by ``W`` equals ``RMS(x)`` read by
  ``W diag(g)``: fold each gain into the Q/K/V (``input_layernorm``), gate/up
  (``post_attention_layernorm``) and ``lm_head`` (``norm``) weights, set it to 1.
  The stream then has the full ``O(D)``. Tied embeddings are refused (the final
  gain cannot be folded into a head that is also the embedding).
* **LayerNorm** (GPT-2): ``LN(x) = g * RMS(C x) + b``; fold ``g, b`` of ``ln_1``/``ln_2``
  into ``c_attn``/``c_fc`` (``Conv1D`` ``(in, out)``: ``W <- diag(g) W``,
  ``bias <- bias + b W``) and set ``g = 1, b = 0``. The head is tied to ``wte``,
  so ``ln_f``'s gain cannot be folded into it: the head is **untied**
  (``lm_head = wte diag(g_f)``, ``ln_f.bias <- b_f / g_f``, ``ln_f.weight <- 1``, and
  the output config gets ``tie_word_embeddings = false``). The norm keeps its
  centring ``C``, so the stream's symmetry is the centred subgroup
  ``O_1(D) = {O in O(D): O 1 = 1}`` (``O`` commutes with ``C``); ``ln_f.bias`` rotates
  covariantly.

The spec adds to the adapter's attention spec ``ff.i`` (``S_{d_ff}``) and
``residual`` acting on every writer (embeddings, positions, attention/MLP
outputs and their biases) and reader (Q/K/V, MLP inputs, head).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import Tensor

from symalign.errors import ConfigError, MatchError
from symalign.groups import Orthogonal, Permutation
from symalign.match.residual import CenteredOrthogonal
from symalign.spec import SymmetrySpec

LLAMA_LIKE = ("llama", "mistral", "qwen2")
SUPPORTED = LLAMA_LIKE + ("gpt2",)


@dataclass
class Prepared:
    """A checkpoint's folded state, its whole-model spec, and what changed in its format."""

    state: dict[str, Tensor]
    spec: SymmetrySpec
    untied: bool = False
    notes: list[str] = field(default_factory=list)


def _prefix(keys, probe: str) -> str:
    hits = [k[: -len(probe)] for k in keys if k.endswith(probe)]
    if not hits:
        raise MatchError(f"no tensor '*{probe}' in the checkpoint")
    return min(hits, key=len)


def prepare(config: Any, state: Mapping[str, Tensor], attention_spec: SymmetrySpec) -> Prepared:
    """Fold the norm gains (exact) and build the whole-model spec (see the module docstring)."""
    mt = config.model_type
    if mt in LLAMA_LIKE:
        return _prepare_llama(config, state, attention_spec)
    if mt == "gpt2":
        return _prepare_gpt2(config, state, attention_spec)
    raise ConfigError(f"--scope model supports {', '.join(SUPPORTED)}; {mt!r} is not mapped yet "
                      "(use --scope attention)")


def _f64(state: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, torch.dtype]]:
    return {k: v.to(torch.float64) for k, v in state.items()}, {k: v.dtype for k, v in state.items()}


def _back(s: dict[str, Tensor], dtypes: dict[str, torch.dtype], default: torch.dtype) -> dict[str, Tensor]:
    return {k: v.to(dtypes.get(k, default)).contiguous() for k, v in s.items()}


def _prepare_llama(config, state, att: SymmetrySpec) -> Prepared:
    s, dt = _f64(state)
    p = _prefix(s, "layers.0.self_attn.q_proj.weight")
    head = "lm_head.weight"
    if bool(getattr(config, "tie_word_embeddings", False)) or head not in s:
        raise MatchError("--scope model: a Llama-style model with tied embeddings cannot fold its final RMSNorm "
                         "gain into the head (it is also the embedding); residual rotations would not be exact")
    D = int(config.hidden_size)
    spec = SymmetrySpec(dict(att.spaces), {k: list(v) for k, v in att.tensors.items()}, dict(att.couplings))
    spec.add_space("residual", Orthogonal(D))
    spec.act_on(p + "embed_tokens.weight", "residual", 1, "co")
    spec.act_on(head, "residual", 1, "contra")
    for i in range(int(config.num_hidden_layers)):
        lp = f"{p}layers.{i}."
        g1 = s[lp + "input_layernorm.weight"]
        g2 = s[lp + "post_attention_layernorm.weight"]
        for n in "qkv":
            s[f"{lp}self_attn.{n}_proj.weight"] = s[f"{lp}self_attn.{n}_proj.weight"] * g1
            spec.act_on(f"{lp}self_attn.{n}_proj.weight", "residual", 1, "contra")
        for n in ("gate", "up"):
            s[f"{lp}mlp.{n}_proj.weight"] = s[f"{lp}mlp.{n}_proj.weight"] * g2
            spec.act_on(f"{lp}mlp.{n}_proj.weight", "residual", 1, "contra")
        s[lp + "input_layernorm.weight"] = torch.ones_like(g1)
        s[lp + "post_attention_layernorm.weight"] = torch.ones_like(g2)
        for out in ("self_attn.o_proj", "mlp.down_proj"):
            spec.act_on(f"{lp}{out}.weight", "residual", 0, "co")
            if f"{lp}{out}.bias" in s:
                spec.act_on(f"{lp}{out}.bias", "residual", 0, "co")
        ff = f"ff.{i}"
        spec.add_space(ff, Permutation(int(config.intermediate_size)))
        for n in ("gate", "up"):
            spec.act_on(f"{lp}mlp.{n}_proj.weight", ff, 0)
            if f"{lp}mlp.{n}_proj.bias" in s:
                spec.act_on(f"{lp}mlp.{n}_proj.bias", ff, 0)
        spec.act_on(f"{lp}mlp.down_proj.weight", ff, 1, "contra")
    gf = s[p + "norm.weight"]
    s[head] = s[head] * gf
    s[p + "norm.weight"] = torch.ones_like(gf)
    return Prepared(_back(s, dt, torch.float32), spec, False, ["RMSNorm gains folded into the next linear maps"])


def _prepare_gpt2(config, state, att: SymmetrySpec) -> Prepared:
    s, dt = _f64(state)
    p = _prefix(s, "h.0.attn.c_attn.weight")
    D = int(config.hidden_size)
    spec = SymmetrySpec(dict(att.spaces), {k: list(v) for k, v in att.tensors.items()}, dict(att.couplings))
    spec.add_space("residual", CenteredOrthogonal(D))
    for t in ("wte.weight", "wpe.weight"):
        spec.act_on(p + t, "residual", 1, "co")
    d_ff = int(getattr(config, "n_inner", None) or 4 * D)
    for i in range(int(config.num_hidden_layers)):
        lp = f"{p}h.{i}."
        for ln, lin in (("ln_1", "attn.c_attn"), ("ln_2", "mlp.c_fc")):
            g, b = s[f"{lp}{ln}.weight"], s[f"{lp}{ln}.bias"]
            w = s[f"{lp}{lin}.weight"]
            s[f"{lp}{lin}.bias"] = s[f"{lp}{lin}.bias"] + b @ w
            s[f"{lp}{lin}.weight"] = g[:, None] * w
            s[f"{lp}{ln}.weight"] = torch.ones_like(g)
            s[f"{lp}{ln}.bias"] = torch.zeros_like(b)
            spec.act_on(f"{lp}{lin}.weight", "residual", 0, "contra")
        for out in ("attn.c_proj", "mlp.c_proj"):
            spec.act_on(f"{lp}{out}.weight", "residual", 1, "co")
            spec.act_on(f"{lp}{out}.bias", "residual", 0, "co")
        ff = f"ff.{i}"
        spec.add_space(ff, Permutation(d_ff))
        spec.act_on(f"{lp}mlp.c_fc.weight", ff, 1)
        spec.act_on(f"{lp}mlp.c_fc.bias", ff, 0)
        spec.act_on(f"{lp}mlp.c_proj.weight", ff, 0, "contra")
    gf, bf = s[p + "ln_f.weight"], s[p + "ln_f.bias"]
    if bool((gf == 0).any()):
        raise MatchError("--scope model: ln_f has a zero gain; its bias cannot be moved behind the head exactly")
    notes = ["LayerNorm gains/biases of ln_1/ln_2 folded into c_attn/c_fc"]
    head = s.get("lm_head.weight", s[p + "wte.weight"])
    untied = bool(getattr(config, "tie_word_embeddings", True))
    if untied:
        notes.append("lm_head untied from wte (tie_word_embeddings=false) to fold ln_f's gain exactly")
    s["lm_head.weight"] = head * gf
    s[p + "ln_f.bias"] = bf / gf
    s[p + "ln_f.weight"] = torch.ones_like(gf)
    dt.setdefault("lm_head.weight", dt[p + "wte.weight"])
    spec.act_on("lm_head.weight", "residual", 1, "contra")
    spec.act_on(p + "ln_f.bias", "residual", 0, "co")
    return Prepared(_back(s, dt, torch.float32), spec, untied, notes)
