r"""Symmetry groups and their exact actions on weight tensors.

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
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Mapping

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment
from torch import Tensor

from symalign.errors import GroupError

Variance = Literal["co", "contra"]
Pairing = Literal["half", "interleaved"]
PAIRINGS: tuple[str, ...] = ("half", "interleaved")


# ----------------------------------------------------------------------------
# Helpers shared by every group
# ----------------------------------------------------------------------------


def _generator(seed_or_gen: int | torch.Generator | None) -> torch.Generator:
    if isinstance(seed_or_gen, torch.Generator):
        return seed_or_gen
    g = torch.Generator()
    g.manual_seed(0 if seed_or_gen is None else int(seed_or_gen))
    return g


def random_orthogonal(n: int, gen: torch.Generator, dtype=torch.float64, batch: tuple[int, ...] = ()) -> Tensor:
    """Haar-distributed orthogonal matrices of shape ``(*batch, n, n)`` (QR with sign fix)."""
    a = torch.randn(*batch, n, n, generator=gen, dtype=torch.float64)
    q, r = torch.linalg.qr(a)
    d = torch.diagonal(r, dim1=-2, dim2=-1).sign()
    d = torch.where(d == 0, torch.ones_like(d), d)
    return (q * d.unsqueeze(-2)).to(dtype)


def random_well_conditioned(n: int, gen: torch.Generator, dtype=torch.float64, batch: tuple[int, ...] = (),
                            log_scale: float = 0.5) -> Tensor:
    """Random invertible ``Q1 diag(exp(s)) Q2`` with ``s ~ U(-log_scale, log_scale)``.

    The condition number is at most ``exp(2 log_scale)``; the distribution has full
    support on a neighbourhood of every orthogonal matrix, so it is generic in GL(n).
    """
    q1 = random_orthogonal(n, gen, torch.float64, batch)
    q2 = random_orthogonal(n, gen, torch.float64, batch)
    s = (torch.rand(*batch, n, generator=gen, dtype=torch.float64) * 2 - 1) * log_scale
    return ((q1 * s.exp().unsqueeze(-2)) @ q2).to(dtype)


def rotary_pairs(n: int, pairing: str) -> tuple[Tensor, Tensor]:
    """Indices ``(j0, j1)`` of the rotation planes of a rotary width ``n``.

    ``"half"`` (Llama/NeoX ``rotate_half``): plane ``j`` is ``(j, j + n/2)``.
    ``"interleaved"`` (GPT-J/RoFormer): plane ``j`` is ``(2j, 2j + 1)``.
    """
    if n % 2:
        raise GroupError(f"the rotated width must be even, got {n}")
    if pairing == "half":
        j0 = torch.arange(n // 2)
        return j0, j0 + n // 2
    if pairing == "interleaved":
        j0 = torch.arange(0, n, 2)
        return j0, j0 + 1
    raise GroupError(f"unknown rotary pairing {pairing!r}; use one of {PAIRINGS}")


def rotary_block_matrix(a: Tensor, b: Tensor, n: int, pairing: str, rest: Tensor | None = None) -> Tensor:
    """Matrix of the element with complex scalars ``c_j = a_j + i b_j`` on the planes.

    ``a, b`` have shape ``(*batch, r/2)``; the block on plane ``(j0, j1)`` is
    ``[[a, -b], [b, a]]`` (so that, writing a plane of a column vector as
    ``z = x_{j0} + i x_{j1}``, the action is ``z -> c z``). ``rest`` is an optional
    ``(*batch, n - r, n - r)`` block acting on the unrotated dimensions ``r..n``.
    """
    r = 2 * a.shape[-1]
    batch = a.shape[:-1]
    out = torch.zeros(*batch, n, n, dtype=a.dtype)
    j0, j1 = rotary_pairs(r, pairing)
    out[..., j0, j0] = a
    out[..., j1, j1] = a
    out[..., j0, j1] = -b
    out[..., j1, j0] = b
    if r < n:
        if rest is None:
            raise GroupError("a partial rotary element needs the block on the unrotated dimensions")
        out[..., r:, r:] = rest
    return out


def apply_on_axis(x: Tensor, axis: int, mat: Tensor, repeat: int = 1) -> Tensor:
    """Multiply ``x`` along ``axis`` by ``mat``: ``x'[.., i, ..] = sum_j mat[i, j] x[.., j, ..]``.

    ``mat`` is either dense ``(n, n)`` or block-diagonal ``(nb, d, d)``; in the latter
    case the axis has ``nb * repeat * d`` entries and block ``k`` acts on each of its
    ``repeat`` consecutive sub-blocks of size ``d`` (GQA: one K/V transform shared by
    the query heads of its group). The product is formed in float64 and cast back.

    A stacked tensor (three axes, ``mat`` dense, ``axis`` not the first: the experts of a mixture of
    experts, ``(E, 2F, D)``) is multiplied one slice of its first axis at a time into a result allocated once,
    so the float64 temporaries are those of one slice (an expert), not of the whole tensor.
    """
    if x.dim() == 3 and mat.dim() == 2 and axis % x.dim() != 0:
        if mat.shape[0] != x.shape[axis]:
            raise GroupError(f"axis {axis} has {x.shape[axis]} entries but the group acts on {mat.shape[0]}")
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        for e in range(x.shape[0]):
            out[e] = apply_on_axis(x[e], axis % x.dim() - 1, mat, repeat)
        return out
    dtype = x.dtype
    xd = torch.movedim(x, axis, 0).to(torch.float64)
    shape = xd.shape
    m = mat.to(torch.float64)
    if m.dim() == 2:
        if m.shape[0] != shape[0]:
            raise GroupError(f"axis {axis} has {shape[0]} entries but the group acts on {m.shape[0]}")
        out = (m @ xd.reshape(shape[0], -1)).reshape(shape)
    else:
        nb, d, _ = m.shape
        if shape[0] != nb * repeat * d:
            raise GroupError(f"axis {axis} has {shape[0]} entries, expected {nb}x{repeat}x{d}")
        xb = xd.reshape(nb, repeat, d, -1)
        out = torch.einsum("kij,krjc->kric", m, xb).reshape(shape)
    return torch.movedim(out.to(dtype), 0, axis)


def assign_max(c: Tensor) -> Tensor:
    """``perm`` maximising ``sum_i c[i, perm[i]]`` (int64; ``scipy.optimize.linear_sum_assignment``)."""
    _, col = linear_sum_assignment(c.detach().cpu().numpy().astype(np.float64), maximize=True)
    return torch.as_tensor(col, dtype=torch.int64)


def one_hot(perm: Tensor, dtype=torch.float64) -> Tensor:
    """The permutation matrix ``P[i, perm[i]] = 1`` (``(P x)_i = x_{perm[i]}``)."""
    n = perm.numel()
    m = torch.zeros(n, n, dtype=dtype)
    m[torch.arange(n), perm] = 1.0
    return m


def straight_through(perm: Tensor, z: Tensor) -> Tensor:
    """``P + Z - sg(Z)``: the permutation matrix of ``perm`` with the gradient of ``z``."""
    return one_hot(perm, z.dtype) + z - z.detach()


def polar(m: Tensor) -> Tensor:
    """The orthogonal polar factor ``U V^T`` of ``m = U S V^T`` (argmax of ``<O, m>`` over ``O(n)``)."""
    u, _, vh = torch.linalg.svd(m.to(torch.float64))
    return u @ vh


def polar_st(z: Tensor, iters: int = 30) -> Tensor:
    """Differentiable polar factor of ``z`` by Newton-Schulz: ``X <- X (3 I - X^T X) / 2``.

    ``z`` is first scaled by its (detached) spectral norm so every singular value is in
    ``(0, 1]``, where the iteration converges to ``U V^T``. Unlike the SVD's backward,
    whose ``1 / (s_i^2 - s_j^2)`` terms are infinite at an orthogonal ``z`` (all ``s = 1``,
    exactly the weight-matching initialisation), its gradient is finite.
    """
    x = z / torch.linalg.matrix_norm(z.detach(), 2).clamp_min(1e-300)
    eye = torch.eye(z.shape[-1], dtype=z.dtype)
    for _ in range(iters):
        x = 0.5 * x @ (3 * eye - x.T @ x)
    return x


def condition(u: Tensor) -> Tensor:
    """2-norm condition number per block (``inf`` for singular blocks)."""
    s = torch.linalg.svdvals(u)
    return s[..., 0] / s[..., -1]


# positive monomials (ReLU units): the exact block minimiser of weight matching

def scale_objective(s: Tensor, p: Tensor, q: Tensor, r: Tensor, t: Tensor) -> Tensor:
    """``f(s) = p s^2 - 2 q s + r s^{-2} - 2 t s^{-1}`` (broadcast; ``s > 0``)."""
    return p * s * s - 2 * q * s + r / (s * s) - 2 * t / s


def positive_scales(p: Tensor, q: Tensor, r: Tensor, t: Tensor, max_scale: float = 1e4,
                    polish: int = 3) -> Tensor:
    r"""Batched ``argmin_{s in [1/max_scale, max_scale]} f(s)`` of :func:`scale_objective`, per entry.

    With ``p = |w_in|^2``, ``q = <w_in, a_in>``, ``r = |w_out|^2``, ``t = <w_out, a_out>``
    this is ``argmin_s ||s w_in - a_in||^2 + ||w_out / s - a_out||^2`` (up to a constant).
    ``f'(s) = 0`` is the quartic ``p s^4 - q s^3 + t s - r = 0``. For ``p, r > 0`` it is
    solved in the scaled variable ``x = s / s0``, ``s0 = (r/p)^{1/4}``:
    ``x^4 - (q s0^3 / r) x^3 + (t s0 / r) x - 1 = 0``, whose four roots are formed in closed
    form (:func:`quartic_roots`, Ferrari's method in real arithmetic: elementwise, so the
    ``n^2`` problems of :func:`pair_costs` cost a few dozen vector operations, not ``n^2``
    eigenvalue problems; when ``|a3| > |a1|`` the reciprocal quartic, whose roots are ``1/x``, is the
    better conditioned one and is used); each positive candidate is polished by ``polish`` Newton
    steps. ``f`` may have two local minima (``q, t > 0``), so every candidate --
    the stationary points, the closed forms of the degenerate cases (``r = 0``:
    ``s = q/p``; ``p = 0``: ``s = r/t``) and both bounds -- is evaluated, and the one
    with the least ``f`` is returned. The bounds are meant for degenerate units (all
    in- or out-weights zero), where ``f`` has no interior minimum.

    Args: 1-D float tensors of equal length. Returns: float64 scales, same length.
    """
    p, q, r, t = (x.to(torch.float64) for x in (p, q, r, t))
    lo, hi = 1.0 / max_scale, float(max_scale)
    both = (p > 0) & (r > 0)
    ps, rs = torch.where(both, p, torch.ones_like(p)), torch.where(both, r, torch.ones_like(r))
    s0 = (rs / ps) ** 0.25
    a3, a1 = -q * s0 ** 3 / rs, t * s0 / rs
    # x is a root iff 1/x is a root of v^4 - a1 v^3 - a3 v - 1 (the same form): the closed form is taken for
    # whichever of the two has the smaller cubic coefficient (a large one cancels catastrophically in it)
    flip = a3.abs() > a1.abs()
    x = quartic_roots(torch.where(flip, -a1, a3), torch.where(flip, -a3, a1))
    x = torch.where(flip[:, None], 1.0 / torch.where(x != 0, x, torch.full_like(x, float("nan"))), x)
    x = _newton(x, a3[:, None], a1[:, None], polish)
    roots = torch.where(both[:, None] & (x > 0), s0[:, None] * x, torch.full_like(x, float("nan")))
    degenerate = torch.where((r == 0) & (p > 0) & (q > 0), q / torch.where(p > 0, p, torch.ones_like(p)),
                             torch.where((p == 0) & (r > 0) & (t > 0), r / torch.where(t > 0, t, torch.ones_like(t)),
                                         torch.ones_like(p)))
    cand = torch.cat([roots, degenerate[:, None], torch.full_like(p, lo)[:, None], torch.full_like(p, hi)[:, None]],
                     dim=1).clamp(lo, hi)
    f = scale_objective(cand, p[:, None], q[:, None], r[:, None], t[:, None])
    f = torch.where(torch.isnan(cand), torch.full_like(f, float("inf")), f)
    best = f.argmin(dim=1, keepdim=True)
    out = cand.gather(1, best).squeeze(1)
    # Near its minimum f is flat (f - f_min ~ (s - s*)^2), so it cannot rank candidates closer than
    # ~sqrt(eps): polish the chosen stationary point once more on the quartic itself -- an interior one only
    # (from a root clamped to a bound Newton would leave the bound for a worse point), and only if f does not rise
    # beyond rounding.
    is_root = (best.squeeze(1) < roots.shape[1]) & (out > lo) & (out < hi)
    x = _newton((out / s0)[:, None], a3[:, None], a1[:, None], polish).squeeze(1)
    polished = (s0 * x).clamp(lo, hi)
    size = p * out * out + (2 * q * out).abs() + r / (out * out) + (2 * t / out).abs()  # f's rounding scale
    keep = is_root & (scale_objective(polished, p, q, r, t) <= scale_objective(out, p, q, r, t) + 1e-12 * size)
    return torch.where(keep, polished, out)


def quartic_roots(a3: Tensor, a1: Tensor) -> Tensor:
    r"""Candidates for the real roots of ``x^4 + a3 x^3 + a1 x - 1``, ``(N, 4)`` float64, per entry (Ferrari,
    in real arithmetic): every real root, and the real part of each complex pair.

    ``x = y - a3/4`` gives the depressed quartic ``y^4 + P y^2 + Q y + R`` with ``P = -3 a3^2/8``,
    ``Q = a3^3/8 + a1``, ``R = -3 a3^4/256 - a3 a1/4 - 1``. For a root ``m`` of the resolvent cubic
    ``c(m) = m^3 + P m^2 + (P^2/4 - R) m - Q^2/8`` the quartic is ``(y^2 + P/2 + m)^2 - 2m (y - Q/(4m))^2``,
    so with ``w = sqrt(2m)`` the roots are ``y = (s w +- sqrt(-(2P + 2m + 2 s Q / w))) / 2``, ``s = +-1``.
    ``c(0) = -Q^2/8 <= 0`` and ``c`` grows without bound, so its largest real root is ``m >= 0``: taken
    (Cardano with real cube roots when ``c`` has one real root, the trigonometric form when it has three),
    ``w`` is real and each ``s`` gives two real roots or a complex pair with real part ``s w / 2``.
    ``m = 0`` (``Q = 0``) is the biquadratic ``y^2 = (-P +- sqrt(P^2 - 4R)) / 2``. Elementwise, so the ``n^2``
    problems of :func:`pair_costs` cost a few dozen vector operations; :func:`positive_scales` polishes each
    candidate with Newton steps on the quartic itself and keeps the best by the objective."""
    b, d = a3.to(torch.float64), a1.to(torch.float64)
    pp = -0.375 * b * b
    qq = b * b * b / 8 + d
    rr = -3.0 * b ** 4 / 256 - b * d / 4 - 1.0
    # resolvent cubic m^3 + A m^2 + B m + C, depressed by m = z - A/3: z^3 + P z + Q' = 0
    A, B, C = pp, pp * pp / 4 - rr, -qq * qq / 8
    P = B - A * A / 3
    Q = 2 * A ** 3 / 27 - A * B / 3 + C
    disc = Q * Q / 4 + P ** 3 / 27
    sq = torch.sqrt(disc.clamp_min(0))
    one = torch.sign(-Q) * (Q.abs() / 2 + sq)  # the larger-modulus Cardano term: no cancellation
    u = torch.sign(one) * one.abs() ** (1.0 / 3)
    z_one = torch.where(u != 0, u - P / (3 * torch.where(u != 0, u, torch.ones_like(u))), torch.zeros_like(u))
    neg = torch.where(P < 0, P, -torch.ones_like(P))
    cos_arg = (1.5 * Q / neg * torch.sqrt(-3.0 / neg)).clamp(-1.0, 1.0)
    z_three = 2 * torch.sqrt(-neg / 3) * torch.cos(torch.acos(cos_arg) / 3)  # the largest of three real roots
    z = torch.where((disc > 0) | (P >= 0), z_one, z_three)
    m = (z - A / 3).clamp_min(0)
    w = torch.sqrt(2 * m)
    safe_w = torch.where(w > 0, w, torch.ones_like(w))
    out = []
    for s in (1.0, -1.0):
        arg = -(2 * pp + 2 * m + 2 * s * qq / safe_w)
        root = torch.sqrt(arg.clamp_min(0))
        out += [(s * w + root) / 2, (s * w - root) / 2]
    bi = torch.sqrt((pp * pp - 4 * rr).clamp_min(0))  # m = 0: y^2 = (-P +- sqrt(P^2 - 4R)) / 2
    y2 = torch.stack([(-pp + bi) / 2, (-pp - bi) / 2], dim=1).clamp_min(0).sqrt()
    bi_roots = torch.cat([y2, -y2], dim=1)
    roots = torch.where((w > 0)[:, None], torch.stack(out, dim=1), bi_roots)
    return roots - b[:, None] / 4


def _newton(x: Tensor, a3: Tensor, a1: Tensor, steps: int) -> Tensor:
    """Newton steps on ``h(x) = x^4 + a3 x^3 + a1 x - 1`` (a step that would make ``x <= 0`` is skipped)."""
    for _ in range(steps):
        h = ((x + a3) * x * x + a1) * x - 1.0
        dh = (4 * x + 3 * a3) * x * x + a1
        step = torch.where(dh != 0, h / torch.where(dh != 0, dh, torch.ones_like(dh)), torch.zeros_like(h))
        x = torch.where(x - step > 0, x - step, x)
    return x


def pair_costs(q: Tensor, tt: Tensor, p: Tensor, r: Tensor, max_scale: float = 1e4,
               chunk: int = 1 << 16) -> tuple[Tensor, Tensor]:
    r"""``(cost, scale)``, both ``(n, n)``: for every pairing of unit ``i`` of A with unit ``j`` of B,
    ``scale[i, j] = argmin_s f_ij(s)`` and ``cost[i, j] = f_ij(scale[i, j])``, where
    ``f_ij(s) = p_j s^2 - 2 Q_ij s + r_j s^{-2} - 2 T_ij s^{-1}`` (:func:`scale_objective`, minimised
    exactly by :func:`positive_scales`; ``n^2`` scalar problems, batched ``chunk`` at a time)."""
    n = q.shape[0]
    pf, rf = p[None, :].expand(n, n).reshape(-1), r[None, :].expand(n, n).reshape(-1)
    qf, tf = q.reshape(-1), tt.reshape(-1)
    s = torch.cat([positive_scales(pf[k:k + chunk], qf[k:k + chunk], rf[k:k + chunk], tf[k:k + chunk], max_scale)
                   for k in range(0, n * n, chunk)]) if n else torch.zeros(0, dtype=torch.float64)
    return scale_objective(s, pf, qf, rf, tf).reshape(n, n), s.reshape(n, n)


Latent = dict[str, Tensor]
"""Latent tensors of one space for learned matching, by suffix (``""``, ``":log"``, ``":e"``...)."""


# ----------------------------------------------------------------------------
# The abstract group
# ----------------------------------------------------------------------------


class Group(ABC):
    """A group acting linearly on a feature space ``R^n`` (see the module docstring)."""

    n: int
    #: The step of whole-model weight matching that solves a space of this group
    #: (:func:`symalign.match.whole.partition`): ``"attention"`` (the two-stage attention matcher:
    #: head permutations and per-head blocks), ``"permutation"`` (a linear assignment, :meth:`fit`),
    #: ``"orthogonal"`` (Procrustes, :meth:`fit`); ``None``: not solved by weight matching.
    matcher: ClassVar[str | None] = None

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

    def soft_act(self, soft: Any, x: Tensor, axis: int, variance: Variance, rep: str | None = None) -> Tensor:
        """:meth:`soft`'s element acting on ``axis`` of ``x`` (differentiable)."""
        raise self._unsupported("latent parametrisation for learned matching")

    def from_latent(self, latent: Mapping[str, Tensor], start: Tensor,
                    max_cond: float = 1e6) -> tuple[Tensor, list[tuple[int, float]]]:
        """The exact element the (detached) latents stand for, and the blocks that fell back to ``start``
        (index, condition number); only per-block matrix groups have fallbacks."""
        raise self._unsupported("latent parametrisation for learned matching")


