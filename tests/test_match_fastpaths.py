"""The matcher's fast paths: float32 stage-1 products (error bound) and the batched L-BFGS
stage 2 (stopping rule, batching invariance, agreement with scipy's L-BFGS-B)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.optimize import minimize


from _match_util import make_stack, state
from symalign.match import match_attention
from symalign.match.api import stage1_precision
from symalign.match.heads import (assign_heads, cost_error_bound, gram_rows, head_cost, head_scales, objective,
                                  rounding_delta)
from symalign.match.qk import Grams, orthogonal_solution, solve_gl
from symalign.match.views import find_layers
from symalign.spec import apply, invert, sample


def planted32(cfg: dict, seed: int = 0):
    m = make_stack(seed, 2, dtype=torch.float32, **cfg)
    spec = m.symmetry_spec()
    sa = state(m)
    g = {k: (v.float() if v.is_floating_point() else v) for k, v in sample(spec, seed + 1).items()}
    return spec, sa, g, apply(spec, g, sa)


@pytest.mark.parametrize("cfg", [dict(d_model=32, n_heads=8, bias=True),
                                 dict(d_model=32, n_heads=8, n_kv_heads=2, pe="rope")])
def test_float32_stage1_recovers_planted_permutation(cfg):
    spec, sa, g, sb = planted32(cfg)
    layers = find_layers(spec, sa)
    assert stage1_precision(layers, sa, sb) == torch.float32
    r32 = match_attention(spec, sa, sb, stage2="none")
    r64 = match_attention(spec, sa, sb, stage2="none", stage1_dtype=torch.float64)
    inv = invert(spec, g)
    for lay in layers:
        assert torch.equal(r32.transform[lay.heads], r64.transform[lay.heads])
        assert torch.equal(r32.transform[lay.heads], inv[lay.heads])
    assert stage1_precision(layers, {k: v.double() for k, v in sa.items()}, sb) == torch.float64


def near_tie_models(seed: int, eps: float):
    """A with heads that pairwise almost coincide, B a head permutation of A plus noise: near-ties."""
    cfg = dict(d_model=32, n_heads=8, bias=True)
    a = make_stack(seed, 1, dtype=torch.float32, **cfg)
    sa = state(a)
    spec = a.symmetry_spec()
    gen = torch.Generator().manual_seed(seed)
    d = 4
    for name, t in sa.items():  # head 2k+1 := head 2k + eps * noise, on every head-indexed axis
        if name.endswith("o_proj.weight"):
            v = t.view(t.shape[0], 8, d)
            v[:, 1::2] = v[:, 0::2] + eps * torch.randn(v[:, 1::2].shape, generator=gen)
        else:
            v = t.view(8, d, *t.shape[1:])
            v[1::2] = v[0::2] + eps * torch.randn(v[1::2].shape, generator=gen)
    g = sample(spec, seed + 3, spaces=["heads.0"])
    sb = apply(spec, g, sa)
    sb = {k: v + eps * torch.randn(v.shape, generator=gen) for k, v in sb.items()}
    return spec, sa, sb


def test_float32_cost_within_stated_bound_on_near_ties():
    flipped = 0
    for seed in range(3):
        spec, sa, sb = near_tie_models(seed, 1e-5)
        lay = find_layers(spec, sa)[0]
        c64 = head_cost(lay, sa, sb)
        c32 = head_cost(lay, sa, sb, dtype=torch.float32)
        a, b = head_scales(lay, sa), head_scales(lay, sb)
        delta = rounding_delta(gram_rows(lay, sa), torch.float32, lay.head_dim)
        err = (c32 - c64).abs()
        assert bool((err <= delta * (a[:, None] + b[None, :]) ** 2).all())  # entrywise bound
        assert float(err.max()) > 0  # the float32 path really is a different computation
        pi32, pi64 = assign_heads(c32, lay.heads_group), assign_heads(c64, lay.heads_group)
        flipped += not torch.equal(pi32, pi64)
        loss = objective(c64, pi32) - objective(c64, pi64)
        rows = torch.arange(8)
        assert 0 <= loss <= float(err[rows, pi32].sum() + err[rows, pi64].sum())  # the argument, actual errors
        assert loss <= cost_error_bound(lay, sa, sb, torch.float32)  # the stated bound
    assert flipped  # the near-ties are close enough for float32 to choose differently


def random_grams(n: int, d: int, rows: int, seed: int) -> Grams:
    gen = torch.Generator().manual_seed(seed)
    x = [torch.randn(n, rows, d, generator=gen, dtype=torch.float64) for _ in range(4)]
    xa, xb, ya, yb = x
    return Grams(xb.mT @ xb, xa.mT @ xb, (xa * xa).sum(1), yb.mT @ yb, ya.mT @ yb, (ya * ya).sum(1))


def scipy_block(g: Grams, i: int, **options) -> float:
    """scipy L-BFGS-B on the same objective (from the same Procrustes start)."""
    d = g.d
    cbb, cab, tbb, tab = (t[i].numpy() for t in (g.co_bb, g.co_ab, g.ct_bb, g.ct_ab))
    const = float(g.co_aa[i].sum() + g.ct_aa[i].sum())
    u0 = orthogonal_solution(g.select(torch.tensor([i])))[0].numpy()

    def fg(x):
        u = x.reshape(d, d)
        v = np.linalg.inv(u)
        ug, hv = u @ cbb, tbb @ v
        f = const - 2 * np.sum(cab * u) + np.sum(ug * u) - 2 * np.sum(tab.T * v) + np.sum(v * hv)
        return f, (2 * (ug - cab) - v.T @ (2 * (hv - tab.T)) @ v.T).ravel()

    return float(minimize(fg, u0.ravel(), jac=True, method="L-BFGS-B", options=options).fun)


def test_lbfgs_reaches_scipy_optimum_on_unrelated_blocks():
    g = random_grams(6, 10, 60, seed=4)
    sol = solve_gl(g)
    assert bool(sol.converged.all()) and not bool(sol.fallback.any())
    total_default = 0.0
    for i in range(g.n):
        f_default = scipy_block(g, i, maxiter=2000, gtol=1e-10)  # what the benchmark's loop does
        f_tight = scipy_block(g, i, maxiter=5000, gtol=1e-13, ftol=1e-15)
        f = float(sol.objective[i])
        assert f <= f_default * (1 + 1e-7)  # per block: the same optimum up to both stopping rules
        assert f <= f_tight * (1 + 1e-7)
        total_default += f_default
    assert float(sol.objective.sum()) <= total_default  # in total at least as good as scipy's
    assert bool((sol.objective < g.objective(orthogonal_solution(g))).all())


def test_lbfgs_stops_early_on_converged_blocks_and_is_batch_invariant():
    g = random_grams(5, 8, 40, seed=5)
    first = solve_gl(g)
    assert int(first.iterations.min()) > 10
    again = solve_gl(g, u0=first.u)  # every block starts at its optimum
    assert bool(again.converged.all())
    assert int(again.iterations.max()) <= 6
    assert bool((again.objective <= first.objective * (1 + 1e-12)).all())  # never worse,
    assert bool((again.objective >= first.objective * (1 - 1e-7)).all())  # and there was little left
    # one converged block in a batch of fresh ones: it stops early, the others are unaffected
    mixed = Grams.cat([g.select(torch.tensor([0])), g.select(torch.tensor([1, 2, 3]))])
    u0 = torch.cat([first.u[:1], orthogonal_solution(mixed)[1:]])
    sol = solve_gl(mixed, u0=u0)
    assert int(sol.iterations[0]) <= 6 and int(sol.iterations[1:].min()) > 10
    alone = solve_gl(g.select(torch.tensor([1, 2, 3])))
    assert torch.allclose(sol.objective[1:], alone.objective, rtol=1e-12)
    assert torch.equal(sol.iterations[1:], alone.iterations)


def test_lbfgs_exact_on_planted_gl():
    gen = torch.Generator().manual_seed(6)
    n, d, rows = 4, 6, 30
    xa = torch.randn(n, rows, d, generator=gen, dtype=torch.float64)
    ya = torch.randn(n, rows, d, generator=gen, dtype=torch.float64)
    u = torch.randn(n, d, d, generator=gen, dtype=torch.float64) + 2 * torch.eye(d, dtype=torch.float64)
    xb, yb = xa @ torch.linalg.inv(u).mT, ya @ u  # B = U^{-1} . A, so U . B = A
    g = Grams(xb.mT @ xb, xa.mT @ xb, (xa * xa).sum(1), yb.mT @ yb, ya.mT @ yb, (ya * ya).sum(1))
    sol = solve_gl(g)
    assert torch.allclose(sol.u, u, rtol=0, atol=1e-8 * float(u.abs().max()))  # the 1e-8
    assert bool((sol.objective <= 1e-13 * g.scale()).all())  # rounding level of the Gram objective


def two_loop(s_list, y_list, g):
    """Textbook L-BFGS two-loop recursion (reference for the compact form)."""
    q = g.clone()
    alphas = []
    for s, y in reversed(list(zip(s_list, y_list))):
        a = (s @ q) / (s @ y)
        q = q - a * y
        alphas.append(a)
    s, y = s_list[-1], y_list[-1]
    q = (s @ y) / (y @ y) * q
    for (s, y), a in zip(zip(s_list, y_list), reversed(alphas)):
        b = (y @ q) / (s @ y)
        q = q + (a - b) * s
    return q


def test_compact_lbfgs_history_equals_two_loop_recursion():
    from symalign.match.qk import _History

    gen = torch.Generator().manual_seed(8)
    n, dim, m = 3, 12, 4
    hist = _History(n, dim, m)
    pairs: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(n)]
    for step in range(7):  # wraps the ring; block 1 skips step 3 (an empty pair)
        s = torch.randn(n, dim, generator=gen, dtype=torch.float64)
        y = s + 0.3 * torch.randn(n, dim, generator=gen, dtype=torch.float64)  # s^T y > 0
        valid = torch.tensor([True, step != 3, True])
        g = torch.randn(n, dim, generator=gen, dtype=torch.float64)
        hg = hist.push_apply(s, y, valid, g)
        for b in range(n):
            pairs[b] = (pairs[b] + [(s[b], y[b])] if bool(valid[b]) else pairs[b] + [None])[-m:]
            kept = [p for p in pairs[b] if p is not None]
            ref = two_loop([p[0] for p in kept], [p[1] for p in kept], g[b])
            assert torch.allclose(hg[b], ref, rtol=1e-10, atol=1e-12), (step, b)


def test_direct_before_distance_matches_the_gram_formula():
    from symalign.match.api import _grams, _identity_distance
    from symalign.match.views import direct_distance

    for dtype in (torch.float64, torch.float32):
        cfg = dict(d_model=24, n_heads=6, n_kv_heads=2, bias=True, pe="rope", rotary_fraction=0.5)
        a, b = make_stack(0, 1, dtype=dtype, **cfg), make_stack(3, 1, dtype=dtype, **cfg)
        spec, sa, sb = a.symmetry_spec(), state(a), state(b)
        lay = find_layers(spec, sa)[0]
        for side in (lay.qk, lay.vo):
            ref = _identity_distance(_grams(side, sa, sb))
            tol = 1e-12 if dtype == torch.float64 else 1e-6
            assert torch.allclose(direct_distance(side, sa, sb), ref, rtol=tol)
