"""Planted recovery: B = g . A for a random g of the declared group; matching returns A."""

from __future__ import annotations

import json

import pytest
import torch


from _match_util import make_stack, rel, state
from symalign.match import align_models, match_attention
from symalign.spec import apply, invert, sample

CONFIGS = {
    "none": dict(d_model=16, n_heads=4),
    "none-bias": dict(d_model=16, n_heads=4, bias=True),
    "sinusoidal-bias": dict(d_model=16, n_heads=4, pe="sinusoidal", bias=True),
    "rope-half": dict(d_model=16, n_heads=4, pe="rope", rope_pairing="half"),
    "rope-interleaved-bias": dict(d_model=16, n_heads=4, pe="rope", rope_pairing="interleaved", bias=True),
    "gqa": dict(d_model=24, n_heads=6, n_kv_heads=2, bias=True),
    "gqa-rope": dict(d_model=16, n_heads=4, n_kv_heads=2, pe="rope"),
    "partial-rope": dict(d_model=32, n_heads=4, pe="rope", rotary_fraction=0.5, bias=True),
    "partial-rope-gqa-interleaved": dict(d_model=32, n_heads=4, n_kv_heads=2, pe="rope", rotary_fraction=0.5,
                                         rope_pairing="interleaved"),
    "alibi": dict(d_model=16, n_heads=4, pe="alibi", bias=True),
}


def planted(name: str, seed: int = 0, n_layers: int = 3):
    m = make_stack(seed, n_layers, **CONFIGS[name])
    spec = m.symmetry_spec()
    sa = state(m)
    g = sample(spec, seed + 1)
    return m, spec, sa, g, apply(spec, g, sa)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_planted_recovery_exact(name):
    _, spec, sa, g, sb = planted(name)
    res = match_attention(spec, sa, sb)
    assert rel(sa, sb) > 0.5
    assert rel(sa, res.apply(sb)) <= 1e-8
    inv = invert(spec, g)
    for space in spec.spaces:
        if space.startswith("heads."):
            assert torch.equal(res.transform[space], inv[space]), space
    assert res.totals["distance_after"] <= 1e-14 * res.totals["distance_before"]
    assert 1.0 <= res.worst_condition < 1e3
    d = json.loads(json.dumps(res.to_dict()))
    assert len(d["layers"]) == 3 and d["layers"][0]["tag"] == "0"


@pytest.mark.parametrize("name", ["none-bias", "rope-half", "gqa", "partial-rope"])
@pytest.mark.parametrize("eps", [1e-6, 1e-4, 1e-2])
def test_noise_gives_order_eps_error(name, eps):
    _, spec, sa, g, sb = planted(name, n_layers=2)
    gen = torch.Generator().manual_seed(7)
    noisy = {k: v + eps * v.abs().mean() * torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in sb.items()}
    res = match_attention(spec, sa, noisy)
    err = rel(sa, res.apply(noisy))
    assert err <= 30 * eps, err
    inv = invert(spec, g)
    for space in spec.spaces:
        if space.startswith("heads."):
            assert torch.equal(res.transform[space], inv[space])


@pytest.mark.parametrize("name", ["sinusoidal-bias", "rope-interleaved-bias", "gqa", "partial-rope", "alibi"])
def test_matched_model_computes_same_function_float64(name):
    m, spec, sa, g, sb = planted(name, n_layers=2)
    b = make_stack(0, 2, **CONFIGS[name])
    b.load_state_dict(sb)
    res = align_models(m, b)
    b2 = make_stack(0, 2, **CONFIGS[name])
    b2.load_state_dict(res.apply(b.state_dict()))
    x = torch.randn(2, 7, CONFIGS[name]["d_model"], dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        yb, yb2 = b(x), b2(x)
    assert float((yb - yb2).norm() / yb.norm()) <= 1e-10


@pytest.mark.parametrize("name", ["none-bias", "rope-half", "gqa-rope"])
def test_matched_model_computes_same_function_float32(name):
    a = make_stack(0, 2, dtype=torch.float32, **CONFIGS[name])
    b = make_stack(5, 2, dtype=torch.float32, **CONFIGS[name])  # independent models: a real match
    res = align_models(a, b)
    b2 = make_stack(0, 2, dtype=torch.float32, **CONFIGS[name])
    b2.load_state_dict(res.apply(b.state_dict()))
    assert all(v.dtype == torch.float32 for v in b2.state_dict().values())
    x = torch.randn(2, 7, CONFIGS[name]["d_model"], generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        yb, yb2 = b(x), b2(x)
    assert float((yb - yb2).norm() / yb.norm()) <= 1e-5
    assert res.totals["distance_after"] < res.totals["distance_before"]


def test_ablations_order_and_identity_when_off():
    _, spec, sa, g, sb = planted("none-bias", n_layers=2)
    res_none = match_attention(spec, sa, sb, stage1=False, stage2="none")
    assert rel(res_none.apply(sb), sb) == 0.0
    for space in spec.spaces:
        if space.startswith("heads."):
            assert torch.equal(res_none.transform[space], torch.arange(4))
    d = {m: match_attention(spec, sa, sb, stage2=m).totals["distance_after"] for m in ("none", "orthogonal", "full")}
    assert d["full"] <= d["orthogonal"] <= d["none"]


