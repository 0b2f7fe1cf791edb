r"""StableLM (StableLM-2, StableLM-3B-4E1T, StableCode): Llama's projections behind LayerNorms, partial rotary.

Layout (``model.`` prefix; transformers' ``modeling_stablelm``): ``layers.{i}.self_attn.{q,k,v}_proj``
(biases when ``use_qkv_bias``), ``self_attn.o_proj`` (no bias), gated FF ``mlp.gate_proj``/``mlp.up_proj`` ->
``hidden_act`` -> ``mlp.down_proj`` (no biases), ``input_layernorm`` and ``post_attention_layernorm``
(``nn.LayerNorm``, gain and bias) before the two branches, ``norm`` before ``lm_head``. The head dimension is
``hidden_size / num_attention_heads`` with grouped-query K/V heads.

* Attention: RoPE ``rotate_half`` on the first ``r = head_dim * partial_rotary_factor`` dimensions of each
  head (read from the model's own rotary module: ``r = 2 len(inv_freq)``), the rest passed through: Q-K group
  ``H(r, half) (+) GL(d - r)`` per K/V head, ``GL(d)`` on V-O, heads ``S_{h_kv} wr S_g``. The key bias (when
  present) rotates with the key; its unrotated part is a softmax shift (a named gauge direction).
* Whole model: every LayerNorm reads the stream, so gains and biases fold into Q/K/V, gate/up and ``lm_head``
  and the stream has ``O_1(D)`` (rotations fixing ``1``); a tied head is untied first.
  ``use_parallel_residual`` (``x + attn(ln x) + mlp(ln x)``, no ``post_attention_layernorm``): the one norm
  folds into both branches.
* ``qk_layernorm`` (a separate ``nn.LayerNorm`` per head on Q and K, ``q_layernorm.norms.{j}``) is refused: a
  head permutation would have to move the per-head norms, and a centring norm per head leaves no
  ``GL``/``H`` on Q-K that the declaration could state.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from symalign.families.base import Decoder, Family, refuse
from symalign.families.declared import DECODER, Case, Tiny


class StableLmFamily(Family):
    family = "StableLM"
    model_types = ("stablelm",)
    decl = Decoder(norm="layer")
    tiny = Tiny("StableLmForCausalLM", "StableLmConfig",
                {**DECODER, "num_key_value_heads": 2, "partial_rotary_factor": 0.5})
    probe_kw = {"num_key_value_heads": 1}
    refusals = ({"qk_layernorm": True},)
    cases = (Case(probe=True, groups={"qk.0": "H(4,half)+GL(4)^2"}, residual="O_1(32)",
                  streamed=("float32", "big", "merge"), row="StableLM (partial rotary 0.5, LayerNorm)"),
             Case({"use_qkv_bias": True}, probe=True, row="StableLM + use_qkv_bias"),
             Case({"use_parallel_residual": True}, residual="O_1(32)"),
             Case({"tie_word_embeddings": True}, residual="O_1(32)", streamed=("merge",)),
             Case({"partial_rotary_factor": 1.0}, groups={"qk.0": "H(8,half)^2"}))

    def declaration(self, config: Any) -> Decoder:
        """Q/K/V biases from ``use_qkv_bias``; ``use_parallel_residual``: one norm read by both branches."""
        if getattr(config, "qk_layernorm", False):
            raise refuse(self.family, "qk_layernorm=True", "a LayerNorm of its own per head on Q and K is not "
                         "mapped; use a checkpoint with qk_layernorm=false")
        dec = replace(self.decl, qkv_bias=bool(getattr(config, "use_qkv_bias", False)))
        if getattr(config, "use_parallel_residual", False):
            dec = replace(dec, pre_ff_norm=dec.pre_attn_norm)
        return dec
