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

LLAMA_LIKE = ("llama", "mistral", "qwen2")
"""The Llama-style families the streamed ``--scope model`` handles (RMSNorm gains folded, residual ``O(D)``)."""


class LlamaFamily(Family):
    family = "Llama"
    model_types = ("llama",)
    decl = Decoder()


class MistralFamily(LlamaFamily):
    family = "Mistral"
    model_types = ("mistral",)


class Qwen2Family(LlamaFamily):
    family = "Qwen2"
    model_types = ("qwen2",)
    decl = Decoder(qkv_bias=True)