# ----------------------------------------------------------------------------
# Permutations
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Permutation(Group):
    """The symmetric group ``S_n`` acting by ``(T x)_i = x_{perm[i]}``."""

    n: int
    matcher: ClassVar[str | None] = "permutation"

    @property
    def dim(self) -> int:
        return 0

    def identity(self, dtype=torch.int64) -> Tensor:
        return torch.arange(self.n)

    def sample(self, gen=None, dtype=None) -> Tensor:
        return torch.randperm(self.n, generator=_generator(gen))

    def compose(self, a: Tensor, b: Tensor) -> Tensor:
        return b[a]

    def inverse(self, a: Tensor) -> Tensor:
        return torch.argsort(a)

    def contains(self, a: Tensor, atol: float = 0.0) -> bool:
        return a.shape == (self.n,) and not a.is_floating_point() and bool(
            torch.equal(torch.sort(a).values, torch.arange(self.n)))

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
        z = latent[""]
        return straight_through(assign_max(z.detach()), z)

    def soft_act(self, soft, x, axis, variance, rep=None) -> Tensor:
        return apply_on_axis(x, axis, soft)  # a permutation matrix: T^{-T} = T

    def from_latent(self, latent, start, max_cond=1e6):
        return assign_max(latent[""].detach()), []


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
    """

    log_scale: float = 1.0  # sample: s = exp(U(-log_scale, log_scale))

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
        g = _generator(gen)
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
        m[torch.arange(self.n), p] = s
        return m

    def act(self, a: Tensor, x: Tensor, axis: int, variance: Variance = "co", rep: str | None = None) -> Tensor:
        """``x`` along ``axis``: entry ``i`` becomes ``s_i x_{perm[i]}`` (co) or ``x_{perm[i]} / s_i`` (contra);
        formed in float64 and cast back."""
        p, s = self.parts(a)
        if variance not in ("co", "contra"):
            raise GroupError(f"unknown variance {variance!r}; use 'co' or 'contra'")
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
        """
        n = self.n
        q = torch.zeros(n, n, dtype=torch.float64)
        tt = torch.zeros(n, n, dtype=torch.float64)
        p = torch.zeros(n, dtype=torch.float64)
        r = torch.zeros(n, dtype=torch.float64)
        for xa, xb, variance in pairs:
            if variance == "co":
                q += xa @ xb.T
                p += xb.pow(2).sum(1)
            else:
                tt += xa @ xb.T
                r += xb.pow(2).sum(1)
        cost, scale = pair_costs(q, tt, p, r, max_scale)
        perm = assign_max(-cost)
        return self.pack(perm, scale[torch.arange(n), perm])

    def latent(self, element: Tensor) -> Latent:
        """``Z = P`` and ``log s``."""
        perm, scale = self.parts(element)
        return {"": one_hot(perm), ":log": scale.log()}

    def soft(self, latent, start) -> tuple[Tensor, Tensor]:
        """``(diag(s) P_st, diag(1/s) P_st)``: the matrices of covariant and contravariant axes."""
        z = latent[""]
        p_st = straight_through(assign_max(z.detach()), z)
        scale = latent[":log"].exp()[:, None]
        return scale * p_st, p_st / scale

    def soft_act(self, soft, x, axis, variance, rep=None) -> Tensor:
        return apply_on_axis(x, axis, soft[0] if variance == "co" else soft[1])

    def from_latent(self, latent, start, max_cond=1e6):
        return self.pack(assign_max(latent[""].detach()), latent[":log"].detach().exp()), []


