"""The symmetry probe: measured Jacobian nullity == predicted group dimension (float64, small layers)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from symalign.errors import SymalignError
from symalign.nn.attention import AttentionConfig
from symalign.probe import (ProbeResult, attention_parameter_count, generic_attention, predicted_nullity,
                            probe, probe_attention, probe_tour)


def _measure(seq_len: int = 6, **kw) -> ProbeResult:
    cfg = AttentionConfig(**kw)
    res = probe_attention(cfg, seq_len, method="dense")
    assert res.method == "dense" and res.parameters == attention_parameter_count(cfg)
    assert res.outputs >= 2 * res.parameters
    assert not res.warnings
    return res


SIZES = [dict(d_model=8, n_heads=2, head_dim=4), dict(d_model=8, n_heads=4, head_dim=2),
         dict(d_model=6, n_heads=3, head_dim=2)]


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"D{s['d_model']}h{s['n_heads']}d{s['head_dim']}")
@pytest.mark.parametrize("pe", ["none", "sinusoidal", "learned"])
def test_absolute_pe_nullity_is_2hd2(pe, size):
    res = _measure(pe=pe, max_len=6, **size)
    h, d = size["n_heads"], size["head_dim"]
    assert res.nullity == res.predicted == 2 * h * d * d
    assert res.singular_value_gap > 1e6 and res.head_permutations_preserved is True


@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"D{s['d_model']}h{s['n_heads']}d{s['head_dim']}")
@pytest.mark.parametrize("pairing", ["half", "interleaved"])
def test_rope_nullity_is_h_d2_plus_d(pairing, size):
    res = _measure(pe="rope", rope_pairing=pairing, **size)
    h, d = size["n_heads"], size["head_dim"]
    assert res.nullity == res.predicted == h * (d * d + d)
    assert res.head_permutations_preserved is True


@pytest.mark.parametrize("kw,expected", [
    (dict(pe="rope", rotary_fraction=0.5), 2 * (2 + 2 ** 2) + 2 * 16),             # H(2) + GL(2) on Q-K
    (dict(pe="none", n_heads=4, n_kv_heads=2), 2 * 16 + 2 * 16),                    # per K/V head
    (dict(pe="rope", n_heads=4, n_kv_heads=1), 1 * 4 + 1 * 16),                         # H(4) + GL(4)
    (dict(pe="none", bias=True), 64 + 2 * 4 + 2 * 4),                               # key bias + value/output bias
    (dict(pe="rope", bias=True), 40 + 0 + 2 * 4),                                   # rotated key bias matters
    (dict(pe="rope", rotary_fraction=0.5, bias=True), 44 + 2 * 2 + 2 * 4),          # unrotated key bias free
    (dict(pe="learned", bias=True, max_len=6), 64 + 8 + 8 + 8),                     # + uniform PE shift (D)
    (dict(pe="learned", max_len=9), 64 + 3 * 8),                                    # unused PE rows
    (dict(pe="alibi", bias=True, causal=True), 64 + 8 + 8),
    (dict(pe="rope", bias=True, causal=True, n_heads=4, n_kv_heads=2), 2 * 4 + 2 * 16 + 2 * 4),
])
def test_extra_terms(kw, expected):
    res = _measure(**{"d_model": 8, "n_heads": 2, "head_dim": 4, **kw})
    assert res.nullity == res.predicted == expected, res.breakdown


def test_breakdown_names_each_term():
    cfg = AttentionConfig(d_model=8, n_heads=2, head_dim=4, pe="learned", bias=True, max_len=10)
    total, terms = predicted_nullity(cfg, seq_len=6)
    assert terms == {"qk": 32, "vo": 32, "key_bias": 8, "value_output_bias": 8, "pe_shift": 8, "unused_pe_rows": 32}
    assert total == sum(terms.values())


@pytest.mark.parametrize("kw,preserved", [
    (dict(pe="none"), True), (dict(pe="rope"), True), (dict(pe="alibi"), False),
    (dict(pe="alibi", n_heads=4, n_kv_heads=2), False), (dict(pe="none", n_heads=4, n_kv_heads=2), True),
    (dict(pe="alibi", n_heads=4, n_kv_heads=1), False), (dict(pe="learned", bias=True), True),
])
def test_head_permutation_flag(kw, preserved):
    res = _measure(**{"d_model": 8, "n_heads": 2, "head_dim": 4, "max_len": 6, **kw})
    assert res.head_permutations_preserved is preserved
    assert res.match


def test_generic_module_and_errors():
    torch.manual_seed(0)
    lin = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    res = probe(lin, torch.randn(40, 3), method="dense")
    # positive per-unit scaling is not a symmetry of tanh; only the sign flips (discrete) -> nullity 0
    assert res.nullity == 0 and res.predicted is None and res.match is None and res.head_permutations_preserved is None
    # y = W2 W1 x with W1: 4x3, W2: 2x4 -- the product covers all 2x3 matrices (6 dims), so 20 - 6 = 14 free
    lin2 = nn.Sequential(nn.Linear(3, 4, bias=False), nn.Linear(4, 2, bias=False))
    assert probe(lin2, torch.randn(40, 3), method="dense").nullity == 20 - 6
    with pytest.raises(SymalignError, match="no floating-point parameters"):
        probe(nn.ReLU(), torch.randn(3, 3))
    with pytest.raises(SymalignError, match="method"):
        probe(lin, torch.randn(4, 3), method="svd")


def test_result_to_dict_is_json_ready():
    import json

    res = _measure(d_model=8, n_heads=2, head_dim=4)
    d = json.loads(json.dumps(res.to_dict()))
    for key in ("nullity", "predicted", "parameters", "head_permutations_preserved", "tol", "method", "seconds"):
        assert key in d
    assert d["tol"] == 1e-9 and d["match"] is True


def test_matrix_free_agrees_with_dense():
    """Hutchinson + CGLS agrees with the exact count within 4 sigma + 1.

    Kept small (288 parameters) for the 2-core test budget; benchmarks/bench_probe.py
    checks ~1k-parameter layers.
    """
    cfg = AttentionConfig(d_model=8, n_heads=2, head_dim=4, pe="none", bias=True)
    dense = probe_attention(cfg, 6, method="dense")
    mf = probe_attention(cfg, 6, method="matrix-free", probes=8, tol=1e-4)
    assert dense.nullity == dense.predicted
    assert mf.method == "matrix-free" and mf.stderr > 0 and mf.probes == 8
    assert abs(mf.nullity - dense.nullity) <= 4 * mf.stderr + 1, (mf.nullity, mf.stderr, dense.nullity)
    assert math.isclose(mf.rank, mf.parameters - mf.nullity)


def test_probe_tour_subset():
    rows = probe_tour(variants=["alibi", "partial rope (r=2/4)"], biases=(True,))
    assert [r["variant"] for r in rows] == ["partial rope (r=2/4)", "alibi"]
    assert all(r["match"] for r in rows)
    assert [r["head_permutations_preserved"] for r in rows] == [True, False]


def test_package_level_probe_is_the_function():
    import importlib

    import symalign

    importlib.import_module("symalign.probe")  # importing the submodule must not rebind the name
    lin = nn.Linear(2, 2, bias=False)
    assert symalign.probe(lin, torch.randn(5, 2), method="dense").nullity == 0
