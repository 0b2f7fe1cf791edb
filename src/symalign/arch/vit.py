r"""ViT (transformers 5.x names): ``layers.{i}.attention.{q,k,v,o}_proj``, biases.

Layout per layer ``i`` (``nn.Linear``): ``q/k/v_proj.weight`` ``(h d, D)`` -- head
axis 0, biases when ``qkv_bias``; ``o_proj.weight`` ``(D, h d)`` -- head axis 1
(``o_proj.bias`` is on the model axis: untouched).

On disk, transformers 5.24's ``save_pretrained`` still writes the 4.x names
(``encoder.layer.{i}.attention.attention.{query,key,value}``,
``encoder.layer.{i}.attention.output.dense``, same shapes and axes) and converts
them back when loading; both namings are recognised.

Group: ``S_h x (GL(d) x GL(d))^h`` (learned positions and CLS token are added
to the patch embeddings before the first layer).
"""

from __future__ import annotations

from typing import Any

import torch

from symalign.arch.base import Adapter, AttentionLayout, Proj, bias_if, gl, heads_of


class ViTAdapter(Adapter):
    family = "ViT"
    model_types = ("vit",)
    pairing = None
    auto_classes = ("AutoModelForImageClassification", "AutoModel")
    probe = "layers.0.attention.q_proj.weight"
    alt_probes = ("encoder.layer.0.attention.attention.query.weight",)

    def layouts(self, config: Any, prefix: str, keys: set[str]) -> list[AttentionLayout]:
        _, h, d, _ = heads_of(config)
        has_bias = bool(getattr(config, "qkv_bias", True))
        out = []
        legacy = prefix + self.alt_probes[0] in keys and prefix + self.probe not in keys
        for i in range(int(config.num_hidden_layers)):
            if legacy:
                p = f"{prefix}encoder.layer.{i}.attention."
                names = {n: f"attention.{full}" for n, full in zip("qkv", ("query", "key", "value"))}
                o = Proj(p + "output.dense.weight", 1)
            else:
                p = f"{prefix}layers.{i}.attention."
                names = {n: f"{n}_proj" for n in "qkv"}
                o = Proj(p + "o_proj.weight", 1)
            q, k, v = (Proj(p + f"{names[n]}.weight", 0, None, bias_if(keys, p + f"{names[n]}.bias", has_bias))
                       for n in "qkv")
            out.append(AttentionLayout(q, k, v, o, h, d, h, gl(d), gl(d)))
        return out

    def dummy_inputs(self, config: Any, batch: int = 2, seq: int = 8, seed: int = 0) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        size = int(config.image_size)
        return {"pixel_values": torch.randn(batch, int(config.num_channels), size, size, generator=g)}
