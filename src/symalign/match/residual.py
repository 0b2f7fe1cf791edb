r"""The residual-stream step of whole-model matching: orthogonal Procrustes.

For a space acted on by ``O`` along one axis of several tensors, stack each
tensor's other axes as columns: ``X_A, X_B`` are ``D x m``. The orthogonal
``O`` minimising ``sum ||X_A - O X_B||^2`` maximises ``<O, M>`` with
``M = sum X_A X_B^T``; the maximiser is the polar factor ``O = U V^T`` of
``M = U S V^T``. Covariant and contravariant axes coincide for orthogonal ``O``
(``O^{-T} = O``).

The groups themselves (:class:`~symalign.groups.FixingOrthogonal`,
:class:`~symalign.groups.CenteredOrthogonal`, :func:`~symalign.groups.stabiliser`) live in
:mod:`symalign.groups`.
"""

from __future__ import annotations

from typing import Iterable, Mapping

import torch
from torch import Tensor

from symalign.groups import Orthogonal
from symalign.spec import AxisAction, segment_view


def procrustes(m: Tensor, group: Orthogonal) -> Tensor:
    """``argmax <O, m>`` over ``group`` (``O(n)``, or a subgroup fixing a subspace): :meth:`Group.nearest`."""
    return group.nearest(m)


def axis_rows(x: Tensor, a: AxisAction) -> Tensor:
    """The tensor as ``(n, m)`` in float64: the acted-on axis (segment) first, the rest flattened."""
    axis = a.axis % x.dim()
    if a.segment is not None:
        x = segment_view(x, axis, a.segment)
    return torch.movedim(x.to(torch.float64), axis, 0).reshape(x.shape[axis], -1)


def cross(pairs: Iterable[tuple[str, AxisAction]], state_a: Mapping[str, Tensor],
          state_b: Mapping[str, Tensor]) -> Tensor:
    """``M = sum_t X_A^t (X_B^t)^T`` over the given ``(tensor, action)`` pairs (``n x n``)."""
    m = None
    for t, a in pairs:
        xa, xb = axis_rows(state_a[t], a), axis_rows(state_b[t], a)
        c = xa @ xb.T
        m = c if m is None else m + c
    if m is None:
        raise ValueError("no tensors")
    return m
