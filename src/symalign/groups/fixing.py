r"""Orthogonal subgroups that fix a subspace pointwise (residual streams).

:class:`FixingOrthogonal` is ``{O in O(n): O v = v for every v in S}``. With ``Q``
(``n x k``) an orthonormal basis of ``S^perp`` every element is

    O = I + Q (R - I) Q^T = Q R Q^T + (I - Q Q^T),   R in O(k),

so the group is ``O(k)`` acting on ``S^perp`` and the identity on ``S``. The
constrained Procrustes problem ``max <O, M>`` is ``const + <R, Q^T M Q>``, solved by
``R = polar(Q^T M Q)``. Two instances:

* :class:`CenteredOrthogonal`, ``S = span{1}``: the rotations of a LayerNorm stream
  (they commute with the centring ``C = I - 1 1^T / D``); ``O = Q R Q^T + 1 1^T / D``.
* :func:`stabiliser` of a set of vectors (a fixed sinusoidal table ``p_t`` added to
  the stream, plus ``1`` when the norm centres): only rotations fixing every
  ``p_t`` commute with adding the table, ``O (x + p_t) = O x + p_t``.

Numerical rank rule (:func:`stabiliser`): with ``V`` the vectors as rows (in the
coordinates of ``1^perp`` when ``1`` is fixed as well) and ``V = U diag(s) W^T``
its SVD (``s`` padded with zeros to the width), the free space is spanned by the
``k`` trailing right singular vectors, ``k`` the largest count with

    2 sqrt(s_{n-k+1}^2 + ... + s_n^2) <= tol * min_t ||v_t||      (tol = 1e-12).

Since ``(O - I) v_t = Q (R - I) Q^T v_t`` and ``||Q^T v_t||^2 <= sum_t ||Q^T v_t||^2 =
sum_free s_j^2``, every element then moves every ``v_t`` by at most
``tol ||v_t||`` (relative): directions with tiny but non-zero singular values are
freed only while that bound holds; the others stay fixed. The bound is also
checked directly on ``Q`` (``FixingOrthogonal.error``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from symalign.errors import GroupError
from symalign.groups.base import Latent
from symalign.groups.linear import Orthogonal
from symalign.groups.polar import polar, polar_st
from symalign.groups.sampling import as_generator, random_orthogonal


def centred_basis(n: int) -> Tensor:
    """An orthonormal basis ``Q`` (``n x (n-1)``) of the complement of the all-ones vector."""
    ones = torch.ones(n, 1, dtype=torch.float64) / n ** 0.5
    q, _ = torch.linalg.qr(torch.cat([ones, torch.eye(n, dtype=torch.float64)[:, : n - 1]], dim=1))
    return q[:, 1:]


@dataclass(frozen=True)
class FixingOrthogonal(Orthogonal):
    """``{O in O(n): O = I on S}`` ~ ``O(k)`` on ``S^perp`` (see the module docstring).

    ``free``: an orthonormal basis ``Q`` (``n x k``) of ``S^perp``; ``label`` names ``S``
    (it is what ``describe()`` and equality compare); ``error``: the largest relative
    displacement ``||O v - v|| / ||v||`` that any element causes on the vectors ``S``
    was computed from (0 when ``S`` is exact by construction).
    """

    n: int
    free: Tensor | None = field(default=None, compare=False, repr=False)
    label: str = ""
    error: float = field(default=0.0, compare=False)

    def __post_init__(self):
        q = self.free
        if q is None or q.dim() != 2 or q.shape[0] != self.n or q.shape[1] < 1:
            raise GroupError(f"FixingOrthogonal({self.n}) needs an orthonormal basis of shape ({self.n}, k >= 1) "
                             "of the free subspace")
        q = q.to(torch.float64)
        if float((q.T @ q - torch.eye(q.shape[1], dtype=torch.float64)).abs().max()) > 1e-10:
            raise GroupError("the basis of the free subspace must have orthonormal columns")
        object.__setattr__(self, "free", q)

    def note(self, space: str) -> str | None:
        """The restriction: rotations act on the free subspace only."""
        return (f"{space}: {self.describe()}: rotations act on a {self.k}-dimensional subspace only "
                f"({self.n - self.k} of {self.n} dimensions fixed; fixed vectors move by <= {self.error:.1e} relative)")

    @property
    def k(self) -> int:
        """Dimension of the free subspace ``S^perp``."""
        return int(self.free.shape[1])  # type: ignore[union-attr]

    @property
    def free_dims(self) -> int:
        """``k``: the rotations move ``S^perp`` only."""
        return self.k

    @property
    def dim(self) -> int:
        return self.k * (self.k - 1) // 2

    def embed(self, r: Tensor) -> Tensor:
        """``O = I + Q (R - I) Q^T`` for ``R`` (``k x k``); differentiable in ``R``."""
        q = self.free.to(r.dtype)  # type: ignore[union-attr]
        eye_k = torch.eye(self.k, dtype=r.dtype)
        return torch.eye(self.n, dtype=r.dtype) + q @ (r - eye_k) @ q.T

    def reduce(self, o: Tensor) -> Tensor:
        """``R = Q^T O Q`` (inverse of :meth:`embed` on the group)."""
        q = self.free
        return q.T @ o.to(torch.float64) @ q  # type: ignore[union-attr]

    def sample(self, gen=None, dtype=torch.float64) -> Tensor:
        return self.embed(random_orthogonal(self.k, as_generator(gen))).to(dtype)

    def contains(self, a: Tensor, atol: float = 1e-9) -> bool:
        if not super().contains(a, atol):
            return False
        q = self.free
        fixed = torch.eye(self.n, dtype=torch.float64) - q @ q.T  # type: ignore[union-attr]
        return bool(((a.to(torch.float64) - torch.eye(self.n, dtype=torch.float64)) @ fixed).abs().max() <= atol)

    def solve(self, m: Tensor) -> Tensor:
        """``argmax <O, m>`` over the group: ``embed(polar(Q^T m Q))``."""
        return self.embed(polar(self.reduce(m)))

    def nearest(self, scores: Tensor) -> Tensor:
        return self.solve(scores)

    def latent(self, element: Tensor) -> Latent:
        """``R = Q^T O Q`` (``k x k``)."""
        return {"": self.reduce(element)}

    def soft(self, latent, start) -> Tensor:
        """``I + Q (polar_NS(R) - I) Q^T``."""
        return self.embed(polar_st(latent[""]))

    def from_latent(self, latent, start, max_cond=1e6):
        return self.embed(polar(latent[""].detach())), []

    def describe(self) -> str:
        return f"O({self.k}) fixing {self.n - self.k} of {self.n} dims ({self.label})"


@dataclass(frozen=True)
class CenteredOrthogonal(FixingOrthogonal):
    """``{O in O(n): O 1 = 1}`` ~ ``O(n - 1)``: rotations of the centred subspace. Dimension ``(n-1)(n-2)/2``."""

    n: int
    free: Tensor | None = field(default=None, compare=False, repr=False)
    label: str = "1"

    def __post_init__(self):
        object.__setattr__(self, "free", centred_basis(self.n))

    def describe(self) -> str:
        return f"O_1({self.n})"


def stabiliser(vectors: Tensor, *, fix_ones: bool = False, tol: float = 1e-12,
               label: str = "") -> FixingOrthogonal | None:
    """The rotations fixing every row of ``vectors`` (``m x n``), and ``1`` if ``fix_ones``.

    The free space follows the numerical rank rule of the module docstring, so that
    every element moves every row ``v_t`` by at most ``tol ||v_t||``. Returns ``None``
    when no direction is free (the group is trivial).
    """
    v = vectors.detach().to(torch.float64)
    if v.dim() != 2:
        raise GroupError(f"the vectors to fix must be a matrix (rows), got shape {tuple(v.shape)}")
    n = v.shape[1]
    norms = v.norm(dim=1)
    v = v[norms > 0]
    base = centred_basis(n) if fix_ones else torch.eye(n, dtype=torch.float64)
    width = base.shape[1]
    if width == 0:
        return None
    if v.shape[0] == 0:
        q, err = base, 0.0
    else:
        _, s, wh = torch.linalg.svd(v @ base, full_matrices=True)
        s = torch.cat([s, torch.zeros(width - s.numel(), dtype=torch.float64)])
        budget = tol * float(norms[norms > 0].min())
        tail = 2 * s.flip(0).pow(2).cumsum(0).sqrt()  # tail[k-1]: bound with the k smallest directions free
        k = int((tail <= budget).sum())  # tail is non-decreasing: the largest admissible k
        while True:
            if k == 0:
                return None
            q = base @ wh[width - k:].T
            err = float((2 * (v @ q).norm(dim=1) / v.norm(dim=1)).max())
            if err <= tol:
                break
            k -= 1
    name = label or f"{v.shape[0]} vectors" + (" and 1" if fix_ones else "")
    return FixingOrthogonal(n, q, name, err)
