r"""Stage 2 for Q-K under RoPE: the plane group ``H(r) (+) GL(d - r)``, batched.

Write plane ``j`` (columns ``(j0, j1)`` given by the pairing) of a block's rows
(paper layout) as complex vectors ``z = w[:, j0] + i w[:, j1]``. The element
``c = a + i b = r e^{i phi}`` (block ``[[a, -b], [b, a]]``) acts on covariant
rows as ``w -> w U^T``, i.e. ``z -> c z``, and on contravariant rows as
``w -> w U^{-1}``, i.e. ``z -> z / conj(c) = r^{-1} e^{i phi} z``. Hence

    f(c) = ||zQ_A - c zQ_B||^2 + ||zK_A - zK_B / conj(c)||^2
         = ||zQ_A||^2 + ||zK_A||^2 + p r^2 + q r^{-2} - 2 Re(e^{i phi} (r alpha + beta / r)),

with ``alpha = <zQ_A, zQ_B>``, ``beta = <zK_A, zK_B>`` (``<a, b> = sum conj(a) b``),
``p = ||zQ_B||^2``, ``q = ||zK_B||^2``. The best angle for fixed ``r`` is
``phi = -arg(r alpha + beta / r)``, leaving, with ``t = log r``,

    g(t) = p e^{2t} + q e^{-2t} - 2 |alpha e^t + beta e^{-t}|.

(Signs verified numerically against brute-force minimisation over ``(a, b)`` and by
planted recovery, see ``tests/test_match_rope.py``.) All quantities come from the
``d x d`` Gram blocks: ``alpha = G[j0,j0] + G[j1,j1] + i (G[j0,j1] - G[j1,j0])`` with
``G = X_A^T X_B``.

Bracket: at the optimum ``f* <= F1 = f(best c with r = 1)`` and
``f >= (r sqrt(p) - ||zQ_A||)^2``, ``f >= (sqrt(q)/r - ||zK_A||)^2``, so
``t in [-log((||zK_A|| + sqrt F1)/sqrt q), log((||zQ_A|| + sqrt F1)/sqrt p)]``
(``0`` is inside). The batched solver evaluates ``g`` on a grid over that bracket
(clamped to ``|t| <= t_cap``), then golden-section search in the cell pair around
the best grid point -- every plane of every head of every layer at once. A
plane with ``p + q`` negligible (no data) gets ``t = 0``; a finite ``t`` is always
returned. ``"orthogonal"`` under RoPE means the best element with ``|c| = 1``:
``t = 0``, ``phi = -arg(alpha + beta)``.

Partial rotary: the rotated columns ``0..r`` and the others ``r..d`` are disjoint
column sets of every row, so the objective separates exactly into the plane
problems and a ``GL(d - r)`` problem (:func:`symalign.match.qk.solve_gl`).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
from scipy.optimize import minimize_scalar
from torch import Tensor

from symalign.groups import RotaryPlanes, condition, rotary_pairs
from symalign.match.qk import GLSolution, Grams, solve_gl

_GOLD = (math.sqrt(5) - 1) / 2


@dataclass
class PlaneProblem:
    """Per-plane data, all of shape ``(n, r/2)``: ``alpha, beta`` complex, the rest real."""

    alpha: Tensor
    beta: Tensor
    p: Tensor
    q: Tensor
    a2: Tensor  # ||zQ_A||^2
    b2: Tensor  # ||zK_A||^2

    def g(self, t: Tensor) -> Tensor:
        """``g(t)`` (broadcast ``t`` against the planes; extra trailing dims allowed)."""
        ex = lambda x: x.reshape(x.shape + (1,) * (t.dim() - x.dim()))  # noqa: E731
        et = t.exp()
        return (ex(self.p) * et ** 2 + ex(self.q) / et ** 2
                - 2 * (ex(self.alpha) * et + ex(self.beta) / et).abs())

    def derivatives(self, t: Tensor) -> tuple[Tensor, Tensor]:
        """``(g'(t), g''(t))`` with ``S = |alpha e^t + beta e^-t|^2 = A e^{2t} + B e^{-2t} + 2 gamma``."""
        e2 = (2 * t).exp()
        aa, bb = self.alpha.abs() ** 2, self.beta.abs() ** 2
        gam = (self.alpha.conj() * self.beta).real
        big_s = (aa * e2 + bb / e2 + 2 * gam).clamp_min(1e-300)
        s = big_s.sqrt()
        s1 = 2 * aa * e2 - 2 * bb / e2
        s2 = 4 * aa * e2 + 4 * bb / e2
        ds = s1 / (2 * s)
        dds = s2 / (2 * s) - s1 ** 2 / (4 * s ** 3)
        return 2 * self.p * e2 - 2 * self.q / e2 - 2 * ds, 4 * self.p * e2 + 4 * self.q / e2 - 2 * dds

    def objective(self, t: Tensor) -> Tensor:
        """``f`` at the best angle for ``t``: ``||zQ_A||^2 + ||zK_A||^2 + g(t)``."""
        return self.a2 + self.b2 + self.g(t)

    def objective_at(self, t: Tensor, phi: Tensor) -> Tensor:
        """``f(c)`` at ``c = e^{t + i phi}`` (any angle, not only the best one):
        ``||zQ_A||^2 + ||zK_A||^2 + p r^2 + q r^{-2} - 2 Re(e^{i phi} (r alpha + beta / r))``."""
        r = t.exp()
        cross = (torch.polar(torch.ones_like(phi), phi) * (r * self.alpha + self.beta / r)).real
        return self.a2 + self.b2 + self.p * r ** 2 + self.q / r ** 2 - 2 * cross

    def phase(self, t: Tensor) -> Tensor:
        """Best angle ``phi = -arg(r alpha + beta / r)``."""
        r = t.exp()
        return -torch.angle(r * self.alpha + self.beta / r)


def plane_problem(g: Grams, pairing: str, r: int) -> PlaneProblem:
    """The per-plane quantities of the rotated width ``r`` from the Gram blocks."""
    j0, j1 = rotary_pairs(r, pairing)

    def inner(m):
        re = m[:, j0, j0] + m[:, j1, j1]
        im = m[:, j0, j1] - m[:, j1, j0]
        return torch.complex(re, im)

    def norm(m):
        return m[:, j0, j0] + m[:, j1, j1]

    return PlaneProblem(inner(g.co_ab), inner(g.ct_ab), norm(g.co_bb), norm(g.ct_bb),
                        g.co_aa[:, j0] + g.co_aa[:, j1], g.ct_aa[:, j0] + g.ct_aa[:, j1])


def bracket(pp: PlaneProblem, t_cap: float = 20.0) -> tuple[Tensor, Tensor]:
    """Rigorous bracket ``[t_lo, t_hi]`` of the global minimiser, clamped to ``[-t_cap, t_cap]``."""
    f1 = (pp.p + pp.q + pp.a2 + pp.b2 - 2 * (pp.alpha + pp.beta).abs()).clamp_min(0)
    tiny = 1e-300
    hi = torch.log((pp.a2.sqrt() + f1.sqrt()).clamp_min(tiny) / pp.p.clamp_min(tiny).sqrt())
    lo = -torch.log((pp.b2.sqrt() + f1.sqrt()).clamp_min(tiny) / pp.q.clamp_min(tiny).sqrt())
    hi = hi.nan_to_num(t_cap).clamp(0.0, t_cap)
    lo = lo.nan_to_num(-t_cap).clamp(-t_cap, 0.0)
    return lo, hi


def solve_planes(pp: PlaneProblem, *, grid: int = 65, iters: int = 90, t_cap: float = 20.0,
                 degenerate: float = 1e-24, newton: int = 3) -> tuple[Tensor, Tensor]:
    """Global minimiser ``(t, phi)`` of every plane at once (grid + golden section).

    Planes with ``p + q <= degenerate * scale`` (``scale`` the block's total) get ``t = 0``.
    """
    lo, hi = bracket(pp, t_cap)
    s = torch.linspace(0, 1, grid, dtype=torch.float64, device=lo.device)
    ts = lo[..., None] + (hi - lo)[..., None] * s  # (n, m, grid)
    vals = pp.g(ts)
    k = vals.argmin(-1, keepdim=True)
    a = ts.gather(-1, (k - 1).clamp_min(0)).squeeze(-1)
    b = ts.gather(-1, (k + 1).clamp_max(grid - 1)).squeeze(-1)
    best_t = ts.gather(-1, k).squeeze(-1)
    best = vals.gather(-1, k).squeeze(-1)
    c = b - _GOLD * (b - a)
    d = a + _GOLD * (b - a)
    fc, fd = pp.g(c), pp.g(d)
    for _ in range(iters):
        left = fc < fd  # minimum in [a, d]
        b = torch.where(left, d, b)
        a = torch.where(left, a, c)
        new_c = b - _GOLD * (b - a)
        new_d = a + _GOLD * (b - a)
        c_next = torch.where(left, new_c, d)
        d_next = torch.where(left, c, new_d)
        f_c_next = torch.where(left, pp.g(new_c), fd)
        f_d_next = torch.where(left, fc, pp.g(new_d))
        c, d, fc, fd = c_next, d_next, f_c_next, f_d_next
    zero = torch.zeros_like(best_t)
    for cand, fv in ((c, fc), (d, fd), (zero, pp.g(zero))):
        better = fv < best
        best_t = torch.where(better, cand, best_t)
        best = torch.where(better, fv, best)
    for _ in range(newton):  # polish: golden section alone leaves |t - t*| ~ sqrt(eps)
        d1, d2 = pp.derivatives(best_t)
        cand = best_t - d1 / d2
        cand = torch.where((d2 > 0) & torch.isfinite(cand), cand.clamp(lo, hi), best_t)
        fv = pp.g(cand)
        size = pp.p * (2 * cand).exp() + pp.q * (-2 * cand).exp() + pp.a2 + pp.b2
        better = fv <= best + 16 * torch.finfo(torch.float64).eps * size  # rounding slack near the minimum
        best_t = torch.where(better, cand, best_t)
        best = torch.where(better, fv, best)
    scale = (pp.p + pp.q + pp.a2 + pp.b2).sum(-1, keepdim=True).clamp_min(1e-300)
    degen = (pp.p + pp.q) <= degenerate * scale
    t = torch.where(degen, torch.zeros_like(best_t), best_t)
    return t, pp.phase(t)


def solve_planes_brent(pp: PlaneProblem, t_cap: float = 20.0) -> tuple[Tensor, Tensor]:
    """Reference: ``scipy.optimize.minimize_scalar(method='brent')`` per plane (slow)."""
    lo, hi = bracket(pp, t_cap)
    t = torch.zeros_like(pp.p)
    for idx in torch.cartesian_prod(*(torch.arange(s) for s in pp.p.shape)).view(-1, pp.p.dim()):
        i = tuple(int(x) for x in idx)
        al, be, p, q = complex(pp.alpha[i]), complex(pp.beta[i]), float(pp.p[i]), float(pp.q[i])

        def g(x, al=al, be=be, p=p, q=q):
            e = math.exp(x)
            return p * e * e + q / (e * e) - 2 * abs(al * e + be / e)

        res = minimize_scalar(g, bracket=(float(lo[i]), float(hi[i])), method="brent")
        x = float(res.x) if math.isfinite(res.x) else 0.0
        t[i] = min(max(x, float(lo[i])), float(hi[i]))  # same feasible set (|t| <= t_cap) as the batched solver
    return t, pp.phase(t)


@dataclass
class RopeSolution(GLSolution):
    """:class:`GLSolution` plus the per-plane ``log r`` and angle, ``(n, r/2)``."""

    t: Tensor | None = None
    phi: Tensor | None = None


def solve_rope(g: Grams, group: RotaryPlanes, mode: str = "full", *, max_cond: float = 1e6,
               label: str = "Q-K (RoPE)", **kw) -> RopeSolution:
    """Align Q-K over ``H(r) (+) GL(d - r)`` for every block at once.

    ``mode``: ``"none"``, ``"orthogonal"`` (``|c| = 1`` per plane, orthogonal Procrustes on
    the unrotated dims) or ``"full"`` (global per-plane optimum, LM on the unrotated dims).
    """
    n, d, r = g.n, g.d, group.r
    pp = plane_problem(g, group.pairing, r)
    if mode == "none":
        t = torch.zeros_like(pp.p)
        phi = torch.zeros_like(pp.p)
    elif mode == "orthogonal":
        t = torch.zeros_like(pp.p)
        phi = pp.phase(t)
    elif mode == "full":
        t, phi = solve_planes(pp, **{k: v for k, v in kw.items() if k in ("grid", "iters", "t_cap")})
        zero = torch.zeros_like(t)
        keep = pp.objective(zero) < pp.objective(t)  # never above the |c| = 1 solution, per plane
        t = torch.where(keep, zero, t)
        phi = pp.phase(t)
    else:
        raise ValueError(f"unknown stage-2 mode {mode!r}; use 'none', 'orthogonal' or 'full'")
    rest = None
    dev = g.co_bb.device
    iters = torch.zeros(n, dtype=torch.int64, device=dev)
    conv = torch.ones(n, dtype=torch.bool, device=dev)
    fallback = torch.zeros(n, dtype=torch.bool, device=dev)
    f_rest = torch.zeros(n, dtype=torch.float64, device=dev)
    if r < d:
        cols = torch.arange(r, d, device=dev)
        sol = solve_gl(g.columns(cols), mode, max_cond=max_cond, label=label + " unrotated",
                       **{k: v for k, v in kw.items() if k in ("max_iter", "xtol", "ftol")})
        rest, iters, conv, fallback, f_rest = sol.u, sol.iterations, sol.converged, sol.fallback, sol.objective
    # conditioning guard on the planes: fall back to |c| = 1 for ill-conditioned blocks
    u = group.from_planes(t.exp() * phi.cos(), t.exp() * phi.sin(), rest)
    cond = condition(u)
    ill = ~(cond <= max_cond)
    if bool(ill.any()):
        bad = [int(i) for i in torch.nonzero(ill).flatten()]
        warnings.warn(f"{label}: block(s) {bad} are near-singular (cond up to {float(cond[ill].max()):.3g} > "
                      f"max_cond={max_cond:g}); using the |c| = 1 planes there", RuntimeWarning, stacklevel=2)
        t = torch.where(ill[:, None], torch.zeros_like(t), t)
        phi = torch.where(ill[:, None], pp.phase(torch.zeros_like(t)), phi)
        u = group.from_planes(t.exp() * phi.cos(), t.exp() * phi.sin(), rest)
        cond = condition(u)
        fallback = fallback | ill
    f_planes = pp.objective_at(t, phi).sum(-1)  # at the element returned (the identity for "none")
    return RopeSolution(u, f_planes + f_rest, iters, conv, cond, fallback, t=t, phi=phi)
