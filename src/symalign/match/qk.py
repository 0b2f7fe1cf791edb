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
* **Full**: from the orthogonal start, batched L-BFGS in *balanced coordinates*
  (:class:`Balanced`). With ``G_BB = L L^T`` (``L = F diag(l)^{1/2}`` from
  ``eigh(G_BB)``) and ``L^T H_BB L = Q diag(lam) Q^T``, put ``M = L Q`` and
  ``Uh = U M``, ``Wh = Uh^{-1} = M^{-1} U^{-1}``. Then ``U G_BB U^T = Uh Uh^T`` and
  ``V^T H_BB V = Wh^T diag(lam) Wh``, so both quadratic terms are elementwise:

      L = c - 2 <Gh, Uh> + ||Uh||^2 - 2 <Hh, Wh> + sum_ij lam_i Wh_ij^2,
      grad_Uh L = 2 (Uh - Gh) - 2 Wh^T (diag(lam) Wh - Hh) Wh^T,

  ``Gh = G_AB M^{-T}``, ``Hh = M^T H_AB^T``, ``c = tr(X_A^T X_A) + tr(Y_A^T Y_A)``.
  One evaluation costs one batched ``d x d`` inverse and two products. The change
  of variables is linear, so it only preconditions (``G_BB``'s spectrum and the
  K/O side's are equalised); eigenvalues of ``G_BB`` below ``1e-12`` of its largest
  are raised to that floor, which changes the objective by at most ``1e-12 ||G_BB||
  ||U||^2`` (the final objective is always re-evaluated exactly from the Grams).
  The L-BFGS (memory ``m = 5``) uses the compact representation of the inverse
  Hessian (:class:`_History`: two passes over the stored pairs per step), Armijo
  backtracking with quadratic interpolation, and skips curvature pairs with
  ``<s, y> <= 0``. All blocks of all layers form one tensor program, in chunks that
  bound its working memory (``CHUNK_BYTES``); blocks share the history's ring slots
  (a block that takes no step in an iteration stores an empty pair there).

  **Stopping rule, per block** (a stopped block leaves the batch): scipy's
  L-BFGS-B ``factr`` test on the decrease over the last ``w = 3`` steps,
  ``f_{k-w} - f_k <= w * ftol * max(|f_k|, floor)``, with ``floor = 64 eps * scale``
  (``scale`` = total squared norm of the block's rows, instead of scipy's absolute
  ``1``; the window keeps one short step from stopping a block early), or a relative
  step ``||s|| <= xtol ||Uh||``, or a relative gradient ``||grad|| <= gtol ||grad_0||``.
  ``converged`` is False where ``max_iter`` evaluations were used or the line search
  stalled. ``ftol = 1e-9`` (scipy's default is ``2.2e-9``): per block the result is
  within ~1e-7 of scipy's L-BFGS-B on the same objective and, summed over blocks, at
  least as good (checked in the tests and by the benchmark, which prints both).

The result never ends above the orthogonal solution (kept per block if better),
and blocks whose ``cond(U)`` exceeds ``max_cond`` fall back to it with a warning.
"""

from __future__ import annotations

import math
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import Tensor

from symalign.groups import condition, polar


CHUNK_BYTES = 128 * 2**20  # working-memory budget of one batch of the GL solver


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
        return Grams(*(t[idx] for t in self.fields()))

    @staticmethod
    def empty(n: int, d: int, device: torch.device | None = None) -> "Grams":
        """Uninitialised storage for ``n`` blocks of width ``d`` (float64), on ``device``."""
        def sq():
            return torch.empty(n, d, d, dtype=torch.float64, device=device)

        def vec():
            return torch.empty(n, d, dtype=torch.float64, device=device)
        return Grams(sq(), sq(), vec(), sq(), sq(), vec())

    def columns(self, cols: Tensor) -> "Grams":
        """The sub-problem on a subset of the ``d`` columns (e.g. the unrotated dims)."""
        def sq(t):
            return t[:, cols][:, :, cols]
        return Grams(sq(self.co_bb), sq(self.co_ab), self.co_aa[:, cols],
                     sq(self.ct_bb), sq(self.ct_ab), self.ct_aa[:, cols])

    def fields(self) -> tuple[Tensor, ...]:
        return (self.co_bb, self.co_ab, self.co_aa, self.ct_bb, self.ct_ab, self.ct_aa)

    @staticmethod
    def cat(items: list["Grams"]) -> "Grams":
        return Grams(*(torch.cat(ts) for ts in zip(*(g.fields() for g in items))))

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


@contextmanager
def one_thread() -> Iterator[None]:
    """Run the block ops of the L-BFGS loop on one intra-op thread, then restore the count.

    Its tensors are small (``d x d`` blocks, ``d^2``-long histories): with more threads
    each op pays OpenMP's fork/barrier, and on a loaded machine the spinning threads
    contend. Measured (float64, 8 blocks of 128 x 128, 2 cores shared with other jobs):
    ``inv_ex`` 3.5 ms on one thread vs 169 ms on two, ``vecdot`` 0.2 ms vs 14 ms; a 7B
    layer's V-O solve 19 s vs 92 s. Results do not depend on the caller's thread count.
    """
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


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


def _dot(a: Tensor, b: Tensor) -> Tensor:
    """Frobenius inner product per block, ``(n, d, d) x (n, d, d) -> (n,)``."""
    return torch.linalg.vecdot(a.flatten(1), b.flatten(1))


@dataclass
class Balanced:
    """The GL problem of a batch of blocks in balanced coordinates ``Uh = U M`` (module docstring).

    ``m``, ``m_inv``: ``(n, d, d)``; ``gh``, ``hh``: ``(n, d, d)``; ``lam``: ``(n, d)``; ``const``: ``(n,)``.
    """

    m: Tensor
    m_inv: Tensor
    gh: Tensor
    hh: Tensor
    lam: Tensor
    const: Tensor

    def select(self, idx: Tensor) -> "Balanced":
        return Balanced(self.m[idx], self.m_inv[idx], self.gh[idx], self.hh[idx], self.lam[idx], self.const[idx])

    def value_grad(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``(L, grad L)`` at ``Uh = x``; ``L = inf`` where ``x`` is singular."""
        w, info = torch.linalg.inv_ex(x)
        lw = self.lam[:, :, None] * w
        f = self.const + _dot(x - 2 * self.gh, x) + _dot(lw - 2 * self.hh, w)
        grad = 2 * (x - self.gh) - 2 * (w.mT @ (lw - self.hh)) @ w.mT
        bad = (info != 0) | ~torch.isfinite(f)
        f = torch.where(bad, torch.full_like(f, math.inf), f)
        return f, grad


def balance(g: Grams, floor: float = 1e-12) -> Balanced:
    """Balanced coordinates of every block (see the module docstring)."""
    lg, fg = torch.linalg.eigh(g.co_bb)
    top = lg[:, -1:].clamp_min(1e-300)
    root = lg.clamp_min(floor * top).sqrt()
    ell = fg * root[:, None, :]  # G_BB ~ L L^T
    ell_inv = (fg / root[:, None, :]).mT
    lam, q = torch.linalg.eigh(ell.mT @ g.ct_bb @ ell)
    m = ell @ q
    m_inv = q.mT @ ell_inv
    return Balanced(m, m_inv, g.co_ab @ m_inv.mT, m.mT @ g.ct_ab.mT, lam.clamp_min(0.0),
                    g.co_aa.sum(-1) + g.ct_aa.sum(-1))


@dataclass
class LBFGSResult:
    x: Tensor
    f: Tensor
    evaluations: Tensor
    converged: Tensor


class _History:
    """L-BFGS memory of a batch in compact form (Byrd, Nocedal & Schnabel 1994).

    ``z = [S; Y]`` ``(n, 2m, d^2)`` holds the pairs in ring slots shared by all blocks (an
    empty pair, ``s = y = 0``, where a block stored nothing), ``gram = z z^T``. With the
    pairs in chronological order, ``R = triu(S^T Y)``, ``D = diag(S^T Y)`` and
    ``gamma = s^T y / y^T y`` of the newest pair,
    ``H g = gamma g + S R^{-T} ((D + gamma Y^T Y) c - gamma Y^T g) - gamma Y c``,
    ``c = R^{-1} S^T g``: two passes over ``z`` per direction (an empty pair gets
    ``R_ii = 1`` and contributes nothing).
    """

    def __init__(self, n: int, dim: int, memory: int, device: torch.device | None = None):
        self.m = memory
        self.z = torch.zeros(n, 2 * memory, dim, dtype=torch.float64, device=device)
        self.gram = torch.zeros(n, 2 * memory, 2 * memory, dtype=torch.float64, device=device)
        self.gamma = torch.ones(n, dtype=torch.float64, device=device)
        self.slot = 0  # next slot to write

    def select(self, keep: Tensor) -> None:
        self.z, self.gram, self.gamma = self.z[keep], self.gram[keep], self.gamma[keep]

    def push_apply(self, s: Tensor, y: Tensor, valid: Tensor, g: Tensor) -> Tensor:
        """Store ``(s, y)`` ``(n, d^2)`` where ``valid`` (an empty pair elsewhere), return ``H g``.

        One pass over ``z`` gives both the new pair's inner products and ``z g``; one more
        combines the direction.
        """
        k, m = self.slot, self.m
        vm = valid[:, None]
        self.z[:, k] = torch.where(vm, s, 0.0)
        self.z[:, m + k] = torch.where(vm, y, 0.0)
        v = torch.bmm(self.z, torch.stack([self.z[:, k], self.z[:, m + k], g], -1))  # (n, 2m, 3)
        self.gram[:, :, k], self.gram[:, k, :] = v[..., 0], v[..., 0]
        self.gram[:, :, m + k], self.gram[:, m + k, :] = v[..., 1], v[..., 1]
        sy, yy = v[:, m + k, 0], v[:, m + k, 1]
        self.gamma = torch.where(valid, sy / torch.where(valid, yy, torch.ones_like(yy)), self.gamma)
        self.slot = (k + 1) % m
        order = torch.tensor([(self.slot + j) % m for j in range(m)], device=self.z.device)  # oldest first
        r = v[..., 2]
        a, b = r[:, order], r[:, m + order]
        sy = self.gram[:, order][:, :, m + order]
        yy = self.gram[:, m + order][:, :, m + order]
        dg = torch.diagonal(sy, dim1=-2, dim2=-1)
        rr = torch.triu(sy) + torch.diag_embed((dg <= 0).to(sy.dtype))
        gam = self.gamma[:, None, None]
        c = torch.linalg.solve_triangular(rr, a[..., None], upper=True)
        t = dg[..., None] * c + gam * (yy @ c) - gam * b[..., None]
        w = torch.linalg.solve_triangular(rr.mT, t, upper=False)
        coef = torch.empty(g.shape[0], 2 * m, dtype=torch.float64, device=g.device)
        coef[:, order], coef[:, m + order] = w[..., 0], -gam[..., 0] * c[..., 0]
        return gam[..., 0] * g + torch.bmm(coef[:, None, :], self.z)[:, 0]


def _where(mask: Tensor, new: Tensor, old: Tensor) -> Tensor:
    """``torch.where`` over the leading (block) dimension, skipped when every block takes ``new``."""
    if bool(mask.all()):
        return new
    return torch.where(mask.view(-1, *([1] * (new.dim() - 1))), new, old)


def lbfgs(prob: Balanced, x0: Tensor, scale: Tensor, *, memory: int = 5, max_iter: int = 500,
          ftol: float = 1e-9, gtol: float = 1e-12, xtol: float = 1e-14, c1: float = 1e-4,
          window: int = 3) -> LBFGSResult:
    """Batched L-BFGS on ``prob.value_grad`` from ``x0`` ``(n, d, d)`` (module docstring).

    ``max_iter`` counts evaluations per block (the start included); the ``ftol`` test is
    applied to the decrease over the last ``window`` steps (one short step does not stop
    a block). Blocks that stop are frozen and dropped from the working set once a quarter
    of it has stopped.
    """
    n, d = x0.shape[0], x0.shape[-1]
    eps = torch.finfo(torch.float64).eps
    dev = x0.device
    out = LBFGSResult(x0.clone(), torch.empty(n, dtype=torch.float64, device=dev),
                      torch.ones(n, dtype=torch.int64, device=dev), torch.zeros(n, dtype=torch.bool, device=dev))
    w = _start(prob, x0, scale, window, eps)
    hist = _History(n, d * d, memory, dev)
    for _ in range(max_iter - 1):
        if bool(w.stop.any()) and (bool(w.stop.all()) or int(w.stop.sum()) * 4 >= w.stop.numel()):
            prob = _retire(w, out, hist, prob)
            if w.ids.numel() == 0:
                break
        run, step, y, ft, gt = _trial(prob, w)
        ok = run & torch.isfinite(ft) & (ft <= w.f + c1 * w.alpha * w.gp + w.floor)
        ss = _dot(step, step)
        pair_ok = ok & (_dot(step, y) > 1e-10 * torch.sqrt(ss * _dot(y, y)))  # curvature pairs need s^T y > 0
        done = _accept(w, ok, step, ft, gt, ss, window, ftol, xtol, gtol)
        _directions(w, hist, ok & ~done, step, y, pair_ok)
        rej = run & ~ok
        if bool(rej.any()):
            _backtrack(w, rej, ft, eps)
    out.x[w.ids], out.f[w.ids], out.evaluations[w.ids], out.converged[w.ids] = w.x, w.f, w.evals, w.conv
    return out


@dataclass
class _Working:
    """The working set of :func:`lbfgs`: per running block its index ``ids`` in the batch, iterate ``x``, value
    ``f``, gradient ``gr``, direction ``p``, slope ``gp = <gr, p>``, step length ``alpha``, evaluations, whether
    it converged, value floor ``64 eps scale``, initial gradient norm ``g0``, the values before the last
    ``window`` steps ``f_back``, and whether it stopped."""

    ids: Tensor
    x: Tensor
    f: Tensor
    gr: Tensor
    p: Tensor
    gp: Tensor
    alpha: Tensor
    evals: Tensor
    conv: Tensor
    floor: Tensor
    g0: Tensor
    f_back: Tensor
    stop: Tensor

    def select(self, keep: Tensor) -> None:
        """Keep only the blocks where ``keep``."""
        self.ids, self.x, self.f, self.gr, self.p = self.ids[keep], self.x[keep], self.f[keep], self.gr[keep], \
            self.p[keep]
        self.gp, self.alpha, self.evals, self.conv = self.gp[keep], self.alpha[keep], self.evals[keep], \
            self.conv[keep]
        self.floor, self.g0, self.f_back = self.floor[keep], self.g0[keep], self.f_back[keep]


def _start(prob: Balanced, x0: Tensor, scale: Tensor, window: int, eps: float) -> _Working:
    """Every block at ``x0``: one evaluation, steepest descent with step ``min(1, 1 / |g0|)``; a block with a
    zero gradient has converged, one with a non-finite value has stopped."""
    n = x0.shape[0]
    x = x0.clone()
    f, gr = prob.value_grad(x)
    floor = 64 * eps * scale
    g0 = torch.linalg.matrix_norm(gr)
    p = -gr
    gp = -_dot(gr, gr)
    alpha = (1.0 / g0.clamp_min(1e-300)).clamp(max=1.0)
    evals = torch.ones(n, dtype=torch.int64, device=x.device)
    f_back = torch.full((n, window), math.inf, dtype=torch.float64, device=x.device)  # f before the last steps
    conv = g0 <= 0
    stop = conv | ~torch.isfinite(f)
    return _Working(torch.arange(n, device=x.device), x, f, gr, p, gp, alpha, evals, conv, floor, g0, f_back, stop)


def _retire(w: _Working, out: LBFGSResult, hist: _History, prob: Balanced) -> Balanced:
    """Write the stopped blocks into ``out`` and drop them from the working set, the memory and the problem;
    returns the problem of the blocks left."""
    stop = w.stop
    out.x[w.ids[stop]], out.f[w.ids[stop]] = w.x[stop], w.f[stop]
    out.evaluations[w.ids[stop]], out.converged[w.ids[stop]] = w.evals[stop], w.conv[stop]
    keep = ~stop
    w.select(keep)
    hist.select(keep)
    prob = prob.select(keep)
    w.stop = torch.zeros(w.ids.numel(), dtype=torch.bool, device=w.ids.device)
    return prob


def _trial(prob: Balanced, w: _Working) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """One trial point ``x + alpha p`` per running block (frozen blocks take a zero step and are not evaluated);
    returns the running mask, the step, the gradient change and the trial value and gradient."""
    run = ~w.stop
    step = _where(run, w.alpha[:, None, None] * w.p, torch.zeros_like(w.p))
    xt = w.x + step
    if bool(run.all()):
        ft, gt = prob.value_grad(xt)
    else:
        idx = torch.nonzero(run).flatten()
        ft, gt = w.f.clone(), w.gr.clone()
        ft[idx], gt[idx] = prob.select(idx).value_grad(xt[idx])
    w.evals += run.long()
    return run, step, gt - w.gr, ft, gt


def _accept(w: _Working, ok: Tensor, step: Tensor, ft: Tensor, gt: Tensor, ss: Tensor, window: int, ftol: float,
            xtol: float, gtol: float) -> Tensor:
    """Move the blocks where ``ok`` (sufficient decrease) to their trial point, then the stopping rule: the
    decrease over ``window`` steps below ``window ftol max(|f|, floor)``, the step below ``xtol |x|`` or the
    gradient below ``gtol g0``. Returns the blocks that converged now."""
    w.f_back = _where(ok, torch.cat([w.f_back[:, 1:], w.f[:, None]], 1), w.f_back)
    w.x, w.f, w.gr = _where(ok, w.x + step, w.x), _where(ok, ft, w.f), _where(ok, gt, w.gr)
    small_f = (w.f_back[:, 0] - w.f) <= window * ftol * torch.maximum(w.f.abs(), w.floor)
    small_x = ss.sqrt() <= xtol * torch.linalg.matrix_norm(w.x)
    small_g = torch.linalg.matrix_norm(w.gr) <= gtol * w.g0
    done = ok & (small_f | small_x | small_g)
    w.conv |= done
    w.stop |= done
    return done


def _directions(w: _Working, hist: _History, need: Tensor, step: Tensor, y: Tensor, pair_ok: Tensor) -> None:
    """Store the pair ``(s, y)`` where ``pair_ok``; where ``need`` the new direction ``-H g`` (steepest descent
    when it is not a descent direction) with step length 1 (computed for the whole working set)."""
    gr = w.gr
    q = hist.push_apply(step.flatten(1), y.flatten(1), pair_ok, gr.flatten(1)).view_as(gr)
    if bool(need.any()):
        gpn = -_dot(gr, q)
        descent = gpn < 0  # else restart with steepest descent
        w.p = _where(need, _where(descent, -q, -gr), w.p)
        w.gp = _where(need, _where(descent, gpn, -_dot(gr, gr)), w.gp)
        w.alpha = _where(need, torch.ones_like(w.alpha), w.alpha)


def _backtrack(w: _Working, rej: Tensor, ft: Tensor, eps: float) -> None:
    """Shorten the step of the rejected trial points by quadratic interpolation (factor in ``[0.1, 0.5]``); a
    block whose step falls below ``eps |x|`` has stalled and stops."""
    alpha, gp = w.alpha, w.gp
    den = 2 * (ft - w.f - gp * alpha)
    trial = -gp * alpha ** 2 / torch.where(den > 0, den, torch.ones_like(den))
    trial = torch.where((den > 0) & torch.isfinite(trial), trial, 0.1 * alpha)
    w.alpha = torch.where(rej, torch.minimum(torch.maximum(trial, 0.1 * alpha), 0.5 * alpha), alpha)
    w.stop |= rej & (w.alpha * torch.linalg.matrix_norm(w.p) <= eps * torch.linalg.matrix_norm(w.x))  # stalled


def solve_gl(g: Grams, mode: str = "full", *, max_iter: int = 500, xtol: float = 1e-14,
             max_cond: float = 1e6, u0: Tensor | None = None, label: str = "GL",
             ftol: float = 1e-9, gtol: float = 1e-12, memory: int = 5) -> GLSolution:
    """Minimise ``L(U)`` over ``U in GL(d)`` for every block at once (see the module docstring).

    ``mode``: ``"none"`` (identity), ``"orthogonal"`` (Procrustes) or ``"full"`` (L-BFGS in
    balanced coordinates from Procrustes, stopping rule ``ftol``/``xtol``/``gtol`` per block,
    at most ``max_iter`` evaluations). Float64 throughout. ``iterations`` counts objective
    evaluations; ``converged`` is False for blocks that used them all or stalled.
    """
    n, d = g.n, g.d
    dev = g.co_bb.device
    eye = torch.eye(d, dtype=torch.float64, device=dev).expand(n, d, d)
    zeros = torch.zeros(n, dtype=torch.int64, device=dev)
    if mode == "none" or n == 0:
        u = eye.clone()
        return GLSolution(u, g.objective(u, u), zeros, torch.ones(n, dtype=torch.bool, device=dev),
                          torch.ones(n, dtype=torch.float64, device=dev), torch.zeros(n, dtype=torch.bool, device=dev))
    uo = orthogonal_solution(g) if u0 is None else u0
    fo = g.objective(uo, uo.mT if u0 is None else None)
    if mode == "orthogonal":
        return GLSolution(uo, fo, zeros, torch.ones(n, dtype=torch.bool, device=dev), condition(uo),
                          torch.zeros(n, dtype=torch.bool, device=dev))
    if mode != "full":
        raise ValueError(f"unknown stage-2 mode {mode!r}; use 'none', 'orthogonal' or 'full'")
    u, evaluations, converged = _lbfgs_chunks(g, uo, memory=memory, max_iter=max_iter, ftol=ftol, gtol=gtol,
                                              xtol=xtol)
    v, info = torch.linalg.inv_ex(u)
    f = torch.where(info == 0, g.objective(u, v), torch.full_like(fo, math.inf))
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
    return GLSolution(u, f, evaluations, converged, cond, fallback)


def _lbfgs_chunks(g: Grams, uo: Tensor, **options) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`lbfgs` from ``uo`` in balanced coordinates, on chunks of blocks that bound the solver's working
    memory (~40 ``(n, d, d)`` float64 tensors, one thread); returns ``U``, the evaluations and whether each block
    converged."""
    n, d = g.n, g.d
    size = max(1, CHUNK_BYTES // (40 * 8 * d * d))
    parts = []
    for lo in range(0, n, size):
        sub = g.select(torch.arange(lo, min(n, lo + size), device=g.co_bb.device))
        prob = balance(sub)
        with one_thread():
            res = lbfgs(prob, uo[lo:lo + size] @ prob.m, sub.scale().clamp_min(1e-300), **options)
        parts.append((res.x @ prob.m_inv, res.evaluations, res.converged))
    u, evaluations, converged = (torch.cat(t) for t in zip(*parts))
    return u, evaluations, converged
