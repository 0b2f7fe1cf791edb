r"""ViT: separate biased ``q/k/v_proj``, pre-LN with LayerNorm, patch embeddings; the stream has ``O_1(D)``.

Declared layout (``vit.`` prefix or none; transformers 5.x names, layer ``layers.{i}.``):
``attention.{q,k,v}_proj`` ``(h d, D)`` (head axis 0, biases when ``qkv_bias``),
``attention.o_proj`` ``(D, h d)`` (head axis 1; its bias is on the model axis),
``layernorm_before`` -> attention, ``layernorm_after`` -> ``mlp.fc1`` -> act -> ``mlp.fc2``,
and the final ``layernorm``. On disk, transformers 5.24's ``save_pretrained`` still
writes the 4.x names (``encoder.layer.{i}.attention.attention.{query,key,value}``,
``attention.output.dense``, ``intermediate.dense``, ``output.dense``; same shapes and
axes) and converts them back when loading: :meth:`ViTFamily.named` recognises both.

* Group: ``S_h x (GL(d) x GL(d))^h`` (learned positions and the CLS token are added to
  the patch embeddings before the first layer).
* Whole model: every LayerNorm folds into its readers (Q/K/V, ``fc1``, the head; with
  ``qkv_bias=False`` the bias stays as ``b / g`` and rotates covariantly) and the
  stream has ``O_1(D)``, acting on the patch convolution's output channels (weight axis
  0, bias), ``cls_token``/``mask_token``/``position_embeddings`` (axis 2; interpolated
  positions are a per-channel linear map of the table, so they commute), ``o_proj`` and
  ``fc2`` rows. Heads: ``classifier`` (image classification, CLS row) or the
  masked-image ``decoder.0`` (a ``1 x 1`` convolution: a linear map on channels). A bare
  ``ViTModel`` outputs the stream: no residual space.
* FF: ``fc1`` rows (+ bias), ``fc2`` columns; ReLU adds positive scales.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from symalign.families.base import Decoder
from symalign.families.declared import Experiment, Tiny
from symalign.families.encoder import Encoder, EncoderFamily, Head

LEGACY = dict(layer="encoder.layer.{i}.", q="attention.attention.query", k="attention.attention.key",
              v="attention.attention.value", o="attention.output.dense", ff_in="intermediate.dense",
              down="output.dense")
"""The names ``save_pretrained`` writes (transformers 4.x naming)."""


class ViTFamily(EncoderFamily):
    family = "ViT"
    model_types = ("vit",)
    tiny = Tiny("ViTForImageClassification", "ViTConfig", {"hidden_size": 16, "num_hidden_layers": 2,
                                                           "num_attention_heads": 4, "intermediate_size": 32,
                                                           "image_size": 8, "patch_size": 4, "num_labels": 3})
    experiment = Experiment("learned", {"image": "ViTForImageClassification"}, None)
    auto_classes = ("AutoModelForImageClassification", "AutoModel")
    decl = Encoder(
        layer="layers.{i}.", q="attention.q_proj", k="attention.k_proj", v="attention.v_proj",
        o="attention.o_proj", gate=None, up=None, ff_in="mlp.fc1", down="mlp.fc2", norm="layer",
        pre_attn_norm="layernorm_before", pre_ff_norm="layernorm_after", final_norm="layernorm", base="vit.",
        embeds=(("embeddings.patch_embeddings.projection.weight", 0),
                ("embeddings.patch_embeddings.projection.bias", 0), ("embeddings.cls_token", 2),
                ("embeddings.mask_token", 2), ("embeddings.position_embeddings", 2)),
        archs={"ViTForImageClassification": Head(reads=("classifier",)),
               "ViTForMaskedImageModeling": Head(reads=("decoder.0",))},
        bare=("ViTModel",))
    alt_probes = (replace(decl, **LEGACY).first_q,)

    def declaration(self, config: Any) -> Decoder:
        """``qkv_bias`` says whether Q/K/V have biases when only a config is known."""
        return replace(self.decl, qkv_bias=bool(getattr(config, "qkv_bias", True)))

    def named(self, dec: Decoder, prefix: str, keys: set[str]) -> Decoder:
        legacy = replace(dec, **LEGACY)
        return legacy if prefix + legacy.first_q in keys and prefix + dec.first_q not in keys else dec

    def dummy_inputs(self, config: Any, batch: int = 2, seq: int = 8, seed: int = 0) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        size = int(config.image_size)
        return {"pixel_values": torch.randn(batch, int(config.num_channels), size, size, generator=g)}
