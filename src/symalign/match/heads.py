r"""Stage 1: matching attention heads by a linear assignment on GL-invariant features.

For query head ``i`` of a layer (paper layout, biases as homogeneous rows):

* ``Mbar_i = W~_Q^i (C W_K^{k(i)})^T`` -- ``C`` centres the key weight over its
  input rows (the paper's row-centring of ``M_i``, removing the softmax shift
  along ``1``); without RoPE the key-bias row is dropped (it only adds a
  per-query constant to the scores), under RoPE it is kept;
* ``N_i = W~_V^{k(i)} (W_O^i)^T`` (``(D+1) x D``: V rows incl. bias, O output rows).

``k(i) = i // g`` is the K/V group under GQA. Both are invariant under the
per-head ``GL``/``H`` actions, so the cost ``C_ij = ||Mbar_i^A - Mbar_j^B||^2 +
||N_i^A - N_j^B||^2`` is unaffected by stage 2's freedom. It is computed without
``D x D`` products, from ``d x d`` Gram blocks:

    ||X Y^T||^2 = sum((X^T X) * (Y^T Y)),   <X Y^T, Z W^T> = sum((X^T Z) * (Y^T W)),

all pairs of heads at once by one matrix product per side
(``(h d, R) @ (R, h d)``). Layers are processed one at a time to bound memory.

Precision. Those products (``2 (h d)^2 R`` flops per side, the bulk of stage 1)
run in a chosen ``dtype``; the elementwise reductions and the cost are float64.
:func:`match_attention <symalign.match.api.match_attention>` uses the weights' own
precision (float32 for float32 weights, about twice the float64 GEMM rate). With
unit roundoff ``u`` (``2^-24`` for float32) and ``gamma_R = R u / (1 - R u)``, every
computed Gram entry ``x^T y`` has ``|error| <= gamma_R ||x|| ||y||``, so by
Cauchy-Schwarz each of the cost's sums of products ``sum_ab (X^T X')_ab (Y^T Y')_ab``
errs by at most ``delta ||X|| ||Y|| ||X'|| ||Y'||`` and

    |C~_ij - C_ij| <= delta (a_i + b_j)^2,  delta ~ 2 gamma_R + u  (:func:`rounding_delta`),
    a_i = sum over the side pairs of ||X_i^A||_F ||Y_i^A||_F  (b_j likewise for B),

hence the chosen permutation is optimal up to
``C(pi~) - C(pi*) <= 2 delta max_pi sum_i (a_i + b_pi(i))^2 <= 4 delta (sum_i a_i^2 +
sum_j b_j^2)`` (:func:`cost_error_bound`). ``delta ~ 5e-4`` at ``R = 4097`` in float32 is
the worst case; rounding errors of BLAS dot products are typically ``~ sqrt(R) u``.
Only near-ties can flip; planted (and any well-separated) assignments are exact.

GQA: only permutations in ``S_{h_kv} wr S_g`` are symmetries. The objective
``sum_i C[i, pi(i)]`` splits over K/V groups, so its exact minimum over the wreath
product is: ``Cg[k, l] = min_tau sum_a C[(k, a), (l, tau(a))]`` (a ``g x g``
assignment for each pair of groups), then an ``h_kv x h_kv`` assignment on ``Cg``.
"""

from __future__ import annotations

import itertools
import math
from typing import Mapping

import numpy as np
import torch
from torch import Tensor

from symalign.groups import HeadPermutation
from symalign.match.views import AttentionLayer, Part, head_rows


def _side_heads(state: Mapping[str, Tensor], parts: tuple[Part, ...], n_heads: int, d: int,
                centre: bool = False, drop_bias: bool = False,
                dtype: torch.dtype = torch.float64) -> list[tuple[Tensor, int]]:
    out = []
    for p in parts:
        if drop_bias and p.homogeneous:
            continue
        if centre and not p.homogeneous:  # centred in float64, then rounded once to dtype
            x, units = head_rows(p.read(state), p, d)
            x = (x - x.mean(dim=1, keepdim=True)).to(dtype)
        else:
            x, units = head_rows(p.read(state), p, d, dtype=dtype)
        out.append((x, units))
    return out


def _expand(units: int, n_heads: int, device: torch.device | None = None) -> Tensor:
    """Head -> unit index (identity, or ``i // g`` for a K/V axis under GQA), on ``device``."""
    return torch.arange(n_heads, device=device) // (n_heads // units)


