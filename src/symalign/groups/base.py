r"""The abstract group: what every symmetry group implements, and the conventions of its action.

Convention (column vectors, PyTorch layout)
-------------------------------------------
A group element ``g`` is represented by an invertible matrix ``T_g`` acting on a
feature space ``R^n``. A tensor axis that indexes this space is either

* **covariant** (``"co"``): the tensor *produces* the features (the output axis
  of an ``nn.Linear`` weight, a bias, an embedding's feature axis). Along that
  axis the tensor is multiplied by ``T``: ``W' = T W``.
* **contravariant** (``"contra"``): the tensor *consumes* the features (the input
  axis of an ``nn.Linear`` weight) or is the other side of a bilinear form (the
  key side of ``q^T k``). Along that axis the tensor is multiplied by
  ``T^{-T}``; for a Linear input axis this is ``W' = W T^{-1}``.

Any contraction of a covariant with a contravariant index (``W_out W_in``,
``q^T k``) is invariant. For permutations and orthogonal matrices
``T^{-T} = T`` and both sides coincide.

In the paper's layout (``W`` is ``D x d_h``, ``q = x W``) the attention action
``W_Q <- W_Q A^T, W_K <- W_K A^{-1}`` is exactly ``T = A`` covariant on the
query side and contravariant on the key side.

Composition: ``compose(a, b)`` is "``b`` first, then ``a``", i.e.
``T_{compose(a, b)} = T_a T_b``.

Elements of matrix groups are ``(n, n)`` tensors (float64 by default); elements
of permutation groups are ``int64`` index tensors ``perm`` with
``(T x)_i = x_{perm[i]}``.

What solvers need of a group
----------------------------
Each group also owns the pieces the matchers use, so that they iterate over the
spaces of a spec without asking which group each one is:

* :meth:`Group.nearest` -- the element ``g`` maximising ``<T_g, M>`` for a score
  matrix ``M`` (a linear assignment for permutations, the polar factor for ``O(n)``);
* the latent parametrisation of learned matching: :meth:`Group.latent` (float64
  leaf tensors starting at an element), :meth:`Group.soft` (a differentiable
  near-element, straight-through where a projection is involved), :meth:`Group.soft_act`
  (its action on a tensor axis) and :meth:`Group.from_latent` (the exact element the
  latents end at). A group without them raises :class:`~symalign.errors.GroupError`.

What callers may ask a group
----------------------------
Solvers, probes and folds never test a group's class: they ask the group. Besides
:attr:`Group.matcher` (the whole-model step that solves it), a group states its structure:
:attr:`Group.is_permutation` (``S_n`` itself), :attr:`Group.scales_units` (positive
monomials ``diag(s) P``), :attr:`Group.permutes_heads` (head permutations),
:attr:`Group.permutes_within_blocks` (``(S_n)^B`` on a stacked axis), :attr:`Group.changes_width`
(splits of units into copies, which widen an axis) and
:attr:`Group.head_block` (the group of each block of a per-head product). A matrix group
(:class:`~symalign.groups.linear.MatrixGroup`) adds what the attention matcher and the
Jacobian probe need of one block: ``block_matcher``, ``relaxation()``, ``key_bias_shift``,
``centring`` and ``rescales_gains``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, ClassVar, Literal, Mapping

import torch
from torch import Tensor

from symalign.errors import GroupError

Variance = Literal["co", "contra"]
Pairing = Literal["half", "interleaved"]
PAIRINGS: tuple[str, ...] = ("half", "interleaved")


Latent = dict[str, Tensor]
"""Latent tensors of one space for learned matching, by suffix (``""``, ``":log"``, ``":e"``...)."""


class Group(ABC):
    """A group acting linearly on a feature space ``R^n`` (see the module docstring)."""

    n: int
    #: The step of whole-model weight matching that solves a space of this group
    #: (:func:`symalign.match.whole.partition`): ``"attention"`` (the two-stage attention matcher:
    #: head permutations and per-head blocks), ``"permutation"`` (a linear assignment, :meth:`fit`),
    #: ``"orthogonal"`` (Procrustes, :meth:`fit`); ``None``: not solved by weight matching.
    matcher: ClassVar[str | None] = None
    #: ``S_n`` itself: every element is a permutation ``perm`` of the axis's entries, ``(T x)_i = x_{perm[i]}``
    #: (an ``int64`` index tensor), and every permutation is an element.
    is_permutation: ClassVar[bool] = False
    #: Elements are positive monomial matrices ``T = diag(s) P`` (``s > 0``): a permutation of the units and
    #: one positive scale per unit (a ReLU's positive homogeneity, ``relu(s z) = s relu(z)``).
    scales_units: ClassVar[bool] = False
    #: Elements permute attention heads: blocks of ``head_dim`` entries, K/V groups onto K/V groups.
    permutes_heads: ClassVar[bool] = False
    #: ``(S_n)^B``: an independent permutation of the units inside each of the ``B`` blocks of a stacked axis 0.
    permutes_within_blocks: ClassVar[bool] = False
    #: Elements map ``n`` units onto ``m >= n`` (splits into copies, :class:`~symalign.groups.SemiPermutation`):
    #: no group acting on one parameter space, so its dimension is 0 and no weight-matching step solves it.
    changes_width: ClassVar[bool] = False

    @property
    def head_block(self) -> Group | None:
        """The group of one block when an element is one matrix per head or K/V group (``T`` block-diagonal,
        :class:`~symalign.groups.product.PerHead`: its ``inner`` matrix group); ``None`` for any other group."""
        return None

    @property
    @abstractmethod
    def dim(self) -> int:
        """Dimension of the group as a manifold (0 for finite groups)."""

    @abstractmethod
    def identity(self, dtype=torch.float64) -> Tensor: ...

    @abstractmethod
    def sample(self, gen: int | torch.Generator | None = None, dtype=torch.float64) -> Tensor:
        """A random element (generic for the group's continuous part)."""

    @abstractmethod
    def compose(self, a: Tensor, b: Tensor) -> Tensor:
        """``b`` first, then ``a``: ``T = T_a T_b``."""

    @abstractmethod
    def inverse(self, a: Tensor) -> Tensor: ...

    @abstractmethod
    def contains(self, a: Tensor, atol: float = 1e-9) -> bool:
        """Whether ``a`` is (numerically) an element of this group."""

    @abstractmethod
    def matrix(self, a: Tensor, rep: str | None = None, size: int | None = None) -> Tensor:
        """Dense ``(size, size)`` matrix ``T`` of ``a`` on an axis (for tests and small problems)."""

    @abstractmethod
    def act(self, a: Tensor, x: Tensor, axis: int, variance: Variance, rep: str | None = None) -> Tensor:
        """Apply ``a`` to ``x`` along ``axis`` (see the module docstring for ``variance``)."""

    def axis_size(self, rep: str | None = None) -> int | None:
        """The size of an axis this group acts on with ``rep`` (``None``: any multiple)."""
        return self.n

    def describe(self) -> str:
        return type(self).__name__

    def note(self, space: str) -> str | None:
        """A diagnostics line for a space of this group in a matching result (``None``: nothing to say)."""
        return None

    # -- what solvers need (see the module docstring) -----------------------
    def _unsupported(self, what: str):
        return GroupError(f"{self.describe()} has no {what}")

    def nearest(self, scores: Tensor) -> Tensor:
        """The element ``g`` maximising ``<T_g, scores>`` (the block step of weight matching)."""
        raise self._unsupported("nearest-element solver")

    def nearest_activations(self, stats: Any) -> Tensor:
        """The element matching B's activations to A's (activation matching), from the paired statistics
        ``stats`` of the rows ``a_n`` (A) and ``b_n`` (B) the space acts on (``stats.cross = sum_n a_n b_n^T``,
        ``stats.correlation()``: Pearson ``corr[i, j]``). Default: ``argmin_g sum_n ||a_n - T_g b_n||^2``
        for a group with ``T^{-T} = T``, i.e. :meth:`nearest` of ``stats.cross`` (Procrustes for ``O(n)``)."""
        return self.nearest(stats.cross)

    def fit(self, pairs: list[tuple[Tensor, Tensor, Variance]]) -> Tensor:
        """The block step of weight matching: ``argmin_g sum_t ||X_A^t - g . X_B^t||^2`` over rows
        ``(X_A, X_B, variance)`` (each ``(n, m)``: the acted-on axis first, float64). Default, for a
        group with ``T^{-T} = T`` (permutations, orthogonal): :meth:`nearest` of ``sum_t X_A X_B^T``."""
        if not pairs:
            raise GroupError("no tensors to fit")
        return self.nearest(sum(xa @ xb.T for xa, xb, _ in pairs))  # type: ignore[arg-type]

    def latent(self, element: Tensor) -> Latent:
        """Float64 latent tensors (learned matching) whose :meth:`from_latent` is ``element``."""
        raise self._unsupported("latent parametrisation for learned matching")

    def soft(self, latent: Mapping[str, Tensor], start: Tensor) -> Any:
        """The differentiable near-element of ``latent`` (computed once per step)."""
        raise self._unsupported("latent parametrisation for learned matching")

    def relaxed(self, latent: Mapping[str, Tensor], start: Tensor, relax: Callable[[Tensor, Tensor], Tensor]) -> Any:
        """:meth:`soft` with every permutation matrix built by ``relax(perm, z)`` instead of the
        straight-through ``P + Z - sg(Z)`` (a soft-permutation relaxation of learned matching; ``perm`` is the
        Hungarian assignment of ``z``). Default: :meth:`soft` (a group without a permutation part)."""
        return self.soft(latent, start)

    def soft_act(self, soft: Any, x: Tensor, axis: int, variance: Variance, rep: str | None = None) -> Tensor:
        """:meth:`soft`'s element acting on ``axis`` of ``x`` (differentiable)."""
        raise self._unsupported("latent parametrisation for learned matching")

    def from_latent(self, latent: Mapping[str, Tensor], start: Tensor,
                    max_cond: float = 1e6) -> tuple[Tensor, list[tuple[int, float]]]:
        """The exact element the (detached) latents stand for, and the blocks that fell back to ``start``
        (index, condition number); only per-block matrix groups have fallbacks."""
        raise self._unsupported("latent parametrisation for learned matching")
