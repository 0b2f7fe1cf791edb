r"""QK-norm groups (docs/symmetry.md, "QK-norm"): diagonal matrices constant on each RoPE plane.

:class:`PlaneSigns` (``+-1``: the Q-K group under per-head RMS QK-norm), :class:`PlaneScales` (positive: the
rescalings of the norms' gains) and :class:`PlaneIdentity` (a centring QK-norm leaves only ``I``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from symalign.groups.linear import GeneralLinear, MatrixGroup
from symalign.groups.rope import RotaryPlanes
from symalign.groups.rotary import plane_of
from symalign.groups.sampling import as_generator


@dataclass(frozen=True)
class _Diagonal(MatrixGroup):
    """Diagonal matrices constant on each RoPE plane (free on the ``n - r`` unrotated coordinates).

    ``proportional``: the rotated planes are the first ``r/2`` planes of the whole head's
    pairing, not the planes of the first ``r`` dimensions (:func:`~symalign.groups.rotary.plane_of`).
    """

    n: int
    pairing: str = "half"
    rotary_dims: int | None = None
    proportional: bool = False

    @property
    def r(self) -> int:
        return self.n if self.rotary_dims is None else int(self.rotary_dims)

    @property
    def units(self) -> int:
        """Independent entries: ``r/2`` planes plus ``n - r`` unrotated coordinates."""
        return self.r // 2 + self.n - self.r

    def relaxation(self) -> MatrixGroup:
        """The RoPE group ``H(r) (+) GL(n - r)`` of the same planes (a diagonal constant on each plane is a
        complex scalar per plane); ``GL(n)`` without rotation or when RoPE is proportional (its turning
        planes are not the first ``r`` dimensions')."""
        if (self.proportional and self.r < self.n) or self.r == 0:
            return GeneralLinear(self.n)
        return RotaryPlanes(self.n, self.pairing, self.r)

    def plane_index(self) -> Tensor:
        return plane_of(self.n, self.pairing, self.r, self.proportional)

    def _layout(self) -> str:
        return f"{self.pairing},proportional" if self.proportional and self.r < self.n else self.pairing

    def from_units(self, u: Tensor) -> Tensor:
        """The diagonal matrix (``(*batch, n, n)``) with entry ``u[plane[j]]`` at ``(j, j)``."""
        return torch.diag_embed(u[..., self.plane_index()])

    def units_of(self, a: Tensor) -> Tensor:
        d = torch.diagonal(a, dim1=-2, dim2=-1)
        idx = torch.zeros(self.units, dtype=torch.long)
        idx[self.plane_index()] = torch.arange(self.n)
        return d[..., idx]

    def inverse(self, a: Tensor) -> Tensor:
        return torch.diag_embed(1.0 / torch.diagonal(a, dim1=-2, dim2=-1))

    def _is_diagonal(self, a: Tensor, atol: float) -> bool:
        a = a.to(torch.float64)
        if a.shape[-2:] != (self.n, self.n):
            return False
        if (a - torch.diag_embed(torch.diagonal(a, dim1=-2, dim2=-1))).abs().max() > atol:
            return False
        return bool((self.from_units(self.units_of(a)) - a).abs().max() <= atol)


@dataclass(frozen=True)
class PlaneSigns(_Diagonal):
    r"""Signs ``diag(s)``, ``s = +-1`` constant on each RoPE plane: the Q-K group under per-head QK-norm.

    With ``q -> RoPE(g * RMS(q))`` (a learned gain ``g`` over ``head_dim``), a per-head
    ``T`` must commute with the RMS normalisation (orthogonal), with ``diag(g)`` for a
    generic gain (diagonal) and with every RoPE rotation (constant on each plane):
    only ``+-1`` per plane and per unrotated coordinate survives. A finite group
    (dimension 0) of order ``2^(r/2 + n - r)``.
    """

    block_matcher: ClassVar[str | None] = "signs"

    @property
    def dim(self) -> int:
        return 0

    def sample(self, gen=None, dtype=torch.float64) -> Tensor:
        g = as_generator(gen)
        s = torch.randint(0, 2, (self.units,), generator=g).to(torch.float64) * 2 - 1
        return self.from_units(s).to(dtype)

    def contains(self, a: Tensor, atol: float = 1e-9) -> bool:
        return self._is_diagonal(a, atol) and bool(
            ((torch.diagonal(a.to(torch.float64), dim1=-2, dim2=-1).abs() - 1).abs() <= atol).all())

    def describe(self) -> str:
        tag = f"Z2^{self.units}" if self.r == self.n else f"Z2^{self.r // 2}+Z2^{self.n - self.r}"
        return f"signs({tag},{self._layout()})"


@dataclass(frozen=True)
class PlaneScales(_Diagonal):
    r"""Positive ``diag(c)``, constant on each RoPE plane: rescales QK-norm gains.

    Acting covariantly on the query norm's gain and contravariantly on the key
    norm's gain (``g_q -> c g_q``, ``g_k -> g_k / c``), every plane's contribution
    ``(c q_p)^T R_p (k_p / c)`` to a score is unchanged (a scalar per plane commutes
    with the plane's rotation). Dimension ``r/2 + n - r``.
    """

    block_matcher: ClassVar[str | None] = "scales"
    rescales_gains: ClassVar[bool] = True

    @property
    def key_bias_shift(self) -> int:
        """``n - r``: an affine key norm's bias is added after the normalisation, and on the unrotated
        coordinates it shifts a query's scores uniformly."""
        return self.n - self.r

    @property
    def dim(self) -> int:
        return self.units

    def sample(self, gen=None, dtype=torch.float64) -> Tensor:
        g = as_generator(gen)
        logc = (torch.rand(self.units, generator=g, dtype=torch.float64) * 2 - 1) * 0.5
        return self.from_units(logc.exp()).to(dtype)

    def contains(self, a: Tensor, atol: float = 1e-9) -> bool:
        return self._is_diagonal(a, atol) and bool((torch.diagonal(a.to(torch.float64), dim1=-2, dim2=-1) > 0).all())

    def describe(self) -> str:
        return f"scales(R+^{self.units},{self._layout()})"


@dataclass(frozen=True)
class PlaneIdentity(_Diagonal):
    r"""The identity only: the per-head Q-K group under a *centring* QK-norm (a LayerNorm with gain and bias).

    With ``q -> RoPE(g * C q / sigma(q) + beta)`` (``C = I - 1 1^T / n``,
    ``sigma(q) = sqrt(|C q|^2 / n + eps)``; Phi's ``qk_layernorm``), a per-head linear
    map of the pre-norm rows must commute with ``C`` and keep ``sigma`` (orthogonal,
    fixing ``1``), then with ``diag(g)`` (diagonal: ``+-1``, and fixing ``1`` leaves
    ``+1``): only ``T = I`` (docs/symmetry.md, "A centring QK-norm"). Declared so that the
    layer keeps its ``qk.i`` space; the matcher relaxes it to ``H`` for stage 1 (as
    :class:`PlaneSigns`) and then keeps ``I``. Dimension 0, order 1.
    """

    block_matcher: ClassVar[str | None] = "identity"
    centring: ClassVar[bool] = True

    @property
    def dim(self) -> int:
        return 0

    def sample(self, gen=None, dtype=torch.float64) -> Tensor:
        return torch.eye(self.n, dtype=dtype)

    def contains(self, a: Tensor, atol: float = 1e-9) -> bool:
        a = a.to(torch.float64)
        return a.shape[-2:] == (self.n, self.n) and bool(
            (a - torch.eye(self.n, dtype=torch.float64)).abs().max() <= atol)

    def describe(self) -> str:
        return f"id({self.n})"
