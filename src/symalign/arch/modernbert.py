r"""ModernBERT: fused ``Wqkv`` ``nn.Linear`` ``(3D, D)``, half-split RoPE, usually no biases.

Layout per layer ``i``: ``layers.{i}.attn.Wqkv.weight`` ``(3 h d, D)`` -- the head
axis is **axis 0**, with Q, K, V in the segments ``(0, hd)``, ``(hd, hd)``,
``(2hd, hd)`` (the forward pass views it as ``(3, h, d)``); ``attn.Wo.weight``
``(D, h d)`` -- head axis 1. Biases (``attention_bias=True``) follow the weight.

Group: ``S_h``; Q-K ``H(r, "half") (+) GL(d - r)`` per head, V-O ``GL(d)``. Global
and local (sliding-window) layers use different RoPE bases (``rope_theta`` per
layer type): the rotations differ but their planes do not, so the group is the
same ``H``; ``r`` is read per layer type from the model's rotary module. The
sliding window only masks scores.

Precision: ``apply_rotary_pos_emb`` casts Q and K to float32 (and back) even in a
float64 model, so a float64 functional check resolves only ~1e-7 relative;
:attr:`precision_floor` says so.
"""

from __future__ import annotations

from typing import Any

from symalign.arch.base import Adapter, AttentionLayout, Proj, bias_if, gl, heads_of
from symalign.arch.rope import rotary_dims
from symalign.groups import RotaryPlanes
from symalign.tolerance import FLOAT32_ROTARY_FLOOR


class ModernBertAdapter(Adapter):
    family = "ModernBERT"
    model_types = ("modernbert",)
    pairing = "half"
    auto_classes = ("AutoModelForMaskedLM", "AutoModel")
    probe = "layers.0.attn.Wqkv.weight"
    precision_floor = FLOAT32_ROTARY_FLOOR

    def layouts(self, config: Any, prefix: str, keys: set[str]) -> list[AttentionLayout]:
        _, h, d, _ = heads_of(config)
        hd = h * d
        types = list(getattr(config, "layer_types", None) or ["full_attention"] * int(config.num_hidden_layers))
        dims = {t: rotary_dims(config, d, t) for t in set(types)}
        has_bias = bool(getattr(config, "attention_bias", False))
        out = []
        for i in range(int(config.num_hidden_layers)):
            p = f"{prefix}layers.{i}.attn."
            bias = bias_if(keys, p + "Wqkv.bias", has_bias)
            q, k, v = (Proj(p + "Wqkv.weight", 0, (j * hd, hd), bias) for j in range(3))
            o = Proj(p + "Wo.weight", 1)
            out.append(AttentionLayout(q, k, v, o, h, d, h, RotaryPlanes(d, self.pairing, dims[types[i]]), gl(d)))
        return out
