r"""Falcon: fused ``query_key_value`` in three layouts, multi-query / grouped K/V, parallel attention, LayerNorm.

Layout (``transformer.`` prefix, layer ``h.{i}.``): ``self_attention.query_key_value``
(``nn.Linear``, rows), ``self_attention.dense`` (O), ``mlp.dense_h_to_4h`` ->
``mlp.dense_4h_to_h``, biases with ``bias=True``; ``word_embeddings``, ``ln_f``, a head
``lm_head`` tied to the embedding by default. The fused rows, as ``_split_heads`` reads
them:

* ``new_decoder_architecture`` (Falcon-40B/180B): per K/V group ``[q_1 .. q_g | k | v]``
  (``g = h / h_kv``, ``h_kv = num_kv_heads``): strided segments ``(0, g d, (g+2) d)``,
  ``(g d, d, (g+2) d)``, ``((g+1) d, d, (g+2) d)``;
* ``multi_query`` (Falcon-7B): ``[Q | k | v]`` with one K/V head: plain segments;
* neither: per head ``[q | k | v]`` (as GPT-NeoX): ``(0, d, 3d)``, ``(d, d, 3d)``, ``(2d, d, 3d)``.

RoPE ``rotate_half`` over the whole head: ``H(d, half)`` on Q-K, ``GL(d)`` on V-O, one
element per K/V head. ``alibi=True`` pins every head (distinct slopes) and leaves no
head permutation: refused, naming the option. The norms: ``ln_attn`` and ``ln_mlp``
(new layout, ``num_ln_in_parallel_attn = 2``), or one ``input_layernorm`` read by both
branches (``parallel_attn``), or ``input_layernorm`` and ``post_attention_layernorm``
(sequential); all LayerNorms reading the stream: gains and biases fold, residual
``O_1(D)``, the tied head untied.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from symalign.families.base import Decoder, Family, refuse

_BASE = Decoder(layer="h.{i}.", q=None, k=None, v=None, o="self_attention.dense", qkv="self_attention.query_key_value",
                gate=None, up=None, ff_in="mlp.dense_h_to_4h", down="mlp.dense_4h_to_h", ff_act="activation",
                norm="layer", pre_attn_norm="input_layernorm", pre_ff_norm="input_layernorm", embed="word_embeddings",
                final_norm="ln_f", heads=("lm_head",), base="transformer.")


class FalconFamily(Family):
    family = "Falcon"
    model_types = ("falcon",)
    decl = _BASE

    def check_config(self, config: Any) -> None:
        if bool(getattr(config, "alibi", False)):
            raise refuse(self.family, "alibi=True", "ALiBi gives every head its own slope, so no head permutation "
                         "is a symmetry and the positions are not RoPE")

    def declaration(self, config: Any) -> Decoder:
        new = bool(config.new_decoder_architecture)
        if new:
            two = (config.num_ln_in_parallel_attn or 2) == 2
            norms = dict(pre_attn_norm="ln_attn", pre_ff_norm="ln_mlp") if two else {}
            return replace(_BASE, qkv_grouped=True, qkv_bias=bool(config.bias), **norms)
        if not bool(config.parallel_attn):
            return replace(_BASE, pre_ff_norm="post_attention_layernorm", qkv_bias=bool(config.bias),
                           qkv_interleaved=not config.multi_query)
        return replace(_BASE, qkv_bias=bool(config.bias), qkv_interleaved=not config.multi_query)

    def heads(self, config: Any) -> tuple[int, int, int, int]:
        D, h = int(config.hidden_size), int(config.num_attention_heads)
        if config.new_decoder_architecture:
            kv = int(config.num_kv_heads)
        else:
            kv = 1 if config.multi_query else h
        return D, h, D // h, kv

    def attention_kwargs(self, x: Tensor) -> dict[str, Any]:
        b, s = x.shape[:2]  # Falcon adds the mask unconditionally: an all-zero additive mask is "no mask"
        return {"alibi": None, "attention_mask": torch.zeros(b, 1, s, s, dtype=x.dtype)}
