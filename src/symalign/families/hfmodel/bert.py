r"""BERT and RoFormer: post-LN, so the residual stream has only the permutations ``S_D``.

A post-LN layer computes ``a = LN_1(x + attn(x))``, ``x' = LN_2(a + W_2 act(W_1 a))``:
the LayerNorm gain sits on the residual path itself, so it cannot be folded into
the readers, and a rotation ``O`` of the stream would need a new gain with
``diag(g') O = O diag(g)``, which for generic gains only permutations satisfy:
rotations of the stream are **not** symmetries.
Permutations are: a LayerNorm commutes with coordinate permutations once its gain
and bias are permuted too (mean and variance are permutation invariant). The
residual permutation ``P`` acts covariantly on every writer -- the word, position
and token-type embeddings (axis 1), the embeddings LayerNorm, each
``attention.output.dense`` and ``output.dense`` (weight axis 0, bias), each
``LayerNorm`` gain/bias -- and contravariantly on every reader: Q/K/V and
``intermediate.dense`` (axis 1), and the head.

Heads (by ``config.architectures[0]``): the pooler (``pooler.dense``, reads the CLS
row); the MLM head ``cls.predictions.transform.dense`` reads the stream and its
output space is permuted by the same ``P`` (``transform.dense`` axis 0 and bias, its
LayerNorm, and the decoder's input axis): the decoder is tied to the word
embeddings, whose columns ``P`` already permutes. Token classification
(``classifier``) and question answering (``qa_outputs``) read the stream;
sequence classification reads the pooler's output (untouched). A bare
``BertModel``/``RoFormerModel`` outputs the stream itself: no residual space.

RoFormer: no position table (RoPE inside attention; ``embed_positions`` is a fixed
buffer of angles, untouched). With ``embedding_size != hidden_size`` the
embeddings live in their own width and ``embeddings_project`` writes the stream:
``P`` acts on its rows (and bias), the embedding space and the MLM transform's
output (tied to it) are left as they are.

FF ``ff.i``: ``intermediate.dense`` rows (+ bias), ``output.dense`` columns (ReLU:
positive scales too).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import Tensor

from symalign.groups import Permutation
from symalign.families.common import (RESIDUAL, Prepared, act_if, back, copy_spec, ff_group, headless_note,
                                           prefix_of, to_f64)
from symalign.spec import SymmetrySpec

# architecture -> the head parts that read the stream
HEADS: dict[str, dict[str, tuple[str, ...]]] = {
    "bert": {"BertForMaskedLM": ("mlm",), "BertLMHeadModel": ("mlm",), "BertForPreTraining": ("mlm", "pooler"),
             "BertForSequenceClassification": ("pooler",), "BertForMultipleChoice": ("pooler",),
             "BertForNextSentencePrediction": ("pooler",), "BertForTokenClassification": ("classifier",),
             "BertForQuestionAnswering": ("qa_outputs",)},
    "roformer": {"RoFormerForMaskedLM": ("mlm",), "RoFormerForCausalLM": ("mlm",),
                 "RoFormerForSequenceClassification": ("classifier.dense",),
                 "RoFormerForTokenClassification": ("classifier",), "RoFormerForQuestionAnswering": ("qa_outputs",)},
}
HEADLESS = {"bert": "BertModel", "roformer": "RoFormerModel"}


def prepare_bert(config: Any, state: Mapping[str, Tensor], att: SymmetrySpec, arch: str | None) -> Prepared:
    s, dt = to_f64(state)
    family = config.model_type
    p = prefix_of(s, "encoder.layer.0.attention.self.query.weight")
    D, L = int(config.hidden_size), int(config.num_hidden_layers)
    spec = copy_spec(att)
    notes: list[str] = []
    parts = HEADS[family].get(arch or "")
    residual = parts is not None and not getattr(config, "add_cross_attention", False)
    if residual:
        spec.add_space(RESIDUAL, Permutation(D), "residual")
        notes.append("post-LN: LayerNorm gains sit on the residual path and cannot be folded, so residual "
                     "rotations are not symmetries; residual group S_D (permutations, LayerNorm gains/biases "
                     "permuted with the stream)")
        _stream_spec(spec, s, config, p, parts)
    elif parts is not None:
        notes.append("residual stream not aligned: cross-attention layers read an external stream")
    else:
        notes.append(headless_note(arch, family, list(HEADS[family]) + [HEADLESS[family]]))
    act = getattr(config, "hidden_act", None)
    for i in range(L):
        lp = f"{p}encoder.layer.{i}."
        ff = f"ff.{i}"
        spec.add_space(ff, ff_group(act, int(config.intermediate_size)), "ff", i)
        spec.act_on(lp + "intermediate.dense.weight", ff, 0)
        act_if(spec, s, lp + "intermediate.dense.bias", ff, 0)
        spec.act_on(lp + "output.dense.weight", ff, 1, "contra")
    return Prepared(back(s, dt, torch.float32), spec, False, notes)


def _stream_spec(spec: SymmetrySpec, s: Mapping[str, Tensor], config: Any, p: str, parts: tuple[str, ...]) -> None:
    """The residual permutation on every writer, LayerNorm and reader (see the module docstring)."""
    e = p + "embeddings."
    projected = p + "embeddings_project.weight" in s
    if projected:  # RoFormer with embedding_size != hidden_size: the projection writes the stream
        spec.act_on(p + "embeddings_project.weight", RESIDUAL, 0)
        act_if(spec, s, p + "embeddings_project.bias", RESIDUAL, 0)
    else:
        for t in ("word_embeddings.weight", "position_embeddings.weight", "token_type_embeddings.weight"):
            act_if(spec, s, e + t, RESIDUAL, 1)
        for t in ("LayerNorm.weight", "LayerNorm.bias"):
            act_if(spec, s, e + t, RESIDUAL, 0)
    for i in range(int(config.num_hidden_layers)):
        lp = f"{p}encoder.layer.{i}."
        for n in ("query", "key", "value"):
            spec.act_on(f"{lp}attention.self.{n}.weight", RESIDUAL, 1, "contra")
        spec.act_on(lp + "intermediate.dense.weight", RESIDUAL, 1, "contra")
        for out in ("attention.output", "output"):
            spec.act_on(f"{lp}{out}.dense.weight", RESIDUAL, 0)
            for t in ("dense.bias", "LayerNorm.weight", "LayerNorm.bias"):
                act_if(spec, s, f"{lp}{out}.{t}", RESIDUAL, 0)
    for part in parts:
        if part == "pooler":
            spec.act_on(p + "pooler.dense.weight", RESIDUAL, 1, "contra")
        elif part == "mlm":
            t = "cls.predictions."
            spec.act_on(t + "transform.dense.weight", RESIDUAL, 1, "contra")
            if not projected:  # the transform writes the (tied) embedding space = the stream's coordinates
                spec.act_on(t + "transform.dense.weight", RESIDUAL, 0)
                for x in ("transform.dense.bias", "transform.LayerNorm.weight", "transform.LayerNorm.bias"):
                    act_if(spec, s, t + x, RESIDUAL, 0)
                act_if(spec, s, t + "decoder.weight", RESIDUAL, 1, "contra")
        else:  # a Linear reading the stream
            spec.act_on(part + ".weight", RESIDUAL, 1, "contra")
