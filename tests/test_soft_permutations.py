"""Soft permutations (Sinkhorn) in learned matching: doubly stochastic, annealed, projected to an exact element."""

from __future__ import annotations

import pytest
import torch

from _whole_util import inputs, model, rel_out, rel_state
from test_whole_learned import _data, _pair

from symalign.errors import MatchError
from symalign.experiments.methods import align_methods
from symalign.groups import assign_max, one_hot, sinkhorn
from symalign.match.latents import Latents, Relaxation
from symalign.match.learned import learn_matching
from symalign.match.whole import align_whole
from symalign.rewrite import rewrite_model
from symalign.spec import apply, sample


def test_sinkhorn_is_doubly_stochastic_and_tends_to_the_assignment():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(7, 7, generator=g, dtype=torch.float64)
    one = torch.ones(7, dtype=torch.float64)
    for scale in (0.5, 1.0, 2.0):
        p = sinkhorn(scale * z, iters=200)
        assert (p > 0).all()
        assert torch.allclose(p.sum(0), one, atol=1e-12) and torch.allclose(p.sum(1), one, atol=1e-8)
    p = sinkhorn(1e3 * z, iters=5)  # the log domain keeps large logits finite
    assert torch.isfinite(p).all() and torch.allclose(p.sum(0), one, atol=1e-12)
    # tau -> 0: the Hungarian assignment (the projection) of the logits, here one with a clear margin
    perm = torch.randperm(7, generator=g)
    zp = one_hot(perm) + 0.1 * z
    assert torch.equal(assign_max(zp), perm)
    assert torch.allclose(sinkhorn(zp / 0.02, iters=30), one_hot(perm), atol=1e-6)
    # exp(Z / tau) scaled by diagonals: its most probable permutation is the assignment of Z itself
    p = sinkhorn(z / 0.7, iters=200)
    assert torch.equal(assign_max(p.log()), assign_max(z))
    with pytest.raises(ValueError, match="iteration"):
        sinkhorn(z, iters=0)


def test_temperature_is_annealed_geometrically_and_bad_settings_are_refused():
    r = Relaxation("sinkhorn", (1.0, 0.01), steps=100)
    assert r.tau_at(0) == pytest.approx(1.0) and r.tau_at(50) == pytest.approx(0.1) and r.tau_at(100) == \
        pytest.approx(0.01) and r.tau_at(500) == pytest.approx(0.01)
    with pytest.raises(MatchError, match="unknown relaxation"):
        Relaxation("gumbel")
    with pytest.raises(MatchError, match="temperatures"):
        Relaxation("sinkhorn", (0.1, 0.0))
    a = rewrite_model(model("vit", "rope"))
    with pytest.raises(MatchError, match="unknown relaxation"):
        learn_matching(a, a, _data(a.cfg), steps=1, relax="soft")


@pytest.mark.parametrize("relax", ["sinkhorn", "sinkhorn-st"])
def test_relaxed_forward_starts_near_weight_matching(relax):
    """At a low temperature the relaxed permutations at the start latents are the weight-matching ones."""
    a, b = _pair("gpt", "rope", n_kv_heads=2, activation="relu")  # S_n x scales, heads under GQA
    wm = align_whole(a, b, max_sweeps=2)
    lat = Latents(wm.spec, wm.transform)
    with torch.no_grad():
        soft = lat.soft_apply(b.state_dict(), lat.soft(Relaxation(relax, (0.02, 0.02)).matrix(0)))
    assert rel_state(wm.apply(b.state_dict()), soft) <= 1e-9


@pytest.mark.slow
@pytest.mark.parametrize("family,pe,kw", [("vit", "rope", {}),
                                          ("gpt", "rope", dict(n_kv_heads=2, bias=False, activation="relu"))])
@pytest.mark.parametrize("relax", ["sinkhorn", "sinkhorn-st"])
def test_sinkhorn_learned_result_is_an_exact_element(family, pe, kw, relax):
    a, b = _pair(family, pe, **kw)
    spec = a.symmetry_spec()
    x = inputs(a.cfg)
    yb = b(x)
    wm = align_whole(a, b, max_sweeps=2)
    res = learn_matching(a, b, _data(a.cfg), steps=6, lr=0.05, init=wm, relax=relax, tau=(0.5, 0.05))
    assert res.relax == relax and res.to_dict()["relax"] == relax
    for s, g in spec.spaces.items():
        assert g.contains(res.transform[s]), s
    b.load_state_dict(res.apply(b.state_dict()))
    assert rel_out(b(x), yb) <= 1e-10  # float64: B' computes B's function
    assert res.objective <= res.objective_init


