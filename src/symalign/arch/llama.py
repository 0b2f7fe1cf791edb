r"""Llama and its grouped-query relatives Mistral and Qwen2.

Layout per layer ``i`` (``nn.Linear``, weight ``(out, in)``):
``layers.{i}.self_attn.{q,k,v}_proj.weight`` -- head axis 0 (Q: ``h d`` rows,
K/V: ``h_kv d`` rows); ``o_proj.weight`` ``(D, h d)`` -- head axis 1. Biases on
Q/K/V when present (Qwen2 always; Llama/Mistral with ``attention_bias``); an
``o_proj`` bias is on the model axis and untouched.

Group: ``S_{h_kv} wr S_g`` on heads, ``(H(r, "half") (+) GL(d - r))^{h_kv}`` on Q-K
(``rotate_half`` pairs ``(j, j + r/2)``; ``r`` read from the model's own rotary
module, so ``partial_rotary_factor`` counts exactly when the model honours it),
``GL(d)^{h_kv}`` on V-O. The key bias is rotated by RoPE together with the key,
so it is the homogeneous row of ``W_K`` and carries the same contravariant label:
``k + b_K -> T^{-T} (k + b_K)`` commutes with every rotation -- exact. RoPE
scaling variants (linear, dynamic, yarn, llama3) change the frequencies or
scale cos/sin by a scalar: the planes, hence the group, stay the same.
"""

from __future__ import annotations

from typing import Any

from symalign.arch.base import Adapter, AttentionLayout, Proj, bias_if, gl, heads_of
from symalign.arch.rope import rotary_dims
from symalign.groups import RotaryPlanes


class LlamaAdapter(Adapter):
    family = "Llama"
    model_types = ("llama",)
    pairing = "half"
    auto_classes = ("AutoModelForCausalLM", "AutoModel")
    probe = "layers.0.self_attn.q_proj.weight"

    def layouts(self, config: Any, prefix: str, keys: set[str]) -> list[AttentionLayout]:
        _, h, d, kv = heads_of(config)
        r = rotary_dims(config, d)
        has_bias = bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2"
        out = []
        for i in range(int(config.num_hidden_layers)):
            p = f"{prefix}layers.{i}.self_attn."
            q, k, v = (Proj(p + f"{n}_proj.weight", 0, None, bias_if(keys, p + f"{n}_proj.bias", has_bias))
                       for n in "qkv")
            o = Proj(p + "o_proj.weight", 1)
            out.append(AttentionLayout(q, k, v, o, h, d, kv, RotaryPlanes(d, self.pairing, r), gl(d)))
        return out


class MistralAdapter(LlamaAdapter):
    family = "Mistral"
    model_types = ("mistral",)


class Qwen2Adapter(LlamaAdapter):
    family = "Qwen2"
    model_types = ("qwen2",)
