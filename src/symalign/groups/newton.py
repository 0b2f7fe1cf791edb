"""Positive monomials (ReLU units): the exact block minimiser of weight matching over one scale per unit.

``f(s) = p s^2 - 2 q s + r s^{-2} - 2 t s^{-1}`` is minimised over ``s > 0`` through the roots of its quartic
``f'(s) = 0`` (in closed form, :func:`quartic_roots`, polished by Newton steps), batched over units and pairings.
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
