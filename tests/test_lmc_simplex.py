"""The many-model barrier over the simplex: the formula, its two-model case, draws, bad input."""

from __future__ import annotations

import numpy as np
import pytest

from _whole_util import model
from test_whole_learned import _data

from symalign.errors import SymalignError
from symalign.lmc import evaluate, interpolate
from symalign.lmc_simplex import dirichlet_weights, simplex_barrier


def _models(n):
    return [model("vit", "rope", seed=s) for s in range(1, n + 1)]


def test_barrier_is_the_merged_loss_minus_the_weighted_losses():
    ms = _models(3)
    data = _data(ms[0].cfg, 2, seed=5)
    batches = lambda: iter(data)  # noqa: E731
    states = [m.state_dict() for m in ms]
    res = simplex_barrier(ms[0], states, batches, draws=4, seed=3)
    assert len(res.weights) == 4 and all(abs(sum(w) - 1) <= 1e-12 and min(w) > 0 for w in res.weights)
    own = [evaluate(m, m.state_dict(), batches) for m in ms]
    for w, b, ab in zip(res.weights, res.barriers, res.acc_barriers):
        merged = {k: sum(wk * s[k] for wk, s in zip(w, states)) for k in states[0]}
        loss, acc = evaluate(ms[0], merged, batches)
        assert b == pytest.approx(loss - sum(wk * o[0] for wk, o in zip(w, own)), abs=1e-12)
        assert ab == pytest.approx(sum(wk * o[1] for wk, o in zip(w, own)) - acc, abs=1e-12)
    d = res.to_dict()
    assert d["max_barrier"] == max(res.barriers) and d["mean_barrier"] == pytest.approx(np.mean(res.barriers))
    assert res.max_barrier > 0.1  # three unrelated random models: merging them costs loss
    again = simplex_barrier(ms[0], states, batches, draws=4, seed=3)
    assert again.weights == res.weights and again.barriers == res.barriers


def test_two_models_give_the_segment_and_copies_give_zero():
    a, b = _models(2)
    data = _data(a.cfg, 1, seed=5)
    batches = lambda: iter(data)  # noqa: E731
    sa, sb = a.state_dict(), b.state_dict()
    res = simplex_barrier(a, [sa, sb], batches, draws=3)
    la, lb = evaluate(a, sa, batches)[0], evaluate(a, sb, batches)[0]
    for (w0, w1), bar in zip(res.weights, res.barriers):
        lt = evaluate(a, interpolate(sa, sb, w1), batches)[0]  # the curve's point t = w_2
        assert bar == pytest.approx(lt - (w0 * la + w1 * lb), abs=1e-10)
    same = simplex_barrier(a, [sa, {k: v.clone() for k, v in sa.items()}, sa], batches, draws=3)
    assert max(abs(x) for x in same.barriers) <= 1e-12


def test_draws_and_bad_input():
    w = dirichlet_weights(4, 16, 1.0, seed=0)
    assert w.shape == (16, 4) and np.allclose(w.sum(1), 1)
    assert np.array_equal(w, np.random.default_rng(0).dirichlet(np.ones(4), size=16))
    a = _models(1)[0]
    with pytest.raises(SymalignError, match=">= 2 models"):
        simplex_barrier(a, [a.state_dict()], lambda: iter(_data(a.cfg, 1)))
    with pytest.raises(SymalignError, match="alpha"):
        dirichlet_weights(3, 4, 0.0)
    other = model("vit", "rope", d_ff=16)
    with pytest.raises(SymalignError, match="shape"):
        simplex_barrier(a, [a.state_dict(), other.state_dict()], lambda: iter(_data(a.cfg, 1)))
