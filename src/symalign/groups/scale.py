"""Positive scalings of units: the positive monomial group ``S_n x (R_{>0})^n`` of a ReLU layer's units."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from symalign.errors import GroupError
from symalign.groups.actions import apply_on_axis
from symalign.groups.assignment import assign_max, one_hot, straight_through
from symalign.groups.base import Latent, Variance
from symalign.groups.newton import pair_costs
from symalign.groups.permutation import Permutation
from symalign.groups.sampling import as_generator


@dataclass(frozen=True)
class PositiveMonomial(Permutation):
    r"""Positive monomial matrices ``S_n x (R_{>0})^n``: ``T = diag(s) P``, ``(T x)_i = s_i x_{perm[i]}``.

    The FF hidden units of a ReLU MLP: ``relu(s z) = s relu(z)`` for ``s > 0``, so
    scaling ``fc_in`` row ``i`` (and its bias) by ``s_i`` and ``fc_out`` column ``i``
    by ``1 / s_i`` is exact (a covariant axis is multiplied by ``T``, a
    contravariant one by ``T^{-T} = diag(1/s) P``).

    An element is a float64 tensor of shape ``(2, n)``: row 0 the permutation
    ``perm`` (integer-valued), row 1 the scales ``s > 0``. A bare permutation
    (``int64`` of shape ``(n,)``, as :class:`Permutation` uses) is accepted
    everywhere as the element with unit scales: ``S_n`` is a subgroup, so a
    permutation-only solver (assignment, activation or learned matching) still
    returns an element. Composition (``b`` first, then ``a``):
    ``diag(s_a) P_a diag(s_b) P_b = diag(s_a * s_b[perm_a]) P_a P_b``, i.e.
    ``(perm_b[perm_a], s_a * s_b[perm_a])``; inverse ``(perm^{-1}, 1 / s[perm^{-1}])``.
    Dimension ``n`` (the scales).

    Representation ``rep="perm"``: the permutation part alone, ``(T x)_i = x_{perm[i]}`` (the homomorphism
    ``diag(s) P -> P``), on tensors the scales do not reach: a BatchNorm's input side -- the convolution
    producing it and its running statistics -- where ``(x - mu) / sqrt(var + eps)`` is not homogeneous, while its
    affine ``w, b`` (covariant) and every reader after a ReLU (contravariant) carry the scales. In a weight-matching
    fit such a tensor adds the scale-free term ``-2 <X_A, P X_B>`` (variance ``"perm"`` in :meth:`fit`'s pairs).
    """

    log_scale: float = 1.0  # sample: s = exp(U(-log_scale, log_scale))
    is_permutation: ClassVar[bool] = False  # S_n is a subgroup (a bare permutation is an element), not the group
    scales_units: ClassVar[bool] = True

    @property
    def dim(self) -> int:
        return self.n

    def parts(self, a: Tensor) -> tuple[Tensor, Tensor]:
        """``(perm, s)`` (``int64``, ``float64``) of an element or of a bare permutation."""
        if a.dim() == 1 and not a.is_floating_point():
            return a, torch.ones(a.shape[0], dtype=torch.float64)
        if a.shape != (2, self.n):
            raise GroupError(f"an element of {self.describe()} is a (2, {self.n}) tensor [perm; scales] or an "
                             f"int64 permutation of length {self.n}; got shape {tuple(a.shape)}")
        return a[0].round().to(torch.int64), a[1].to(torch.float64)

    @staticmethod
    def pack(perm: Tensor, s: Tensor) -> Tensor:
        """The ``(2, n)`` element ``[perm; s]``."""
        return torch.stack([perm.to(torch.float64), s.to(torch.float64)])

    def identity(self, dtype=torch.float64) -> Tensor:
        return self.pack(torch.arange(self.n), torch.ones(self.n, dtype=torch.float64))

    def sample(self, gen=None, dtype=None) -> Tensor:
        g = as_generator(gen)
        perm = torch.randperm(self.n, generator=g)
        u = torch.rand(self.n, generator=g, dtype=torch.float64) * 2 - 1
        return self.pack(perm, (u * self.log_scale).exp())

    def compose(self, a: Tensor, b: Tensor) -> Tensor:
        pa, sa = self.parts(a)
        pb, sb = self.parts(b)
        return self.pack(pb[pa], sa * sb[pa])

    def inverse(self, a: Tensor) -> Tensor:
        p, s = self.parts(a)
        inv = torch.argsort(p)
        return self.pack(inv, 1.0 / s[inv])

    def contains(self, a: Tensor, atol: float = 0.0) -> bool:
        try:
            p, s = self.parts(a)
        except GroupError:
            return False
        if a.is_floating_point() and not bool((a[0] == a[0].round()).all()):
            return False
        return bool(torch.equal(torch.sort(p).values, torch.arange(self.n))) and bool(
            (torch.isfinite(s) & (s > 0)).all())

    def matrix(self, a: Tensor, rep: str | None = None, size: int | None = None) -> Tensor:
        p, s = self.parts(a)
        m = torch.zeros(self.n, self.n, dtype=torch.float64)
        m[torch.arange(self.n), p] = 1.0 if rep == "perm" else s
        return m

    def act(self, a: Tensor, x: Tensor, axis: int, variance: Variance = "co", rep: str | None = None) -> Tensor:
        """``x`` along ``axis``: entry ``i`` becomes ``s_i x_{perm[i]}`` (co) or ``x_{perm[i]} / s_i`` (contra);
        ``x_{perm[i]}`` with ``rep="perm"`` (class docstring); formed in float64 and cast back."""
        p, s = self.parts(a)
        if variance not in ("co", "contra"):
            raise GroupError(f"unknown variance {variance!r}; use 'co' or 'contra'")
        if rep == "perm":
            return x.index_select(axis % x.dim(), p.to(x.device))
        axis = axis % x.dim()
        shape = [1] * x.dim()
        shape[axis] = self.n
        y = x.index_select(axis, p.to(x.device)).to(torch.float64)
        s = s.to(y.device).view(shape)
        y = y * s if variance == "co" else y / s
        return y.to(x.dtype)

    def describe(self) -> str:
        return f"S_{self.n} x R+^{self.n}"

    def nearest(self, scores: Tensor) -> Tensor:
        """The permutation part only (unit scales): the scales need the tensors, not a score matrix
        (:meth:`fit`)."""
        return assign_max(scores)

    def fit(self, pairs: list[tuple[Tensor, Tensor, Variance]], max_scale: float = 1e4) -> Tensor:
        r"""``argmin_{(perm, s)} sum_t ||X_A^t - T X_B^t||^2`` over ``T = diag(s) P``, exactly.

        With ``Q = sum_co X_A X_B^T``, ``T = sum_contra X_A X_B^T`` and the row norms
        ``p_j = sum_co |X_B^j|^2``, ``r_j = sum_contra |X_B^j|^2``, the distance is, up to a constant,
        ``sum_i f_{i, perm[i]}(s_i)`` with ``f_ij(s) = p_j s^2 - 2 Q_ij s + r_j s^{-2} - 2 T_ij s^{-1}``;
        given the pairing the scales separate, so one linear assignment on ``c_ij = min_s f_ij(s)``
        (:func:`pair_costs`) gives the joint minimiser, ``s_i`` the minimiser of the chosen pair.
        Pairs of variance ``"perm"`` (tensors acted on by the permutation alone, ``rep="perm"``) add
        ``-2 U_ij``, ``U = sum_perm X_A X_B^T``, to every pair's cost, whatever its scale.
        """
        n = self.n
        q = torch.zeros(n, n, dtype=torch.float64)
        tt = torch.zeros(n, n, dtype=torch.float64)
        p = torch.zeros(n, dtype=torch.float64)
        r = torch.zeros(n, dtype=torch.float64)
        u = None
        for xa, xb, variance in pairs:
            if variance == "co":
                q += xa @ xb.T
                p += xb.pow(2).sum(1)
            elif variance == "perm":
                u = xa @ xb.T if u is None else u + xa @ xb.T
            else:
                tt += xa @ xb.T
                r += xb.pow(2).sum(1)
        cost, scale = pair_costs(q, tt, p, r, max_scale)
        if u is not None:
            cost = cost - 2.0 * u
        perm = assign_max(-cost)
        return self.pack(perm, scale[torch.arange(n), perm])

    def latent(self, element: Tensor) -> Latent:
        """``Z = P`` and ``log s``."""
        perm, scale = self.parts(element)
        return {"": one_hot(perm), ":log": scale.log()}

    def soft(self, latent, start) -> tuple[Tensor, Tensor, Tensor]:
        """``(diag(s) P_st, diag(1/s) P_st, P_st)``: the matrices of covariant and contravariant axes and of the
        permutation representation (``rep="perm"``)."""
        return self.relaxed(latent, start, straight_through)

    def relaxed(self, latent, start, relax) -> tuple[Tensor, Tensor, Tensor]:
        """``(diag(s) P_r, diag(1/s) P_r, P_r)`` with ``P_r = relax(perm, Z)`` (for a doubly stochastic ``P_r`` the
        contravariant matrix is the same relaxation, not an inverse transpose: the relaxed model is no symmetry)."""
        z = latent[""]
        p_st = relax(assign_max(z.detach()), z)
        scale = latent[":log"].exp()[:, None]
        return scale * p_st, p_st / scale, p_st

    def soft_act(self, soft, x, axis, variance, rep=None) -> Tensor:
        if rep == "perm":
            return apply_on_axis(x, axis, soft[2])
        return apply_on_axis(x, axis, soft[0] if variance == "co" else soft[1])

    def from_latent(self, latent, start, max_cond=1e6):
        return self.pack(assign_max(latent[""].detach()), latent[":log"].detach().exp()), []