def _cross(a_side, b_side, n_heads: int, d: int) -> Tensor:
    """``G[i, a, j, b] = (X_i^A)^T X_j^B`` summed over parts, ``(h, d, h, d)``."""
    total = torch.zeros(n_heads, d, n_heads, d, dtype=a_side[0][0].dtype, device=a_side[0][0].device)
    for (xa, units), (xb, _) in zip(a_side, b_side):
        r = xa.shape[1]
        g = xa.permute(0, 2, 1).reshape(units * d, r) @ xb.permute(1, 0, 2).reshape(r, units * d)
        g = g.view(units, d, units, d)
        if units != n_heads:
            idx = _expand(units, n_heads, g.device)
            g = g[idx][:, :, idx]
        total += g
    return total


def _self(side, n_heads: int, d: int) -> Tensor:
    """``X_i^T X_i`` summed over parts, ``(h, d, d)``."""
    total = torch.zeros(n_heads, d, d, dtype=side[0][0].dtype, device=side[0][0].device)
    for x, units in side:
        g = torch.einsum("ira,irb->iab", x, x)
        total += g[_expand(units, n_heads, g.device)] if units != n_heads else g
    return total


def _pair_cost(co_a, co_b, ct_a, ct_b, n_heads: int, d: int) -> Tensor:
    """``||X_i^A Y_i^A^T - X_j^B Y_j^B^T||^2`` for all pairs ``(i, j)``."""
    f64 = torch.float64  # products in the inputs' dtype, sums of products in float64
    na = (_self(co_a, n_heads, d) * _self(ct_a, n_heads, d)).sum((-1, -2), dtype=f64)
    nb = (_self(co_b, n_heads, d) * _self(ct_b, n_heads, d)).sum((-1, -2), dtype=f64)
    gx = _cross(co_a, co_b, n_heads, d)
    gy = _cross(ct_a, ct_b, n_heads, d)
    inner = (gx * gy).sum((1, 3), dtype=f64) if gx.dtype != f64 else torch.einsum("iajb,iajb->ij", gx, gy)
    return na[:, None] + nb[None, :] - 2 * inner


def _layer_sides(layer: AttentionLayer, state: Mapping[str, Tensor], dtype: torch.dtype):
    """``[(X side, Y side)]`` of the Q-K and V-O invariants (see the module docstring)."""
    h, d = layer.n_heads, layer.head_dim
    drop = layer.qk.rope is None  # the key bias only matters under RoPE
    return [(_side_heads(state, layer.qk.co, h, d, dtype=dtype),
             _side_heads(state, layer.qk.contra, h, d, centre=True, drop_bias=drop, dtype=dtype)),
            (_side_heads(state, layer.vo.co, h, d, dtype=dtype),
             _side_heads(state, layer.vo.contra, h, d, dtype=dtype))]


def head_cost(layer: AttentionLayer, state_a: Mapping[str, Tensor], state_b: Mapping[str, Tensor],
              dtype: torch.dtype = torch.float64) -> Tensor:
    """Stage-1 cost matrix ``C[i, j]`` (head ``i`` of A vs head ``j`` of B), ``(h, h)`` float64.

    ``dtype``: precision of the Gram products (see the module docstring for the error
    bound, :func:`cost_error_bound`).
    """
    h, d = layer.n_heads, layer.head_dim
    sides_a, sides_b = _layer_sides(layer, state_a, dtype), _layer_sides(layer, state_b, dtype)
    cost = torch.zeros(h, h, dtype=torch.float64, device=sides_a[0][0][0][0].device)  # where the tensors are
    for (xa, ya), (xb, yb) in zip(sides_a, sides_b):
        cost += _pair_cost(xa, xb, ya, yb, h, d)
    return cost.clamp_min(0.0)


def rounding_delta(rows: int, dtype: torch.dtype, d: int) -> float:
    """Relative error bound ``delta`` of one product term ``(X^T X')_ab (Y^T Y')_ab`` of the cost.

    ``delta = (1 + gamma_{rows+2})^2 (1 + u) (1 + gamma64_{d^2}) - 1``: each Gram entry is an
    inner product of ``rows`` terms of inputs rounded once to ``dtype`` (unit roundoff
    ``u``), the product of two entries is rounded once, and ``d^2`` products are summed
    in float64.
    """
    def gamma(n: int, uu: float) -> float:
        return math.inf if n * uu >= 1 else n * uu / (1 - n * uu)

    u = torch.finfo(dtype).eps / 2
    u64 = torch.finfo(torch.float64).eps / 2
    return (1 + gamma(rows + 2, u)) ** 2 * (1 + u) * (1 + gamma(d * d, u64)) - 1


