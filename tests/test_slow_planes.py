"""Slow RoPE planes aligned over GL (an approximate symmetry): columns, planted recovery, identity, cost."""

from __future__ import annotations

import pytest
import torch

from _whole_util import inputs, model
from symalign.errors import MatchError
from symalign.groups import GeneralLinear, PerHead, RotaryPlanes
from symalign.match import match_attention
from symalign.match.slow_planes import align_slow_planes, relaxed_spec, slow_columns
from symalign.spec import apply


def rope_pair(seed_b: int = 2):
    a = model("vit", "rope", seed=1, d_model=32, n_heads=2)  # d_h = 16: 8 planes
    b = model("vit", "rope", seed=seed_b, d_model=32, n_heads=2)
    spec = a.symmetry_spec().restrict([s for s in a.symmetry_spec().spaces if s.split(".")[0] in ("heads", "qk", "vo")])
    return a, b, spec


def states(m):
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def test_slow_columns_follow_the_pairing():
    assert slow_columns(RotaryPlanes(8, "half"), [3, 2]).tolist() == [2, 3, 6, 7]
    assert slow_columns(RotaryPlanes(8, "interleaved"), [3]).tolist() == [6, 7]
    with pytest.raises(MatchError, match="outside the 4 planes"):
        slow_columns(RotaryPlanes(8, "half"), [4])


def test_relaxed_spec_swaps_only_rope_spaces():
    _, _, spec = rope_pair()
    rel = relaxed_spec(spec)
    for name, g in spec.spaces.items():
        if isinstance(g, PerHead) and isinstance(g.inner, RotaryPlanes):
            assert rel.spaces[name] == PerHead(GeneralLinear(g.inner.n), g.n_blocks)
        else:
            assert rel.spaces[name] == g
    assert rel.tensors == spec.tensors


def test_no_planes_is_the_identity():
    a, b, spec = rope_pair()
    sa, sb = states(a), states(b)
    m = align_slow_planes(spec, sa, sb, [])
    assert m.exact and m.columns == [] and m.distance_before == m.distance_after == 0.0
    out = m.apply(sb)
    assert all(torch.equal(out[k], sb[k]) for k in sb)


def test_planted_gl_on_slow_columns_is_recovered():
    """B = U0 . A with U0 in GL on the two slowest planes' columns (not a symmetry): the solver finds A's
    Q-K weights back (distance 0), which checks the columns, the action's direction and the solver."""
    a, _, spec = rope_pair()
    sa = states(a)
    rope = next(g.inner for g in spec.spaces.values() if isinstance(g, PerHead) and isinstance(g.inner, RotaryPlanes))
    cols = slow_columns(rope, [6, 7])
    gen = torch.Generator().manual_seed(0)
    rel = relaxed_spec(spec)
    planted = {}
    for name, g in spec.spaces.items():
        if isinstance(g, PerHead) and isinstance(g.inner, RotaryPlanes):
            u = torch.eye(g.inner.n, dtype=torch.float64).repeat(g.n_blocks, 1, 1)
            u[:, cols.unsqueeze(1), cols.unsqueeze(0)] += 0.4 * torch.randn(g.n_blocks, 4, 4, generator=gen,
                                                                             dtype=torch.float64)
            planted[name] = u
    sb = apply(rel, planted, sa)
    m = align_slow_planes(spec, sa, sb, [6, 7])
    assert m.distance_before > 1.0
    assert m.distance_after <= 1e-16 * m.distance_before + 1e-20
    back = m.apply(sb)
    for k in sa:
        assert torch.allclose(back[k], sa[k], rtol=0, atol=1e-6), k  # objective ~1e-14: weights to ~1e-7


def test_refines_the_exact_match_and_costs_less_on_slow_planes():
    """On an exact-group-aligned B': the slow-plane GL step never raises the distance, and relaxing the
    slowest plane changes the function far less than relaxing the fastest one by the same kind of step."""
    a, b, spec = rope_pair()
    sa, sb = states(a), states(b)
    bp = match_attention(spec, sa, sb, stage2="full").apply(sb)
    slow = align_slow_planes(spec, sa, bp, [7])
    fast = align_slow_planes(spec, sa, bp, [0])
    assert not slow.exact and slow.distance_after <= slow.distance_before
    assert fast.distance_after <= fast.distance_before
    x = inputs(a.cfg, n=4)

    def change(m):
        with torch.no_grad():
            y0 = torch.func.functional_call(a, bp, (x,))
            y1 = torch.func.functional_call(a, m.apply(bp), (x,))
        return float((y1 - y0).norm() / y0.norm())

    # relative to how far each step moved the weights (the GL steps differ in size)
    def moved(m):
        out = m.apply(bp)
        return sum(float((out[k] - bp[k]).norm() ** 2) for k in bp) ** 0.5

    assert moved(slow) > 0 and moved(fast) > 0
    assert change(slow) / moved(slow) < 0.2 * change(fast) / moved(fast)
