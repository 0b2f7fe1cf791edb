r"""Qwen3: Llama layout (GQA, RoPE ``rotate_half``, RMSNorm, gated SiLU FF) plus per-head QK-norm.

``q = RoPE(g_q * RMS(W_Q^i x))`` with ``RMS`` over ``head_dim`` and a gain ``g_q``
(``self_attn.q_norm.weight``, ``(d,)``) shared by every head; likewise for K. The
exact group (docs/symmetry.md, "QK-norm"): head permutations ``S_{h_kv} wr S_g``
(the shared gains are untouched), ``+-1`` per RoPE plane on Q-K
(:class:`~symalign.groups.PlaneSigns`), per-plane rescalings of the gains
(``g_q -> c g_q``, ``g_k -> g_k / c``, :class:`~symalign.groups.PlaneScales`, one
element per layer), ``GL(d)`` on V-O. ``attention_bias`` (before the norm) and the
sliding window (a mask) keep the group; a tied head makes the residual group ``S_D``.
"""

from __future__ import annotations

from symalign.families.base import Decoder, Family
from symalign.families.declared import DECODER, Case, Tiny


class Qwen3Family(Family):
    family = "Qwen3"
    model_types = ("qwen3",)
    decl = Decoder(q_norm="self_attn.q_norm", k_norm="self_attn.k_norm", qk_norm_over="head")
    tiny = Tiny("Qwen3ForCausalLM", "Qwen3Config", {**DECODER, "num_key_value_heads": 2, "head_dim": 8})
    probe_kw = {"head_dim": 4, "num_key_value_heads": 1, "rms_norm_eps": 1e-2}  # eps: declared.PROBE
    cases = (Case(probe=True, groups={"qk.0": "signs(Z2^4,half)^2", "qkgain.0": "scales(R+^4,half)^1"},
                  residual="O(32)", streamed=("float32", "merge"), row="Qwen3 (QK-norm per head)"),
             Case({"attention_bias": True}, probe=True, row="Qwen3 + attention_bias"),
             Case({"tie_word_embeddings": True}),
             Case({"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}),
             Case({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}))
