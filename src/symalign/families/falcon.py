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
element per K/V head.

``alibi=True`` (all three layouts): no RoPE; the score of head ``i`` is
``(q_i^T k_j(i) + m_i n) / sqrt(d)`` plus the mask, with one slope ``m_i`` per head
index (``build_alibi_tensor``: powers of ``2^{-8 / h'}``, all distinct), a bias that depends on
no weight. A head permutation would move head ``i``'s weights under slope ``m_{pi(i)}``:
no head permutation is declared (``pinned_heads``). Inside each K/V group nothing
positional touches ``q`` or ``k``, so ``q -> T^{-T} q`` (every query head of the group)
and ``k -> T k`` keep every ``q^T k``: Q-K is ``GL(d)`` per K/V head, V-O ``GL(d)`` per
K/V head, dimension ``2 h_kv d^2`` per layer. (transformers' eager path adds the ALiBi
term twice, once in the logits and once through the mask, SDPA once: the two kernels
compute different functions, each with this group.) The norms: ``ln_attn`` and ``ln_mlp``
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

from symalign.families.base import Decoder, Family
from symalign.families.declared import DECODER, Case, Tiny

_BASE = Decoder(layer="h.{i}.", q=None, k=None, v=None, o="self_attention.dense", qkv="self_attention.query_key_value",
                gate=None, up=None, ff_in="mlp.dense_h_to_4h", down="mlp.dense_4h_to_h", ff_act="activation",
                norm="layer", pre_attn_norm="input_layernorm", pre_ff_norm="input_layernorm", embed="word_embeddings",
                final_norm="ln_f", heads=("lm_head",), base="transformer.")


class FalconFamily(Family):
    family = "Falcon"
    model_types = ("falcon",)
    decl = _BASE
    tiny = Tiny("FalconForCausalLM", "FalconConfig", {**DECODER, "tie_word_embeddings": False})  # multi-query
    cases = (Case(probe=True, residual="O_1(32)", streamed=("float32", "big"), row="Falcon (multi-query, parallel)"),
             Case({"tie_word_embeddings": True}, residual="O_1(32)", streamed=("merge",)),
             Case({"new_decoder_architecture": True, "num_kv_heads": 2}),
             Case({"new_decoder_architecture": True, "num_kv_heads": 2, "num_ln_in_parallel_attn": 1}),
             Case({"multi_query": False, "bias": True}, probe=True, row="Falcon (per-head fused, biases)"),
             Case({"parallel_attn": False}),
             Case({"new_decoder_architecture": True, "num_kv_heads": 1}, exact=False, probe=True,
                  row="Falcon (new decoder, 1 K/V head)"),
             # ALiBi: heads pinned by their slopes, GL(d) on Q-K (tests/test_family_falcon.py)
             Case({"alibi": True}, probe=True, row="Falcon ALiBi (multi-query)"),
             Case({"alibi": True, "new_decoder_architecture": True, "num_kv_heads": 2}),
             Case({"alibi": True, "new_decoder_architecture": True, "num_kv_heads": 1}, exact=False, probe=True,
                  row="Falcon ALiBi (new decoder, 1 K/V head)"),
             Case({"alibi": True, "multi_query": False, "bias": True}, probe=True,
                  row="Falcon ALiBi (per-head fused, biases)"),
             Case({"alibi": True, "parallel_attn": False}))

    def declaration(self, config: Any) -> Decoder:
        alibi = bool(getattr(config, "alibi", False))  # no RoPE, every head pinned by its slope
        base = replace(_BASE, qkv_bias=bool(config.bias), rope=not alibi, pinned_heads=alibi)
        if config.new_decoder_architecture:
            two = (config.num_ln_in_parallel_attn or 2) == 2
            norms = dict(pre_attn_norm="ln_attn", pre_ff_norm="ln_mlp") if two else {}
            return replace(base, qkv_grouped=True, **norms)
        if not bool(config.parallel_attn):
            return replace(base, pre_ff_norm="post_attention_layernorm", qkv_interleaved=not config.multi_query)
        return replace(base, qkv_interleaved=not config.multi_query)

    def heads(self, config: Any) -> tuple[int, int, int, int]:
        D, h = int(config.hidden_size), int(config.num_attention_heads)
        if config.new_decoder_architecture:
            kv = int(config.num_kv_heads)
        else:
            kv = 1 if config.multi_query else h
        return D, h, D // h, kv

    def attention_kwargs(self, x: Tensor, config: Any = None) -> dict[str, Any]:
        """No mask (Falcon adds one unconditionally: all zeros); with ``alibi``, the bias as ``FalconModel``
        builds it for an unpadded batch: ``alibi`` ``(b h, 1, s)`` and, in the additive mask, ``alibi / sqrt(d)``."""
        b, s = x.shape[:2]
        if config is None or not bool(getattr(config, "alibi", False)):
            return {"alibi": None, "attention_mask": torch.zeros(b, 1, s, s, dtype=x.dtype)}
        from transformers.models.falcon.modeling_falcon import build_alibi_tensor

        _, h, d, _ = self.heads(config)
        alibi = build_alibi_tensor(torch.ones(b, s, dtype=torch.long), h, x.dtype)
        mask = (alibi.reshape(b, h, 1, s) / d ** 0.5).expand(b, h, s, s)
        return {"alibi": alibi, "attention_mask": mask}
