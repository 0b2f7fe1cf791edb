"""The symmetry probe: measured Jacobian nullity == predicted group dimension (float64, small layers)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from symalign.errors import SymalignError
from symalign.nn.attention import AttentionConfig
from symalign.probe import (ProbeResult, attention_parameter_count, predicted_nullity,
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


@pytest.mark.slow
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


def test_import_symalign_probe_is_the_module():
    """``import symalign.probe`` gives the module (#18/#24), whose ``probe`` is the function."""
    import importlib
    import inspect

    import symalign
    import symalign.probe

    assert inspect.ismodule(symalign.probe) and inspect.ismodule(importlib.import_module("symalign.probe"))
    assert symalign.probe is importlib.import_module("symalign.probe")
    lin = nn.Linear(2, 2, bias=False)
    assert symalign.probe.probe(lin, torch.randn(5, 2), method="dense").nullity == 0
    for name in symalign.probe.__all__:
        assert getattr(symalign.probe, name) is not None, name


class _Scaled(nn.Module):
    """``y = x * (w * c)``: singular values proportional to ``c`` (one tensor, so equilibration keeps ratios)."""

    def __init__(self, c):
        super().__init__()
        self.w = nn.Parameter(torch.ones(len(c), dtype=torch.float64))
        self.register_buffer("c", torch.tensor(c, dtype=torch.float64))

    def forward(self, x):
        return x * (self.w * self.c)


@pytest.mark.parametrize("tiny,nullity", [(1e-13, 1), (1e-6, 0)])
def test_clean_gap_is_counted(tiny, nullity):
    res = probe(_Scaled([1.0, 0.5, tiny]), torch.ones(4, 3, dtype=torch.float64), method="dense")
    assert res.nullity == nullity


@pytest.mark.parametrize("tiny", [3e-9, 1e-10, 5e-8])
def test_no_clean_gap_is_refused(tiny):
    """A singular value within 100x of the cut (1e-9): refused, naming the value and the gap, no nullity."""
    from symalign.probe import AmbiguousSpectrumError

    with pytest.raises(AmbiguousSpectrumError, match=r"no clean gap.*1 lie between 1\.0e-11 and 1\.0e-07") as exc:
        probe(_Scaled([1.0, 0.5, tiny]), torch.ones(4, 3, dtype=torch.float64), method="dense")
    assert f"({tiny:.1e})" in str(exc.value)
    assert "anywhere from 0 to 1" in str(exc.value)


def test_near_null_counts():
    res = probe(_Scaled([1.0, 0.5, 5e-4, 5e-5, 1e-14]), torch.randn(6, 5, dtype=torch.float64), method="dense")
    assert res.nullity == 1 and res.near_null == {"1e-3": 2, "1e-4": 1}
    assert res.largest_null < 1e-12 and 1e-5 < res.smallest_kept < 1e-4


@pytest.mark.slow
def test_rope_near_null_spectrum_and_slow_planes():
    """#23 item 5: d_h=16, T=17 RoPE head -- exact nullity 272 as predicted, plus the near-null spectrum."""
    cfg = AttentionConfig(d_model=16, n_heads=1, head_dim=16, pe="rope")
    res = probe_attention(cfg, 17, method="dense")
    assert res.nullity == res.predicted == 16 * 16 + 16
    d = res.to_dict()
    planes = d["rope_planes"]
    assert len(planes) == 8 and all(abs(p["angle"] - 16 * 10000 ** (-2 * p["plane"] / 16)) < 1e-12 for p in planes)
    assert d["slow_planes"] == sum(p["angle"] < 0.1 for p in planes) == 3
    assert d["near_null"]["1e-3"] >= d["near_null"]["1e-4"] > 0
    none = probe_attention(AttentionConfig(d_model=16, n_heads=1, head_dim=16, pe="none"), 17, method="dense")
    assert none.near_null["1e-3"] == 0 and none.rope_planes is None


def _llama_attention():
    """Hugging Face Llama attention (D=8, 2 heads, d_h=4, RoPE, eager) with its rotary module, built offline."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    cfg = transformers.LlamaConfig(hidden_size=8, num_attention_heads=2, num_key_value_heads=2, head_dim=4,
                                   num_hidden_layers=1, intermediate_size=16, vocab_size=16)
    cfg._attn_implementation = "eager"

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn, self.rot = LlamaAttention(cfg, 0), LlamaRotaryEmbedding(cfg)

        def forward(self, x):
            pos = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
            return self.attn(x, position_embeddings=self.rot(x, pos), attention_mask=None)[0]

    torch.manual_seed(0)
    return Layer().double(), torch.randn(20, 6, 8, dtype=torch.float64)


@pytest.mark.parametrize("ad", ["forward", "reverse", "both"])
def test_hf_llama_attention_nullity_is_40(ad):
    """#19 item 5: eager softmax runs in float32; computed in float64 the null space is 32 (V-O) + 8 (H on Q-K)."""
    layer, x = _llama_attention()
    res = probe(layer, x, method="dense", ad=ad, check_heads=False)
    assert res.nullity == 2 * 16 + 2 * 4 == 40
    assert res.largest_null < 1e-13 and res.singular_value_gap > 1e9
    assert any("softmax" in u for u in res.upcasts)


def test_hf_llama_in_float32_arithmetic_is_refused_not_miscounted(monkeypatch):
    """Without the float64 upcast the forward-mode spectrum has 8 values at ~1e-9: refused (was: nullity 32)."""
    from symalign.probe import AmbiguousSpectrumError, Float64Mode

    monkeypatch.setattr(Float64Mode, "__torch_function__",
                        lambda self, func, types, args=(), kwargs=None: func(*args, **(kwargs or {})))
    layer, x = _llama_attention()
    with pytest.raises(AmbiguousSpectrumError, match=r"8 lie between .* anywhere from 32 to 40"):
        probe(layer, x, method="dense", check_heads=False)


def test_float64_mode_upcasts_internal_casts():
    from symalign.probe import Float64Mode

    x = torch.randn(3, 4, dtype=torch.float64)
    mode = Float64Mode()
    with mode:
        assert x.float().dtype == torch.float64 and x.to(torch.float32).dtype == torch.float64
        assert torch.softmax(x, -1, dtype=torch.float32).dtype == torch.float64
        assert torch.zeros(2, dtype=torch.float16).dtype == torch.float64
        assert torch.arange(3).dtype == torch.int64 and x.to(torch.int32).dtype == torch.int32
    assert {"Tensor.float()", "Tensor.to(float32)", "softmax(dtype=float32)", "zeros(dtype=float16)"} <= mode.sites
    assert x.float().dtype == torch.float32  # only while active