@pytest.mark.slow
def test_planted_permutations_are_recovered_from_the_identity():
    """B = g . A. Every FF and head permutation starts at the identity, the other spaces at the planted
    solution; descending the weight distance ``||theta_A - P_tau . theta_B||^2`` through the annealed
    Sinkhorn relaxation, then projecting, recovers g exactly: B' is A to rounding."""
    a = rewrite_model(model("vit", "learned"))
    spec = a.symmetry_spec()
    b = rewrite_model(model("vit", "learned"))
    b.load_state_dict(apply(spec, sample(spec, 4), a.state_dict()))
    wm = align_whole(a, b)
    assert rel_state(a.state_dict(), wm.apply(b.state_dict())) <= 1e-8
    perms = [s for s, g in spec.spaces.items() if g.is_permutation or g.permutes_heads]
    start = {**wm.transform, **{s: torch.arange(wm.transform[s].numel()) for s in perms}}
    assert any(not torch.equal(start[s], wm.transform[s]) for s in perms)
    lat = Latents(spec, start, perms)
    steps = 60
    relax = Relaxation("sinkhorn", (1.0, 0.05), steps)
    opt = torch.optim.Adam(lat.parameters(), lr=0.1)
    sa, sb = a.state_dict(), b.state_dict()
    for step in range(steps):
        moved = lat.soft_apply(sb, lat.soft(relax.matrix(step)))
        loss = sum(((moved[k] - sa[k]) ** 2).sum() for k in spec.tensors)
        opt.zero_grad()
        loss.backward()
        opt.step()
    final, _ = lat.project()
    for s in perms:
        assert torch.equal(final[s], wm.transform[s]), s
    assert rel_state(wm.apply(sb), apply(spec, final, sb)) <= 1e-12  # the planted solution: B' is A (1e-8 above)


@pytest.mark.slow
def test_resume_refuses_another_relaxation(tmp_path):
    a, b = _pair("vit", "rope")
    wm = align_whole(a, b, max_sweeps=1)
    ck = tmp_path / "latents.pt"
    learn_matching(a, b, _data(a.cfg, 1), steps=2, init=wm, checkpoint=ck, save_every=1, relax="sinkhorn")
    with pytest.raises(MatchError, match="other settings.*relax"):
        learn_matching(a, b, _data(a.cfg, 1), steps=2, init=wm, checkpoint=ck)
    ck2 = tmp_path / "constant.pt"  # a constant learning rate, but tau is annealed over `steps`
    kw = dict(init=wm, save_every=1, relax="sinkhorn", schedule="constant")
    learn_matching(a, b, _data(a.cfg, 1), steps=2, checkpoint=ck2, **kw)
    with pytest.raises(MatchError, match="other settings.*tau_steps"):
        learn_matching(a, b, _data(a.cfg, 1), steps=3, checkpoint=ck2, **kw)


def test_sinkhorn_is_a_method_of_the_protocol():
    a, b = _pair("vit", "rope")
    test, train = _data(a.cfg, 1, seed=100), _data(a.cfg, 2, seed=0)
    res = align_methods(a, b, test, "classification", methods=("sinkhorn",), points=3, learned_steps=3,
                        train_batches=train)
    e = res["sinkhorn"]
    assert e["function_change"] <= 1e-9 and e["match"]["relax"] == "sinkhorn" and e["match"]["steps"] == 3
    assert e["match"]["objective"] <= e["match"]["objective_init"]


def test_protocol_config_accepts_the_sinkhorn_method():
    from symalign.experiments.config import parse_config

    cfg = parse_config({"name": "x", "data": "digits", "model": {"family": "vit"},
                        "protocol": {"scopes": ["full"], "methods": ["weight", "sinkhorn"]}})
    assert cfg.protocol.methods == ["weight", "sinkhorn"]
