r"""The float64 products of the streamed model scope, formed in blocks of rows.

A 7B layer is held in float32 (0.7 GB); its float64 image would be 1.4 GB, and a
whole-tensor float64 product (``apply_on_axis``, ``x.double().pow(2)``) makes two or
three float64 temporaries the size of the tensor. The functions here give the same
quantities with temporaries of at most :data:`BLOCK_ELEMENTS` float64 values (32 MiB)
besides their result:

* :func:`sq` / :func:`sq_diff`: ``||x||^2``, ``||x - y||^2`` (float64 sums of row blocks);
* :func:`rotate`: ``x`` with the residual element ``O`` on ``axis``
  (``x'[.., i, ..] = sum_j O[i, j] x[.., j, ..]``, :func:`symalign.groups.apply_on_axis`'s
  convention), the product in float64, stored in ``x``'s dtype;
* :func:`rotated_rows`: the float64 rows ``X_{O.B}`` (``rows`` axis first) of the rotated
  tensor, without forming the rotated tensor;
* :func:`cost_into`: ``C += X_A X_B^T`` (``d_ff x d_ff``), A's rows a block at a time;
* :func:`cross_gram_into`: ``M += X_A X_B^T`` (``D x D``) over column blocks;
* :func:`inner`: ``<T_O, M>``, the residual element's matrix against a cross-Gram;
* :func:`assign_max_inplace`: the linear assignment maximising ``sum_i C[i, perm[i]]``,
  solved on ``-C`` formed in place (``scipy``'s ``maximize=True`` would copy ``C``).

The residual element ``O`` is a ``D x D`` matrix (``O(D)``, ``O_1(D)``) or, for a permuted
stream (``S_D``), the index vector ``perm`` of :class:`~symalign.groups.Permutation`
(``(T x)_i = x_{perm[i]}``: a gather, no product; ``T^{-T} = T``, so co- and contravariant
axes coincide as for ``O``).

Each element of a result is the same sum of the same float64 products as the
whole-tensor formula; only the order in which BLAS adds them may differ, so results
agree to float64 rounding (``~1e-16`` relative; after rounding to float32 storage,
almost always bit for bit).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

BLOCK_ELEMENTS = 1 << 22


def _step(width: int) -> int:
    return max(1, BLOCK_ELEMENTS // max(1, width))


def as_rows(x: Tensor, axis: int) -> Tensor:
    """``x`` with ``axis`` first and the other axes flattened (a view when possible), in its dtype."""
    return torch.movedim(x, axis % x.dim(), 0).reshape(x.shape[axis], -1) if x.dim() else x.reshape(1, 1)


def sq(x: Tensor) -> float:
    """``||x||^2`` in float64."""
    r = as_rows(x, 0)
    s = _step(r.shape[1])
    return float(sum(r[i:i + s].to(torch.float64).pow(2).sum() for i in range(0, r.shape[0], s)))


def sq_diff(x: Tensor, y: Tensor) -> float:
    """``||x - y||^2``: the difference in the tensors' dtype, squared and summed in float64."""
    rx, ry = as_rows(x, 0), as_rows(y, 0)
    s = _step(rx.shape[1])
    return float(sum((rx[i:i + s] - ry[i:i + s]).to(torch.float64).pow(2).sum() for i in range(0, rx.shape[0], s)))


def is_permutation(o: Tensor) -> bool:
    """Whether the residual element ``o`` is a permutation's index vector (else a ``D x D`` matrix)."""
    return o.dim() == 1


def inner(o: Tensor, m: Tensor) -> float:
    """``<T_O, M> = sum_ij T_O[i, j] M[i, j]``: ``sum_i M[i, perm[i]]`` for a permutation."""
    if is_permutation(o):
        return float(m.gather(1, o.view(-1, 1)).sum())
    return float((o.to(m.dtype) * m).sum())


def matrix(o: Tensor) -> Tensor:
    """The dense float64 ``D x D`` matrix of the residual element ``o`` (``T[i, perm[i]] = 1``)."""
    if not is_permutation(o):
        return o.to(torch.float64)
    t = torch.zeros(o.numel(), o.numel(), dtype=torch.float64)
    t[torch.arange(o.numel()), o] = 1.0
    return t


