"""Acting with a matrix on one axis of a tensor (dense or block-diagonal), covariantly or contravariantly."""

from __future__ import annotations

import torch
from torch import Tensor

from symalign.errors import GroupError
from symalign.groups.base import Variance


def apply_on_axis(x: Tensor, axis: int, mat: Tensor, repeat: int = 1) -> Tensor:
    """Multiply ``x`` along ``axis`` by ``mat``: ``x'[.., i, ..] = sum_j mat[i, j] x[.., j, ..]``.

    ``mat`` is either dense ``(n, n)`` or block-diagonal ``(nb, d, d)``; in the latter
    case the axis has ``nb * repeat * d`` entries and block ``k`` acts on each of its
    ``repeat`` consecutive sub-blocks of size ``d`` (GQA: one K/V transform shared by
    the query heads of its group). The product is formed in float64 and cast back.

    A stacked tensor (three axes, ``mat`` dense, ``axis`` not the first: the experts of a mixture of
    experts, ``(E, 2F, D)``) is multiplied one slice of its first axis at a time into a result allocated once,
    so the float64 temporaries are those of one slice (an expert), not of the whole tensor.
    """
    if x.dim() == 3 and mat.dim() == 2 and axis % x.dim() != 0:
        if mat.shape[0] != x.shape[axis]:
            raise GroupError(f"axis {axis} has {x.shape[axis]} entries but the group acts on {mat.shape[0]}")
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        for e in range(x.shape[0]):
            out[e] = apply_on_axis(x[e], axis % x.dim() - 1, mat, repeat)
        return out
    dtype = x.dtype
    xd = torch.movedim(x, axis, 0).to(torch.float64)
    shape = xd.shape
    m = mat.to(torch.float64)
    if m.dim() == 2:
        if m.shape[0] != shape[0]:
            raise GroupError(f"axis {axis} has {shape[0]} entries but the group acts on {m.shape[0]}")
        out = (m @ xd.reshape(shape[0], -1)).reshape(shape)
    else:
        nb, d, _ = m.shape
        if shape[0] != nb * repeat * d:
            raise GroupError(f"axis {axis} has {shape[0]} entries, expected {nb}x{repeat}x{d}")
        xb = xd.reshape(nb, repeat, d, -1)
        out = torch.einsum("kij,krjc->kric", m, xb).reshape(shape)
    return torch.movedim(out.to(dtype), 0, axis)


def variance_matrix(t: Tensor, variance: Variance) -> Tensor:
    """``T`` for a covariant axis, ``T^{-T}`` for a contravariant one (batched over leading dims)."""
    t = t.to(torch.float64)
    if variance == "co":
        return t
    if variance == "contra":
        return torch.linalg.inv(t).transpose(-2, -1)
    raise GroupError(f"unknown variance {variance!r}; use 'co' or 'contra'")
