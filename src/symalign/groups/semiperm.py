r"""Semi-permutations: splitting units (or attention heads) into copies, and merging copies back (seed 002's S2).

An element maps ``n`` source units onto ``m >= n`` target units. It is a ``(2, m)`` float64 tensor
``[src; alpha]``: target unit ``j`` is a copy of source unit ``src[j]`` (``src`` onto ``{0 .. n-1}``: every
source unit has at least one copy) carrying the share ``alpha_j > 0``, with the shares of each source
unit's copies summing to one, ``sum_{j: src[j] = i} alpha_j = 1``. Two ``m x n`` matrices stand for it:

* ``S[j, src[j]] = alpha_j`` (the split side) and ``R[j, src[j]] = 1`` (the copied side); ``R^T S = I_n``.

Covariant axes (the tensor produces the units: ``fc_in`` rows, their biases) and contravariant axes (the
tensor consumes them: ``fc_out`` columns) are multiplied by ``S`` or ``R``; which side carries the shares is
the group's ``homogeneous`` flag:

* ``homogeneous=True`` (ReLU units, positive homogeneity; seed 002's ``f(x) = f(alpha x) + f((1 - alpha) x)``):
  covariant by ``S``, contravariant by ``R``. Unit ``i`` with input weights ``w`` and output weights ``v``
  becomes copies with inputs ``alpha_j w`` and outputs ``v``, and
  ``sum_j v relu(alpha_j w x) = (sum_j alpha_j) v relu(w x) = v relu(w x)``: exact because
  ``relu(alpha z) = alpha relu(z)`` for ``alpha > 0`` -- through GELU, or with shares not summing to one, the
  function changes.
* ``homogeneous=False`` (any elementwise activation; the value/output side of attention heads): covariant by
  ``R``, contravariant by ``S``. Copies keep the input weights, the output weights are split,
  ``sum_j alpha_j v f(w x) = v f(w x)``. For ReLU units the two forms differ by a positive monomial
  (:class:`~symalign.groups.PositiveMonomial`: the copy's scales ``1 / alpha_j``), so they reach the same models.

An axis with ``rep="copy"`` is multiplied by ``R`` whatever its variance: the query and key projections of a
split attention head are copied unchanged, so every copy attends exactly as the head did. With
``block = head_dim`` a unit is a block of ``head_dim`` consecutive entries (a head): a head's OV product
``W_O^h W_V^h`` is split linearly, ``sum_j W_O^h (alpha_j W_V^h) = W_O^h W_V^h`` (``homogeneous=True`` puts the
shares on ``W_V``, ``False`` on ``W_O``), while its QK product is copied.

Because ``R^T S = I``, every contraction of a covariant with a contravariant axis is preserved:
``W_out R^T S W_in = W_out W_in``. The left inverse is :meth:`SemiPermutation.merge`: covariant axes by ``R^T``
(``homogeneous``; else ``S^T``), contravariant by ``S^T`` (else ``R^T``): the copies' split side is summed,
their copied side averaged with the shares. Merging a split model gives back the original exactly; on any other
wide model it is a projection.

A split changes widths, so it is no Lie group acting on one parameter space: its dimension in a spec is 0
(:attr:`Group.changes_width`; the whole-model solvers do not solve it: ``matcher = None``). At a split model
the copies make the parameters degenerate: each extra copy frees the weights it could trade with its
siblings (:meth:`SemiPermutation.degeneracy`), directions the Jacobian probe measures but no group declares.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from symalign.errors import GroupError
from symalign.groups.assignment import assign_max
from symalign.groups.base import Group, Variance
from symalign.groups.sampling import as_generator


@dataclass(frozen=True)
class SemiPermutation(Group):
    """Splits of ``n`` source units into ``m`` copies (module docstring); ``block``: entries per unit."""

    n: int
    m: int
    homogeneous: bool = True
    block: int = 1
    matcher: ClassVar[str | None] = None
    changes_width: ClassVar[bool] = True

    def __post_init__(self):
        if not (0 < self.n <= self.m) or self.block < 1:
            raise GroupError(f"a split maps n units onto m >= n copies; got n={self.n}, m={self.m}, "
                             f"block={self.block}")

    @property
    def dim(self) -> int:
        return 0

    def describe(self) -> str:
        unit = "units" if self.block == 1 else f"blocks of {self.block}"
        return f"Split_{self.n}->{self.m} ({unit}, {'homogeneous' if self.homogeneous else 'linear'})"

    def axis_size(self, rep: str | None = None) -> int | None:
        return self.n * self.block

    # -- elements -----------------------------------------------------------
    @staticmethod
    def pack(src: Tensor, alpha: Tensor) -> Tensor:
        """The ``(2, m)`` element ``[src; alpha]``."""
        return torch.stack([src.to(torch.float64), alpha.to(torch.float64)])

    def parts(self, a: Tensor) -> tuple[Tensor, Tensor]:
        """``(src, alpha)`` (``int64``, ``float64``) of an element."""
        if a.dim() != 2 or a.shape[0] != 2:
            raise GroupError(f"an element of {self.describe()} is a (2, m) tensor [src; alpha]; got shape "
                             f"{tuple(a.shape)}")
        return a[0].round().to(torch.int64), a[1].to(torch.float64)

    def shares(self, src: Tensor, alpha: Tensor) -> Tensor:
        """``sum_{j: src[j] = i} alpha_j`` per source unit ``i`` (one for an element)."""
        return torch.zeros(self.n, dtype=torch.float64).index_add_(0, src, alpha)

    def contains(self, a: Tensor, atol: float = 1e-9) -> bool:
        try:
            src, alpha = self.parts(a)
        except GroupError:
            return False
        if a.shape[1] != self.m or not bool((a[0] == a[0].round()).all()):
            return False
        if int(src.min()) < 0 or int(src.max()) >= self.n or torch.unique(src).numel() != self.n:
            return False
        if not bool((torch.isfinite(alpha) & (alpha > 0)).all()):
            return False
        return float((self.shares(src, alpha) - 1).abs().max()) <= atol

    def identity(self, dtype=torch.float64) -> Tensor:
        """The identity (each unit its own single copy); only a split with ``m == n`` has one."""
        if self.m != self.n:
            raise GroupError(f"{self.describe()} changes the width; it has no identity (use uniform())")
        return self.pack(torch.arange(self.n), torch.ones(self.n, dtype=torch.float64))

    def uniform(self) -> Tensor:
        """The unmatched split: units ``0 .. m - n - 1`` (cyclically) copied once more, in order after the
        originals, with equal shares among each unit's copies."""
        src = torch.cat([torch.arange(self.n), torch.arange(self.m - self.n) % self.n])
        counts = torch.bincount(src, minlength=self.n).to(torch.float64)
        return self.pack(src, 1.0 / counts[src])

    def sample(self, gen: int | torch.Generator | None = None, dtype=torch.float64) -> Tensor:
        """A random split: every unit once, ``m - n`` extra copies of random units, shuffled; shares drawn
        from ``U(0.2, 1)`` and normalised per unit."""
        g = as_generator(gen)
        src = torch.cat([torch.arange(self.n), torch.randint(self.n, (self.m - self.n,), generator=g)])
        src = src[torch.randperm(self.m, generator=g)]
        u = 0.2 + 0.8 * torch.rand(self.m, generator=g, dtype=torch.float64)
        return self.pack(src, u / self.shares(src, u)[src])

    def compose(self, a: Tensor, b: Tensor) -> Tensor:
        """``b`` first, then ``a`` (``a``'s sources are ``b``'s copies): ``S = S_a S_b``, ``R = R_a R_b``, i.e.
        ``(src_b[src_a], alpha_a * alpha_b[src_a])``."""
        sa, aa = self.parts(a)
        sb, ab = self.parts(b)
        return self.pack(sb[sa], aa * ab[sa])

    def inverse(self, a: Tensor) -> Tensor:
        """Only a split with ``m == n`` (a permutation) is invertible; a widening split has the left inverse
        :meth:`merge`."""
        if self.m != self.n:
            raise GroupError(f"{self.describe()} widens the units; it has no inverse, only the left inverse "
                             "merge (SemiPermutation.merge)")
        src, _ = self.parts(a)
        return self.pack(torch.argsort(src), torch.ones(self.n, dtype=torch.float64))

    def _split_side(self, variance: Variance, rep: str | None) -> bool:
        """Whether an axis is multiplied by ``S`` (carries the shares) rather than ``R``."""
        if variance not in ("co", "contra"):
            raise GroupError(f"unknown variance {variance!r}; use 'co' or 'contra'")
        if rep == "copy":
            return False
        return (variance == "co") == self.homogeneous

    def _entries(self, src: Tensor) -> Tensor:
        """The axis entries of the copies, in order (units of ``block`` entries)."""
        return (src[:, None] * self.block + torch.arange(self.block)).reshape(-1)

    def matrix(self, a: Tensor, rep: str | None = None, size: int | None = None,
               variance: Variance = "co") -> Tensor:
        """The dense ``(m block) x (n block)`` matrix ``S`` or ``R`` an axis is multiplied by."""
        src, alpha = self.parts(a)
        w = alpha if self._split_side(variance, rep) else torch.ones_like(alpha)
        out = torch.zeros(self.m * self.block, self.n * self.block, dtype=torch.float64)
        rows = torch.arange(self.m * self.block)
        out[rows, self._entries(src)] = w.repeat_interleave(self.block)
        return out

    def act(self, a: Tensor, x: Tensor, axis: int, variance: Variance = "co", rep: str | None = None) -> Tensor:
        """Widen ``axis`` of ``x`` from ``n block`` to ``m block`` entries: entry block ``j`` is source block
        ``src[j]``, times ``alpha_j`` on the split side; formed in float64 and cast back."""
        src, alpha = self.parts(a)
        axis = axis % x.dim()
        if x.shape[axis] != self.n * self.block:
            raise GroupError(f"axis {axis} has {x.shape[axis]} entries but {self.describe()} acts on "
                             f"{self.n * self.block}")
        y = x.index_select(axis, self._entries(src).to(x.device)).to(torch.float64)
        if self._split_side(variance, rep):
            shape = [1] * x.dim()
            shape[axis] = -1
            y = y * alpha.repeat_interleave(self.block).to(y.device).view(shape)
        return y.to(x.dtype)

    def merge(self, a: Tensor, x: Tensor, axis: int, variance: Variance = "co", rep: str | None = None) -> Tensor:
        """The left inverse of :meth:`act`: narrow ``axis`` from ``m block`` to ``n block`` entries. The split
        side sums the copies (``R^T``), the copied side averages them with the shares (``S^T``); so
        ``merge(a, act(a, x)) == x``."""
        src, alpha = self.parts(a)
        axis = axis % x.dim()
        if x.shape[axis] != self.m * self.block:
            raise GroupError(f"axis {axis} has {x.shape[axis]} entries but {self.describe()} merges "
                             f"{self.m * self.block}")
        y = torch.movedim(x, axis, 0).to(torch.float64)
        if not self._split_side(variance, rep):
            y = y * alpha.repeat_interleave(self.block).to(y.device).view(-1, *([1] * (y.dim() - 1)))
        out = torch.zeros((self.n * self.block, *y.shape[1:]), dtype=torch.float64, device=y.device)
        out.index_add_(0, self._entries(src).to(y.device), y)
        return torch.movedim(out, 0, axis).to(x.dtype)

    def degeneracy(self, fan_in: int, fan_out: int) -> int:
        r"""The Jacobian nullity a split adds at the split model beyond its groups' dimensions, for ``block == 1``
        units read from ``fan_in`` features and written to ``fan_out``: each of the ``m - n`` extra copies can
        trade its ``fan_in`` input and ``fan_out`` output weights with a sibling (the siblings' activations are
        proportional), ``(m - n)(fan_in + fan_out)`` directions (its bias direction is the positive scale the
        :class:`~symalign.groups.PositiveMonomial` of the wide layer already counts)."""
        return (self.m - self.n) * (int(fan_in) + int(fan_out))

    # -- the matched split --------------------------------------------------
    def _rows(self, x: Tensor) -> Tensor:
        return x.to(torch.float64).reshape(x.shape[0] // self.block, -1)

    def fit(self, pairs: list[tuple[Tensor, Tensor, Variance]]) -> Tensor:
        r"""The matched split of a narrow model's units (``X_B``, ``n block`` rows) onto a wider target's
        (``X_A``, ``m block`` rows), from rows ``(X_A, X_B, variance)`` whose other axes already agree.

        Pairing: the scale-free similarity ``c[j, i] = sum_v <a_j^v, b_i^v> / (|a_j^v| |b_i^v|)`` over the two
        variances ``v`` (each unit's rows of that variance concatenated) is maximised over maps ``src`` onto the
        source units. Exactly: with ``r[j, i] = max_k c[j, k] - c[j, i] >= 0`` one linear assignment picks a
        distinct target unit for every source unit at least cost ``sum r``, and every other target unit takes its
        best source (cost 0); any onto map costs at least that. Shares: target unit ``j``'s size
        ``rho_j = prod_v |a_j^v|`` (for ReLU units ``|w_j| |v_j|``, the scale-free size of its contribution),
        normalised over each source unit's copies.
        """
        if not pairs:
            raise GroupError("no tensors to fit a split")
        sims = torch.zeros(self.m, self.n, dtype=torch.float64)
        size = torch.ones(self.m, dtype=torch.float64)
        for variance in ("co", "contra"):
            rows = [(self._rows(xa), self._rows(xb)) for xa, xb, v in pairs if v == variance]
            if not rows:
                continue
            xa = torch.cat([r[0] for r in rows], 1)
            xb = torch.cat([r[1] for r in rows], 1)
            if xa.shape[0] != self.m or xb.shape[0] != self.n:
                raise GroupError(f"{self.describe()}: rows {xa.shape[0]} (target) and {xb.shape[0]} (source)")
            na, nb = xa.norm(dim=1), xb.norm(dim=1)
            sims += (xa @ xb.T) / (na[:, None] * nb[None, :]).clamp_min(1e-300)
            size *= na
        reduced = sims.max(1, keepdim=True).values - sims
        rows_of = assign_max(-reduced.T)  # source unit i -> a distinct target unit rows_of[i]
        src = sims.argmax(1)
        src[rows_of] = torch.arange(self.n)
        size = size.clamp_min(1e-12 * float(size.max().clamp_min(1e-300)))
        return self.pack(src, size / self.shares(src, size)[src])
