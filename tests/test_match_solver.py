"""Stage-1 metrics, the GL refinement (monotone, conditioning guard) and input validation."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch


from _match_util import make_stack, state
from symalign.errors import MatchError
from symalign.groups import RotaryPlanes, condition, random_orthogonal
from symalign.match import align_models, lhat, match_attention, permutation_rank
from symalign.match.heads import assign_heads, best_and_identity, head_cost, objective
from symalign.match.qk import Grams, solve_gl
from symalign.match.views import find_layers
from symalign.spec import apply, sample


def two_models(seed_b=9, **cfg):
    a, b = make_stack(0, 2, **cfg), make_stack(seed_b, 2, **cfg)
    return a.symmetry_spec(), state(a), state(b)


@pytest.mark.parametrize("cfg", [dict(d_model=16, n_heads=4, bias=True),
                                 dict(d_model=24, n_heads=6, n_kv_heads=2, pe="rope")])
def test_stage1_is_exact_assignment(cfg):
    spec, sa, sb = two_models(**cfg)
    for lay in find_layers(spec, sa):
        cost = head_cost(lay, sa, sb)
        pi = assign_heads(cost, lay.heads_group)
        assert lay.heads_group.contains(pi)
        assert permutation_rank(cost, pi, lay.heads_group) == 1
        best, ident = best_and_identity(cost, lay.heads_group)
        assert objective(cost, pi) == pytest.approx(best, rel=1e-12)
        assert lhat(objective(cost, pi), best, ident) == pytest.approx(0.0, abs=1e-9)


def test_stage1_cost_is_invariant_under_per_head_gl_and_matches_dense_formula():
    spec, sa, sb = two_models(d_model=8, n_heads=2, bias=True)
    lay = find_layers(spec, sa)[0]
    cost = head_cost(lay, sa, sb)
    g = sample(spec, 3, spaces=["qk.0", "vo.0"])
    assert torch.allclose(head_cost(lay, sa, apply(spec, g, sb)), cost, rtol=1e-10, atol=1e-10)
    # dense reference: Mbar = W~_Q (C W_K)^T (key bias dropped), N = W~_V W_O^T
    def feats(s, i):
        sl = slice(4 * i, 4 * i + 4)
        wq = torch.cat([s["layers.0.q_proj.weight"][sl].T, s["layers.0.q_proj.bias"][sl][None]])
        wk = s["layers.0.k_proj.weight"][sl].T
        wk = wk - wk.mean(0, keepdim=True)
        wv = torch.cat([s["layers.0.v_proj.weight"][sl].T, s["layers.0.v_proj.bias"][sl][None]])
        wo = s["layers.0.o_proj.weight"][:, sl]
        return wq @ wk.T, wv @ wo.T
    for i, j in itertools.product(range(2), range(2)):
        (ma, na), (mb, nb) = feats(sa, i), feats(sb, j)
        ref = float((ma - mb).pow(2).sum() + (na - nb).pow(2).sum())
        assert float(cost[i, j]) == pytest.approx(ref, rel=1e-10)


def test_permutation_rank_and_lhat_values():
    cost = torch.tensor([[0.0, 5.0, 9.0], [5.0, 1.0, 9.0], [9.0, 9.0, 2.0]], dtype=torch.float64)
    assert permutation_rank(cost, torch.tensor([0, 1, 2])) == 1
    assert permutation_rank(cost, torch.tensor([1, 0, 2])) == 2  # cost 12 > 3; next best 12
    assert lhat(3.0, 3.0, 10.0) == 0.0 and lhat(10.0, 3.0, 10.0) == 100.0


@pytest.mark.parametrize("cfg", [dict(d_model=16, n_heads=4, bias=True),
                                 dict(d_model=32, n_heads=4, n_kv_heads=2, pe="rope", rotary_fraction=0.5)])
def test_full_never_above_orthogonal_on_independent_models(cfg):
    spec, sa, sb = two_models(**cfg)
    ro = match_attention(spec, sa, sb, stage2="orthogonal")
    rf = match_attention(spec, sa, sb, stage2="full")
    for lo, lf in zip(ro.layers, rf.layers):
        assert all(f <= o for f, o in zip(lf.qk_after, lo.qk_after))
        assert all(f <= o for f, o in zip(lf.vo_after, lo.vo_after))
        assert all(a <= s + 1e-12 * s for a, s in zip(lf.qk_after + lf.vo_after, lf.qk_stage1 + lf.vo_stage1))
    assert rf.totals["distance_after"] < ro.totals["distance_after"]
    assert 1.0 <= rf.worst_condition < 1e6
    # the reported objective is the real distance between A and B'
    sb2 = rf.apply(sb)
    direct = sum(float((sa[t].double() - sb2[t].double()).pow(2).sum()) for t in spec.tensors)
    assert direct == pytest.approx(rf.totals["distance_after"], rel=1e-9)


@pytest.mark.slow
def test_ill_conditioned_solution_falls_back_with_warning():
    gen = torch.Generator().manual_seed(0)
    d = 4
    xb, yb = (torch.randn(2, 20, d, generator=gen, dtype=torch.float64) for _ in range(2))
    q = random_orthogonal(d, gen)
    # block 0 ill-posed (cond 1e8)
    u_star = torch.stack([q @ torch.diag(torch.tensor([1.0, 1.0, 1.0, 1e-8], dtype=torch.float64)),
                          q @ torch.diag(torch.tensor([2.0, 1.0, 1.0, 0.5], dtype=torch.float64))])
    xa, ya = xb @ u_star.mT, yb @ torch.linalg.inv(u_star)
    g = Grams(xb.mT @ xb, xa.mT @ xb, (xa * xa).sum(1), yb.mT @ yb, ya.mT @ yb, (ya * ya).sum(1))
    with pytest.warns(RuntimeWarning, match="near-singular"):
        sol = solve_gl(g, "full", max_cond=1e6)
    assert bool(sol.fallback[0]) and not bool(sol.fallback[1])
    assert float(sol.cond[0]) < 1e6 and float(condition(sol.u[:1])[0]) < 1e6
    assert torch.allclose(sol.u[1], u_star[1], atol=1e-9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        solve_gl(g, "full", max_cond=1e12)  # allowed when the threshold is raised


def test_bad_inputs_raise_match_error_naming_the_layer():
    spec, sa, sb = two_models(d_model=16, n_heads=4, bias=True)
    bad = dict(sb)
    bad["layers.1.k_proj.weight"] = bad["layers.1.k_proj.weight"].clone()
    bad["layers.1.k_proj.weight"][0, 0] = float("nan")
    with pytest.raises(MatchError, match=r"layer '1'.*k_proj.weight.*NaN"):
        match_attention(spec, sa, bad)
    bad = dict(sb)
    bad["layers.0.v_proj.weight"] = torch.zeros(8, 16, dtype=torch.float64)
    with pytest.raises(MatchError, match=r"layer '0'.*v_proj.weight.*shape"):
        match_attention(spec, sa, bad)
    with pytest.raises(MatchError, match="stage2"):
        match_attention(spec, sa, sb, stage2="gd")
    # different head counts / encodings / widths between models
    for other in (dict(d_model=16, n_heads=2, bias=True), dict(d_model=16, n_heads=4, bias=True, pe="rope"),
                  dict(d_model=32, n_heads=4, bias=True)):
        with pytest.raises(MatchError, match="space"):
            align_models(make_stack(0, 2, d_model=16, n_heads=4, bias=True), make_stack(1, 2, **other))
    # an odd rotated width (a hand-made spec)
    spec_r, ra, rb = two_models(d_model=16, n_heads=4, pe="rope")
    grp = spec_r.spaces["qk.0"].inner
    assert isinstance(grp, RotaryPlanes)
    object.__setattr__(grp, "rotary_dims", 3)
    with pytest.raises(MatchError, match="odd rotated width"):
        match_attention(spec_r, ra, rb)


