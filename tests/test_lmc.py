"""LMC curves and barriers on a small attention classifier."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from symalign import lmc
from symalign import spec as S
from symalign.errors import SymalignError
from symalign.nn.attention import AttentionConfig, MultiHeadAttention


class TinyClassifier(nn.Module):
    def __init__(self, pe="rope", seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.attn = MultiHeadAttention(AttentionConfig(d_model=16, n_heads=4, pe=pe, max_len=8))
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.attn(x).mean(1))

    def symmetry_spec(self):
        return self.attn.symmetry_spec(prefix="attn.")


def _data(seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 8, 16, generator=g, dtype=dtype)
    y = torch.randint(0, 3, (64,), generator=g)
    return lambda: [(x[:32], y[:32]), (x[32:], y[32:])]


def test_barrier_with_itself_is_zero_and_endpoints_match():
    m = TinyClassifier().double()
    st = lmc.full_state(m)
    c = lmc.curve(m, st, st, _data(), points=5)
    assert c.loss_barrier == pytest.approx(0.0, abs=1e-12)
    assert c.acc_barrier == pytest.approx(0.0, abs=1e-12)
    m2 = TinyClassifier(seed=1).double()
    st2 = lmc.full_state(m2)
    c = lmc.curve(m, st, st2, _data(), points=5)
    assert c.loss[0] == pytest.approx(lmc.evaluate(m, st, _data())[0], rel=1e-12)
    assert c.loss[-1] == pytest.approx(lmc.evaluate(m2, st2, _data())[0], rel=1e-12)
    assert c.acc[-1] == lmc.evaluate(m2, st2, _data())[1]


def test_symmetric_copy_has_zero_barrier_after_undoing_the_transform():
    m = TinyClassifier().double()
    sp = m.symmetry_spec()
    st = lmc.full_state(m)
    g = S.sample(sp, 3)
    st_b = S.apply(sp, g, st)  # same function, far away in weight space
    naive = lmc.curve(m, st, st_b, _data(), points=7)
    aligned = lmc.curve(m, st, S.apply(sp, S.invert(sp, g), st_b), _data(), points=7)
    assert naive.loss[-1] == pytest.approx(naive.loss[0], rel=1e-9)
    assert abs(aligned.loss_barrier) <= 1e-6
    assert naive.loss_barrier > 1e-4


def test_barrier_definitions_on_a_handmade_curve():
    c = lmc.Curve(t=[0, 0.5, 1], loss=[1.0, 3.0, 2.0], acc=[0.9, 0.5, 0.7])
    assert c.loss_barrier == pytest.approx(3.0 - 1.5)
    assert c.acc_barrier == pytest.approx(0.8 - 0.5)
    assert c.midpoint_loss_barrier == pytest.approx(3.0 - 1.5)
    assert lmc.barrier_ratio(0.1, 0.4) == pytest.approx(25.0)


def test_mismatched_models_raise():
    a = lmc.full_state(TinyClassifier())
    b = dict(a)
    b["head.weight"] = torch.zeros(4, 16)
    with pytest.raises(SymalignError, match="head.weight"):
        lmc.curve(TinyClassifier(), a, b, _data(dtype=torch.float32))
    b = {k: v for k, v in a.items() if k != "head.bias"}
    with pytest.raises(SymalignError, match="different parameters"):
        lmc.curve(TinyClassifier(), a, b, _data(dtype=torch.float32))


@pytest.mark.slow
def test_curve_memory_is_two_models_plus_one():
    """At most one interpolated state is alive at a time (besides A and B themselves)."""
    import gc
    import weakref

    m = TinyClassifier()
    a, b = lmc.full_state(m), lmc.full_state(TinyClassifier(seed=2))
    alive: list[weakref.ref] = []
    max_alive = 0
    orig = lmc.interpolate

    def spy(sa, sb, t):
        nonlocal max_alive
        gc.collect()
        live = sum(r() is not None for r in alive)
        out = orig(sa, sb, t)
        alive.append(weakref.ref(out["head.weight"]))
        max_alive = max(max_alive, live + 1)
        return out

    lmc.interpolate = spy
    try:
        c = lmc.curve(m, a, b, _data(dtype=torch.float32), points=9)
    finally:
        lmc.interpolate = orig
    assert len(alive) == 7 and len(c.t) == 9  # the endpoints reuse A and B themselves
    assert max_alive == 1