# ----------------------------------------------------------------------------
# Matrix groups: GL, O, and the RoPE plane group H
# ----------------------------------------------------------------------------


class MatrixGroup(Group):
    """A subgroup of ``GL(n)`` whose elements are stored as dense ``(n, n)`` matrices."""

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


def variance_matrix(t: Tensor, variance: Variance) -> Tensor:
    """``T`` for a covariant axis, ``T^{-T}`` for a contravariant one (batched over leading dims)."""
    t = t.to(torch.float64)
    if variance == "co":
        return t
    if variance == "contra":
        return torch.linalg.inv(t).transpose(-2, -1)
    raise GroupError(f"unknown variance {variance!r}; use 'co' or 'contra'")


@dataclass(frozen=True)
class GeneralLinear(MatrixGroup):
    """``GL(n)``: every invertible ``n x n`` matrix. Dimension ``n^2``."""

    n: int

    @property
    def dim(self) -> int:
        return self.n * self.n

    def sample(self, gen=None, dtype=torch.float64) -> Tensor:
        return random_well_conditioned(self.n, _generator(gen), dtype)

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
    def dim(self) -> int:
        return self.n * (self.n - 1) // 2

    def sample(self, gen=None, dtype=torch.float64) -> Tensor:
        return random_orthogonal(self.n, _generator(gen), dtype)

    def inverse(self, a: Tensor) -> Tensor:
        return a.transpose(-2, -1).clone()

    def contains(self, a: Tensor, atol: float = 1e-9) -> bool:
        a = a.to(torch.float64)
        eye = torch.eye(self.n, dtype=torch.float64)
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

    def from_planes(self, a: Tensor, b: Tensor, rest: Tensor | None = None) -> Tensor:
        """Element from per-plane ``(a, b)`` of shape ``(*batch, r/2)`` and the GL block."""
        return rotary_block_matrix(a, b, self.n, self.pairing, rest)

    def planes(self, t: Tensor) -> tuple[Tensor, Tensor]:
        """The complex scalars ``(a, b)`` of an element, shape ``(*batch, r/2)``."""
        j0, j1 = rotary_pairs(self.r, self.pairing)
        return t[..., j0, j0], t[..., j1, j0]

    def sample(self, gen=None, dtype=torch.float64) -> Tensor:
        g = _generator(gen)
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


