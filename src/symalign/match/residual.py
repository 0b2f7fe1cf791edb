r"""The residual-stream step of whole-model matching: orthogonal Procrustes.

For a space acted on by ``O`` along one axis of several tensors, stack each
tensor's other axes as columns: ``X_A, X_B`` are ``D x m``. The orthogonal
``O`` minimising ``sum ||X_A - O X_B||^2`` maximises ``<O, M>`` with
``M = sum X_A X_B^T``; the maximiser is the polar factor ``O = U V^T`` of
``M = U S V^T``. Covariant and contravariant axes coincide for orthogonal ``O``
(``O^{-T} = O``).

:class:`CenteredOrthogonal` is the subgroup ``{O in O(D): O 1 = 1}`` -- the
rotations of a LayerNorm stream (they commute with the centring
``C = I - 1 1^T / D``). Parametrised by an orthonormal basis ``Q`` of ``1^perp``:
``O = Q R Q^T + 1 1^T / D`` with ``R in O(D - 1)``; the constrained Procrustes
solution is ``R = polar(Q^T M Q)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

import torch
from torch import Tensor

from symalign.groups import Orthogonal, _generator, random_orthogonal
from symalign.spec import AxisAction


def centred_basis(n: int) -> Tensor:
    """An orthonormal basis ``Q`` (``n x (n-1)``) of the complement of the all-ones vector."""
    ones = torch.ones(n, 1, dtype=torch.float64) / n ** 0.5
    q, _ = torch.linalg.qr(torch.cat([ones, torch.eye(n, dtype=torch.float64)[:, : n - 1]], dim=1))
    return q[:, 1:]


@dataclass(frozen=True)
class CenteredOrthogonal(Orthogonal):
    """``{O in O(n): O 1 = 1}`` ~ ``O(n - 1)``: rotations of the centred subspace. Dimension ``(n-1)(n-2)/2``."""

    n: int

    @property
    def dim(self) -> int:
        return (self.n - 1) * (self.n - 2) // 2

    def sample(self, gen=None, dtype=torch.float64) -> Tensor:
        q = centred_basis(self.n)
        r = random_orthogonal(self.n - 1, _generator(gen))
        return (q @ r @ q.T + torch.full((self.n, self.n), 1.0 / self.n, dtype=torch.float64)).to(dtype)

    def contains(self, a: Tensor, atol: float = 1e-9) -> bool:
        ones = torch.ones(self.n, dtype=torch.float64)
        return super().contains(a, atol) and bool((a.to(torch.float64) @ ones - ones).abs().max() <= atol)

    def describe(self) -> str:
        return f"O_1({self.n})"


def polar(m: Tensor) -> Tensor:
    """The orthogonal polar factor ``U V^T`` of ``m = U S V^T`` (argmax of ``<O, m>`` over ``O(n)``)."""
    u, _, vh = torch.linalg.svd(m.to(torch.float64))
    return u @ vh


def procrustes(m: Tensor, group: Orthogonal) -> Tensor:
    """``argmax <O, m>`` over ``group`` (``O(n)``, or the centred subgroup)."""
    if isinstance(group, CenteredOrthogonal):
        q = centred_basis(group.n)
        return q @ polar(q.T @ m.to(torch.float64) @ q) @ q.T + torch.full_like(q[:, :1] @ q[:, :1].T, 1.0 / group.n)
    return polar(m)


def axis_rows(x: Tensor, a: AxisAction) -> Tensor:
    """The tensor as ``(n, m)`` in float64: the acted-on axis (segment) first, the rest flattened."""
    axis = a.axis % x.dim()
    if a.segment is not None:
        x = x.narrow(axis, a.segment[0], a.segment[1])
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
