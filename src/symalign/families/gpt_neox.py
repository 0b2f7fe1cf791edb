r"""GPT-NeoX (the Pythia suite): per-head interleaved fused QKV, partial rotary, LayerNorm, untied head.

Declared layout (``gpt_neox.`` prefix; ``embed_out`` is the LM head as saved on disk,
``lm_head`` in memory):

* ``layers.{i}.attention.query_key_value`` (``nn.Linear``, rows ``(head, [q | k | v])``:
  head ``j``'s query is rows ``3 d j .. 3 d j + d``) -> segments ``(0, d, 3d)``,
  ``(d, d, 3d)``, ``(2d, d, 3d)``; its bias (``attention_bias``) likewise;
  ``attention.dense`` is O (bias on the model axis).
* RoPE on the first ``r = 2 len(inv_freq)`` dimensions of each head (``rotary_pct`` /
  ``partial_rotary_factor``), ``rotate_half`` pairing within them: Q-K group
  ``H(r) (+) GL(d - r)``; ``rotary_pct = 0`` leaves ``GL(d)``. RoPE scaling variants
  change frequencies or scale cos/sin by a scalar only: same planes, same group.
* ``use_parallel_residual`` (``x + attn(ln1 x) + mlp(ln2 x)``) or sequential: either
  way each LayerNorm reads the stream, so gains and biases fold into
  ``query_key_value``/``dense_h_to_4h``/``embed_out`` and the stream has ``O_1(D)``.
* FF ``dense_h_to_4h`` -> act -> ``dense_4h_to_h`` with biases: ``S_{d_ff}`` (ReLU: with
  positive scales).
"""

from __future__ import annotations

from typing import Any

from symalign.errors import ConfigError
from symalign.families.base import Decoder, Family
from symalign.families.declared import DECODER, Case, Tiny


class GPTNeoXFamily(Family):
    family = "GPT-NeoX"
    model_types = ("gpt_neox",)
    alt_probes = ()
    decl = Decoder(layer="layers.{i}.", q=None, k=None, v=None, o="attention.dense",
                   qkv="attention.query_key_value", qkv_interleaved=True, gate=None, up=None,
                   ff_in="mlp.dense_h_to_4h", down="mlp.dense_4h_to_h", norm="layer",
                   pre_attn_norm="input_layernorm", pre_ff_norm="post_attention_layernorm", embed="embed_in",
                   final_norm="final_layer_norm", heads=("embed_out", "lm_head"), base="gpt_neox.")
    tiny = Tiny("GPTNeoXForCausalLM", "GPTNeoXConfig", {**DECODER, "rotary_pct": 0.5})
    cases = (Case(probe=True, groups={"qk.0": "H(4,half)+GL(4)^4"}, residual="O_1(32)",
                  streamed=("float32", "merge"), row="GPT-NeoX (rotary_pct 0.5, biases)"),
             Case({"attention_bias": False}, probe=True, row="GPT-NeoX (no biases)"),
             Case({"use_parallel_residual": False}), Case({"hidden_act": "relu"}),
             Case({"tie_word_embeddings": True}, residual="O_1(32)"),
             Case({"rotary_pct": 1.0}, groups={"qk.0": "H(8,half)^4"}),
             Case({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0,
                                       "partial_rotary_factor": 0.25}}))

    def rotary(self, config: Any, d: int) -> int | None:
        try:
            return super().rotary(config, d)
        except ConfigError:  # rotary_pct = 0: nothing rotated
            return None
