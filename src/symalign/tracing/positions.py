r"""The Q-K group of an attention layer whose queries/keys pass through a position-dependent map.

Between a head-split projection ``x`` (``(..., h, T, d)``) and the query fed to
attention, a model may apply a map ``q = f(x)`` (RoPE: a rotation of each plane by
``m theta_j`` at position ``m``). The tracer identifies ``f`` numerically on the
example inputs: it re-runs only the graph nodes between ``x`` and ``q`` with probes
``e_j`` (one-hot along the head axis ``d``, equal at every other index), reads the
matrices ``M[idx]`` (``q[idx] = M[idx] x[idx]`` for every index ``idx`` of the
other axes) and checks on a random probe that ``f`` is exactly this linear map
(no offset, nothing mixed across indices).

The maps must not depend on the batch or the head (else the head permutation would
change the function); they may depend on one more axis, the positions. The scores are
``q_m^T k_n = x_m^T N_{mn} y_n`` with ``N_{mn} = Mq_m^T Mk_n``, and an element ``A`` of
the per-head Q-K group (``x -> A x``, ``y -> A^{-T} y``) keeps them iff
``A^T N_{mn} = N_{mn} A^T`` for every pair. The group chosen is the largest of
``GL(d)``, ``RotaryPlanes(d, pairing, r)`` (``H(r) (+) GL(d - r)``, both pairings, every
even ``r``) whose generic random element commutes with every ``N_{mn}`` to ``1e-12``
relative (``1e-6`` when the map computes in float32); ``None`` when none does.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from symalign.groups import GeneralLinear, MatrixGroup, RotaryPlanes


def identify_map(run: Callable[[Tensor], Tensor], x: Tensor, d_axis: int, gen: torch.Generator,
                 tol: float = 1e-12) -> Tensor | None:
    """``M`` of shape ``(*other_axes, d, d)`` with ``run(p)[idx] = M[idx] p[idx]``, or None if ``run`` is not such a
    map."""
    d = x.shape[d_axis]
    cols = []
    for j in range(d):
        p = torch.zeros_like(x)
        p.narrow(d_axis, j, 1).fill_(1.0)
        y = run(p)
        if y is None or y.shape != x.shape:
            return None
        cols.append(torch.movedim(y, d_axis, -1).to(torch.float64))
    m = torch.stack(cols, dim=-1)  # (*other, d_out, d_in)
    r = torch.randn(x.shape, generator=gen, dtype=torch.float64).to(x.dtype)
    y = run(r)
    want = (m @ torch.movedim(r, d_axis, -1).to(torch.float64).unsqueeze(-1)).squeeze(-1)
    got = torch.movedim(y, d_axis, -1).to(torch.float64)
    if float((got - want).abs().max()) > tol * max(1.0, float(want.abs().max())):
        return None
    return m


def position_maps(m: Tensor, head_axis: int, d_axis: int, tol: float = 1e-12) -> tuple[Tensor | None, str]:
    """The per-position maps ``(T, d, d)`` from ``M`` (``(*other, d, d)``), or None and why.

    ``head_axis``/``d_axis`` index the original tensor; ``M``'s leading axes are the
    tensor's axes without ``d_axis``. The map must be constant along every axis but one.
    """
    nd = m.dim() - 2 + 1
    axes = [a for a in range(nd) if a != d_axis % nd]
    varying = []
    for k, a in enumerate(axes):
        if m.shape[k] == 1:
            continue
        first = m.narrow(k, 0, 1)
        if float((m - first).abs().max()) > tol * max(1.0, float(m.abs().max())):
            if a == head_axis % nd:
                return None, "the position map differs between heads"
            varying.append(k)
    if len(varying) > 1:
        return None, "the position map depends on more than one axis (batch?)"
    if not varying:
        return m.reshape(-1, m.shape[-2], m.shape[-1])[:1], ""
    k = varying[0]
    idx = [0] * (m.dim() - 2)
    idx[k] = slice(None)
    return m[tuple(idx)], ""


def candidates(d: int) -> list[MatrixGroup]:
    """``GL(d)``, then ``H(r) (+) GL(d - r)`` for both pairings and ``r = d, d-2, ..., 2``, largest group first."""
    out: list[MatrixGroup] = [GeneralLinear(d)]
    rot = [RotaryPlanes(d, p, r) for r in range(d if d % 2 == 0 else d - 1, 0, -2) for p in ("half", "interleaved")]
    return out + sorted(rot, key=lambda g: -g.dim)


def qk_group(mq: Tensor, mk: Tensor, gen: torch.Generator, tol: float = 1e-12) -> MatrixGroup | None:
    """The largest candidate group keeping every ``N_{mn} = Mq_m^T Mk_n`` (see the module docstring)."""
    d = mq.shape[-1]
    n = torch.einsum("mji,njk->mnik", mq.to(torch.float64), mk.to(torch.float64)).reshape(-1, d, d)
    scale = max(1.0, float(n.abs().max()))
    for g in candidates(d):
        a = g.sample(gen).T
        if float((a @ n - n @ a).abs().max()) <= tol * scale * float(a.abs().max()):
            return g
    return None
