r"""Phi-3: fused ``qkv_proj`` (rows ``[Q | K | V]``), fused ``gate_up_proj`` (rows ``[gate | up]``).

Q is rows ``0 .. h d``, K ``h d .. (h + h_kv) d``, V the last ``h_kv d`` (segments on
axis 0); the FF permutation acts on both halves of ``gate_up_proj`` alike. RoPE
``rotate_half`` on ``r = 2 len(inv_freq)`` dimensions (``partial_rotary_factor``
honoured as the model does); ``longrope`` scaling rescales frequencies only. RMSNorm
pre-norms: gains fold, residual ``O(D)`` (a tied head: ``S_D``).
"""

from __future__ import annotations

from symalign.families.base import Decoder, Family
from symalign.families.declared import DECODER, Case, Tiny


class Phi3Family(Family):
    family = "Phi-3"
    model_types = ("phi3",)
    decl = Decoder(q=None, k=None, v=None, qkv="self_attn.qkv_proj", gate=None, up=None,
                   gate_up="mlp.gate_up_proj")
    tiny = Tiny("Phi3ForCausalLM", "Phi3Config", {**DECODER, "num_key_value_heads": 2})
    probe_kw = {"num_key_value_heads": 1}
    cases = (Case(probe=True, groups={"qk.0": "H(8,half)^2"}, residual="O(32)", row="Phi-3 (fused qkv)"),
             Case({"tie_word_embeddings": True}),
             Case({"partial_rotary_factor": 0.5}, groups={"qk.0": "H(4,half)+GL(4)^2"}))
