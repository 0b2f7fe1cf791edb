"""Random elements: seeded generators, Haar orthogonal and well-conditioned invertible matrices."""

from __future__ import annotations

import torch
from torch import Tensor


def as_generator(seed_or_gen: int | torch.Generator | None) -> torch.Generator:
    """``seed_or_gen`` itself if it is a generator, else a new one seeded with it (``None``: seed 0)."""
    if isinstance(seed_or_gen, torch.Generator):
        return seed_or_gen
    g = torch.Generator()
    g.manual_seed(0 if seed_or_gen is None else int(seed_or_gen))
    return g


def random_orthogonal(n: int, gen: torch.Generator, dtype=torch.float64, batch: tuple[int, ...] = ()) -> Tensor:
    """Haar-distributed orthogonal matrices of shape ``(*batch, n, n)`` (QR with sign fix)."""
    a = torch.randn(*batch, n, n, generator=gen, dtype=torch.float64)
    q, r = torch.linalg.qr(a)
    d = torch.diagonal(r, dim1=-2, dim2=-1).sign()
    d = torch.where(d == 0, torch.ones_like(d), d)
    return (q * d.unsqueeze(-2)).to(dtype)


def random_well_conditioned(n: int, gen: torch.Generator, dtype=torch.float64, batch: tuple[int, ...] = (),
                            log_scale: float = 0.5) -> Tensor:
    """Random invertible ``Q1 diag(exp(s)) Q2`` with ``s ~ U(-log_scale, log_scale)``.

    The condition number is at most ``exp(2 log_scale)``; the distribution has full
    support on a neighbourhood of every orthogonal matrix, so it is generic in GL(n).
    """
    q1 = random_orthogonal(n, gen, torch.float64, batch)
    q2 = random_orthogonal(n, gen, torch.float64, batch)
    s = (torch.rand(*batch, n, generator=gen, dtype=torch.float64) * 2 - 1) * log_scale
    return ((q1 * s.exp().unsqueeze(-2)) @ q2).to(dtype)
