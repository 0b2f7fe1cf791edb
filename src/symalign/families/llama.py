r"""Llama and its grouped-query relatives Mistral and Qwen2: the default :class:`~symalign.families.base.Decoder`.

Per layer ``i`` (``nn.Linear``, weight ``(out, in)``): ``layers.{i}.self_attn.{q,k,v}_proj``
(head axis 0; Q ``h d`` rows, K/V ``h_kv d``), ``o_proj`` (head axis 1); biases on
Q/K/V when present (Qwen2 always; Llama/Mistral with ``attention_bias``; the ``o_proj``
bias is on the model axis). ``input_layernorm`` and ``post_attention_layernorm`` are
RMSNorm pre-norms of the two branches; gated SiLU FF ``gate_proj``/``up_proj`` ->
``down_proj``; ``norm`` before ``lm_head``.

Attention group: ``S_{h_kv} wr S_g`` on heads, ``(H(r, half) (+) GL(d - r))^{h_kv}`` on
Q-K (``rotate_half`` pairs ``(j, j + r/2)``; ``r`` read from the model's own rotary
module, so ``partial_rotary_factor`` counts exactly when the model honours it; RoPE
scaling variants (linear, dynamic, yarn, llama3) change the frequencies or scale
cos/sin by a scalar: same planes, same group), ``GL(d)^{h_kv}`` on V-O. The key bias is
rotated with the key, so it is the homogeneous row of ``W_K`` and carries its label.

Whole model: the RMSNorm gains fold into Q/K/V, gate/up and ``lm_head``, and the stream
has ``O(D)`` (``RMS(O x) = O RMS(x)``); with a tied head the gains stay and the stream
has ``S_D``, every gain permuted with it (the final gain cannot be folded into a head
that is also the embedding).
"""

from __future__ import annotations

from symalign.families.base import Decoder, Family
from symalign.families.declared import DECODER, Case, Experiment, Tiny

LLAMA_LIKE = ("llama", "mistral", "qwen2")
"""The Llama-style families the streamed ``--scope model`` handles (RMSNorm gains folded, residual ``O(D)``)."""


class LlamaFamily(Family):
    family = "Llama"
    model_types = ("llama",)
    decl = Decoder()
    tiny = Tiny("LlamaForCausalLM", "LlamaConfig", {**DECODER, "num_key_value_heads": 2})
    probe_kw = {"head_dim": 4, "num_key_value_heads": 1}
    cases = (Case(probe=True, row="Llama (GQA)"), Case({"attention_bias": True}),
             Case({"tie_word_embeddings": True}, residual="S_32", streamed=("float32", "big")),
             Case({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 10000.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 16}}))
    experiment = Experiment("rope", {"lm": "LlamaForCausalLM"})


class MistralFamily(LlamaFamily):
    family = "Mistral"
    model_types = ("mistral",)
    tiny = Tiny("MistralForCausalLM", "MistralConfig", {**DECODER, "num_key_value_heads": 2})
    cases = (Case(probe=True, residual="O(32)", row="Mistral (GQA)"),)
    experiment = Experiment("rope", {"lm": "MistralForCausalLM"})


class Qwen2Family(LlamaFamily):
    family = "Qwen2"
    model_types = ("qwen2",)
    decl = Decoder(qkv_bias=True)
    tiny = Tiny("Qwen2ForCausalLM", "Qwen2Config", {**DECODER, "num_key_value_heads": 2})
    cases = (Case(probe=True, residual="O(32)", row="Qwen2 (GQA, Q/K/V biases)"), Case({"tie_word_embeddings": True}))
    experiment = Experiment("rope", {"lm": "Qwen2ForCausalLM"})
