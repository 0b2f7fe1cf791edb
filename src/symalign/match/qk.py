r"""Stage 2 over ``GL(d)``: align the per-head transforms of one side pair, batched.

For a block (one head or K/V group) with covariant rows ``X`` (Q or V) and
contravariant rows ``Y`` (K or O), paper layout, minimise over ``U in GL(d)``

    L(U) = ||X_A - X_B U^T||_F^2 + ||Y_A - Y_B U^{-1}||_F^2,

which is the distance between A and ``U . B`` (``T = U`` on the block). Only
``d x d`` Gram matrices are needed (:class:`Grams`):

    ||X_A - X_B U^T||^2 = tr(X_A^T X_A) - 2 sum(G_AB * U) + sum((U G_BB) * U),
    ||Y_A - Y_B V||^2   = tr(Y_A^T Y_A) - 2 sum(H_AB^T * V) + sum(V * (H_BB V)),

with ``G_AB = X_A^T X_B``, ``H_AB = Y_A^T Y_B``, ``V = U^{-1}``.

* **Orthogonal** (``U^{-1} = U^T``): orthogonal Procrustes,
  ``U^T = polar(X_B^T X_A + Y_B^T Y_A) = polar(G_AB^T + H_AB^T)`` by SVD.
* **Full**: from the orthogonal start, a batched damped Newton method in the
  relative update ``U <- (I + E) U``, preconditioned by Gauss-Newton. With
  ``X~ = X_B U^T``, ``Y~ = Y_B U^{-1}``, ``P = X~^T X~``, ``K = Y~^T Y~``, the
  Gauss-Newton model of ``L((I + E) U)`` is
  ``L + 2 <g, E> + tr(E P E^T) + tr(E^T K E)`` with half-gradient
  ``g = (P - X_A^T X~) - (K - (Y_A^T Y~)^T)``; its damped minimiser solves the
  Sylvester equation ``E (P + mu I) + K E = -g``, solved exactly with the
  eigendecompositions of ``P`` and ``K``. The exact Newton system adds the
  residual term of ``(I + E)^{-1} = I - E + E^2 - ...``:
  ``E P + K E - N^T E^T - E^T N^T + mu E = -g`` with ``N = (Y_A - Y~)^T Y~``; it is
  solved by a few batched preconditioned-CG steps with that Sylvester solve as
  preconditioner (the Gauss-Newton step is used where the model has negative
  curvature). Steps are accepted per block when
  ``L`` does not increase (each block has its own damping ``mu``); converged
  blocks leave the batch. All blocks of all layers are one tensor program.

The result never ends above the orthogonal solution (kept per block if better),
and blocks whose ``cond(U)`` exceeds ``max_cond`` fall back to it with a warning.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class Grams:
    """Gram blocks of one side pair, batched over blocks ``n``.

    ``co_bb = X_B^T X_B``, ``co_ab = X_A^T X_B`` ``(n, d, d)``, ``co_aa = diag(X_A^T X_A)``
    ``(n, d)``; ``ct_*`` likewise for the contravariant rows ``Y``.
    """

    co_bb: Tensor
    co_ab: Tensor
    co_aa: Tensor
    ct_bb: Tensor
    ct_ab: Tensor
    ct_aa: Tensor

    @property
    def n(self) -> int:
        return self.co_bb.shape[0]

    @property
    def d(self) -> int:
        return self.co_bb.shape[-1]

    def select(self, idx: Tensor) -> "Grams":
        return Grams(*(t[idx] for t in self._fields()))

    def columns(self, cols: Tensor) -> "Grams":
        """The sub-problem on a subset of the ``d`` columns (e.g. the unrotated dims)."""
        def sq(t):
            return t[:, cols][:, :, cols]
        return Grams(sq(self.co_bb), sq(self.co_ab), self.co_aa[:, cols],
                     sq(self.ct_bb), sq(self.ct_ab), self.ct_aa[:, cols])

    def _fields(self):
        return (self.co_bb, self.co_ab, self.co_aa, self.ct_bb, self.ct_ab, self.ct_aa)

    @staticmethod
    def cat(items: list["Grams"]) -> "Grams":
        return Grams(*(torch.cat(ts) for ts in zip(*(g._fields() for g in items))))

    def scale(self) -> Tensor:
        """``||X_A||^2 + ||X_B||^2 + ||Y_A||^2 + ||Y_B||^2`` per block (for relative tolerances)."""
        tr = lambda m: torch.diagonal(m, dim1=-2, dim2=-1).sum(-1)  # noqa: E731
        return self.co_aa.sum(-1) + tr(self.co_bb) + self.ct_aa.sum(-1) + tr(self.ct_bb)

    def objective(self, u: Tensor, v: Tensor | None = None) -> Tensor:
        """``L(U)`` per block, ``(n,)``; ``v = U^{-1}`` if known."""
        if v is None:
            v = torch.linalg.inv(u)
        co = self.co_aa.sum(-1) - 2 * (self.co_ab * u).sum((-1, -2)) + ((u @ self.co_bb) * u).sum((-1, -2))
        ct = self.ct_aa.sum(-1) - 2 * (self.ct_ab.mT * v).sum((-1, -2)) + (v * (self.ct_bb @ v)).sum((-1, -2))
        return co + ct


def polar(m: Tensor) -> Tensor:
    """Orthogonal polar factor ``W Z^T`` of ``m = W S Z^T`` (batched)."""
    w, _, zt = torch.linalg.svd(m)
    return w @ zt


def orthogonal_solution(g: Grams) -> Tensor:
    """Orthogonal Procrustes ``U`` per block: ``U^T = polar(G_AB^T + H_AB^T)``."""
    return polar(g.co_ab.mT + g.ct_ab.mT).mT.contiguous()


@dataclass
class GLSolution:
    """Per-block result: ``u`` ``(n, d, d)``, objective, iterations, convergence flag, ``cond(U)``."""

    u: Tensor
    objective: Tensor
    iterations: Tensor
    converged: Tensor
    cond: Tensor
    fallback: Tensor  # True where the orthogonal solution was kept (better or better conditioned)


def condition(u: Tensor) -> Tensor:
    """2-norm condition number per block (``inf`` for singular blocks)."""
    s = torch.linalg.svdvals(u)
    return s[..., 0] / s[..., -1]


def _newton_cg(hess, prec, rhs: Tensor, mu: Tensor, iters: int, fallback: Tensor) -> Tensor:
    """Batched preconditioned CG on ``(H + mu I) E = rhs``; blocks meeting negative curvature keep
    their last iterate (or ``fallback``, the Gauss-Newton step, if that is still zero)."""
    x = torch.zeros_like(rhs)
    r = rhs.clone()
    z = prec(r)
    d = z.clone()
    rz = (r * z).sum((-1, -2))
    live = torch.ones(rhs.shape[0], dtype=torch.bool)
    first = torch.ones_like(live)
    for _ in range(iters):
        hd = hess(d) + mu[:, None, None] * d
        dhd = (d * hd).sum((-1, -2))
        neg = ~(dhd > 0) & live
        fb = neg & first
        x = torch.where(fb[:, None, None], fallback, x)
        live = live & ~neg
        alpha = torch.where(live, rz / torch.where(live, dhd, torch.ones_like(dhd)), torch.zeros_like(rz))
        x = x + alpha[:, None, None] * d
        r = r - alpha[:, None, None] * hd
        z = prec(r)
        rz_new = (r * z).sum((-1, -2))
        beta = torch.where(live & (rz != 0), rz_new / torch.where(rz != 0, rz, torch.ones_like(rz)),
                           torch.zeros_like(rz))
        d = z + beta[:, None, None] * d
        rz = rz_new
        first = torch.zeros_like(first)
        if not bool(live.any()):
            break
    return x


def solve_gl(g: Grams, mode: str = "full", *, max_iter: int = 100, xtol: float = 1e-11,
             max_cond: float = 1e6, u0: Tensor | None = None, label: str = "GL",
             cg_iters: int = 10, ftol: float = 1e-10) -> GLSolution:
    """Minimise ``L(U)`` over ``U in GL(d)`` for every block at once (see the module docstring).

    ``mode``: ``"none"`` (identity), ``"orthogonal"`` (Procrustes) or ``"full"`` (damped
    Newton-CG from Procrustes). Float64 throughout. ``converged`` is False for blocks that
    hit ``max_iter`` or stalled (damping above 1e12).
    """
    n, d = g.n, g.d
    eye = torch.eye(d, dtype=torch.float64).expand(n, d, d)
    zeros = torch.zeros(n, dtype=torch.int64)
    if mode == "none" or n == 0:
        u = eye.clone()
        return GLSolution(u, g.objective(u, u), zeros, torch.ones(n, dtype=torch.bool), torch.ones(n, dtype=torch.float64),
                          torch.zeros(n, dtype=torch.bool))
    uo = orthogonal_solution(g) if u0 is None else u0
    fo = g.objective(uo, uo.mT if u0 is None else None)
    if mode == "orthogonal":
        return GLSolution(uo, fo, zeros, torch.ones(n, dtype=torch.bool), condition(uo), torch.zeros(n, dtype=torch.bool))
    if mode != "full":
        raise ValueError(f"unknown stage-2 mode {mode!r}; use 'none', 'orthogonal' or 'full'")
    u, v, f = uo.clone(), torch.linalg.inv(uo), fo.clone()
    scale = g.scale().clamp_min(1e-300)
    slack = 64 * torch.finfo(torch.float64).eps * scale
    lam = torch.full((n,), 1e-2, dtype=torch.float64)
    iters = torch.zeros(n, dtype=torch.int64)
    conv = torch.zeros(n, dtype=torch.bool)
    active = torch.arange(n)
    for _ in range(max_iter):
        if active.numel() == 0:
            break
        a = active
        ga = g.select(a)
        ua, va = u[a], v[a]
        p = ua @ ga.co_bb @ ua.mT
        k = va.mT @ ga.ct_bb @ va
        nres = (ga.ct_ab @ va) - k  # N = Y_A^T Y~ - Y~^T Y~ = R^T Y~
        half = (p - ga.co_ab @ ua.mT) + nres.mT
        lp, fp = torch.linalg.eigh(p)
        lk, fk = torch.linalg.eigh(k)
        mu = lam[a] * (lp.mean(-1) + lk.mean(-1)).clamp_min(1e-300)
        den = (lk[:, :, None] + lp[:, None, :] + mu[:, None, None]).clamp_min(1e-300)

        def prec(rr, fk=fk, fp=fp, den=den):  # (GN + mu)^{-1}: the Sylvester solve E P + K E + mu E = R
            return fk @ ((fk.mT @ rr @ fp) / den) @ fp.mT

        def hess(x, p=p, k=k, nres=nres):  # half-Hessian of L((I + E) U) at E = 0 (exact, Newton)
            return x @ p + k @ x - nres.mT @ x.mT - x.mT @ nres.mT

        e_gn = prec(-half)
        e = _newton_cg(hess, prec, -half, mu, cg_iters, e_gn)
        pred = -(2 * (half * e).sum((-1, -2)) + (e * hess(e)).sum((-1, -2)))
        gn = ~(pred > 0)  # the Newton model is not trustworthy here: use the Gauss-Newton step
        if bool(gn.any()):
            e = torch.where(gn[:, None, None], e_gn, e)
            pred_gn = -(2 * (half * e_gn).sum((-1, -2)) + ((e_gn @ p) * e_gn).sum((-1, -2))
                        + ((k @ e_gn) * e_gn).sum((-1, -2)))
            pred = torch.where(gn, pred_gn, pred)
        un = ua + e @ ua
        vn = torch.linalg.inv(un)
        fn = ga.objective(un, vn)
        ok = torch.isfinite(fn) & (fn <= f[a] + slack[a]) & torch.isfinite(vn).all(-1).all(-1)
        iters[a] += 1
        acc = a[ok]
        u[acc], v[acc], f[acc] = un[ok], vn[ok], fn[ok]
        lam[a] = torch.where(ok, (lam[a] / 3).clamp_min(1e-12), lam[a] * 4)
        step = torch.linalg.matrix_norm(e)
        small = (pred <= 1e-3 * slack[a]) | (pred <= ftol * f[a].abs())
        met = ok & ((step <= xtol) | small)
        done = met | (lam[a] > 1e12)  # stalled blocks stop without the converged flag
        conv[a[met]] = True
        active = a[~done]
    # never above the orthogonal start; guard the conditioning
    cond = condition(u)
    worse = ~(f <= fo)
    ill = ~(cond <= max_cond)
    fallback = worse | ill
    if bool(ill.any()):
        bad = [int(i) for i in torch.nonzero(ill).flatten()]
        warnings.warn(f"{label}: the GL solution of block(s) {bad} is near-singular "
                      f"(cond up to {float(cond[ill].max()):.3g} > max_cond={max_cond:g}); "
                      "falling back to the orthogonal solution there", RuntimeWarning, stacklevel=3)
    u = torch.where(fallback[:, None, None], uo, u)
    f = torch.where(fallback, fo, f)
    cond = torch.where(fallback, condition(uo), cond)
    return GLSolution(u, f, iters, conv, cond, fallback)
