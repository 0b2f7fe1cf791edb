r"""Matching under QK-norm: head permutations, plane signs on Q-K, gain rescalings, ``GL`` on V-O.

With per-head (Qwen3, Gemma 3) or all-heads (OLMo 2) RMS normalisation of Q and K
and learned gains, the Q-K group of a K/V block is
:class:`~symalign.groups.PlaneSigns` (``+-1`` per RoPE plane), and the gains carry
:class:`~symalign.groups.PlaneScales` (``g_q -> c g_q``, ``g_k -> g_k / c`` per plane).
See docs/symmetry.md ("QK-norm") for the derivation.

:func:`symalign.match.match_attention` runs the two-stage matcher on the *relaxed* spec (:func:`relaxed`)
in which each ``PlaneSigns`` Q-K space is replaced by the RoPE group ``H (+) GL`` it is a subgroup
of (``GL`` when RoPE is proportional -- its turning planes are not the first ``r``
dimensions' -- or absent; :meth:`~symalign.groups.MatrixGroup.relaxation`): stage 1's head costs
are invariant under ``H`` hence under the signs, and the V-O solution is unaffected (the V-O spaces are
untouched). Its Q-K elements are then discarded and replaced by the exact optimum over the signs, per block
and plane (:func:`exact_solutions`; under a centring QK-norm -- Phi's ``qk_layernorm``, Q-K group
:class:`~symalign.groups.PlaneIdentity` -- by the identity, and the gain spaces act on the norms' biases as well)::

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

Which exact step a per-head space takes is the block group's
:attr:`~symalign.groups.MatrixGroup.block_matcher` (``"signs"``, ``"identity"``, ``"scales"``,
``"signed-permutations"``); this module never tests a group's class.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

import torch
from torch import Tensor

from symalign.errors import MatchError
from symalign.groups import Group
from symalign.match.views import direct_distance, find_layers
from symalign.spec import SymmetrySpec, Transform, apply, segment_view

GRID = torch.linspace(-6.0, 6.0, 241, dtype=torch.float64)
EXACT_STEPS = ("signs", "identity", "scales", "signed-permutations")
"""The block matchers (:attr:`~symalign.groups.MatrixGroup.block_matcher`) solved here, on top of the relaxed match."""


def exact_step(g: Group | None) -> str | None:
    """The exact step of a per-head space of group ``g`` (one of :data:`EXACT_STEPS`), or ``None`` when the
    two-stage matcher solves it directly (or it is not a per-head space)."""
    block = None if g is None else g.head_block
    step = None if block is None else block.block_matcher  # type: ignore[attr-defined]
    return step if step in EXACT_STEPS else None


def has_qknorm(spec: SymmetrySpec) -> bool:
    """Whether any per-head space has an exact step: QK-norm plane signs, identity or gain scales, or the
    signed permutations of a clamped V-O."""
    return any(exact_step(g) is not None for g in spec.spaces.values())


def relaxed(spec: SymmetrySpec) -> SymmetrySpec:
    """The spec with every per-head space of an exact step widened to its block group's
    :meth:`~symalign.groups.MatrixGroup.relaxation` (``H (+) GL`` or ``GL``), and the gain spaces dropped."""
    keep = [n for n, g in spec.spaces.items() if exact_step(g) != "scales"]
    out = spec.restrict(keep)
    for n, g in out.spaces.items():
        if exact_step(g) is not None:
            out.spaces[n] = replace(g, inner=g.head_block.relaxation())  # type: ignore[union-attr]
    return out


def _heads_applied(spec: SymmetrySpec, transform: Mapping[str, Tensor], t: str, x: Tensor) -> Tensor:
    """``x`` with the head permutations of ``transform`` applied (heads act first)."""
    for a in spec.tensors[t]:
        g = spec.spaces[a.space]
        if a.space in transform and g.head_block is None:
            view = x if a.segment is None else segment_view(x, a.axis, a.segment)
            x = g.act(transform[a.space], view, a.axis, a.variance, a.rep)
    return x


def _device_of(spec: SymmetrySpec, space: str, state: Mapping[str, Tensor]) -> torch.device:
    """The device of the weights on ``space`` (the first tensor acted on): where its accumulators live."""
    t, _ = next(iter(spec.tensors_of(space)))
    return state[t].device


def _unit_products(spec: SymmetrySpec, space: str, transform: Mapping[str, Tensor], state_a, state_b,
                   variance: str) -> tuple[Tensor, Tensor]:
    """Per (block, unit): ``sum <a, b'>`` and ``sum ||b'||^2`` over the tensors on one side."""
    g: Any = spec.spaces[space]  # a per-head space
    inner = g.inner
    nb, d = g.n_blocks, inner.n
    dev = _device_of(spec, space, state_a)
    ab = torch.zeros(nb, d, dtype=torch.float64, device=dev)
    bb = torch.zeros(nb, d, dtype=torch.float64, device=dev)
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
    idx = inner.plane_index().to(dev)
    units = torch.zeros(nb, inner.units, dtype=torch.float64, device=dev)
    return units.index_add(1, idx, ab), torch.zeros_like(units).index_add(1, idx, bb)


def solve_signs(spec: SymmetrySpec, space: str, transform, state_a, state_b) -> Tensor:
    """The optimal :class:`~symalign.groups.PlaneSigns` element per block (``(n_blocks, d, d)``)."""
    g: Any = spec.spaces[space]  # a per-head space
    co, _ = _unit_products(spec, space, transform, state_a, state_b, "co")
    ct, _ = _unit_products(spec, space, transform, state_a, state_b, "contra")
    s = torch.where(co + ct >= 0, 1.0, -1.0).to(torch.float64)
    return g.inner.from_units(s)


def solve_signed_permutations(spec: SymmetrySpec, space: str, transform, state_a, state_b) -> Tensor:
    """The optimal :class:`~symalign.groups.SignedPermutations` element per block: ``argmax_T <T, M_k>`` with
    ``M_k`` the sum over the space's tensors of ``a_k b'_k^T`` (rows of block ``k``; ``b'`` head-permuted B)."""
    g: Any = spec.spaces[space]  # a per-head space
    nb, d = g.n_blocks, g.inner.n
    m = torch.zeros(nb, d, d, dtype=torch.float64, device=_device_of(spec, space, state_a))
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
    """The optimal :class:`~symalign.groups.PlaneScales` element per block:
    ``argmin_c ||a_q - c b_q||^2 + ||a_k - b_k/c||^2``."""
    g: Any = spec.spaces[space]  # a per-head space
    a1, b1 = _unit_products(spec, space, transform, state_a, state_b, "co")
    a2, b2 = _unit_products(spec, space, transform, state_a, state_b, "contra")

    def f(c):
        return c * c * b1 - 2 * c * a1 + b2 / (c * c) - 2 * a2 / c

    grid = GRID.to(a1.device).exp()
    cs = grid.view(-1, 1, 1)
    c = torch.gather(grid.expand(*a1.shape, -1), -1, f(cs).argmin(0).unsqueeze(-1)).squeeze(-1)
    for _ in range(newton):
        d1 = 2 * c * b1 - 2 * a1 - 2 * b2 / c ** 3 + 2 * a2 / c ** 2
        d2 = 2 * b1 + 6 * b2 / c ** 4 - 4 * a2 / c ** 3
        step = torch.where(d2 > 0, d1 / d2, torch.zeros_like(d1))
        new = torch.where(c - step > 0, c - step, c / 2)
        c = torch.where(f(new) <= f(c), new, c)
    if not bool(torch.isfinite(c).all()):
        raise MatchError(f"space {space!r}: non-finite QK-norm gain scale (zero gains?)")
    return g.inner.from_units(c)


def exact_solutions(spec: SymmetrySpec, base: Any, state_a: Mapping[str, Tensor], state_b: Mapping[str, Tensor],
                    stage2: str = "full") -> Transform:
    """The transform of ``spec`` from ``base``, the attention match of :func:`relaxed` ``(spec)``: every space of an
    exact step replaced by its exact optimum (the identity with ``stage2="none"`` or for ``"identity"``). The
    layers of ``base`` are updated in place: Q-K (and clamped V-O) distances after the exact solution, and each
    layer's ``encoding`` the declared Q-K block group."""
    transform = dict(base.transform)
    for name, g in spec.spaces.items():
        step = exact_step(g)
        if step is None:
            continue
        if stage2 == "none" or step == "identity":
            transform[name] = g.identity()
        elif step == "signed-permutations":
            transform[name] = solve_signed_permutations(spec, name, transform, state_a, state_b)
        elif step == "signs":
            transform[name] = solve_signs(spec, name, transform, state_a, state_b)
        else:
            transform[name] = solve_scales(spec, name, transform, state_a, state_b)
    if stage2 != "none":  # Q-K distances after the exact (sign) solution, not the relaxed one
        rel = relaxed(spec)
        out_b = apply(rel, {k: v for k, v in transform.items() if k in rel.spaces}, state_b)
        for lay, view in zip(base.layers, find_layers(rel, state_a)):
            lay.qk_after = direct_distance(view.qk, state_a, out_b).tolist()
            lay.qk_cond = [1.0] * len(lay.qk_after)
            if exact_step(spec.spaces.get(view.vo.name)) == "signed-permutations":
                lay.vo_after = direct_distance(view.vo, state_a, out_b).tolist()
                lay.vo_cond = [1.0] * len(lay.vo_after)
        base.totals["distance_after"] = sum(sum(d.qk_after) + sum(d.vo_after) for d in base.layers)
    for lay in base.layers:
        qk = spec.spaces.get(f"qk.{lay.tag}")
        if qk is not None:
            lay.encoding = qk.inner.describe()  # type: ignore[union-attr]
    return transform
