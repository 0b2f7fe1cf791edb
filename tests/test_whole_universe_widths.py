"""Universe matching of several models, merged checkpoint; exact embedding into a wider stream."""

from __future__ import annotations

import pytest

from _whole_util import inputs, model, rel_out, rel_state

from symalign.errors import MatchError
from symalign.match.universe import load_merged, match_universe, save_merged
from symalign.match.widths import embed_wider, match_widths
from symalign.rewrite import rewrite_model
from symalign.spec import apply, sample


def test_universe_of_planted_copies_merges_to_the_model(tmp_path):
    a = rewrite_model(model("gpt", "rope"))
    spec = a.symmetry_spec()
    x = inputs(a.cfg)
    ya = a(x)
    copies = []
    for seed in (1, 2, 3):
        m = rewrite_model(model("gpt", "rope"))
        m.load_state_dict(apply(spec, sample(spec, seed), a.state_dict()))
        copies.append(m)
    res = match_universe(copies, rounds=2)
    assert res.spread[-1] <= 1e-16 * sum(float(v.pow(2).sum()) for v in a.state_dict().values())
    for m, t in zip(copies, res.transforms):
        ym = m(x)
        m.load_state_dict(apply(spec, t, m.state_dict()))
        assert rel_out(m(x), ym) <= 1e-9
    merged = load_merged(save_merged(tmp_path / "merged", a, res.merged, res.to_dict()))
    assert rel_out(merged(x), ya) <= 1e-9


def test_universe_of_independent_models_is_exact_per_model():
    ms = [rewrite_model(model("vit", "learned", seed=s)) for s in (1, 2, 3)]
    spec = ms[0].symmetry_spec()
    x = inputs(ms[0].cfg)
    res = match_universe(ms, rounds=2, max_sweeps=3, stage2="orthogonal")
    assert len(res.spread) == 2
    for m, t in zip(ms, res.transforms):
        y = m(x)
        m.load_state_dict(apply(spec, t, m.state_dict()))
        assert rel_out(m(x), y) <= 1e-9
    with pytest.raises(MatchError, match="two models"):
        match_universe(ms[:1])


@pytest.mark.parametrize("family,pe", [("gpt", "rope"), ("vit", "learned"), ("encoder", "none")])
def test_embed_wider_is_exact(family, pe):
    b = rewrite_model(model(family, pe, d_model=8, n_heads=4, d_ff=16))
    x = inputs(b.cfg)
    wide = embed_wider(b, 16)
    assert wide.cfg.d_model == 16 and wide.cfg.head_dim == 2
    assert wide.cfg.norm_eps == b.cfg.norm_eps  # the architecture of a width-16 model with B's settings
    assert rel_out(wide(x), b(x)) <= 1e-12
    from torch.func import functional_call

    from symalign.rewrite import rewritten_model
    a_arch = rewritten_model(wide.cfg).double()  # a width-16 model's own architecture runs B's state exactly
    assert rel_out(functional_call(a_arch, wide.state_dict(), (x,)), b(x)) <= 1e-12


def test_match_widths_planted():
    """A = g . embed(B): aligning the narrow B recovers A exactly (rectangular O E)."""
    b = rewrite_model(model("gpt", "rope", d_model=8, n_heads=4, d_ff=16))
    wide = embed_wider(b, 16)
    spec = wide.symmetry_spec()
    a = embed_wider(b, 16)
    a.load_state_dict(apply(spec, sample(spec, 9), wide.state_dict()))
    x = inputs(b.cfg)
    res, emb = match_widths(a, b)
    out = res.apply(emb.state_dict())
    assert rel_state(a.state_dict(), out) <= 1e-8
    emb.load_state_dict(out)
    assert rel_out(emb(x), b(x)) <= 1e-9


def test_widths_refused():
    b = rewrite_model(model("gpt", "sinusoidal", d_model=8, n_heads=4, d_ff=16))
    with pytest.raises(MatchError, match="sinusoidal"):
        embed_wider(b, 16)
    a = rewrite_model(model("gpt", "rope", d_model=16, n_heads=4, d_ff=32))
    with pytest.raises(MatchError, match="FF width"):
        match_widths(a, rewrite_model(model("gpt", "rope", d_model=8, n_heads=4, d_ff=16)))
