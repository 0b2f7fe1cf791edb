"""Matrix groups stored as dense ``(n, n)`` elements: ``GL(n)``, ``O(n)`` and the signed permutations."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Mapping

import torch
from torch import Tensor

from symalign.groups.actions import apply_on_axis, variance_matrix
from symalign.groups.assignment import assign_max, one_hot
from symalign.groups.base import Group, Latent, Variance
from symalign.groups.polar import polar, polar_st
from symalign.groups.sampling import as_generator, random_orthogonal, random_well_conditioned


class MatrixGroup(Group):
    """A subgroup of ``GL(n)`` whose elements are stored as dense ``(n, n)`` matrices.

    As the group of one block of a per-head space (:class:`~symalign.groups.product.PerHead`) it
    also states what the attention matcher and the Jacobian probe need to know of that block
    (:attr:`block_matcher`, :meth:`relaxation`, :attr:`key_bias_shift`, :attr:`centring`,
    :attr:`rescales_gains`).
    """

    #: How the attention matcher (:mod:`symalign.match`) solves one block of a per-head space of this
    #: group: ``"gl"`` / ``"rope"`` -- stage 2 of the two-stage matcher, over ``GL(d)`` or
    #: ``H(r) (+) GL(d - r)``; ``"signs"``, ``"identity"``, ``"scales"``, ``"signed-permutations"`` -- the
    #: exact optimum over the group itself, on top of the match of its :meth:`relaxation`
    #: (:mod:`symalign.match.qknorm`); ``None``: the attention matcher does not solve it.
    block_matcher: ClassVar[str | None] = None
    #: The Q-K group of a *centring* QK-norm (a LayerNorm on each head's q and k, Phi's ``qk_layernorm``):
    #: adding ``c 1`` to a pre-norm row of a head, or ``1 v^T`` to its rows, leaves the function unchanged.
    centring: ClassVar[bool] = False
    #: The group rescales normalisation gains (``g_q -> c g_q``, ``g_k -> g_k / c``) rather than weights.
    rescales_gains: ClassVar[bool] = False

    @property
    def key_bias_shift(self) -> int:
        """How many directions of a key bias on the contravariant side of this (per-head Q-K) group only add
        one constant to every score of a query, which the softmax ignores: ``q^T (k + b) = q^T k + q^T b``
        on the coordinates that no rotation or later normalisation acts on. 0 unless a group states it."""
        return 0

    def relaxation(self) -> MatrixGroup:
        """The group, containing this one, whose per-block problem the two-stage attention matcher solves
        (:attr:`block_matcher` ``"gl"`` or ``"rope"``); ``self`` unless a group states a wider one."""
        return self

    def identity(self, dtype=torch.float64) -> Tensor:
        return torch.eye(self.n, dtype=dtype)

    def compose(self, a: Tensor, b: Tensor) -> Tensor:
        return a @ b

    def inverse(self, a: Tensor) -> Tensor:
        return torch.linalg.inv(a.to(torch.float64)).to(a.dtype)

    def matrix(self, a: Tensor, rep: str | None = None, size: int | None = None) -> Tensor:
        return a.to(torch.float64)

    def act(self, a: Tensor, x: Tensor, axis: int, variance: Variance, rep: str | None = None) -> Tensor:
        return apply_on_axis(x, axis, variance_matrix(a, variance))

    def _is_invertible(self, a: Tensor) -> bool:
        return a.shape[-2:] == (self.n, self.n) and bool(torch.isfinite(a).all()) and bool(
            (torch.linalg.matrix_rank(a.to(torch.float64)) == self.n).all())

    # -- per-block latents (learned matching inside :class:`PerHead`) ----------
    def block_latent(self, n_blocks: int) -> Latent:
        """Latents of ``n_blocks`` multiplicative corrections ``M`` starting at ``I``."""
        raise self._unsupported("per-block latent parametrisation for learned matching")

    def block_matrix(self, latent: Mapping[str, Tensor]) -> Tensor:
        """The corrections ``M`` ``(n_blocks, n, n)`` of :meth:`block_latent`'s tensors; ``U = U_start M``."""
        raise self._unsupported("per-block latent parametrisation for learned matching")


@dataclass(frozen=True)
class GeneralLinear(MatrixGroup):
    """``GL(n)``: every invertible ``n x n`` matrix. Dimension ``n^2``."""

    n: int
    block_matcher: ClassVar[str | None] = "gl"

    @property
    def key_bias_shift(self) -> int:
        """``n``: without RoPE or QK-norm every coordinate of a key bias shifts a query's scores uniformly."""
        return self.n

    @property
    def dim(self) -> int:
        return self.n * self.n

    def sample(self, gen=None, dtype=torch.float64) -> Tensor:
        return random_well_conditioned(self.n, as_generator(gen), dtype)

    def contains(self, a: Tensor, atol: float = 1e-9) -> bool:
        return self._is_invertible(a)

    def describe(self) -> str:
        return f"GL({self.n})"

    def block_latent(self, n_blocks: int) -> Latent:
        """``E`` (start 0): ``M = I + E``."""
        return {":e": torch.zeros(n_blocks, self.n, self.n, dtype=torch.float64)}

    def block_matrix(self, latent) -> Tensor:
        return torch.eye(self.n, dtype=torch.float64) + latent[":e"]


