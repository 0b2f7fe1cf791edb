"""Whole-model weight matching: exact transforms, planted recovery, bad inputs."""

from __future__ import annotations

import pytest
import torch

from _whole_util import FAMILIES, PES, inputs, model, rel_out, rel_state

from symalign.errors import MatchError
from symalign.groups import CenteredOrthogonal
from symalign.match.residual import procrustes
from symalign.match.whole import align_whole, match_whole
from symalign.rewrite import rewrite_model
from symalign.spec import apply, sample


def planted(family, pe, seed=5, **kw):
    a = rewrite_model(model(family, pe, **kw))
    spec = a.symmetry_spec()
    b = rewrite_model(model(family, pe, **kw))
    b.load_state_dict(apply(spec, sample(spec, seed), a.state_dict()))
    return a, b


@pytest.mark.parametrize("pe", PES)
@pytest.mark.parametrize("family", FAMILIES)
def test_planted_recovery_and_exactness(family, pe):
    a, b = planted(family, pe)
    x = inputs(a.cfg)
    yb = b(x)
    res = align_whole(a, b)
    out = res.apply(b.state_dict())
    assert rel_state(a.state_dict(), out) <= 1e-8
    assert res.distances[-1] <= 1e-16 * res.distances[0]
    b.load_state_dict(out)
    assert rel_out(b(x), yb) <= 1e-9
    d = res.to_dict()
    assert d["relative_distance_after"] <= 1e-8 and d["iterations"] >= 1


@pytest.mark.parametrize("family,pe", [("gpt", "rope"), ("vit", "learned")])
def test_independent_pair_exact_and_distance_falls(family, pe):
    a = rewrite_model(model(family, pe, seed=1))
    b = rewrite_model(model(family, pe, seed=2))
    x = inputs(a.cfg)
    yb = b(x)
    res = align_whole(a, b, max_sweeps=8)
    assert res.distances[-1] < 0.9 * res.distances[0]
    assert min(res.distances[1:]) <= res.distances[1] + 1e-9
    b.load_state_dict(res.apply(b.state_dict()))
    assert rel_out(b(x), yb) <= 1e-9


def test_original_spec_with_permuted_residual_post_ln():
    """Post-LN (no rewrite): the original spec (residual S_D, FF, attention) is matched too."""
    a = model("gpt", "rope", pre_norm=False)
    spec = a.symmetry_spec()
    b = model("gpt", "rope", pre_norm=False)
    b.load_state_dict(apply(spec, sample(spec, 2), a.state_dict()))
    res = match_whole(spec, a.state_dict(), b.state_dict())
    assert rel_state(a.state_dict(), res.apply(b.state_dict())) <= 1e-8


def test_centred_procrustes_fixes_ones():
    g = CenteredOrthogonal(8)
    o = g.sample(3)
    assert g.contains(o)
    m = torch.randn(8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    r = procrustes(m @ o.T, g)
    assert g.contains(r)
    x = torch.randn(8, 20, dtype=torch.float64)
    x = x - x.mean(0)
    assert float((procrustes(x @ (o @ x).T, g) - o.T).abs().max()) <= 1e-10


def test_bad_inputs():
    a = rewrite_model(model("gpt", "rope"))
    with pytest.raises(MatchError, match="depth"):
        align_whole(a, rewrite_model(model("gpt", "rope", n_layers=3)))
    with pytest.raises(MatchError, match="FF widths differ"):
        align_whole(a, rewrite_model(model("gpt", "rope", d_ff=48)))
    with pytest.raises(MatchError, match="widths differ"):
        align_whole(a, rewrite_model(model("gpt", "rope", d_model=32)))
    sb = dict(a.state_dict())
    sb["blocks.0.mlp.fc_in.weight"] = sb["blocks.0.mlp.fc_in.weight"].clone().fill_(float("nan"))
    with pytest.raises(MatchError, match="NaN"):
        match_whole(a.symmetry_spec(), a.state_dict(), sb)
    sb = {k: v for k, v in a.state_dict().items() if not k.startswith("blocks.1.")}
    with pytest.raises(MatchError, match="model B has no tensor 'blocks.1.*depth or structure"):
        match_whole(a.symmetry_spec(), a.state_dict(), sb)
    sb = dict(a.state_dict())
    sb["blocks.0.mlp.fc_in.weight"] = sb["blocks.0.mlp.fc_in.weight"][:-1]
    with pytest.raises(MatchError, match=r"'blocks.0.mlp.fc_in.weight' has shape .* in A but .* in B; .*equal widths"):
        match_whole(a.symmetry_spec(), a.state_dict(), sb)


@pytest.mark.parametrize("kw", [dict(n_kv_heads=2, activation="relu", bias=False),
                                dict(rope_pairing="interleaved", rotary_fraction=0.5, head_dim=4)])
def test_planted_recovery_gqa_and_partial_rope(kw):
    a, b = planted("gpt", "rope", **kw)
    res = align_whole(a, b)
    assert rel_state(a.state_dict(), res.apply(b.state_dict())) <= 1e-8