# ----------------------------------------------------------------------------
# Head-structured groups
# ----------------------------------------------------------------------------


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
        g = _generator(gen)
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
        if not torch.equal(torch.sort(a).values, torch.arange(self.n_heads)):
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
        return (blocks.view(-1, 1) * d + torch.arange(d)).reshape(-1)

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
        c = cost.detach().cpu().numpy().astype(np.float64)
        g, kv = self.group_size, self.kv
        if g == 1:
            return torch.as_tensor(linear_sum_assignment(c)[1], dtype=torch.int64)
        c4 = c.reshape(kv, g, kv, g)
        cg = np.empty((kv, kv))
        taus = np.empty((kv, kv, g), dtype=np.int64)
        for k in range(kv):
            for l_ in range(kv):
                r, col = linear_sum_assignment(c4[k, :, l_, :])
                cg[k, l_] = c4[k, r, l_, col].sum()
                taus[k, l_] = col
        sigma = linear_sum_assignment(cg)[1]
        tau = torch.as_tensor(np.stack([taus[k, sigma[k]] for k in range(kv)]))
        return self.from_parts(torch.as_tensor(sigma, dtype=torch.int64), tau)

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
        z = latent[""]
        pi = self.nearest(z.detach())
        pq = straight_through(pi, z)
        pkv = pq
        if self.group_size > 1:
            pkv = straight_through(self.kv_permutation(pi), self._kv_latent(z))
        return pq, pkv

    def soft_act(self, soft, x, axis, variance, rep=None) -> Tensor:
        p = soft[1] if rep == "kv" else soft[0]
        return apply_on_axis(x, axis, p if rep == "head" else torch.kron(p, torch.eye(self.head_dim, dtype=p.dtype)))

    def from_latent(self, latent, start, max_cond=1e6):
        return self.nearest(latent[""].detach()), []


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
    def n(self) -> int:  # type: ignore[override]
        return self.n_blocks * self.inner.n

    @property
    def dim(self) -> int:
        return self.n_blocks * self.inner.dim

    def identity(self, dtype=torch.float64) -> Tensor:
        return torch.eye(self.inner.n, dtype=dtype).expand(self.n_blocks, -1, -1).clone()

    def sample(self, gen=None, dtype=torch.float64) -> Tensor:
        g = _generator(gen)
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