@dataclass(frozen=True)
class Orthogonal(MatrixGroup):
    """``O(n)``: ``T^T T = I``. Dimension ``n (n - 1) / 2``."""

    n: int
    matcher: ClassVar[str | None] = "orthogonal"

    @property
    def free_dims(self) -> int:
        """Dimension of the subspace the rotations move: ``n`` (less for a subgroup fixing a subspace)."""
        return self.n

    @property
    def dim(self) -> int:
        return self.n * (self.n - 1) // 2

    def sample(self, gen=None, dtype=torch.float64) -> Tensor:
        return random_orthogonal(self.n, as_generator(gen), dtype)

    def inverse(self, a: Tensor) -> Tensor:
        return a.transpose(-2, -1).clone()

    def contains(self, a: Tensor, atol: float = 1e-9) -> bool:
        a = a.to(torch.float64)
        eye = torch.eye(self.n, dtype=torch.float64, device=a.device)
        return a.shape[-2:] == (self.n, self.n) and bool(
            (a.transpose(-2, -1) @ a - eye).abs().max() <= atol)

    def describe(self) -> str:
        return f"O({self.n})"

    def nearest(self, scores: Tensor) -> Tensor:
        """Procrustes: the polar factor of ``scores``."""
        return polar(scores)

    def latent(self, element: Tensor) -> Latent:
        """``R = O`` (``n x n``)."""
        return {"": element.to(torch.float64).clone()}

    def soft(self, latent, start) -> Tensor:
        """``polar_NS(R)`` (Newton-Schulz, :func:`polar_st`)."""
        return polar_st(latent[""])

    def soft_act(self, soft, x, axis, variance, rep=None) -> Tensor:
        return apply_on_axis(x, axis, soft)  # orthogonal: T^{-T} = T

    def from_latent(self, latent, start, max_cond=1e6):
        return polar(latent[""].detach()), []


@dataclass(frozen=True)
class SignedPermutations(MatrixGroup):
    r"""Signed permutation matrices ``T = S P`` (``P`` a permutation, ``S = diag(+-1)``): the V-O group under a clamp.

    An elementwise odd, coordinate-blind map ``c`` (OLMo's ``clip_qkv`` clamp
    ``v -> clamp(v, -c, c)``) commutes with ``T`` exactly when ``T`` is a signed
    permutation: ``clamp(T v) = T clamp(v)``. ``T^{-1} = T^T = T^{-T}``. A finite group
    (dimension 0) of order ``2^n n!``; :meth:`nearest` maximises ``<T, M>`` exactly
    (a linear assignment on ``|M|``, each sign that of its chosen entry).
    """

    n: int
    block_matcher: ClassVar[str | None] = "signed-permutations"

    def relaxation(self) -> MatrixGroup:
        """``GL(n)``: the V-O group without the clamp."""
        return GeneralLinear(self.n)

    @property
    def dim(self) -> int:
        return 0

    def sample(self, gen=None, dtype=torch.float64) -> Tensor:
        g = as_generator(gen)
        perm = torch.randperm(self.n, generator=g)
        s = torch.randint(0, 2, (self.n,), generator=g).to(torch.float64) * 2 - 1
        return (s[:, None] * one_hot(perm)).to(dtype)

    def inverse(self, a: Tensor) -> Tensor:
        return a.transpose(-2, -1).clone()

    def contains(self, a: Tensor, atol: float = 1e-9) -> bool:
        a = a.to(torch.float64)
        if a.shape[-2:] != (self.n, self.n):
            return False
        m = a.abs()
        return bool((((m - 1).abs() <= atol) | (m <= atol)).all()) and bool(
            ((m > 0.5).sum(-1) == 1).all()) and bool(((m > 0.5).sum(-2) == 1).all())

    def describe(self) -> str:
        return f"signed-perm({self.n})"

    def nearest(self, scores: Tensor) -> Tensor:
        """``argmax_T <T, M>``: ``perm = assign(|M|)``, ``T[i, perm[i]] = sign(M[i, perm[i]])`` (``+1`` on ties)."""
        m = scores.to(torch.float64)
        perm = assign_max(m.abs())
        s = torch.where(m[torch.arange(self.n, device=m.device), perm] >= 0, 1.0, -1.0).to(torch.float64)
        return s[:, None] * one_hot(perm)
