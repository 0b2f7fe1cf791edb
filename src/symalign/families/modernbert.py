r"""ModernBERT: fused ``Wqkv``, half-split RoPE, GLU FF, pre-LN but a norm on the embeddings; the stream has ``S_D``.

Declared layout (``model.`` prefix or none, layer ``layers.{i}.``, ``nn.Linear``):

* ``attn.Wqkv`` ``(3 h d, D)``: head axis 0, Q, K, V in the segments ``(0, hd)``,
  ``(hd, hd)``, ``(2hd, hd)`` (the forward views it as ``(3, h, d)``); ``attn.Wo``
  ``(D, h d)``: head axis 1. Biases (``attention_bias=True``) follow the weight.
* Group ``S_h``; Q-K ``H(r, "half") (+) GL(d - r)`` per head, V-O ``GL(d)``. Global and
  local (sliding-window) layers use different RoPE bases (``rope_theta`` per layer type):
  the rotations differ but their planes do not; ``r`` is read per layer type from the
  model's rotary module. The sliding window only masks scores.
* The stream starts as ``x_0 = embeddings.norm(E[token])`` and layer ``i`` adds
  ``attn.Wo(attn(attn_norm(x)))`` (layer 0's ``attn_norm`` is an ``Identity``: absent)
  and ``mlp.Wo(act(u) * v)`` with ``[u; v] = mlp.Wi(mlp_norm(x))``; the output is
  ``final_norm(x)``. The readers' norms could be folded, but the embeddings' gain scales
  ``x_0`` itself, so the residual group is the permutations ``S_D``
  (:mod:`symalign.families.encoder`): every norm's gain (and bias) permuted, nothing folded.
* Heads: ``head.dense`` -> act -> ``head.norm`` writes into the word embeddings'
  coordinates; the ``decoder`` (tied to them by default) or the ``classifier`` reads it.
  A bare ``ModernBertModel`` outputs the stream: no residual space.
* FF: the GLU pairs unit ``j`` of ``u`` with unit ``j`` of ``v``: one permutation on both
  halves of ``mlp.Wi`` (rows, + bias) and on ``mlp.Wo``'s columns.

Precision: ``apply_rotary_pos_emb`` casts Q and K to float32 (and back) even in a float64
model, so a float64 functional check resolves only ~1e-7 relative:
:attr:`ModernBertFamily.precision_floor` says so.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from symalign.arch.base import AttentionLayout
from symalign.arch.rope import rotary_dims
from symalign.families.declared import TOKENS, Experiment, Tiny
from symalign.families.encoder import Encoder, EncoderFamily, Head
from symalign.groups import RotaryPlanes
from symalign.tolerance import FLOAT32_ROTARY_FLOOR

HEAD = dict(transform="head.dense", transform_norm="head.norm")


class ModernBertFamily(EncoderFamily):
    family = "ModernBERT"
    model_types = ("modernbert",)
    tiny = Tiny("ModernBertForMaskedLM", "ModernBertConfig", {
        "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 32, "vocab_size": 64,
        "max_position_embeddings": 64, "global_attn_every_n_layers": 2, "local_attention": 4, "cls_token_id": 1,
        "sep_token_id": 2, **TOKENS})
    experiment = Experiment("rope", {"text": "ModernBertForSequenceClassification"})
    pairing = "half"
    auto_classes = ("AutoModelForMaskedLM", "AutoModel")
    decl = Encoder(
        layer="layers.{i}.", q=None, k=None, v=None, qkv="attn.Wqkv", o="attn.Wo", gate=None, up=None,
        gate_up="mlp.Wi", down="mlp.Wo", norm="layer", pre_attn_norm="attn_norm", pre_ff_norm="mlp_norm",
        final_norm="final_norm", base="model.", embeds=(("embeddings.tok_embeddings.weight", 1),),
        embed_norm="embeddings.norm",
        archs={"ModernBertForMaskedLM": Head(**HEAD, decoder="decoder"),
               **{f"ModernBertFor{t}": Head(**HEAD, decoder="classifier")
                  for t in ("SequenceClassification", "TokenClassification", "QuestionAnswering", "MultipleChoice")}},
        bare=("ModernBertModel",))

    @property
    def precision_floor(self) -> float:  # type: ignore[override]
        return FLOAT32_ROTARY_FLOOR

    def layouts(self, config: Any, prefix: str, keys: set[str]) -> list[AttentionLayout]:
        """One ``H(r)`` per layer, ``r`` read from the rotary table of the layer's type (global or local)."""
        n = int(config.num_hidden_layers)
        types = list(getattr(config, "layer_types", None) or ["full_attention"] * n)
        out = super().layouts(config, prefix, keys)
        dims = {t: rotary_dims(config, out[0].head_dim, t) for t in set(types)}
        return [replace(lay, qk=RotaryPlanes(lay.head_dim, self.pairing, dims[types[i]])) for i, lay in enumerate(out)]

    def rotary(self, config: Any, d: int) -> int | None:
        return d  # replaced per layer type in layouts