# ----------------------------------------------------------------------------
# QK-norm groups (see docs/symmetry.md, "QK-norm")
# ----------------------------------------------------------------------------


def _plane_of(n: int, pairing: str, r: int, proportional: bool = False) -> Tensor:
    """``plane[j]``: the index of the RoPE plane (or unrotated coordinate) holding dimension ``j``.

    Rotated planes come first (``0 .. r/2 - 1``), then the unrotated coordinates in order.
    Partial RoPE rotates the first ``r`` dimensions in the planes of width ``r``
    (``rotary_pairs(r, pairing)``); ``proportional`` RoPE (transformers'
    ``rope_type="proportional"``) keeps the planes of the whole head
    (``rotary_pairs(n, pairing)``) and turns only the first ``r/2`` of them (the others have
    frequency zero), so with ``"half"`` pairing plane ``k < r/2`` is ``(k, k + n/2)``.
    """
    out = torch.empty(n, dtype=torch.long)
    j0, j1 = rotary_pairs(n if proportional else r, pairing)
    j0, j1 = j0[: r // 2], j1[: r // 2]
    out[j0] = torch.arange(r // 2)
    out[j1] = torch.arange(r // 2)
    rest = torch.ones(n, dtype=torch.bool)
    rest[j0] = rest[j1] = False
    out[rest] = torch.arange(n - r) + r // 2
    return out


@dataclass(frozen=True)
class _Diagonal(MatrixGroup):
    """Diagonal matrices constant on each RoPE plane (free on the ``n - r`` unrotated coordinates).

    ``proportional``: the rotated planes are the first ``r/2`` planes of the whole head's
    pairing, not the planes of the first ``r`` dimensions (:func:`_plane_of`).
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

    def plane_index(self) -> Tensor:
        return _plane_of(self.n, self.pairing, self.r, self.proportional)

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

    @property
    def dim(self) -> int:
        return 0

    def sample(self, gen=None, dtype=torch.float64) -> Tensor:
        g = _generator(gen)
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

    @property
    def dim(self) -> int:
        return self.units

    def sample(self, gen=None, dtype=torch.float64) -> Tensor:
        g = _generator(gen)
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

    @property
    def dim(self) -> int:
        return 0

    def sample(self, gen=None, dtype=torch.float64) -> Tensor:
        g = _generator(gen)
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
        s = torch.where(m[torch.arange(self.n), perm] >= 0, 1.0, -1.0).to(torch.float64)
        return s[:, None] * one_hot(perm)


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


# ----------------------------------------------------------------------------
# Orthogonal subgroups that fix a subspace pointwise (residual streams)
# ----------------------------------------------------------------------------
#
# Subgroups that fix a subspace pointwise
# ---------------------------------------
# :class:`FixingOrthogonal` is ``{O in O(n): O v = v for every v in S}``. With ``Q``
# (``n x k``) an orthonormal basis of ``S^perp`` every element is
# 
#     O = I + Q (R - I) Q^T = Q R Q^T + (I - Q Q^T),   R in O(k),
# 
# so the group is ``O(k)`` acting on ``S^perp`` and the identity on ``S``. The
# constrained Procrustes problem ``max <O, M>`` is ``const + <R, Q^T M Q>``, solved by
# ``R = polar(Q^T M Q)``. Two instances:
# 
# * :class:`CenteredOrthogonal`, ``S = span{1}``: the rotations of a LayerNorm stream
#   (they commute with the centring ``C = I - 1 1^T / D``); ``O = Q R Q^T + 1 1^T / D``.
# * :func:`stabiliser` of a set of vectors (a fixed sinusoidal table ``p_t`` added to
#   the stream, plus ``1`` when the norm centres): only rotations fixing every
#   ``p_t`` commute with adding the table, ``O (x + p_t) = O x + p_t``.
# 
# Numerical rank rule (:func:`stabiliser`): with ``V`` the vectors as rows (in the
# coordinates of ``1^perp`` when ``1`` is fixed as well) and ``V = U diag(s) W^T``
# its SVD (``s`` padded with zeros to the width), the free space is spanned by the
# ``k`` trailing right singular vectors, ``k`` the largest count with
# 
#     2 sqrt(s_{n-k+1}^2 + ... + s_n^2) <= tol * min_t ||v_t||      (tol = 1e-12).
# 
# Since ``(O - I) v_t = Q (R - I) Q^T v_t`` and ``||Q^T v_t||^2 <= sum_t ||Q^T v_t||^2 =
# sum_free s_j^2``, every element then moves every ``v_t`` by at most
# ``tol ||v_t||`` (relative): directions with tiny but non-zero singular values are
# freed only while that bound holds; the others stay fixed. The bound is also
# checked directly on ``Q`` (``FixingOrthogonal.error``).


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
        return self.embed(random_orthogonal(self.k, _generator(gen))).to(dtype)

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


# ----------------------------------------------------------------------------
# Permutations inside blocks of a stacked tensor (mixture-of-experts units)
# ----------------------------------------------------------------------------


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

    @property
    def dim(self) -> int:
        return 0

    def identity(self, dtype=torch.int64) -> Tensor:
        return torch.arange(self.n).repeat(self.n_blocks, 1)

    def sample(self, gen=None, dtype=None) -> Tensor:
        g = _generator(gen)
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
