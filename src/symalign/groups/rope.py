"""The RoPE Q-K group ``H(r) (+) GL(n - r)``: a nonzero complex scalar per rotated plane."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from symalign.errors import GroupError
from symalign.groups.base import PAIRINGS, Latent
from symalign.groups.linear import MatrixGroup
from symalign.groups.rotary import rotary_block_matrix, rotary_pairs
from symalign.groups.sampling import as_generator, random_well_conditioned


@dataclass(frozen=True)
class RotaryPlanes(MatrixGroup):
    r"""The RoPE Q-K group ``H(r) (+) GL(n - r)`` on a head of width ``n``.

    The first ``rotary_dims = r`` dimensions are rotated by RoPE in planes given by
    ``pairing``; on each plane the element is a nonzero complex scalar
    ``c = a + i b`` (block ``[[a, -b], [b, a]]``), the matrices commuting with every
    rotation. The remaining ``n - r`` dimensions (partial rotary) carry a full
    ``GL(n - r)``. Dimension ``r + (n - r)^2``; with ``r = n`` this is the paper's
    ``H(d_h) ~ (C^x)^{d_h/2}`` of dimension ``d_h``.
    """

    n: int
    pairing: str = "half"
    rotary_dims: int | None = None
    block_matcher: ClassVar[str | None] = "rope"

    def __post_init__(self):
        r = self.r
        if r % 2 or not 0 < r <= self.n:
            raise GroupError(f"RoPE needs an even rotated width in (0, {self.n}], got {r}")
        if self.pairing not in PAIRINGS:
            raise GroupError(f"unknown rotary pairing {self.pairing!r}; use one of {PAIRINGS}")

    @property
    def r(self) -> int:
        return self.n if self.rotary_dims is None else int(self.rotary_dims)

    @property
    def dim(self) -> int:
        return self.r + (self.n - self.r) ** 2

    @property
    def key_bias_shift(self) -> int:
        """``n - r``: a key bias on a rotated plane turns with the key's position (its score term varies with
        the position, so it does not cancel), on the unrotated coordinates it shifts a query's scores."""
        return self.n - self.r

    def from_planes(self, a: Tensor, b: Tensor, rest: Tensor | None = None) -> Tensor:
        """Element from per-plane ``(a, b)`` of shape ``(*batch, r/2)`` and the GL block."""
        return rotary_block_matrix(a, b, self.n, self.pairing, rest)

    def planes(self, t: Tensor) -> tuple[Tensor, Tensor]:
        """The complex scalars ``(a, b)`` of an element, shape ``(*batch, r/2)``."""
        j0, j1 = rotary_pairs(self.r, self.pairing)
        return t[..., j0, j0], t[..., j1, j0]

    def sample(self, gen=None, dtype=torch.float64) -> Tensor:
        g = as_generator(gen)
        half = self.r // 2
        logr = (torch.rand(half, generator=g, dtype=torch.float64) * 2 - 1) * 0.5
        phi = torch.rand(half, generator=g, dtype=torch.float64) * 2 * math.pi
        rest = random_well_conditioned(self.n - self.r, g) if self.r < self.n else None
        return self.from_planes(logr.exp() * phi.cos(), logr.exp() * phi.sin(), rest).to(dtype)

    def contains(self, a: Tensor, atol: float = 1e-9) -> bool:
        if not self._is_invertible(a):
            return False
        pa, pb = self.planes(a.to(torch.float64))
        rest = a[..., self.r:, self.r:] if self.r < self.n else None
        return bool((self.from_planes(pa, pb, rest) - a.to(torch.float64)).abs().max() <= atol)

    def describe(self) -> str:
        tag = f"H({self.r},{self.pairing})"
        return tag if self.r == self.n else f"{tag}+GL({self.n - self.r})"

    def block_latent(self, n_blocks: int) -> Latent:
        """Per plane ``(s_j, phi_j)`` (start 0) and, under partial rotary, ``E_rest`` (start 0): plane ``j``
        of ``M`` is the complex scalar ``e^{s_j + i phi_j}``, the unrotated block ``I + E_rest``."""
        half = self.r // 2
        out = {":log": torch.zeros(n_blocks, half, dtype=torch.float64),
               ":phase": torch.zeros(n_blocks, half, dtype=torch.float64)}
        if self.r < self.n:
            rest = self.n - self.r
            out[":rest"] = torch.zeros(n_blocks, rest, rest, dtype=torch.float64)
        return out

    def block_matrix(self, latent) -> Tensor:
        s, phi = latent[":log"], latent[":phase"]
        rest = None
        if self.r < self.n:
            rest = torch.eye(self.n - self.r, dtype=torch.float64) + latent[":rest"]
        return self.from_planes(s.exp() * phi.cos(), s.exp() * phi.sin(), rest)
