r"""Approximate symmetries of RoPE: the slow planes aligned over ``GL`` (not an exact symmetry).

Under RoPE the exact Q-K group of a head is ``H = (C^x)^{d_h/2}``: per plane ``j`` a
nonzero complex scalar, because only matrices commuting with every rotation
``R(m theta_j)`` survive the position-dependent rotation of queries and keys. A plane
whose total rotation over the context, ``theta_j (T - 1)``, is small (a *slow* plane,
:func:`symalign.probe.theory.rope_planes`) is rotated almost not at all, so on the
``2k``-dimensional span ``S`` of ``k`` slow planes the rotations are nearly the identity
and any ``M in GL(S)`` nearly commutes with them: the probe's near-null singular values
(:mod:`symalign.probe.spectrum`). This module aligns that larger, approximate group.

**What is solved.** For B already aligned to A over the exact group (B', e.g. the
two-stage matcher's ``full`` result), per RoPE layer and K/V block, with ``X`` the
query rows and ``Y`` the key rows restricted to the columns ``S`` (paper layout),

    min_{M in GL(2k)} ||X_A[:, S] - X_B'[:, S] M^T||^2 + ||Y_A[:, S] - Y_B'[:, S] M^{-1}||^2,

by :func:`symalign.match.qk.solve_gl` from two starts, ``M = I`` (which never ends above B''s
distance) and the orthogonal Procrustes solution (the exact matcher's start), keeping the
better per block (the problem is not convex: from ``I`` alone a planted ``GL(4)`` element was
missed in one block of two, from Procrustes it was found); and the element applied is
``U = I`` on the other columns and ``M`` on ``S``. The objective separates over column sets
exactly (``U`` is block-diagonal over ``S`` and its complement), so the other planes keep B''s
exact optimum. ``GL(S)`` contains the slow planes' own complex scalars, so the result is at
least as close to A in weights as B'.

**What it costs.** ``U`` is not a symmetry: queries and keys at positions ``m, n`` meet
through ``R(n - m)`` on ``S``, which ``M`` does not commute with unless ``M`` is a
complex scalar per plane. The function changes; :class:`SlowPlaneMatch` carries the
planes, the distances, and is applied through a relaxed spec (the Q-K spaces of the
RoPE layers as ``PerHead(GL(d_h))``) -- callers must report the function change
(``benchmarks/rope_slow_planes.py`` does, on the evaluation data).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch
from torch import Tensor

from symalign.errors import MatchError
from symalign.groups import GeneralLinear, PerHead, RotaryPlanes, rotary_pairs
from symalign.match.api import _grams
from symalign.match.qk import solve_gl
from symalign.match.views import find_layers
from symalign.spec import SymmetrySpec, apply


def slow_columns(group: RotaryPlanes, planes: Sequence[int]) -> Tensor:
    """The head columns of RoPE planes ``planes`` (indices ``j < r/2`` of ``group``'s pairing), sorted."""
    half = group.r // 2
    bad = [j for j in planes if not 0 <= int(j) < half]
    if bad:
        raise MatchError(f"plane indices {bad} are outside the {half} planes of {group.describe()}")
    j0, j1 = rotary_pairs(group.r, group.pairing)
    idx = torch.tensor(sorted({int(j) for j in planes}), dtype=torch.long, device=j0.device)
    return torch.cat([j0[idx], j1[idx]]).sort().values


def relaxed_spec(spec: SymmetrySpec) -> SymmetrySpec:
    """``spec`` with every ``PerHead(RotaryPlanes)`` space replaced by ``PerHead(GL(d_h))`` (same blocks and
    tensors): the spec a :class:`SlowPlaneMatch` is applied through. Its elements are *not* symmetries."""
    spaces = {name: (PerHead(GeneralLinear(g.inner.n), g.n_blocks)  # type: ignore[attr-defined]
                     if g.head_block is not None and g.head_block.block_matcher == "rope" else g)
              for name, g in spec.spaces.items()}
    return SymmetrySpec(spaces, {t: list(a) for t, a in spec.tensors.items()}, dict(spec.couplings), dict(spec.info))


@dataclass
class SlowPlaneMatch:
    """The approximate alignment of the slow planes. ``transform`` maps each RoPE layer's Q-K space to its
    per-block ``(n_kv, d_h, d_h)`` element (identity outside the slow columns); ``planes``/``columns``
    are the slow planes and their columns; ``distance_before``/``distance_after`` are the Q-K distances
    ``||X_A - X_B||^2 + ||Y_A - Y_B||^2`` on the slow columns, summed over blocks, before and after."""

    transform: dict[str, Tensor]
    spec: SymmetrySpec = field(repr=False)
    planes: list[int]
    columns: list[int]
    distance_before: float
    distance_after: float
    condition: float
    exact: bool = False

    def apply(self, state_b: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """``U . state_b`` through the relaxed spec (changes the function unless no plane was relaxed)."""
        return apply(self.spec, self.transform, state_b)


def align_slow_planes(spec: SymmetrySpec, state_a: Mapping[str, Tensor], state_b: Mapping[str, Tensor],
                      planes: Sequence[int], *, max_iter: int = 500) -> SlowPlaneMatch:
    """Align the columns of RoPE ``planes`` of every RoPE Q-K space of ``spec`` over ``GL(2k)`` (module docstring).

    ``state_b`` should already be aligned over the exact group (the result only refines it). Every RoPE
    layer must share one group (width, pairing, rotary dims), so that ``planes`` means the same frequencies.
    With ``planes`` empty the transform is the identity and ``exact`` is True.
    """
    layers = [lay for lay in find_layers(spec, state_a) if lay.qk.rope is not None]
    if not layers:
        raise MatchError("the spec has no RoPE Q-K space; slow planes exist only under RoPE")
    groups = {lay.qk.rope for lay in layers}
    if len(groups) != 1:
        raise MatchError(f"the RoPE layers have different groups {sorted(g.describe() for g in groups)}; "
                         "align them one group at a time")
    group = groups.pop()
    dev = state_a[layers[0].qk.co[0].tensor].device
    cols = (slow_columns(group, planes) if len(planes) else torch.zeros(0, dtype=torch.long, device="cpu")).to(dev)
    d = group.n
    transform: dict[str, Tensor] = {}
    before = after = 0.0
    cond = 1.0
    for lay in layers:
        n = lay.n_kv
        u = torch.eye(d, dtype=torch.float64, device=dev).expand(n, d, d).clone()
        if cols.numel():
            g = _grams(lay.qk, state_a, state_b).columns(cols)
            k = cols.numel()
            eye = torch.eye(k, dtype=torch.float64, device=dev).expand(n, k, k).clone()
            label = f"slow planes, layer {lay.tag}"
            from_b = solve_gl(g, "full", u0=eye, max_iter=max_iter, label=label)  # never above B'
            from_procrustes = solve_gl(g, "full", max_iter=max_iter, label=label)
            better = from_procrustes.objective < from_b.objective
            m = torch.where(better[:, None, None], from_procrustes.u, from_b.u)
            f = torch.where(better, from_procrustes.objective, from_b.objective)
            before += float(g.objective(eye, eye).sum())
            after += float(f.sum())
            cond = max(cond, float(torch.where(better, from_procrustes.cond, from_b.cond).max()))
            u[:, cols.unsqueeze(1), cols.unsqueeze(0)] = m
        transform[lay.qk.name] = u
    return SlowPlaneMatch(transform, relaxed_spec(spec), sorted({int(j) for j in planes}), cols.tolist(),
                          before, after, cond, exact=not cols.numel())
