"""Per-head products: one element of a matrix group per head or K/V group (block-diagonal ``T``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from symalign.errors import GroupError
from symalign.groups.actions import apply_on_axis, variance_matrix
from symalign.groups.base import Group, Latent, Variance
from symalign.groups.linear import MatrixGroup
from symalign.groups.polar import condition
from symalign.groups.sampling import as_generator


@dataclass(frozen=True)
class PerHead(Group):
    r"""One element of ``inner`` per head (or per K/V group): block-diagonal ``T``.

    Elements have shape ``(n_blocks, d, d)``. On an axis of ``n_blocks * d`` entries
    (``rep="kv"`` or ``None``) block ``k`` acts on entries ``k d .. (k+1) d``. On a
    query-head axis under GQA (``rep="query"``, ``n_blocks * g * d`` entries) block
    ``k`` acts on each of the ``g`` query heads of group ``k``. Dimension
    ``n_blocks * inner.dim``.
    """

    inner: MatrixGroup
    n_blocks: int
    matcher: ClassVar[str | None] = "attention"

    @property
    def head_block(self) -> MatrixGroup:
        """``inner``: the group of each block."""
        return self.inner

    @property
    def n(self) -> int:  # type: ignore[override]
        return self.n_blocks * self.inner.n

    @property
    def dim(self) -> int:
        return self.n_blocks * self.inner.dim

    def identity(self, dtype=torch.float64) -> Tensor:
        return torch.eye(self.inner.n, dtype=dtype).expand(self.n_blocks, -1, -1).clone()

    def sample(self, gen=None, dtype=torch.float64) -> Tensor:
        g = as_generator(gen)
        return torch.stack([self.inner.sample(g, dtype) for _ in range(self.n_blocks)])

    def compose(self, a: Tensor, b: Tensor) -> Tensor:
        return a @ b

    def inverse(self, a: Tensor) -> Tensor:
        return torch.linalg.inv(a.to(torch.float64)).to(a.dtype)

    def contains(self, a: Tensor, atol: float = 1e-9) -> bool:
        return a.shape == (self.n_blocks, self.inner.n, self.inner.n) and all(
            self.inner.contains(blk, atol) for blk in a)

    def axis_size(self, rep: str | None = None) -> int | None:
        return None if rep == "query" else self.n

    def _repeat(self, size: int) -> int:
        per = self.n_blocks * self.inner.n
        if size % per:
            raise GroupError(f"an axis of {size} entries is not a multiple of {self.n_blocks} blocks of {self.inner.n}")
        return size // per

    def matrix(self, a: Tensor, rep: str | None = None, size: int | None = None) -> Tensor:
        rep_n = 1 if size is None else self._repeat(size)
        blocks = a.to(torch.float64).repeat_interleave(rep_n, dim=0)
        return torch.block_diag(*blocks)

    def act(self, a: Tensor, x: Tensor, axis: int, variance: Variance, rep: str | None = None) -> Tensor:
        return apply_on_axis(x, axis, variance_matrix(a, variance), repeat=self._repeat(x.shape[axis]))

    def describe(self) -> str:
        return f"{self.inner.describe()}^{self.n_blocks}"

    def latent(self, element: Tensor) -> Latent:
        """The inner group's per-block corrections (:meth:`MatrixGroup.block_latent`), starting at ``I``:
        ``U = U_start M`` stays in the group because it is one."""
        return self.inner.block_latent(self.n_blocks)

    def _blocks(self, latent, start: Tensor) -> Tensor:
        return start.to(torch.float64) @ self.inner.block_matrix(latent)

    def soft(self, latent, start) -> dict[str, Tensor]:
        """``{"co": U}``; the contravariant ``U^{-T}`` is added on first use (once per step)."""
        return {"co": self._blocks(latent, start)}

    def soft_act(self, soft, x, axis, variance, rep=None) -> Tensor:
        if variance == "contra" and "contra" not in soft:
            soft["contra"] = torch.linalg.inv(soft["co"]).mT
        m = soft["co"] if variance == "co" else soft["contra"]
        return apply_on_axis(x, axis, m, repeat=x.shape[axis] // self.n)

    def from_latent(self, latent, start, max_cond=1e6):
        """``U = U_start M``; a block that is not finite or has ``cond(U) > max_cond`` keeps ``U_start``."""
        start = start.to(torch.float64)
        u = self._blocks({k: v.detach() for k, v in latent.items()}, start)
        cond = condition(u)
        bad = ~torch.isfinite(u).all(-1).all(-1) | ~(cond <= max_cond)
        fallbacks = [(i, float(cond[i])) for i in torch.nonzero(bad).flatten().tolist()]
        return torch.where(bad[:, None, None], start, u), fallbacks


@dataclass(frozen=True)
class OffsetPerHead(PerHead):
    r""":class:`PerHead` acting on ``x + offset`` (a gain stored as ``w`` with effective gain ``offset + w``).

    Gemma's RMSNorms multiply by ``1 + w``: scaling the effective gain by ``c`` is the
    affine map ``w -> c (1 + w) - 1`` of the stored weight, i.e. the linear action on
    ``1 + w``. Still a group action (``(c_1 c_2) (1 + w) - 1``), of the same dimension.
    """

    offset: float = 0.0

    def act(self, a: Tensor, x: Tensor, axis: int, variance: Variance, rep: str | None = None) -> Tensor:
        if not self.offset:
            return super().act(a, x, axis, variance, rep)
        return super().act(a, x + self.offset, axis, variance, rep) - self.offset

    def describe(self) -> str:
        base = super().describe()
        return f"{base} on (w + {self.offset:g})" if self.offset else base
