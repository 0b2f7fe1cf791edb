r"""Linear assignment (Hungarian, :func:`scipy.optimize.linear_sum_assignment`), permutation matrices, and their
doubly stochastic relaxation (Sinkhorn)."""

from __future__ import annotations

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment
from torch import Tensor


def assign_max(c: Tensor) -> Tensor:
    """``perm`` maximising ``sum_i c[i, perm[i]]`` (int64, on ``c``'s device; ``scipy.optimize.linear_sum_assignment``
    on the CPU)."""
    _, col = linear_sum_assignment(c.detach().cpu().numpy().astype(np.float64), maximize=True)
    return torch.as_tensor(col, dtype=torch.int64, device=c.device)


def assign_grouped(cost: Tensor, kv: int, g: int) -> tuple[Tensor, Tensor | None]:
    """The pairing minimising ``sum_i cost[i, pi[i]]`` over ``kv`` groups of ``g`` items that map onto groups.

    Returns ``(sigma, taus)``: without groups (``g == 1``) one linear assignment, ``sigma = pi`` and
    ``taus = None``; else, for every pair of groups ``(k, l)``, the best within-group assignment
    ``taus[k, l]`` of cost ``C_kl``, then the best assignment ``sigma`` of groups on ``C``, and the rows
    ``taus[k, sigma[k]]`` (``(kv, g)``). Exact: given the group assignment, the groups separate.
    """
    c = cost.detach().cpu().numpy().astype(np.float64)
    dev = cost.device  # the result where the cost is
    if g == 1:
        return torch.as_tensor(linear_sum_assignment(c)[1], dtype=torch.int64, device=dev), None
    c4 = c.reshape(kv, g, kv, g)
    cg = np.empty((kv, kv))
    taus = np.empty((kv, kv, g), dtype=np.int64)
    for k in range(kv):
        for l_ in range(kv):
            r, col = linear_sum_assignment(c4[k, :, l_, :])
            cg[k, l_] = c4[k, r, l_, col].sum()
            taus[k, l_] = col
    sigma = linear_sum_assignment(cg)[1]
    tau = torch.as_tensor(np.stack([taus[k, sigma[k]] for k in range(kv)]), device=dev)
    return torch.as_tensor(sigma, dtype=torch.int64, device=dev), tau


def one_hot(perm: Tensor, dtype=torch.float64) -> Tensor:
    """The permutation matrix ``P[i, perm[i]] = 1`` (``(P x)_i = x_{perm[i]}``), on ``perm``'s device."""
    n = perm.numel()
    m = torch.zeros(n, n, dtype=dtype, device=perm.device)
    m[torch.arange(n, device=perm.device), perm] = 1.0
    return m


def straight_through(perm: Tensor, z: Tensor) -> Tensor:
    """``P + Z - sg(Z)``: the permutation matrix of ``perm`` with the gradient of ``z``."""
    return one_hot(perm, z.dtype) + z - z.detach()


def sinkhorn(logits: Tensor, iters: int = 30) -> Tensor:
    r"""The doubly stochastic matrix ``Sinkhorn(exp(logits))``: alternate row and column normalisation.

    In the log domain (stable for large ``logits``): ``l <- l - logsumexp_j l``, then
    ``l <- l - logsumexp_i l``, ``iters`` times; returns ``exp(l)``. Columns sum to 1 exactly (up
    to rounding) and rows to within the method's convergence (geometric for a positive matrix).
    The result has the form ``diag(u) exp(logits) diag(v)``, so ``sum_i log P[i, pi(i)]`` differs
    from ``sum_i logits[i, pi(i)]`` by a constant over permutations ``pi``: the Hungarian
    projection of ``logits`` (:func:`assign_max`) is also the most probable permutation under ``P``.
    Differentiable.
    """
    if iters < 1:
        raise ValueError(f"sinkhorn needs at least one iteration, got {iters}")
    lg = logits
    for _ in range(iters):
        lg = lg - torch.logsumexp(lg, dim=1, keepdim=True)
        lg = lg - torch.logsumexp(lg, dim=0, keepdim=True)
    return lg.exp()
