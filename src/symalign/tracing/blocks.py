r"""Permutation groups that respect a split of the feature space into ``g`` equal contiguous blocks.

Grouped convolutions and GroupNorm tie a channel space of ``n = g m`` channels to its
``g`` groups of ``m`` consecutive channels (group ``j``: channels ``j m .. (j+1) m - 1``):

* :class:`WithinBlocks` ``(S_m)^g``: a permutation inside each block, blocks kept in
  place. The output channels of a grouped convolution (group ``j`` of the output reads
  only group ``j`` of the input, whose channels stay where they are).
* :class:`WithinBlocksMonomial` ``(S_m)^g x R_{>0}^n``: the same with positive
  per-channel scales (grouped convolution outputs followed by ReLU, no norm).
* :class:`BlockWreath` ``S_m wr S_g``: the permutations that map blocks onto blocks
  (``j m + r -> pi(j) m + sigma_j(r)``). GroupNorm's channels: its statistics are taken
  over each group, so a permutation keeps them iff it keeps the partition into groups.

All three are subclasses of :class:`~symalign.groups.Permutation` (or
:class:`~symalign.groups.PositiveMonomial`) with the same element format, so every
matcher handles them; only :meth:`nearest`, :meth:`fit` and the sampling are
restricted to the subgroup (each an exact block minimiser: per-block assignments,
and for the wreath product one assignment over blocks of the best per-pair values).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from symalign.errors import GroupError
from symalign.groups import Permutation, PositiveMonomial


def _check(n: int, blocks: int) -> int:
    if blocks < 1 or n % blocks:
        raise GroupError(f"{n} features cannot be split into {blocks} equal blocks")
    return n // blocks


def _within(perm: Tensor, m: int) -> bool:
    idx = torch.arange(perm.numel())
    return bool(torch.equal(perm // m, idx // m))


def _soft(group, z: Tensor) -> Tensor:
    """``P + Z - sg(Z)`` with ``P`` the group's nearest permutation to ``Z`` (straight-through)."""
    perm = group.nearest(z.detach())
    p = torch.zeros_like(z)
    p[torch.arange(z.shape[0]), perm] = 1.0
    return p + z - z.detach()


def _generator(gen) -> torch.Generator:
    """``gen`` if it is a generator, else one seeded with it (``None``: 0)."""
    return gen if isinstance(gen, torch.Generator) else torch.Generator().manual_seed(int(gen or 0))


def _block_permutation(m: int, targets, g: torch.Generator) -> Tensor:
    """A random permutation of each block of ``m`` entries, block ``j`` placed at block ``targets[j]``."""
    return torch.cat([torch.randperm(m, generator=g) + t * m for t in targets])


@dataclass(frozen=True)
class WithinBlocks(Permutation):
    """``(S_m)^g``: a permutation of each contiguous block of ``m = n / blocks`` entries (module docstring)."""

    blocks: int = 1

    def __post_init__(self):
        _check(self.n, self.blocks)

    @property
    def m(self) -> int:
        return self.n // self.blocks

    def sample(self, gen=None, dtype=None) -> Tensor:
        g = _generator(gen)
        return _block_permutation(self.m, range(self.blocks), g)

    def contains(self, a: Tensor, atol: float = 0.0) -> bool:
        return super().contains(a) and _within(a, self.m)

    def describe(self) -> str:
        return f"S_{self.m}^{self.blocks}"

    def nearest(self, scores: Tensor) -> Tensor:
        """Per block, the assignment maximising ``sum_i scores[i, perm[i]]`` inside the block."""
        m, inner = self.m, Permutation(self.m)
        return torch.cat([inner.nearest(scores[j * m:(j + 1) * m, j * m:(j + 1) * m]) + j * m
                          for j in range(self.blocks)])

    def soft(self, latent, start) -> Tensor:
        return _soft(self, latent[""])

    def from_latent(self, latent, start, max_cond=1e6):
        return self.nearest(latent[""].detach()), []


