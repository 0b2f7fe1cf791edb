"""Positive monomials (ReLU units): the exact block minimiser of weight matching over one scale per unit.

``f(s) = p s^2 - 2 q s + r s^{-2} - 2 t s^{-1}`` is minimised over ``s > 0`` through the roots of its quartic
``f'(s) = 0`` (companion-matrix eigenvalues polished by Newton steps), batched over units and pairings.
"""

from __future__ import annotations

import torch
from torch import Tensor


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
    ``x^4 - (q s0^3 / r) x^3 + (t s0 / r) x - 1 = 0``, whose roots are the eigenvalues of
    the (batched) companion matrix; each positive real part is polished by ``polish``
    Newton steps. ``f`` may have two local minima (``q, t > 0``), so every candidate --
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
    comp = torch.zeros(p.shape[0], 4, 4, dtype=torch.float64)
    comp[:, 0, 0], comp[:, 0, 2], comp[:, 0, 3] = -a3, -a1, 1.0
    comp[:, 1, 0] = comp[:, 2, 1] = comp[:, 3, 2] = 1.0
    x = _newton(torch.linalg.eigvals(comp).real, a3[:, None], a1[:, None], polish)
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
    # ~sqrt(eps): polish the chosen stationary point once more on the quartic itself.
    is_root = best.squeeze(1) < roots.shape[1]
    x = _newton((out / s0)[:, None], a3[:, None], a1[:, None], polish).squeeze(1)
    return torch.where(is_root, (s0 * x).clamp(lo, hi), out)


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
