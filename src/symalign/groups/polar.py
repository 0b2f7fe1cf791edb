"""The orthogonal polar factor (exact by SVD, differentiable by Newton-Schulz) and block condition numbers."""

from __future__ import annotations

import torch
from torch import Tensor


def polar(m: Tensor) -> Tensor:
    """The orthogonal polar factor ``U V^T`` of ``m = U S V^T`` (argmax of ``<O, m>`` over ``O(n)``)."""
    u, _, vh = torch.linalg.svd(m.to(torch.float64))
    return u @ vh


def polar_st(z: Tensor, iters: int = 30) -> Tensor:
    """Differentiable polar factor of ``z`` by Newton-Schulz: ``X <- X (3 I - X^T X) / 2``.

    ``z`` is first scaled by its (detached) spectral norm so every singular value is in
    ``(0, 1]``, where the iteration converges to ``U V^T``. Unlike the SVD's backward,
    whose ``1 / (s_i^2 - s_j^2)`` terms are infinite at an orthogonal ``z`` (all ``s = 1``,
    exactly the weight-matching initialisation), its gradient is finite.
    """
    x = z / torch.linalg.matrix_norm(z.detach(), 2).clamp_min(1e-300)
    eye = torch.eye(z.shape[-1], dtype=z.dtype, device=z.device)
    for _ in range(iters):
        x = 0.5 * x @ (3 * eye - x.T @ x)
    return x


def condition(u: Tensor) -> Tensor:
    """2-norm condition number per block (``inf`` for singular blocks)."""
    s = torch.linalg.svdvals(u)
    return s[..., 0] / s[..., -1]
