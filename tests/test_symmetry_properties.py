"""Property tests: declared symmetries are exact; larger groups are not symmetries."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from symalign.groups import GeneralLinear, PerHead
from symalign.nn.attention import AttentionConfig, attention_spec
from symalign.probe import double_copy, generic_attention, head_swap
from symalign.spec import apply, sample

PES = ["none", "sinusoidal", "learned", "rope", "alibi"]
SETTINGS = settings(max_examples=25, deadline=None)


def _setup(pe: str, seed: int, bias: bool, kv: int, pairing: str = "half", dtype=torch.float64):
    cfg = AttentionConfig(d_model=8, n_heads=4, head_dim=4, n_kv_heads=kv, pe=pe, bias=bias, rope_pairing=pairing,
                          max_len=5)
    layer = double_copy(generic_attention(cfg, seed)).to(dtype)
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(seed + 7), dtype=dtype)
    state = {k: v.detach() for k, v in layer.state_dict().items()}
    return cfg, layer, x, state


def _rel_change(layer, x, state, new_state) -> float:
    from torch.func import functional_call

    with torch.no_grad():
        y0 = functional_call(layer, state, (x,))
        y1 = functional_call(layer, new_state, (x,))
    return float((y1 - y0).norm() / y0.norm())


@pytest.mark.slow
@SETTINGS
@given(pe=st.sampled_from(PES), seed=st.integers(0, 10_000), bias=st.booleans(), kv=st.sampled_from([1, 2, 4]))
def test_declared_group_is_exact(pe, seed, bias, kv):
    cfg, layer, x, state = _setup(pe, seed, bias, kv)
    spec = layer.symmetry_spec()
    g = sample(spec, seed)
    assert _rel_change(layer, x, state, apply(spec, g, state)) <= 1e-10
    _, layer32, x32, state32 = _setup(pe, seed, bias, kv, dtype=torch.float32)
    assert _rel_change(layer32, x32, state32, apply(spec, g, state32)) <= 1e-5


@SETTINGS
@given(seed=st.integers(0, 10_000), bias=st.booleans(), kv=st.sampled_from([2, 4]))
def test_gl_on_qk_breaks_rope(seed, bias, kv):
    cfg, layer, x, state = _setup("rope", seed, bias, kv)
    bigger = attention_spec(dataclasses.replace(cfg, pe="none")).restrict(["qk.0"])  # GL(d_h) per K/V group
    assert isinstance(bigger.spaces["qk.0"], PerHead) and isinstance(bigger.spaces["qk.0"].inner, GeneralLinear)
    g = sample(bigger, seed)
    assert _rel_change(layer, x, state, apply(bigger, g, state)) >= 1e-3


@SETTINGS
@given(seed=st.integers(0, 10_000), model_pairing=st.sampled_from(["half", "interleaved"]), bias=st.booleans())
def test_wrong_pairing_is_not_a_symmetry(seed, model_pairing, bias):
    cfg, layer, x, state = _setup("rope", seed, bias, 4, pairing=model_pairing)
    wrong = "interleaved" if model_pairing == "half" else "half"
    spec = attention_spec(dataclasses.replace(cfg, rope_pairing=wrong)).restrict(["qk.0"])
    g = sample(spec, seed)
    assert _rel_change(layer, x, state, apply(spec, g, state)) >= 1e-3


@SETTINGS
@given(seed=st.integers(0, 10_000), bias=st.booleans(), kv=st.sampled_from([1, 2, 4]))
def test_head_swap_breaks_alibi(seed, bias, kv):
    cfg, layer, x, state = _setup("alibi", seed, bias, kv)
    spec = attention_spec(dataclasses.replace(cfg, pe="none")).restrict(["heads.0"])
    pi = head_swap(spec.spaces["heads.0"])
    assert _rel_change(layer, x, state, apply(spec, {"heads.0": pi}, state)) >= 1e-3