def head_scales(layer: AttentionLayer, state: Mapping[str, Tensor]) -> Tensor:
    """``a_i = sum over the side pairs of ||X_i||_F ||Y_i||_F`` per query head, ``(h,)`` float64.

    With :func:`rounding_delta` ``delta``, ``|C~_ij - C_ij| <= delta (a_i^A + a_j^B)^2`` for the
    cost ``C~`` computed with rounded products (module docstring).
    """
    h = layer.n_heads
    sides = _layer_sides(layer, state, torch.float64)
    a = torch.zeros(h, dtype=torch.float64, device=sides[0][0][0][0].device)
    for x_side, y_side in sides:
        nx = sum(_per_head(x.pow(2).sum((1, 2)), units, h) for x, units in x_side)
        ny = sum(_per_head(y.pow(2).sum((1, 2)), units, h) for y, units in y_side)
        a += (nx * ny).sqrt()
    return a


def gram_rows(layer: AttentionLayer, state: Mapping[str, Tensor]) -> int:
    """The largest number of rows ``R`` entering one stage-1 Gram product."""
    return max(sum(x.shape[1] for x, _ in side) for pair in _layer_sides(layer, state, torch.float64)
               for side in pair)


def cost_error_bound(layer: AttentionLayer, state_a: Mapping[str, Tensor], state_b: Mapping[str, Tensor],
                     dtype: torch.dtype) -> float:
    """Bound on ``C(pi~) - C(pi*)`` when ``pi~`` is optimal for the cost computed with ``dtype``
    products: ``4 delta (sum_i a_i^2 + sum_j b_j^2)`` (module docstring, :func:`head_scales`)."""
    a, b = head_scales(layer, state_a), head_scales(layer, state_b)
    delta = rounding_delta(max(gram_rows(layer, state_a), gram_rows(layer, state_b)), dtype, layer.head_dim)
    return 4 * delta * float((a * a).sum() + (b * b).sum())


def _per_head(v: Tensor, units: int, n_heads: int) -> Tensor:
    """Per-unit values -> per-head (a K/V unit is shared by its ``g`` query heads)."""
    return v[_expand(units, n_heads)] if units != n_heads else v


def assign_heads(cost: Tensor, group: HeadPermutation) -> Tensor:
    """The element ``pi`` of ``group`` minimising ``sum_i cost[i, pi[i]]`` (exact, GQA-aware:
    :meth:`symalign.groups.HeadPermutation.assign`).

    ``cost[i, j]`` compares head ``i`` of A with head ``j`` of B; the result re-orders
    B: new head ``i`` of B' is old head ``pi[i]`` of B.
    """
    return group.assign(cost)


def objective(cost: Tensor, pi: Tensor) -> float:
    """Stage-1 objective ``sum_i cost[i, pi[i]]``."""
    return float(cost[torch.arange(cost.shape[0], device=cost.device), pi.to(cost.device)].sum())


def permutation_rank(cost: Tensor, pi: Tensor, group: HeadPermutation | None = None,
                     max_heads: int = 8) -> int:
    """Rank (1 = best) of ``pi`` among all elements of ``group`` (default ``S_h``) by the stage-1 objective.

    Brute force over ``h!`` permutations (``h <= max_heads``); ties count in ``pi``'s
    favour (rank = 1 + number of strictly better elements, with a relative tolerance
    of 1e-12).
    """
    h = cost.shape[0]
    if h > max_heads:
        raise ValueError(f"brute-force rank needs h <= {max_heads}, got {h}")
    c = cost.detach().cpu().numpy().astype(np.float64)
    mine = c[np.arange(h), pi.numpy()].sum()
    perms = np.array(list(itertools.permutations(range(h))))
    if group is not None:
        keep = [group.contains(torch.as_tensor(p)) for p in perms]
        perms = perms[np.array(keep)]
    vals = c[np.arange(h)[None, :], perms].sum(1)
    tol = 1e-12 * max(abs(mine), np.abs(c).max(), 1e-300)
    return int((vals < mine - tol).sum()) + 1


def best_and_identity(cost: Tensor, group: HeadPermutation | None = None) -> tuple[float, float]:
    """``(L_best, L_identity)`` by brute force (for :func:`lhat`)."""
    h = cost.shape[0]
    c = cost.detach().cpu().numpy().astype(np.float64)
    perms = np.array(list(itertools.permutations(range(h))))
    if group is not None:
        perms = perms[np.array([group.contains(torch.as_tensor(p)) for p in perms])]
    vals = c[np.arange(h)[None, :], perms].sum(1)
    return float(vals.min()), float(np.trace(c))


def lhat(l_method: float, l_best: float, l_identity: float) -> float:
    """``Lhat = 100 (L_method - L_best) / (L_identity - L_best)`` (0 when identity is already best)."""
    den = l_identity - l_best
    if den <= 0 or not math.isfinite(den):
        return 0.0
    return 100.0 * (l_method - l_best) / den
