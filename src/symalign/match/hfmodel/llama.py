r"""Llama-style checkpoints (``llama``, ``mistral``, ``qwen2``): RMSNorm, so the stream has the full ``O(D)``.

``RMS(x) * g`` read by ``W`` equals ``RMS(x)`` read by ``W diag(g)``: each gain is
folded into the Q/K/V (``input_layernorm``), gate/up (``post_attention_layernorm``)
and ``lm_head`` (``norm``) weights and set to 1. Then ``RMS(O x) = O RMS(x)`` for
every ``O in O(D)``: writers (``embed_tokens``, ``o_proj``, ``down_proj``) ``W <- O W``,
readers ``W <- W O^T``. The FF permutation acts on gate/up rows and ``down_proj``
columns. Tied embeddings are refused: the final gain cannot be folded into a head
that is also the embedding.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import Tensor

from symalign.errors import MatchError
from symalign.groups import Orthogonal, Permutation
from symalign.match.hfmodel.common import RESIDUAL, Prepared, back, copy_spec, prefix_of, to_f64
from symalign.spec import SymmetrySpec

LLAMA_LIKE = ("llama", "mistral", "qwen2")


def prepare_llama(config: Any, state: Mapping[str, Tensor], att: SymmetrySpec) -> Prepared:
    s, dt = to_f64(state)
    p = prefix_of(s, "layers.0.self_attn.q_proj.weight")
    head = "lm_head.weight"
    if bool(getattr(config, "tie_word_embeddings", False)) or head not in s:
        raise MatchError("--scope model: a Llama-style model with tied embeddings cannot fold its final RMSNorm "
                         "gain into the head (it is also the embedding); residual rotations would not be exact")
    spec = copy_spec(att)
    spec.add_space(RESIDUAL, Orthogonal(int(config.hidden_size)), "residual")
    spec.act_on(p + "embed_tokens.weight", RESIDUAL, 1, "co")
    spec.act_on(head, RESIDUAL, 1, "contra")
    for i in range(int(config.num_hidden_layers)):
        lp = f"{p}layers.{i}."
        g1 = s[lp + "input_layernorm.weight"]
        g2 = s[lp + "post_attention_layernorm.weight"]
        for n in "qkv":
            s[f"{lp}self_attn.{n}_proj.weight"] = s[f"{lp}self_attn.{n}_proj.weight"] * g1
            spec.act_on(f"{lp}self_attn.{n}_proj.weight", RESIDUAL, 1, "contra")
        for n in ("gate", "up"):
            s[f"{lp}mlp.{n}_proj.weight"] = s[f"{lp}mlp.{n}_proj.weight"] * g2
            spec.act_on(f"{lp}mlp.{n}_proj.weight", RESIDUAL, 1, "contra")
        s[lp + "input_layernorm.weight"] = torch.ones_like(g1)
        s[lp + "post_attention_layernorm.weight"] = torch.ones_like(g2)
        for out in ("self_attn.o_proj", "mlp.down_proj"):
            spec.act_on(f"{lp}{out}.weight", RESIDUAL, 0, "co")
            if f"{lp}{out}.bias" in s:
                spec.act_on(f"{lp}{out}.bias", RESIDUAL, 0, "co")
        ff = f"ff.{i}"
        spec.add_space(ff, Permutation(int(config.intermediate_size)), "ff", i)
        for n in ("gate", "up"):
            spec.act_on(f"{lp}mlp.{n}_proj.weight", ff, 0)
            if f"{lp}mlp.{n}_proj.bias" in s:
                spec.act_on(f"{lp}mlp.{n}_proj.bias", ff, 0)
        spec.act_on(f"{lp}mlp.down_proj.weight", ff, 1, "contra")
    gf = s[p + "norm.weight"]
    s[head] = s[head] * gf
    s[p + "norm.weight"] = torch.ones_like(gf)
    return Prepared(back(s, dt, torch.float32), spec, False, ["RMSNorm gains folded into the next linear maps"])
