r"""The float64 products of the streamed model scope, formed in blocks of rows.

A 7B layer is held in float32 (0.7 GB); its float64 image would be 1.4 GB, and a
whole-tensor float64 product (``apply_on_axis``, ``x.double().pow(2)``) makes two or
three float64 temporaries the size of the tensor. The functions here give the same
quantities with temporaries of at most :data:`BLOCK_ELEMENTS` float64 values (32 MiB)
besides their result:

* :func:`sq` / :func:`sq_diff`: ``||x||^2``, ``||x - y||^2`` (float64 sums of row blocks);
* :func:`rotate`: ``x`` with the residual rotation ``O`` on ``axis``
  (``x'[.., i, ..] = sum_j O[i, j] x[.., j, ..]``, :func:`symalign.groups.apply_on_axis`'s
  convention), the product in float64, stored in ``x``'s dtype;
* :func:`rotated_rows`: the float64 rows ``X_{O.B}`` (``rows`` axis first) of the rotated
  tensor, formed a block at a time as they are used (:class:`RotatedRows`), never as a whole;
* :func:`cost_into`: ``C += X_A X_B^T`` (``d_ff x d_ff``), a block of A's and of B's rows at a time,
  accumulated in place (``addmm_``);
* :func:`cross_gram_into`: ``M += X_A X_B^T`` (``D x D``) over column blocks, in place
  (:func:`cross_gram_axis_into`: of the rows of an axis of a tensor, a stacked one slice by slice);
* :func:`inner`: ``<T_O, M>``, the residual element's matrix against a cross-Gram;
* :func:`assign_max_inplace`: the linear assignment maximising ``sum_i C[i, perm[i]]``,
  solved on ``-C`` formed in place (``scipy``'s ``maximize=True`` would copy ``C``).

Every function allocates on its inputs' device (a CUDA device for a streamed run with ``--device``; the
assignment, :func:`assign_max_inplace`, runs on the CPU). Each element of a result is the same sum of the same
float64 products as the whole-tensor formula; only the order in which BLAS adds them may differ, so results
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


class RotatedRows:
    """The float64 rows ``X_{O.B}`` (``(n_rows, D)``, ``rows`` axis first) of ``O`` on ``res_axis`` of ``x``,
    formed a block of rows at a time when asked (:meth:`rows`), never as a whole for a matrix whose two axes are
    ``res_axis`` and ``rows_axis`` (other layouts are rotated once, by :func:`symalign.groups.apply_on_axis`).

    Row ``r`` is ``O x_r`` with ``x_r`` the ``rows_axis`` slice ``r``: for ``rows_axis = 0`` the block
    ``x[r0:r1] O^T``; for ``rows_axis = 1`` the block ``x[:, r0:r1]^T O^T``. A permutation ``o`` (an index
    vector, :func:`is_permutation`) gathers instead of multiplying."""

    def __init__(self, x: Tensor, res_axis: int, rows_axis: int, o: Tensor):
        self._full: Tensor | None = None
        self._perm = o if is_permutation(o) else None
        if x.dim() != 2 or res_axis % 2 == rows_axis % 2:
            self._full = as_rows(rotate(x, res_axis, o), rows_axis).to(torch.float64)
            self._xv = self._full
        else:
            self._xv = x if rows_axis % 2 == 0 else x.T
            self._ot = None if self._perm is not None else o.to(torch.float64).T
        self.shape = tuple(self._xv.shape)

    def rows(self, start: int, stop: int) -> Tensor:
        """Float64 rows ``start:stop`` (a new tensor, or a view of the rotated tensor for other layouts)."""
        if self._full is not None:
            return self._full[start:stop]
        if self._perm is not None:  # row r of T x: the columns gathered (T[i, perm[i]] = 1)
            return self._xv[start:stop].index_select(1, self._perm).to(torch.float64)
        return self._xv[start:stop].to(torch.float64) @ self._ot

    def full(self) -> Tensor:
        """All rows, float64 (``n_rows x D``), formed a block at a time."""
        out = torch.empty(self.shape, dtype=torch.float64, device=self._xv.device)
        s = _step(self.shape[1])
        for i in range(0, self.shape[0], s):
            out[i:i + s] = self.rows(i, i + s)
        return out


def rotated_rows(x: Tensor, res_axis: int, rows_axis: int, o: Tensor) -> RotatedRows:
    """:class:`RotatedRows` of ``x`` (lazy: pass it to :func:`cost_into`; ``.full()`` forms every row)."""
    return RotatedRows(x, res_axis, rows_axis, o)


def cost_into(c: Tensor | None, xa: Tensor, xb: Tensor | RotatedRows) -> Tensor:
    """``C + X_A X_B^T`` (``C`` ``None``: a new float64 ``n_A x n_B`` matrix), updated in place.

    ``X_A`` (any float dtype, rows first) is converted a block of rows at a time; ``X_B`` is a float
    tensor (rows first) or :class:`RotatedRows`, whose float64 rows are formed a block of
    ``2 x`` :data:`BLOCK_ELEMENTS` values at a time. Each block product is accumulated straight into
    its block of ``C`` (``addmm_``), so the temporaries are two blocks, never a full ``X_B`` or a
    product the size of a block row of ``C``. Every entry is one float64 dot product over ``X``'s
    columns, as in the whole-matrix formula."""
    rows_b = xb if isinstance(xb, RotatedRows) else None
    n, m = xa.shape[0], xb.shape[0]
    fresh = c is None
    if c is None:
        c = torch.empty(n, m, dtype=torch.float64, device=xa.device)
    sa = _step(xa.shape[1])
    sb = 2 * _step(xb.shape[1])
    for j in range(0, m, sb):
        yb = rows_b.rows(j, j + sb) if rows_b is not None else xb[j:j + sb].to(torch.float64)
        for i in range(0, n, sa):
            c[i:i + sa, j:j + sb].addmm_(xa[i:i + sa].to(torch.float64), yb.T, beta=0.0 if fresh else 1.0)
        del yb
    return c


def cross_gram_into(m: Tensor, xa: Tensor, xb: Tensor) -> None:
    """``M += X_A X_B^T`` (``D x D``, float64, in place) with ``X`` ``(D, k)`` of any float dtype, over
    blocks of columns (converted to contiguous float64 a block at a time, accumulated by ``addmm_``: no
    ``D x D`` temporary). Every block is laid out as :func:`cross_gram_axis_into` lays out its gathered blocks, so
    the BLAS call, hence the order of every sum, is the same in both (bit-identical on any CPU, not only where the
    library happens to pick one kernel for both layouts)."""
    k = xa.shape[1]
    s = _step(xa.shape[0])
    for j in range(0, k, s):
        m.addmm_(xa[:, j:j + s].to(torch.float64).contiguous(), xb[:, j:j + s].to(torch.float64).contiguous().T)


def cross_gram_axis_into(m: Tensor, xa: Tensor, xb: Tensor, axis: int) -> None:
    """``M += X_A X_B^T`` with ``X`` the rows of ``axis`` of each tensor (:func:`as_rows`), as
    :func:`cross_gram_into` forms it. A stacked tensor (three or more axes, ``axis`` not the first: a mixture
    of experts' ``(E, 2F, D)``) is never copied with ``axis`` moved first: its rows are the rows of each
    slice ``x[e]`` (views) side by side, and each column block is gathered from the slices it falls in, so
    the blocks, and every float64 product and sum, are those of :func:`cross_gram_into` on the moved copy
    (the same ``M``, bit for bit)."""
    if xa.dim() < 3 or axis % xa.dim() == 0:
        cross_gram_into(m, as_rows(xa, axis), as_rows(xb, axis))
        return
    ra = [as_rows(x, axis % xa.dim() - 1) for x in xa]
    rb = [as_rows(x, axis % xb.dim() - 1) for x in xb]
    n, w = ra[0].shape
    total = len(ra) * w
    s = _step(n)
    for j in range(0, total, s):
        k = min(s, total - j)
        m.addmm_(_columns(ra, j, k), _columns(rb, j, k).T)


def _columns(rows: list[Tensor], j: int, k: int) -> Tensor:
    """Columns ``j:j + k`` (float64, contiguous) of the matrices ``rows`` (each ``n x w``) side by side."""
    n, w = rows[0].shape
    out = torch.empty(n, k, dtype=torch.float64, device=rows[0].device)
    c = 0
    while c < k:
        e, c0 = divmod(j + c, w)
        take = min(w - c0, k - c)
        out[:, c:c + take].copy_(rows[e][:, c0:c0 + take])
        c += take
    return out


def assign_max_inplace(c: Tensor) -> Tensor:
    """``perm`` maximising ``sum_i c[i, perm[i]]`` (``scipy.optimize.linear_sum_assignment``); ``c`` (float64,
    contiguous) is negated in place and so consumed. Same answer as ``maximize=True``, which negates a copy."""
    from scipy.optimize import linear_sum_assignment

    if c.dtype != torch.float64 or not c.is_contiguous():
        c = c.to(torch.float64).contiguous()
    c.neg_()
    _, col = linear_sum_assignment(np.asarray(c.numpy()), maximize=False)
    return torch.as_tensor(col, dtype=torch.int64)
