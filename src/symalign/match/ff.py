r"""The permutation step of whole-model matching: one linear assignment per space.

For a permutation space (FF hidden units ``ff.i``, or a permuted residual stream)
stack, for each unit, every row it owns across the tensors the space acts on
(``[W_in ; b_in ; W_out^T]`` for an MLP). With ``C = sum X_A X_B^T`` (``C[i, j] =
<unit i of A, unit j of B>``), the permutation maximising ``sum_i C[i, perm[i]]``
minimises ``sum ||A - P B||^2`` (norms are permutation invariant); it is found
exactly by ``scipy.optimize.linear_sum_assignment``. Convention: new unit ``i`` of
B' is old unit ``perm[i]`` of B (:class:`symalign.groups.Permutation`).

ReLU units also scale (``relu(s z) = s relu(z)``, ``s > 0``): their group is the
positive monomials :class:`symalign.groups.PositiveMonomial`, solved by
:func:`match_monomial` (exactly: one assignment on the per-pair costs with each
pair's best scale).
"""

from __future__ import annotations

import torch
from torch import Tensor

from symalign.groups import PositiveMonomial, assign_max
from symalign.match.residual import axis_rows


assign = assign_max
"""``perm`` maximising ``sum_i c[i, perm[i]]`` (int64): :func:`symalign.groups.assign_max`."""


# ----------------------------------------------------------------------------
# ReLU units: permutation and positive per-unit scaling
# ----------------------------------------------------------------------------


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


def match_monomial(pairs, state_a, state_b, n: int, max_scale: float = 1e4) -> Tensor:
    r"""``argmin_{(perm, s)} sum_t ||A_t - T B_t||^2`` over positive monomials ``T = diag(s) P`` (ReLU units),
    solved exactly.

    For the given ``(tensor, action)`` pairs of one space, unit ``i`` of B' is
    ``s_i`` times unit ``perm[i]`` of B on covariant axes (``fc_in`` rows, bias) and
    ``1/s_i`` times it on contravariant ones (``fc_out`` columns). With
    ``Q = sum_co X_A X_B^T``, ``T = sum_contra X_A X_B^T`` and the row norms
    ``p_j = sum_co |X_B^j|^2``, ``r_j = sum_contra |X_B^j|^2``, the distance is, up to a
    constant, ``sum_i f_{i, perm[i]}(s_i)`` with
    ``f_ij(s) = p_j s^2 - 2 Q_ij s + r_j s^{-2} - 2 T_ij s^{-1}``. Given the pairing, the
    scales separate, so
    ``min_{perm, s} = min_perm sum_i c_{i, perm[i]}`` with ``c_ij = min_{s > 0} f_ij(s)``
    (:func:`pair_costs`): one linear assignment on ``c`` gives the exact joint minimiser,
    and ``s_i`` is the minimiser of the chosen pair. (Alternating assignment and scales
    instead stops at a block-wise fixed point that is not, in general, the minimum.)

    Returns the element ``[perm; s]`` of :class:`symalign.groups.PositiveMonomial`.
    """
    q = torch.zeros(n, n, dtype=torch.float64)
    tt = torch.zeros(n, n, dtype=torch.float64)
    p = torch.zeros(n, dtype=torch.float64)
    r = torch.zeros(n, dtype=torch.float64)
    for name, a in pairs:
        xa, xb = axis_rows(state_a[name], a), axis_rows(state_b[name], a)
        if a.variance == "co":
            q += xa @ xb.T
            p += xb.pow(2).sum(1)
        else:
            tt += xa @ xb.T
            r += xb.pow(2).sum(1)
    cost, scale = pair_costs(q, tt, p, r, max_scale)
    perm = assign(-cost)
    return PositiveMonomial.pack(perm, scale[torch.arange(n), perm])
