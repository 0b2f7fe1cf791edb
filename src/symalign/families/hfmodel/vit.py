r"""ViT: pre-LN with LayerNorm (gain and bias); the stream has the centred subgroup ``O_1(D)``.

Layer ``i``: ``x += o_proj(attn(layernorm_before(x)))``, ``x += fc2(act(fc1(layernorm_after(x))))``;
the input is ``[cls_token; patch_conv(pixels)] + position_embeddings`` (and ``mask_token``
for masked patches); the output ``layernorm(x)`` is read by ``classifier`` (its CLS
row) or by the masked-image ``decoder.0`` (a ``1 x 1`` conv).

* **Fold** (:func:`~symalign.families.common.fold_layernorm`):
  ``layernorm_before`` into Q/K/V, ``layernorm_after`` into ``fc1``, ``layernorm`` into the
  head; the norms are left with unit gain and zero bias (with ``qkv_bias=False`` the
  bias stays, as ``b / g``, and rotates covariantly).
* **Residual** ``O_1(D)``: a LayerNorm with unit gain satisfies ``LN(O x) = O LN(x)`` for
  ``O 1 = 1`` (``O`` commutes with the centring and keeps norms). Covariant: the patch
  conv's output channels (weight axis 0, bias), ``cls_token``/``mask_token``/
  ``position_embeddings`` (axis 2), ``o_proj`` and ``fc2`` (weight axis 0, bias);
  contravariant: Q/K/V, ``fc1`` and head inputs (axis 1). Interpolated positions are
  a per-channel linear map of the table, so they commute with ``O``.
* **FF** ``ff.i``: ``fc1`` rows (+ bias), ``fc2`` columns; ReLU adds positive scales.

A bare ``ViTModel`` outputs the stream itself: no residual space (FF and attention only).
transformers 5.x names (``layers.{i}.attention.q_proj``, ``mlp.fc1``) and the names
``save_pretrained`` writes (``encoder.layer.{i}.attention.attention.query``,
``intermediate.dense``) are both recognised.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import Tensor

from symalign.arch.vit import ViTAdapter
from symalign.families.common import (RESIDUAL, Prepared, act_if, back, copy_spec, ff_group, fold_layernorm,
                                           headless_note, to_f64)
from symalign.groups import CenteredOrthogonal
from symalign.spec import SymmetrySpec

HEADS = {"ViTForImageClassification": "classifier", "ViTForMaskedImageModeling": "decoder.0"}
HEADLESS = ("ViTModel",)

_NEW = {"q": "attention.q_proj", "k": "attention.k_proj", "v": "attention.v_proj", "o": "attention.o_proj",
        "fc1": "mlp.fc1", "fc2": "mlp.fc2"}
_LEGACY = {"q": "attention.attention.query", "k": "attention.attention.key", "v": "attention.attention.value",
           "o": "attention.output.dense", "fc1": "intermediate.dense", "fc2": "output.dense"}


def prepare_vit(config: Any, state: Mapping[str, Tensor], att: SymmetrySpec, arch: str | None) -> Prepared:
    s, dt = to_f64(state)
    adapter = ViTAdapter()
    p = adapter.prefix(set(s))
    legacy = p + adapter.alt_probes[0] in s and p + adapter.probe not in s
    names, layer = (_LEGACY, "encoder.layer") if legacy else (_NEW, "layers")
    D, L = int(config.hidden_size), int(config.num_hidden_layers)
    spec = copy_spec(att)
    notes: list[str] = []
    head = HEADS.get(arch or "", "")
    residual = bool(head) and head + ".weight" in s
    if residual:
        spec.add_space(RESIDUAL, CenteredOrthogonal(D), "residual")
        e = p + "embeddings."
        for t, axis in (("patch_embeddings.projection.weight", 0), ("patch_embeddings.projection.bias", 0),
                        ("cls_token", 2), ("mask_token", 2), ("position_embeddings", 2)):
            act_if(spec, s, e + t, RESIDUAL, axis)
    else:
        notes.append(headless_note(arch, "ViT", list(HEADS) + list(HEADLESS)))
    for i in range(L):
        lp = f"{p}{layer}.{i}."
        n = {k: lp + v for k, v in names.items()}
        ff = f"ff.{i}"
        spec.add_space(ff, ff_group(getattr(config, "hidden_act", None), int(config.intermediate_size)), "ff", i)
        spec.act_on(n["fc1"] + ".weight", ff, 0)
        act_if(spec, s, n["fc1"] + ".bias", ff, 0)
        spec.act_on(n["fc2"] + ".weight", ff, 1, "contra")
        if not residual:
            continue
        for norm, readers in ((lp + "layernorm_before", [n["q"], n["k"], n["v"]]), (lp + "layernorm_after", [n["fc1"]])):
            if fold_layernorm(s, norm, readers):
                spec.act_on(norm + ".bias", RESIDUAL, 0, "co")
            for r in readers:
                spec.act_on(r + ".weight", RESIDUAL, 1, "contra")
        for w in (n["o"], n["fc2"]):
            spec.act_on(w + ".weight", RESIDUAL, 0, "co")
            act_if(spec, s, w + ".bias", RESIDUAL, 0, "co")
    if residual:
        if fold_layernorm(s, p + "layernorm", [head]):
            spec.act_on(p + "layernorm.bias", RESIDUAL, 0, "co")
        spec.act_on(head + ".weight", RESIDUAL, 1, "contra")
        notes.append(f"LayerNorm gains/biases folded into Q/K/V, fc1 and {head}; residual group O_1(D) "
                     "(rotations fixing the all-ones direction)")
    return Prepared(back(s, dt, torch.float32), spec, False, notes)