def rotate(x: Tensor, axis: int, o: Tensor) -> Tensor:
    """``O`` on ``axis`` of ``x`` (float64 products, result in ``x``'s dtype), in blocks of the other axis
    of a matrix; other ranks go through :func:`symalign.groups.apply_on_axis`; a permutation gathers."""
    from symalign.groups import apply_on_axis

    if is_permutation(o):
        return x.index_select(axis % x.dim(), o)
    if x.dim() != 2 or o.dim() != 2:
        return apply_on_axis(x, axis, o)
    o64 = o.to(torch.float64)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if axis % 2 == 1:  # rows of x: x_r' = O x_r, i.e. x[r0:r1] O^T
        s = _step(x.shape[1])
        for i in range(0, x.shape[0], s):
            out[i:i + s] = (x[i:i + s].to(torch.float64) @ o64.T).to(x.dtype)
    else:  # columns of x: O x[:, c0:c1]
        s = _step(x.shape[0])
        for j in range(0, x.shape[1], s):
            out[:, j:j + s] = (o64 @ x[:, j:j + s].to(torch.float64)).to(x.dtype)
    return out


def rotated_rows(x: Tensor, res_axis: int, rows_axis: int, o: Tensor) -> Tensor:
    """Float64 ``(n_rows, D)``: row ``r`` is the ``rows_axis`` slice ``r`` of ``O`` on ``res_axis`` of ``x``
    (a matrix whose two axes are ``res_axis`` and ``rows_axis``)."""
    if is_permutation(o):
        return as_rows(x.index_select(res_axis % x.dim(), o), rows_axis).to(torch.float64)
    if x.dim() != 2 or o.dim() != 2 or res_axis % 2 == rows_axis % 2:
        from symalign.groups import apply_on_axis

        return as_rows(apply_on_axis(x, res_axis, o), rows_axis).to(torch.float64)
    xv = x if rows_axis % 2 == 0 else x.T
    out = torch.empty(xv.shape, dtype=torch.float64)
    ot = o.to(torch.float64).T
    s = _step(xv.shape[1])
    for i in range(0, xv.shape[0], s):
        torch.matmul(xv[i:i + s].to(torch.float64), ot, out=out[i:i + s])
    return out


def cost_into(c: Tensor | None, xa: Tensor, xb64: Tensor) -> Tensor:
    """``C + X_A X_B^T`` (``C`` ``None``: a new float64 matrix), ``X_A`` (any float dtype, rows first)
    converted a block of rows at a time; ``C`` is updated in place."""
    n = xa.shape[0]
    if c is None:
        c = torch.empty(n, xb64.shape[0], dtype=torch.float64)
        fresh = True
    else:
        fresh = False
    s = _step(xa.shape[1])
    for i in range(0, n, s):
        p = xa[i:i + s].to(torch.float64) @ xb64.T
        if fresh:
            c[i:i + s] = p
        else:
            c[i:i + s] += p
    return c


def cross_gram_into(m: Tensor, xa: Tensor, xb: Tensor) -> None:
    """``M += X_A X_B^T`` (``D x D``, float64, in place) with ``X`` ``(D, k)`` of any float dtype, over
    blocks of columns (converted to float64 a block at a time)."""
    k = xa.shape[1]
    s = _step(xa.shape[0])
    for j in range(0, k, s):
        m += xa[:, j:j + s].to(torch.float64) @ xb[:, j:j + s].to(torch.float64).T


def assign_max_inplace(c: Tensor) -> Tensor:
    """``perm`` maximising ``sum_i c[i, perm[i]]`` (``scipy.optimize.linear_sum_assignment``); ``c`` (float64,
    contiguous) is negated in place and so consumed. Same answer as ``maximize=True``, which negates a copy."""
    from scipy.optimize import linear_sum_assignment

    if c.dtype != torch.float64 or not c.is_contiguous():
        c = c.to(torch.float64).contiguous()
    c.neg_()
    _, col = linear_sum_assignment(np.asarray(c.numpy()), maximize=False)
    return torch.as_tensor(col, dtype=torch.int64)
