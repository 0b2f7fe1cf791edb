r"""The permutation step of whole-model matching: one linear assignment per space.

For a permutation space (FF hidden units ``ff.i``, or a permuted residual stream)
stack, for each unit, every row it owns across the tensors the space acts on
(``[W_in ; b_in ; W_out^T]`` for an MLP). With ``C = sum X_A X_B^T`` (``C[i, j] =
<unit i of A, unit j of B>``), the permutation maximising ``sum_i C[i, perm[i]]``
minimises ``sum ||A - P B||^2`` (norms are permutation invariant); it is found
exactly by ``scipy.optimize.linear_sum_assignment``. Convention: new unit ``i`` of
B' is old unit ``perm[i]`` of B (:class:`symalign.groups.Permutation`).
"""

from __future__ import annotations

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment
from torch import Tensor


def assign(c: Tensor) -> Tensor:
    """``perm`` maximising ``sum_i c[i, perm[i]]`` (int64)."""
    _, col = linear_sum_assignment(c.detach().cpu().numpy().astype(np.float64), maximize=True)
    return torch.as_tensor(col, dtype=torch.int64)


def correlation(xa: Tensor, xb: Tensor, eps: float = 1e-12) -> Tensor:
    """Pearson correlation ``corr[i, j]`` between column ``i`` of ``xa`` and ``j`` of ``xb`` (``(N, n)`` each)."""
    xa = xa.to(torch.float64)
    xb = xb.to(torch.float64)
    xa = xa - xa.mean(0)
    xb = xb - xb.mean(0)
    sa = xa.norm(dim=0).clamp_min(eps)
    sb = xb.norm(dim=0).clamp_min(eps)
    return (xa.T @ xb) / (sa[:, None] * sb[None, :])
