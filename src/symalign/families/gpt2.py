r"""GPT-2: fused, transposed ``Conv1D`` projections with biases; learned ``wpe``; LayerNorm; tied head.

Declared layout (``transformer.`` prefix, layer ``h.{i}.``; ``Conv1D`` stores ``(in, out)``,
``y = x W + b``, so every head or stream axis is the transpose of the ``nn.Linear`` one):

* ``attn.c_attn`` ``(D, 3D)``: Q, K, V side by side on **axis 1**, in the segments
  ``(0, D)``, ``(D, D)``, ``(2D, D)``; head ``j`` at ``j d .. (j+1) d`` of each. Acting
  covariantly on axis 1 forms ``W T^T``, i.e. ``q -> T q``. Its bias ``(3D,)``: axis 0,
  same segments. ``attn.c_proj`` ``(h d, D)``: the head axis is **axis 0**; its bias is
  on the model axis (untouched).
* Group: ``S_h x (GL(d) x GL(d))^h`` (learned absolute positions, no RoPE). The score
  scale (``1/sqrt(d)``, ``scale_attn_by_inverse_layer_idx``, ``reorder_and_upcast_attn``)
  is one scalar per layer and commutes with every element. Cross-attention
  (``add_cross_attention``) is left out of the attention spec (its weights are untouched)
  and leaves the stream unaligned in the whole model.
* Whole model: ``ln_1``/``ln_2`` fold into ``c_attn``/``mlp.c_fc`` (``W <- diag(g) W``,
  ``bias <- bias + b W`` in ``Conv1D`` storage); the norms keep their centring, so the
  stream has ``O_1(D) = {O in O(D): O 1 = 1}``, acting on ``wte`` and ``wpe`` columns, the
  ``c_proj`` outputs and the readers' inputs. ``ln_f``'s gain cannot be folded into the
  tied head, so the head is **untied** (``lm_head = wte diag(g_f)``, ``ln_f.bias <- b_f /
  g_f``, rotating covariantly; ``tie_word_embeddings = false``). FF: ``mlp.c_fc`` ->
  ``activation_function`` -> ``mlp.c_proj``, ``S_{d_ff}`` (ReLU: with positive scales).
"""

from __future__ import annotations

from symalign.families.base import Decoder, Family
from symalign.families.declared import TOKENS, Case, Experiment, Tiny


class GPT2Family(Family):
    family = "GPT-2"
    model_types = ("gpt2",)
    pairing = None
    auto_classes = ("AutoModelForCausalLM", "AutoModel")
    decl = Decoder(layer="h.{i}.", q=None, k=None, v=None, o="attn.c_proj", qkv="attn.c_attn", qkv_bias=True,
                   conv1d=True, gate=None, up=None, ff_in="mlp.c_fc", down="mlp.c_proj",
                   ff_act="activation_function", ff_size="n_inner", norm="layer", pre_attn_norm="ln_1",
                   pre_ff_norm="ln_2", embed="wte", positions=("wpe",), final_norm="ln_f", heads=("lm_head",),
                   base="transformer.")
    tiny = Tiny("GPT2LMHeadModel", "GPT2Config", {"n_embd": 16, "n_layer": 2, "n_head": 4, "vocab_size": 64,
                                                  "n_positions": 32, **TOKENS})
    # its attention group and exactness: tests/test_arch.py, tests/test_families.py (older families)
    cases = (Case({"tie_word_embeddings": False}, exact=False, residual="O_1(16)", streamed=("big",)),
             Case({"tie_word_embeddings": False, "activation_function": "relu"}, exact=False,
                  residual="O_1(16)"),  # ReLU units: scales
             # a LayerNorm stream with a tied head: the rewrite unties it (a head tensor appended to B's last shard)
             Case({"tie_word_embeddings": True}, exact=False, residual="O_1(16)", streamed=("big", "merge")))
    experiment = Experiment("learned", {"lm": "GPT2LMHeadModel"}, "n_positions")
