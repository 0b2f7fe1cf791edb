r"""RoFormer: BERT layout with RoPE on interleaved pairs ``(2j, 2j + 1)``.

Layout: as BERT (``encoder.layer.{i}.attention.self.{query,key,value}``,
``attention.output.dense``, biases). The sinusoidal table
``encoder.embed_positions.weight`` is a fixed buffer (saved, never transformed).

Group: ``S_h``; on Q-K ``H(d, "interleaved")^h`` (the query/key biases are rotated
with the projections, so they carry the weight's labels: exact); on V-O
``GL(d)^h`` -- or ``H(d, "interleaved")^h`` when ``rotary_value=True``, because V
is then rotated by its key position and ``W_O`` reads the rotated values, so a
V-O element must commute with every rotation too.
"""

from __future__ import annotations

from typing import Any

from symalign.arch.base import AttentionLayout, heads_of
from symalign.arch.bert import BertAdapter
from symalign.groups import RotaryPlanes


class RoFormerAdapter(BertAdapter):
    family = "RoFormer"
    model_types = ("roformer",)
    pairing = "interleaved"
    auto_classes = ("AutoModel",)

    def qk_group(self, config: Any, d: int):
        return RotaryPlanes(d, self.pairing)

    def layouts(self, config: Any, prefix: str, keys: set[str]) -> list[AttentionLayout]:
        _, _, d, _ = heads_of(config)
        out = super().layouts(config, prefix, keys)
        if getattr(config, "rotary_value", False):
            out = [AttentionLayout(l.q, l.k, l.v, l.o, l.n_heads, l.head_dim, l.n_kv_heads, l.qk,
                                   RotaryPlanes(d, self.pairing)) for l in out]
        return out
