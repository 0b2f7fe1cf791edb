r"""RoFormer: BERT's layout and post-LN with RoPE on interleaved pairs ``(2j, 2j + 1)``.

Declared layout: as BERT (``roformer.`` prefix, ``encoder.layer.{i}.attention.self.{query,
key,value}``, ``attention.output.dense``, biases, post-LN), embeddings ``word`` and
``token_type`` (no position table: the sinusoidal ``encoder.embed_positions.weight`` is a
fixed table of angles, saved and never transformed).

* Q-K: ``H(d, "interleaved")^h`` (the query/key biases are rotated with the
  projections, so they carry the weight's labels: exact); V-O ``GL(d)^h`` -- or
  ``H(d, "interleaved")^h`` with ``rotary_value=True``, because V is then rotated by its
  key position and ``W_O`` reads the rotated values, so a V-O element must commute with
  every rotation too.
* Whole model: residual ``S_D`` as BERT (post-LN). With ``embedding_size !=
  hidden_size`` the embeddings live in their own width and ``embeddings_project`` writes
  the stream (its rows and bias are permuted); the embeddings, their LayerNorm and the
  MLM transform's output (tied to them) are left as they are.
* Heads: MLM / causal LM transform + tied decoder (``cls.predictions``), the
  sequence-classification head's ``classifier.dense``, token classification's
  ``classifier``, question answering's ``qa_outputs``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from symalign.arch.base import AttentionLayout
from symalign.families.bert import BERT_LAYOUT, MLM
from symalign.families.declared import Experiment, Tiny
from symalign.families.encoder import Encoder, EncoderFamily, Head
from symalign.groups import RotaryPlanes


class RoFormerFamily(EncoderFamily):
    family = "RoFormer"
    model_types = ("roformer",)
    tiny = Tiny("RoFormerModel", "RoFormerConfig", {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                                                    "intermediate_size": 32, "vocab_size": 64, "embedding_size": 32,
                                                    "max_position_embeddings": 64, "pad_token_id": 0})
    experiment = Experiment("rope", {"text": "RoFormerForSequenceClassification"})
    pairing = "interleaved"
    decl = Encoder(
        **BERT_LAYOUT, base="roformer.", embed_project="embeddings_project",
        embeds=(("embeddings.word_embeddings.weight", 1), ("embeddings.token_type_embeddings.weight", 1)),
        archs={"RoFormerForMaskedLM": MLM, "RoFormerForCausalLM": MLM,
               "RoFormerForSequenceClassification": Head(reads=("classifier.dense",)),
               "RoFormerForTokenClassification": Head(reads=("classifier",)),
               "RoFormerForQuestionAnswering": Head(reads=("qa_outputs",))},
        bare=("RoFormerModel",))

    def rotary(self, config: Any, d: int) -> int | None:
        return d  # the sinusoid table spans the whole head

    def layouts(self, config: Any, prefix: str, keys: set[str]) -> list[AttentionLayout]:
        out = super().layouts(config, prefix, keys)
        if getattr(config, "rotary_value", False):
            out = [replace(lay, vo=RotaryPlanes(lay.head_dim, self.pairing)) for lay in out]
        return out
