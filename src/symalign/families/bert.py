r"""BERT: separate biased ``query``/``key``/``value``, post-LN, learned positions; the stream has ``S_D``.

Declared layout (``bert.`` prefix or none, layer ``encoder.layer.{i}.``, ``nn.Linear``):

* ``attention.self.{query,key,value}`` ``(h d, D)``: head axis 0, biases likewise;
  ``attention.output.dense`` ``(D, h d)``: head axis 1 (its bias is on the model axis).
  Group ``S_h x (GL(d) x GL(d))^h``: learned absolute positions are added to the input,
  before attention, and transformers 5.x has no relative-position BERT attention.
  Cross-attention layers of a BERT decoder are left out (untouched).
* Post-LN: ``a = attention.output.LayerNorm(x + attn(x))``,
  ``x' = output.LayerNorm(a + output.dense(act(intermediate.dense(a))))``; the
  embeddings' sum (``word``, ``position``, ``token_type``) goes through
  ``embeddings.LayerNorm``. Every gain sits on the stream path, so the residual group is
  the permutations ``S_D`` (:mod:`symalign.families.encoder`), nothing folded.
* Heads: the MLM transform ``cls.predictions.transform.dense`` (+ its LayerNorm) writes
  into the word embeddings' coordinates, read by the tied ``cls.predictions.decoder``;
  the pooler (``bert.pooler.dense``) reads the stream for sequence-level heads (the
  classifier behind it reads the pooler's output: untouched); token classification
  (``classifier``) and question answering (``qa_outputs``) read it directly. A bare
  ``BertModel`` outputs the stream: no residual space.
* FF: ``intermediate.dense`` -> ``hidden_act`` -> ``output.dense``, ``S_{d_ff}`` (ReLU:
  positive scales too).
"""

from __future__ import annotations

from symalign.families.declared import Experiment, Tiny
from symalign.families.encoder import Encoder, EncoderFamily, Head

MLM = Head(transform="cls.predictions.transform.dense", transform_norm="cls.predictions.transform.LayerNorm",
           decoder="cls.predictions.decoder")
POOLER = Head(reads=("{base}pooler.dense",))

BERT_LAYOUT = dict(
    layer="encoder.layer.{i}.", q="attention.self.query", k="attention.self.key", v="attention.self.value",
    o="attention.output.dense", qkv_bias=True, gate=None, up=None, ff_in="intermediate.dense", down="output.dense",
    norm="layer", pre_attn_norm=None, post_attn_norm="attention.output.LayerNorm", pre_ff_norm=None,
    post_ff_norm="output.LayerNorm", embed_norm="embeddings.LayerNorm")


class BertFamily(EncoderFamily):
    family = "BERT"
    model_types = ("bert",)
    tiny = Tiny("BertModel", "BertConfig", {"hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4,
                                            "intermediate_size": 32, "vocab_size": 64, "max_position_embeddings": 32,
                                            "pad_token_id": 0})
    experiment = Experiment("learned", {"text": "BertForSequenceClassification"})
    decl = Encoder(
        **BERT_LAYOUT, base="bert.",
        embeds=(("embeddings.word_embeddings.weight", 1), ("embeddings.position_embeddings.weight", 1),
                ("embeddings.token_type_embeddings.weight", 1)),
        archs={"BertForMaskedLM": MLM, "BertLMHeadModel": MLM,
               "BertForPreTraining": Head(POOLER.reads, MLM.transform, MLM.transform_norm, MLM.decoder),
               "BertForSequenceClassification": POOLER, "BertForMultipleChoice": POOLER,
               "BertForNextSentencePrediction": POOLER, "BertForTokenClassification": Head(reads=("classifier",)),
               "BertForQuestionAnswering": Head(reads=("qa_outputs",))},
        bare=("BertModel",))
