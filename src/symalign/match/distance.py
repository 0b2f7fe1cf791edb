r"""Weight-space distances between two state dicts, over the tensors a spec labels.

* :func:`distance`: ``sum_t ||A_t - B_t||_F^2`` (squared, what the matchers minimise);
* :func:`relative_distance`: ``sqrt(sum_t ||A_t - B_t||_F^2 / sum_t ||A_t||_F^2)``
  (what ``symalign align`` reports before and after alignment);
* :func:`attention_distance`: :func:`relative_distance` over the attention tensors
  (heads, Q-K, V-O spaces), in total and per layer.

All sums run in float64 whatever the tensors' dtype.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

from torch import Tensor

from symalign.spec import ATTENTION_ROLES, SymmetrySpec


def _sq(a: Mapping[str, Tensor], b: Mapping[str, Tensor] | None, names: Iterable[str]) -> float:
    if b is None:
        return float(sum(float(a[t].double().pow(2).sum()) for t in names))
    return float(sum(float((a[t].double() - b[t].double()).pow(2).sum()) for t in names))


def distance(spec: SymmetrySpec, state_a: Mapping[str, Tensor], state_b: Mapping[str, Tensor]) -> float:
    """``sum_t ||A_t - B_t||^2`` over the tensors the spec labels."""
    return _sq(state_a, state_b, spec.tensors)


def relative_distance(a: Mapping[str, Tensor], b: Mapping[str, Tensor], names: Iterable[str]) -> float:
    """``sqrt(sum_t ||A_t - B_t||^2 / sum_t ||A_t||^2)`` over the tensors ``names`` (absolute if A is 0), summed in
    sorted name order so that a set of names gives the same float whatever Python's hash seed."""
    names = sorted(names)
    num, den = _sq(a, b, names), _sq(a, None, names)
    return math.sqrt(num / den) if den else math.sqrt(num)


def attention_distance(spec: SymmetrySpec, a: Mapping[str, Tensor], b: Mapping[str, Tensor]) -> dict[str, Any]:
    """:func:`relative_distance` over the attention tensors the spec labels, in total and per layer (the
    total also counts what a head space shared by several layers alone acts on, e.g. T5's bias tables)."""
    per_layer, every = [], set()
    for i in spec.layers(("heads", "qk")):
        names = {t for space in spec.select(ATTENTION_ROLES, i) for t, _ in spec.tensors_of(space)}
        per_layer.append(relative_distance(a, b, names))
        every |= names
    every |= {t for space in spec.select(ATTENTION_ROLES) if spec.layer(space) is None
              for t, _ in spec.tensors_of(space)}
    return {"total": relative_distance(a, b, every), "per_layer": per_layer}
