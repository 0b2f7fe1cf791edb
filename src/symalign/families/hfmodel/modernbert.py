r"""ModernBERT: pre-LN, but the embeddings' LayerNorm is on the stream, so only ``S_D`` is exact.

The stream starts as ``x_0 = LN_e(E[token])`` (``embeddings.norm``, gain ``g_e``, bias
iff ``norm_bias``); layer ``i`` adds ``Wo(attn(attn_norm(x)))`` (layer 0's
``attn_norm`` is an ``Identity``) and ``mlp.Wo(act(u) * v)`` with ``[u; v] =
mlp.Wi(mlp_norm(x))``; the output is ``final_norm(x)``, read by ``head.dense`` ->
act -> ``head.norm`` -> ``decoder`` (tied to ``E``) or ``classifier``.

* The readers' norms could be folded, but ``g_e`` cannot: it scales ``x_0`` itself.
  A rotation ``O`` of the stream would need ``x_0' = O x_0``, i.e. a new embedding
  norm with ``diag(g_e') O = O diag(g_e)`` on the centred subspace, which for a
  generic gain only permutations satisfy. So the residual group is the
  **permutations** ``S_D``, which commute with every LayerNorm once its gain (and
  bias) are permuted: ``P`` acts covariantly on ``E``'s columns, every norm's
  gain/bias, ``attn.Wo`` and ``mlp.Wo`` (rows, + bias), and contravariantly on
  ``Wqkv``, ``mlp.Wi`` and ``head.dense`` (axis 1). Nothing is folded.
* The head: ``head.dense``'s output space is permuted by the same ``P`` (its rows,
  bias and ``head.norm``), because the decoder is tied to ``E`` whose columns ``P``
  permutes; an untied ``decoder`` or a ``classifier`` reads it (axis 1).
* FF ``ff.i``: the GLU ``act(u) * v`` pairs unit ``j`` of the ``u`` half of ``Wi``
  with unit ``j`` of the ``v`` half, so one permutation acts on both halves
  (``Wi`` rows in the segments ``(0, d_ff)`` and ``(d_ff, d_ff)``, + bias) and on
  ``mlp.Wo``'s columns.

A bare ``ModernBertModel`` outputs the stream itself: no residual space.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import Tensor

from symalign.groups import Permutation
from symalign.families.common import (RESIDUAL, Prepared, act_if, back, copy_spec, headless_note, prefix_of,
                                           to_f64)
from symalign.spec import SymmetrySpec

HEADS = ("ModernBertForMaskedLM", "ModernBertForSequenceClassification", "ModernBertForTokenClassification",
         "ModernBertForQuestionAnswering", "ModernBertForMultipleChoice")
HEADLESS = ("ModernBertModel",)


def prepare_modernbert(config: Any, state: Mapping[str, Tensor], att: SymmetrySpec, arch: str | None) -> Prepared:
    s, dt = to_f64(state)
    p = prefix_of(s, "layers.0.attn.Wqkv.weight")
    D, L, d_ff = int(config.hidden_size), int(config.num_hidden_layers), int(config.intermediate_size)
    spec = copy_spec(att)
    notes: list[str] = []
    residual = arch in HEADS and "head.dense.weight" in s
    if residual:
        spec.add_space(RESIDUAL, Permutation(D), "residual")
        notes.append("the embeddings LayerNorm gain scales the stream itself and cannot be folded, so residual "
                     "rotations are not symmetries; residual group S_D (permutations, norm gains/biases permuted)")
        _norm(spec, s, p + "embeddings.norm")
        spec.act_on(p + "embeddings.tok_embeddings.weight", RESIDUAL, 1)
        _norm(spec, s, p + "final_norm")
        spec.act_on("head.dense.weight", RESIDUAL, 1, "contra")
        spec.act_on("head.dense.weight", RESIDUAL, 0)
        act_if(spec, s, "head.dense.bias", RESIDUAL, 0)
        _norm(spec, s, "head.norm")
        act_if(spec, s, "decoder.weight", RESIDUAL, 1, "contra")
        act_if(spec, s, "classifier.weight", RESIDUAL, 1, "contra")
    else:
        notes.append(headless_note(arch, "ModernBERT", list(HEADS) + list(HEADLESS)))
    for i in range(L):
        lp = f"{p}layers.{i}."
        ff = f"ff.{i}"
        spec.add_space(ff, Permutation(d_ff), "ff", i)
        for seg in ((0, d_ff), (d_ff, d_ff)):
            spec.act_on(lp + "mlp.Wi.weight", ff, 0, "co", None, seg)
            act_if(spec, s, lp + "mlp.Wi.bias", ff, 0, "co", seg)
        spec.act_on(lp + "mlp.Wo.weight", ff, 1, "contra")
        if not residual:
            continue
        _norm(spec, s, lp + "attn_norm")  # absent (Identity) in layer 0
        _norm(spec, s, lp + "mlp_norm")
        spec.act_on(lp + "attn.Wqkv.weight", RESIDUAL, 1, "contra")
        spec.act_on(lp + "mlp.Wi.weight", RESIDUAL, 1, "contra")
        for w in ("attn.Wo", "mlp.Wo"):
            spec.act_on(lp + w + ".weight", RESIDUAL, 0)
            act_if(spec, s, lp + w + ".bias", RESIDUAL, 0)
    return Prepared(back(s, dt, torch.float32), spec, False, notes)


def _norm(spec: SymmetrySpec, s: Mapping[str, Tensor], name: str) -> None:
    for t in (".weight", ".bias"):
        act_if(spec, s, name + t, RESIDUAL, 0)
