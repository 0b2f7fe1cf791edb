r"""Matching under QK-norm: head permutations, plane signs on Q-K, gain rescalings, ``GL`` on V-O.

With per-head (Qwen3, Gemma 3) or all-heads (OLMo 2) RMS normalisation of Q and K
and learned gains, the Q-K group of a K/V block is
:class:`~symalign.groups.PlaneSigns` (``+-1`` per RoPE plane), and the gains carry
:class:`~symalign.groups.PlaneScales` (``g_q -> c g_q``, ``g_k -> g_k / c`` per plane).
See docs/symmetry.md ("QK-norm") for the derivation.

:func:`match_qknorm` runs the two-stage matcher on the *relaxed* spec in which each
``PlaneSigns`` Q-K space is replaced by the RoPE group ``H (+) GL`` it is a subgroup
of (``GL`` when RoPE is proportional -- its turning planes are not the first ``r``
dimensions' -- or absent): stage 1's head costs are invariant under ``H`` hence under
the signs, and the V-O solution is unaffected (the V-O spaces are untouched). Its Q-K elements are then
discarded and replaced by the exact optimum over the signs, per block and plane (under a
centring QK-norm -- Phi's ``qk_layernorm``, Q-K group :class:`~symalign.groups.PlaneIdentity` --
by the identity, and the gain spaces act on the norms' biases as well)::

    s_p = sign( sum_{Q, K rows} < a_p, b'_p > )          (b' = head-permuted B)

(``||a - s b||^2 = ||a||^2 + ||b||^2 - 2 s <a, b>``, and Q rows enter covariantly,
K rows contravariantly, both multiplied by ``s``). The gain scale of each plane
minimises ``f(c) = ||a_q - c b_q||^2 + ||a_k - b_k / c||^2`` over ``c > 0`` (a grid
over ``log c``, then Newton steps); a planted scale is recovered exactly.

Under a clamp of V (OLMoE's ``clip_qkv``) the V-O space is a per-block
:class:`~symalign.groups.SignedPermutations`: it is widened to ``GL(d)`` for the relaxed
match as well, and its element replaced by the exact optimum over signed permutations,
``argmax_T <T, M>`` with ``M = sum_{V rows} a b'^T + sum_{O columns} a b'^T`` per block
(``T^{-T} = T``, so both sides enter alike).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

import torch
from torch import Tensor

from symalign.errors import MatchError
from symalign.groups import GeneralLinear, PerHead, PlaneIdentity, PlaneScales, PlaneSigns, RotaryPlanes, \
    SignedPermutations
from symalign.spec import SymmetrySpec, apply, segment_view

GRID = torch.linspace(-6.0, 6.0, 241, dtype=torch.float64)


def has_qknorm(spec: SymmetrySpec) -> bool:
    """Whether any space is a per-head :class:`PlaneSigns`, :class:`PlaneIdentity` or :class:`PlaneScales` group."""
    return any(isinstance(g, PerHead) and isinstance(g.inner, (PlaneSigns, PlaneIdentity, PlaneScales,
                                                                SignedPermutations))
               for g in spec.spaces.values())


def relaxed(spec: SymmetrySpec) -> SymmetrySpec:
    """The spec with ``PlaneSigns`` / ``PlaneIdentity`` Q-K spaces widened to ``H (+) GL`` and gain spaces dropped."""
    keep = [n for n, g in spec.spaces.items() if not (isinstance(g, PerHead) and isinstance(g.inner, PlaneScales))]
    out = spec.restrict(keep)
    for n, g in out.spaces.items():
        if isinstance(g, PerHead) and isinstance(g.inner, (PlaneSigns, PlaneIdentity)):
            s = g.inner
            # proportional RoPE's planes are not those of a partial H (+) GL: widen to GL (no rotation: GL too)
            wide = GeneralLinear(s.n) if (s.proportional and s.r < s.n) or s.r == 0 else RotaryPlanes(s.n, s.pairing,
                                                                                                       s.r)
            out.spaces[n] = replace(g, inner=wide)
        elif isinstance(g, PerHead) and isinstance(g.inner, SignedPermutations):
            out.spaces[n] = replace(g, inner=GeneralLinear(g.inner.n))
    return out


def _heads_applied(spec: SymmetrySpec, transform: Mapping[str, Tensor], t: str, x: Tensor) -> Tensor:
    """``x`` with the head permutations of ``transform`` applied (heads act first)."""
    for a in spec.tensors[t]:
        g = spec.spaces[a.space]
        if a.space in transform and not isinstance(g, PerHead):
            view = x if a.segment is None else segment_view(x, a.axis, a.segment)
            x = g.act(transform[a.space], view, a.axis, a.variance, a.rep)
    return x


def _unit_products(spec: SymmetrySpec, space: str, transform: Mapping[str, Tensor], state_a, state_b,
                   variance: str) -> tuple[Tensor, Tensor]:
    """Per (block, unit): ``sum <a, b'>`` and ``sum ||b'||^2`` over the tensors on one side."""
    g: PerHead = spec.spaces[space]  # type: ignore[assignment]
    inner = g.inner
    nb, d = g.n_blocks, inner.n
    ab = torch.zeros(nb, d, dtype=torch.float64)
    bb = torch.zeros(nb, d, dtype=torch.float64)
    for t, a in spec.tensors_of(space):
        if a.variance != variance:
            continue
        off = float(getattr(g, "offset", 0.0))  # gains stored as w with effective gain offset + w
        xa = state_a[t] if a.segment is None else segment_view(state_a[t], a.axis, a.segment)
        xa = xa + off if off else xa
        xb = _heads_applied(spec, transform, t, state_b[t])
        xb = xb + off if off else xb
        if a.segment is not None:
            xb = segment_view(xb, a.axis, a.segment)
        va = torch.movedim(xa.to(torch.float64), a.axis, 0)
        vb = torch.movedim(xb.to(torch.float64), a.axis, 0)
        va = va.reshape(nb, -1, d, *va.shape[1:]).movedim(2, -1).reshape(nb, -1, d)
        vb = vb.reshape(nb, -1, d, *vb.shape[1:]).movedim(2, -1).reshape(nb, -1, d)
        ab += (va * vb).sum(1)
        bb += (vb * vb).sum(1)
    idx = inner.plane_index()
    units = torch.zeros(nb, inner.units, dtype=torch.float64)
    return units.index_add(1, idx, ab), torch.zeros_like(units).index_add(1, idx, bb)


def solve_signs(spec: SymmetrySpec, space: str, transform, state_a, state_b) -> Tensor:
    """The optimal :class:`PlaneSigns` element per block (``(n_blocks, d, d)``)."""
    g: PerHead = spec.spaces[space]  # type: ignore[assignment]
    co, _ = _unit_products(spec, space, transform, state_a, state_b, "co")
    ct, _ = _unit_products(spec, space, transform, state_a, state_b, "contra")
    s = torch.where(co + ct >= 0, 1.0, -1.0).to(torch.float64)
    return g.inner.from_units(s)


def solve_signed_permutations(spec: SymmetrySpec, space: str, transform, state_a, state_b) -> Tensor:
    """The optimal :class:`SignedPermutations` element per block: ``argmax_T <T, M_k>`` with ``M_k`` the
    sum over the space's tensors of ``a_k b'_k^T`` (rows of block ``k``; ``b'`` head-permuted B)."""
    g: PerHead = spec.spaces[space]  # type: ignore[assignment]
    nb, d = g.n_blocks, g.inner.n
    m = torch.zeros(nb, d, d, dtype=torch.float64)
    for t, a in spec.tensors_of(space):
        xa = state_a[t] if a.segment is None else segment_view(state_a[t], a.axis, a.segment)
        xb = _heads_applied(spec, transform, t, state_b[t])
        if a.segment is not None:
            xb = segment_view(xb, a.axis, a.segment)
        va = torch.movedim(xa.to(torch.float64), a.axis, 0)
        vb = torch.movedim(xb.to(torch.float64), a.axis, 0)
        va = va.reshape(nb, -1, d, *va.shape[1:]).movedim(2, 1).reshape(nb, d, -1)
        vb = vb.reshape(nb, -1, d, *vb.shape[1:]).movedim(2, 1).reshape(nb, d, -1)
        m += va @ vb.mT
    return torch.stack([g.inner.nearest(m[k]) for k in range(nb)])


def solve_scales(spec: SymmetrySpec, space: str, transform, state_a, state_b, newton: int = 60) -> Tensor:
    """The optimal :class:`PlaneScales` element per block: ``argmin_c ||a_q - c b_q||^2 + ||a_k - b_k/c||^2``."""
    g: PerHead = spec.spaces[space]  # type: ignore[assignment]
    a1, b1 = _unit_products(spec, space, transform, state_a, state_b, "co")
    a2, b2 = _unit_products(spec, space, transform, state_a, state_b, "contra")

    def f(c):
        return c * c * b1 - 2 * c * a1 + b2 / (c * c) - 2 * a2 / c

    cs = GRID.exp().view(-1, 1, 1)
    c = torch.gather(GRID.exp().expand(*a1.shape, -1), -1, f(cs).argmin(0).unsqueeze(-1)).squeeze(-1)
    for _ in range(newton):
        d1 = 2 * c * b1 - 2 * a1 - 2 * b2 / c ** 3 + 2 * a2 / c ** 2
        d2 = 2 * b1 + 6 * b2 / c ** 4 - 4 * a2 / c ** 3
        step = torch.where(d2 > 0, d1 / d2, torch.zeros_like(d1))
        new = torch.where(c - step > 0, c - step, c / 2)
        c = torch.where(f(new) <= f(c), new, c)
    if not bool(torch.isfinite(c).all()):
        raise MatchError(f"space {space!r}: non-finite QK-norm gain scale (zero gains?)")
    return g.inner.from_units(c)


def match_qknorm(spec: SymmetrySpec, state_a: Mapping[str, Tensor], state_b: Mapping[str, Tensor],
                 **kw: Any):
    """:func:`symalign.match.match_attention` for specs with QK-norm spaces (see the module docstring)."""
    from symalign.match.api import AttentionMatch, match_attention

    spec_b = kw.pop("spec_b", None)
    if spec_b is not None and spec_b.describe() != spec.describe():
        raise MatchError("the models have different symmetry specs (QK-norm groups differ)")
    base = match_attention(relaxed(spec), state_a, state_b, spec_b=None, **kw)
    transform = dict(base.transform)
    stage2 = kw.get("stage2", "full")
    for name, g in spec.spaces.items():
        if not (isinstance(g, PerHead) and isinstance(g.inner, (PlaneSigns, PlaneIdentity, PlaneScales,
                                                                SignedPermutations))):
            continue
        if stage2 == "none" or isinstance(g.inner, PlaneIdentity):
            transform[name] = g.identity()
        elif isinstance(g.inner, SignedPermutations):
            transform[name] = solve_signed_permutations(spec, name, transform, state_a, state_b)
        elif isinstance(g.inner, PlaneSigns):
            transform[name] = solve_signs(spec, name, transform, state_a, state_b)
        else:
            transform[name] = solve_scales(spec, name, transform, state_a, state_b)
    if stage2 != "none":  # Q-K distances after the exact (sign) solution, not the relaxed one
        from symalign.match.api import _direct_distance
        from symalign.match.views import find_layers

        rel = relaxed(spec)
        out_b = apply(rel, {k: v for k, v in transform.items() if k in rel.spaces}, state_b)
        for lay, view in zip(base.layers, find_layers(rel, state_a)):
            lay.qk_after = _direct_distance(view.qk, state_a, out_b).tolist()
            lay.qk_cond = [1.0] * len(lay.qk_after)
            if isinstance(getattr(spec.spaces.get(view.vo.name), "inner", None), SignedPermutations):
                lay.vo_after = _direct_distance(view.vo, state_a, out_b).tolist()
                lay.vo_cond = [1.0] * len(lay.vo_after)
        base.totals["distance_after"] = sum(sum(d.qk_after) + sum(d.vo_after) for d in base.layers)
    for lay in base.layers:
        qk = spec.spaces.get(f"qk.{lay.tag}")
        if qk is not None:
            lay.encoding = qk.inner.describe()  # type: ignore[union-attr]
    return AttentionMatch(transform, base.layers, spec, base.stage1, base.stage2, base.totals)
