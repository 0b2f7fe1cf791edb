r"""BERT: separate ``query``/``key``/``value`` and ``attention.output.dense``, all biased.

Layout per layer ``i`` (``nn.Linear``): ``encoder.layer.{i}.attention.self.{query,key,value}.weight``
``(h d, D)`` -- head axis 0, biases likewise; ``attention.output.dense.weight``
``(D, h d)`` -- head axis 1 (its bias is on the model axis: untouched).

Group: ``S_h x (GL(d) x GL(d))^h`` (learned absolute positions are added to the
input, before attention). transformers 5.x has no relative-position BERT
attention, so nothing else enters the scores. Cross-attention layers of a BERT
decoder are left out (untouched).
"""

from __future__ import annotations

from typing import Any

from symalign.arch.base import Adapter, AttentionLayout, Proj, bias_if, gl, heads_of


class BertAdapter(Adapter):
    family = "BERT"
    model_types = ("bert",)
    pairing = None
    auto_classes = ("AutoModel",)
    probe = "encoder.layer.0.attention.self.query.weight"
    names = {"q": "query", "k": "key", "v": "value"}

    def layouts(self, config: Any, prefix: str, keys: set[str]) -> list[AttentionLayout]:
        _, h, d, _ = heads_of(config)
        out = []
        for i in range(int(config.num_hidden_layers)):
            p = f"{prefix}encoder.layer.{i}.attention."
            q, k, v = (Proj(p + f"self.{self.names[n]}.weight", 0, None,
                            bias_if(keys, p + f"self.{self.names[n]}.bias", True)) for n in "qkv")
            o = Proj(p + "output.dense.weight", 1)
            out.append(AttentionLayout(q, k, v, o, h, d, h, self.qk_group(config, d), gl(d)))
        return out

    def qk_group(self, config: Any, d: int):
        return gl(d)
