"""The full scope's naive curve interpolates in the same (rewritten) coordinates as its aligned curves."""

from __future__ import annotations

import pytest

from _whole_util import model
from test_whole_learned import _data

from symalign import lmc
from symalign.experiments.protocol import alignment_models, curve_runner, naive_curves


def test_full_scope_naive_curve_is_in_the_rewritten_coordinates_and_the_original_is_reported():
    a, b = model("vit", "sinusoidal", seed=1), model("vit", "sinusoidal", seed=2)
    batches = _data(a.cfg, 2, seed=5)
    curve = curve_runner(batches, "classification", 5)
    sa, sb = lmc.full_state(a), lmc.full_state(b)
    arch_a, arch_b, _ = alignment_models(a, b, "full")
    ra, rb = lmc.full_state(arch_a), lmc.full_state(arch_b)
    naive, original = naive_curves(curve, a, arch_a, (sa, sb), (ra, rb))
    same = lmc.curve(arch_a, ra, rb, lambda: batches, "classification", 5)
    own = lmc.curve(a, sa, sb, lambda: batches, "classification", 5)
    assert naive.loss == same.loss and original is not None and original.loss == own.loss
    # the rewrite is exact on the endpoints (same functions) and not on the path in between
    for i in (0, -1):
        assert naive.loss[i] == pytest.approx(original.loss[i], rel=1e-10)
    assert max(abs(x - y) for x, y in zip(naive.loss, original.loss)) > 1e-6


def test_other_scopes_have_one_naive_curve():
    a, b = model("vit", "rope", seed=1), model("vit", "rope", seed=2)
    batches = _data(a.cfg, 1, seed=5)
    curve = curve_runner(batches, "classification", 3)
    arch_a, arch_b, _ = alignment_models(a, b, "all-attention")
    sa, sb = lmc.full_state(a), lmc.full_state(b)
    naive, original = naive_curves(curve, a, arch_a, (sa, sb), (sa, sb))
    assert original is None and naive.loss == lmc.curve(a, sa, sb, lambda: batches, "classification", 3).loss
