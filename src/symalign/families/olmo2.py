r"""OLMo 2: QK-norm over all heads, post-norms on both branches, no pre-norms.

``q = RoPE(split_heads(g_q * RMS(W_Q x)))`` with ``RMS`` over all ``h d`` entries and a
gain per entry (``q_norm.weight``, ``(h d,)``; ``k_norm.weight``, ``(h_kv d,)``). The
normalisation spans the heads, so only maps that preserve the norm of the whole
concatenation survive: per-head orthogonal blocks and head permutations, the
permutations moving the gain entries with the heads (``heads.i`` acts on both norm
weights); with generic gains the per-head blocks are ``+-1`` per RoPE plane. The gain
rescalings are per K/V block and plane (``qkgain.i`` coupled to the heads).

The layer is ``h = h + post_attn_norm(attn(h))``, ``h = h + post_ff_norm(mlp(h))``:
the stream is read raw and written through ``RMS(y) * g``, so an orthogonal map of
the stream must commute with ``diag(g)``: the residual group is the signed
permutations; ``S_D`` is declared (gains permuted with the stream).
"""

from __future__ import annotations

from symalign.families.base import Decoder, Family
from symalign.families.declared import DECODER, Case, Tiny


class Olmo2Family(Family):
    family = "OLMo 2"
    model_types = ("olmo2",)
    decl = Decoder(q_norm="self_attn.q_norm", k_norm="self_attn.k_norm", qk_norm_over="all",
                   pre_attn_norm=None, pre_ff_norm=None, post_attn_norm="post_attention_layernorm",
                   post_ff_norm="post_feedforward_layernorm")
    tiny = Tiny("Olmo2ForCausalLM", "Olmo2Config", {**DECODER, "num_key_value_heads": 2})
    probe_kw = {"num_key_value_heads": 1, "rms_norm_eps": 1e-2}  # eps: declared.PROBE
    cases = (Case(probe=True, groups={"qk.0": "signs(Z2^4,half)^2", "qkgain.0": "scales(R+^4,half)^2"},
                  residual="S_32", row="OLMo 2 (QK-norm over all heads)"),
             Case({"attention_bias": True}),
             Case({"num_key_value_heads": 2}, exact=False, row="OLMo 2, h_kv = h"))
