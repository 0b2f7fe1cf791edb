"""Finite permutation groups with ``int64`` index elements: ``S_n``, head permutations (``S_{h_kv} wr S_g``
under grouped-query attention) and independent permutations inside the blocks of a stacked axis."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from symalign.errors import GroupError
from symalign.groups.actions import apply_on_axis
from symalign.groups.assignment import assign_grouped, assign_max, one_hot, straight_through
from symalign.groups.base import Group, Latent, Variance
from symalign.groups.sampling import as_generator


@dataclass(frozen=True)
class Permutation(Group):
    """The symmetric group ``S_n`` acting by ``(T x)_i = x_{perm[i]}``."""

    n: int
    matcher: ClassVar[str | None] = "permutation"
    is_permutation: ClassVar[bool] = True

    @property
    def dim(self) -> int:
        return 0

    def identity(self, dtype=torch.int64) -> Tensor:
        return torch.arange(self.n)

    def sample(self, gen=None, dtype=None) -> Tensor:
        return torch.randperm(self.n, generator=as_generator(gen))

    def compose(self, a: Tensor, b: Tensor) -> Tensor:
        return b[a]

    def inverse(self, a: Tensor) -> Tensor:
        return torch.argsort(a)

    def contains(self, a: Tensor, atol: float = 0.0) -> bool:
        return a.shape == (self.n,) and not a.is_floating_point() and bool(
            torch.equal(torch.sort(a).values, torch.arange(self.n, device=a.device)))

    def matrix(self, a: Tensor, rep: str | None = None, size: int | None = None) -> Tensor:
        m = torch.zeros(self.n, self.n, dtype=torch.float64)
        m[torch.arange(self.n), a] = 1.0
        return m

    def act(self, a: Tensor, x: Tensor, axis: int, variance: Variance = "co", rep: str | None = None) -> Tensor:
        return x.index_select(axis, a.to(x.device))

    def describe(self) -> str:
        return f"S_{self.n}"

    def nearest(self, scores: Tensor) -> Tensor:
        """The linear assignment maximising ``sum_i scores[i, perm[i]]``."""
        return assign_max(scores)

    def nearest_activations(self, stats: Any) -> Tensor:
        """The assignment maximising the summed Pearson correlation ``sum_i corr(a_i, b_{perm[i]})``
        (scale-free: units differ in scale); a :class:`PositiveMonomial` gets unit scales."""
        return assign_max(stats.correlation())

    def latent(self, element: Tensor) -> Latent:
        """``Z = P`` (``n x n``)."""
        return {"": one_hot(element)}

    def soft(self, latent, start) -> Tensor:
        """``P + Z - sg(Z)`` with ``P`` the assignment of ``Z`` (straight-through)."""
        return self.relaxed(latent, start, straight_through)

    def relaxed(self, latent, start, relax) -> Tensor:
        z = latent[""]
        return relax(assign_max(z.detach()), z)

    def soft_act(self, soft, x, axis, variance, rep=None) -> Tensor:
        return apply_on_axis(x, axis, soft)  # a permutation matrix: T^{-T} = T

    def from_latent(self, latent, start, max_cond=1e6):
        return assign_max(latent[""].detach()), []


@dataclass(frozen=True)
class HeadPermutation(Group):
    r"""Permutations of attention heads, acting on blocks of ``head_dim`` entries.

    With grouped-query attention (``n_kv_heads < n_heads``, ``g = n_heads / n_kv_heads``
    query heads share each K/V head) only permutations that map K/V groups onto K/V
    groups are symmetries: ``S_{h_kv} wr S_g``. An element is the permutation ``pi``
    of the *query* heads, ``(T x)_{head i} = x_{head pi[i]}``; it acts on query-head
    axes (``rep="query"``, ``n_heads * head_dim`` entries) by ``pi`` and on K/V axes
    (``rep="kv"``, ``n_kv_heads * head_dim`` entries) by the induced group
    permutation ``sigma[k] = pi[k g] // g``. An axis with one entry per query head
    (``rep="head"``, ``n_heads`` entries: a per-head table such as T5's relative position
    bias) is permuted by ``pi`` itself.
    """

    n_heads: int
    head_dim: int
    n_kv_heads: int | None = None
    matcher: ClassVar[str | None] = "attention"
    permutes_heads: ClassVar[bool] = True

    def __post_init__(self):
        if self.kv <= 0 or self.n_heads % self.kv:
            raise GroupError(f"n_kv_heads={self.kv} must divide n_heads={self.n_heads}")

    @property
    def kv(self) -> int:
        return self.n_heads if self.n_kv_heads is None else int(self.n_kv_heads)

    @property
    def group_size(self) -> int:
        return self.n_heads // self.kv

    @property
    def n(self) -> int:  # type: ignore[override]
        return self.n_heads * self.head_dim

    @property
    def dim(self) -> int:
        return 0

    def order(self) -> int:
        """Number of elements: ``h_kv! (g!)^{h_kv}``."""
        return math.factorial(self.kv) * math.factorial(self.group_size) ** self.kv

    def identity(self, dtype=torch.int64) -> Tensor:
        return torch.arange(self.n_heads)

    def from_parts(self, sigma: Tensor, taus: Tensor) -> Tensor:
        """Build ``pi`` from the K/V-group permutation ``sigma`` and ``taus[k]`` within group ``k``."""
        g = self.group_size
        return (sigma.view(-1, 1) * g + taus).reshape(-1)

    def kv_permutation(self, pi: Tensor) -> Tensor:
        return pi[:: self.group_size] // self.group_size

    def sample(self, gen=None, dtype=None) -> Tensor:
        g = as_generator(gen)
        sigma = torch.randperm(self.kv, generator=g)
        taus = torch.stack([torch.randperm(self.group_size, generator=g) for _ in range(self.kv)])
        return self.from_parts(sigma, taus)

    def compose(self, a: Tensor, b: Tensor) -> Tensor:
        return b[a]

    def inverse(self, a: Tensor) -> Tensor:
        return torch.argsort(a)

    def contains(self, a: Tensor, atol: float = 0.0) -> bool:
        if a.shape != (self.n_heads,) or a.is_floating_point():
            return False
        if not torch.equal(torch.sort(a).values, torch.arange(self.n_heads, device=a.device)):
            return False
        grp = (a // self.group_size).view(self.kv, self.group_size)
        return bool((grp == grp[:, :1]).all())

    def block_permutation(self, a: Tensor, rep: str | None) -> Tensor:
        """The permutation of blocks on an axis of kind ``rep`` (``query`` or ``kv``)."""
        if rep in (None, "query", "head"):
            return a
        if rep == "kv":
            return self.kv_permutation(a)
        raise GroupError(f"HeadPermutation has no representation {rep!r}; use 'query', 'kv' or 'head'")

    def axis_size(self, rep: str | None = None) -> int:
        if rep == "head":
            return self.n_heads
        return (self.kv if rep == "kv" else self.n_heads) * self.head_dim

    def index(self, a: Tensor, rep: str | None) -> Tensor:
        blocks = self.block_permutation(a, rep)
        d = 1 if rep == "head" else self.head_dim
        return (blocks.view(-1, 1) * d + torch.arange(d, device=blocks.device)).reshape(-1)

    def matrix(self, a: Tensor, rep: str | None = None, size: int | None = None) -> Tensor:
        idx = self.index(a, rep)
        m = torch.zeros(idx.numel(), idx.numel(), dtype=torch.float64)
        m[torch.arange(idx.numel()), idx] = 1.0
        return m

    def act(self, a: Tensor, x: Tensor, axis: int, variance: Variance = "co", rep: str | None = None) -> Tensor:
        return x.index_select(axis, self.index(a, rep).to(x.device))

    def describe(self) -> str:
        if self.kv == self.n_heads:
            return f"S_{self.n_heads}"
        return f"S_{self.kv} wr S_{self.group_size}"

    def assign(self, cost: Tensor) -> Tensor:
        """The element ``pi`` minimising ``sum_i cost[i, pi[i]]`` (exact, GQA-aware).

        ``cost[i, j]`` compares head ``i`` of A with head ``j`` of B (``h x h``). Without GQA a
        linear assignment; with K/V groups of ``g`` query heads, for every pair of groups
        ``(k, l)`` the best within-group assignment, then the best assignment of groups.
        """
        sigma, taus = assign_grouped(cost, self.kv, self.group_size)
        return sigma if taus is None else self.from_parts(sigma, taus)

    def nearest(self, scores: Tensor) -> Tensor:
        """The element maximising ``sum_i scores[i, pi[i]]`` (``h x h`` head scores)."""
        return self.assign(-scores)

    def latent(self, element: Tensor) -> Latent:
        """``Z = P`` (``h x h``, query heads)."""
        return {"": one_hot(element)}

    def _kv_latent(self, z: Tensor) -> Tensor:
        """``Z_kv[k, l] = sum_{a, b} Z[(k, a), (l, b)] / g``: the K/V-group latent of a query-head latent."""
        s = self.group_size
        return z.reshape(self.kv, s, self.kv, s).sum((1, 3)) / s

    def soft(self, latent, start) -> tuple[Tensor, Tensor]:
        """``(P_q, P_kv)``: ``P + Z - sg(Z)`` on query-head axes and, under GQA, the group-level
        ``P_kv + Z_kv - sg(Z_kv)`` on K/V axes."""
        return self.relaxed(latent, start, straight_through)

    def relaxed(self, latent, start, relax) -> tuple[Tensor, Tensor]:
        z = latent[""]
        pi = self.nearest(z.detach())
        pq = relax(pi, z)
        pkv = pq
        if self.group_size > 1:
            pkv = relax(self.kv_permutation(pi), self._kv_latent(z))
        return pq, pkv

    def soft_act(self, soft, x, axis, variance, rep=None) -> Tensor:
        p = soft[1] if rep == "kv" else soft[0]
        return apply_on_axis(x, axis, p if rep == "head" else torch.kron(p, torch.eye(self.head_dim, dtype=p.dtype)))

    def from_latent(self, latent, start, max_cond=1e6):
        return self.nearest(latent[""].detach()), []


@dataclass(frozen=True)
class BlockPermutations(Group):
    r"""``(S_n)^B``: an independent permutation of ``n`` units inside each of ``B`` blocks.

    The FF units of a mixture of experts whose ``B`` experts are stacked on **axis 0**
    of 3-D tensors (transformers' fused ``gate_up_proj`` ``(E, 2F, D)`` and
    ``down_proj`` ``(E, D, F)``): expert ``e``'s units are permuted by ``perm[e]``,
    ``x'[e, .., i, ..] = x[e, .., perm[e, i], ..]`` along the acted-on axis (never
    axis 0, which must have ``B`` entries). An element is an ``int64`` tensor
    ``(B, n)``, one permutation per row; ``compose(a, b)[e] = b[e][a[e]]``.

    Declared with a :class:`Permutation` of the ``B`` experts acting on axis 0 of
    the same tensors **before** it, and coupled to it (``spec.couple(experts,
    units)``): the pair then acts as ``blockdiag(sigma) P``,
    ``W'[e] = sigma_e W[pi(e)]``, and composing re-indexes the blocks by ``pi``
    exactly as per-head blocks are re-indexed by a head permutation.
    """

    n_blocks: int
    n: int
    permutes_within_blocks: ClassVar[bool] = True

    @property
    def dim(self) -> int:
        return 0

    def identity(self, dtype=torch.int64) -> Tensor:
        return torch.arange(self.n).repeat(self.n_blocks, 1)

    def sample(self, gen=None, dtype=None) -> Tensor:
        g = as_generator(gen)
        return torch.stack([torch.randperm(self.n, generator=g) for _ in range(self.n_blocks)])

    def compose(self, a: Tensor, b: Tensor) -> Tensor:
        return torch.gather(b, 1, a)

    def inverse(self, a: Tensor) -> Tensor:
        return torch.argsort(a, dim=1)

    def contains(self, a: Tensor, atol: float = 0.0) -> bool:
        return a.shape == (self.n_blocks, self.n) and not a.is_floating_point() and bool(
            torch.equal(torch.sort(a, dim=1).values, self.identity()))

    def matrix(self, a: Tensor, rep: str | None = None, size: int | None = None) -> Tensor:
        """The block-diagonal ``(B n, B n)`` matrix (blocks and units flattened, block-major)."""
        return torch.block_diag(*[one_hot(row) for row in a])

    def act(self, a: Tensor, x: Tensor, axis: int, variance: Variance = "co", rep: str | None = None) -> Tensor:
        axis = axis % x.dim()
        if axis == 0 or x.shape[0] != self.n_blocks or x.shape[axis] != self.n:
            raise GroupError(f"{self.describe()} acts on a unit axis (not 0) of a tensor whose axis 0 has "
                             f"{self.n_blocks} blocks; got axis {axis} of shape {tuple(x.shape)}")
        shape = [1] * x.dim()
        shape[0], shape[axis] = self.n_blocks, self.n
        return torch.gather(x, axis, a.to(x.device).view(shape).expand(x.shape))

    def describe(self) -> str:
        return f"S_{self.n}^{self.n_blocks}"

    def nearest(self, scores: Tensor) -> Tensor:
        """Per block, the assignment maximising ``sum_i scores[e, i, perm[e, i]]`` (``scores``: ``(B, n, n)``)."""
        return torch.stack([assign_max(s) for s in scores])