@dataclass(frozen=True)
class WithinBlocksMonomial(PositiveMonomial):
    """``(S_m)^g x R_{>0}^n``: :class:`WithinBlocks` with positive per-entry scales (module docstring)."""

    blocks: int = 1

    def __post_init__(self):
        _check(self.n, self.blocks)

    @property
    def m(self) -> int:
        return self.n // self.blocks

    def sample(self, gen=None, dtype=None) -> Tensor:
        g = _generator(gen)
        perm = _block_permutation(self.m, range(self.blocks), g)
        u = torch.rand(self.n, generator=g, dtype=torch.float64) * 2 - 1
        return self.pack(perm, (u * self.log_scale).exp())

    def contains(self, a: Tensor, atol: float = 0.0) -> bool:
        return super().contains(a) and _within(self.parts(a)[0], self.m)

    def describe(self) -> str:
        return f"S_{self.m}^{self.blocks} x R+^{self.n}"

    def nearest(self, scores: Tensor) -> Tensor:
        return WithinBlocks(self.n, blocks=self.blocks).nearest(scores)

    def fit(self, pairs, max_scale: float = 1e4) -> Tensor:
        """Per block, :meth:`PositiveMonomial.fit` on the block's rows: the joint minimiser over the block's
        permutation and scales (the blocks share no term, so together this is the exact minimiser)."""
        m, inner = self.m, PositiveMonomial(self.m, self.log_scale)
        perms, scales = [], []
        for j in range(self.blocks):
            rows = slice(j * m, (j + 1) * m)
            el = inner.fit([(xa[rows], xb[rows], v) for xa, xb, v in pairs], max_scale)
            p, s = inner.parts(el)
            perms.append(p + j * m)
            scales.append(s)
        return self.pack(torch.cat(perms), torch.cat(scales))

    def soft(self, latent, start):
        z = latent[""]
        p_st = _soft(self, z)
        scale = latent[":log"].exp()[:, None]
        return scale * p_st, p_st / scale, p_st

    def from_latent(self, latent, start, max_cond=1e6):
        return self.pack(self.nearest(latent[""].detach()), latent[":log"].detach().exp()), []


@dataclass(frozen=True)
class BlockWreath(Permutation):
    """``S_m wr S_g``: permutations mapping each block of ``m = n / blocks`` entries onto a block (docstring)."""

    blocks: int = 1

    def __post_init__(self):
        _check(self.n, self.blocks)

    @property
    def m(self) -> int:
        return self.n // self.blocks

    @property
    def dim(self) -> int:
        return 0

    def sample(self, gen=None, dtype=None) -> Tensor:
        g = _generator(gen)
        pi = torch.randperm(self.blocks, generator=g)
        return _block_permutation(self.m, (int(pi[j]) for j in range(self.blocks)), g)

    def contains(self, a: Tensor, atol: float = 0.0) -> bool:
        if not super().contains(a):
            return False
        src = (a // self.m).view(self.blocks, self.m)
        return bool((src == src[:, :1]).all())

    def describe(self) -> str:
        return f"S_{self.m} wr S_{self.blocks}"

    def nearest(self, scores: Tensor) -> Tensor:
        """The exact maximiser of ``sum_i scores[i, perm[i]]`` over the wreath product: for every pair of
        blocks ``(j, k)`` the best inner assignment ``sigma_jk`` and its value ``V[j, k]``; then the block
        assignment ``pi`` maximising ``sum_j V[j, pi(j)]``."""
        m, g, inner = self.m, self.blocks, Permutation(self.m)
        value = torch.zeros(g, g, dtype=torch.float64)
        best: dict[tuple[int, int], Tensor] = {}
        for j in range(g):
            for k in range(g):
                sub = scores[j * m:(j + 1) * m, k * m:(k + 1) * m].to(torch.float64)
                s = inner.nearest(sub)
                best[j, k] = s
                value[j, k] = sub[torch.arange(m), s].sum()
        pi = Permutation(g).nearest(value)
        return torch.cat([best[j, int(pi[j])] + int(pi[j]) * m for j in range(g)])

    def soft(self, latent, start) -> Tensor:
        return _soft(self, latent[""])

    def from_latent(self, latent, start, max_cond=1e6):
        return self.nearest(latent[""].detach()), []
