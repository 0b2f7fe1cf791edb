"""Whole-model alignment methods for the protocol: entries shaped like the protocol's variants, exact, data split."""

from __future__ import annotations

import pytest
import torch

from _whole_util import model
from test_whole_learned import _Stream, _data

from symalign import lmc
from symalign.errors import MatchError
from symalign.data.base import Dataset
from symalign.experiments.methods import TrainStream, align_methods, train_stream
from symalign.match.objective import interpolated_objective
from symalign.rewrite import rewrite_model


def _pair():
    return rewrite_model(model("vit", "rope", seed=1)), rewrite_model(model("vit", "rope", seed=2))


def test_entries_match_the_protocol_variants():
    a, b = _pair()
    test = _data(a.cfg, 2, seed=100)  # the curve's batches
    train = _data(a.cfg, 2, seed=0)  # the alignment's batches
    sb = {k: v.clone() for k, v in b.state_dict().items()}
    naive = lmc.Curve([0.0, 0.5, 1.0], [1.0, 3.0, 1.0], [0.9, 0.4, 0.9])  # barriers 2.0 and 0.5
    res = align_methods(a, b, test, "classification", points=5, learned_steps=8, train_batches=train, naive=naive)
    assert list(res) == ["weight", "activation", "learned"]
    for method, e in res.items():
        for key in ("curve", "function_change", "loss_barrier_ratio_percent", "acc_barrier_ratio_percent", "match"):
            assert key in e, (method, key)
        assert e["function_change"] <= 1e-9
        assert e["match"]["method"] == method
        c = lmc.curve(a, a.state_dict(), e["state"], lambda: test, "classification", 5)
        assert c.loss == pytest.approx(e["curve"]["loss"], rel=1e-12) and e["loss_barrier"] == c.loss_barrier
        assert e["loss_barrier_ratio_percent"] == pytest.approx(100 * c.loss_barrier / 2.0, abs=1e-12)
        assert e["acc_barrier_ratio_percent"] == pytest.approx(100 * c.acc_barrier / 0.5, abs=1e-12)
    assert all(torch.equal(v, b.state_dict()[k]) for k, v in sb.items())  # B untouched
    # learned matching ran on the training batches: its objective is the one on `train`, not `test`
    learned = res["learned"]["match"]
    j = interpolated_objective(a, a.state_dict(), res["learned"]["state"], train)
    assert learned["objective"] == pytest.approx(j, rel=1e-9)
    assert learned["objective"] <= learned["objective_init"]


def test_bad_input():
    a, b = _pair()
    test = _data(a.cfg, 1, seed=100)
    with pytest.raises(MatchError, match="train_batches"):
        align_methods(a, b, test, methods=("activation",))
    with pytest.raises(MatchError, match="unknown"):
        align_methods(a, b, test, methods=("vanilla",))
    res = align_methods(a, b, test, methods=("weight",), points=3)  # data-free method needs no training data
    naive = lmc.curve(a, a.state_dict(), b.state_dict(), lambda: test, "classification", 3)  # default naive curve
    expect = lmc.barrier_ratio(res["weight"]["loss_barrier"], naive.loss_barrier)
    assert res["weight"]["loss_barrier_ratio_percent"] == pytest.approx(expect, nan_ok=True)


def test_stream_and_validation_selection():
    """A stream feeds learned matching one fresh batch per step and activation matching its first
    batches; learned matching's choice is judged on the validation batches."""
    a, b = _pair()
    test, val = _data(a.cfg, 1, seed=100), _data(a.cfg, 2, seed=200)
    stream = _Stream(a.cfg)
    res = align_methods(a, b, test, "classification", points=3, learned_steps=5, train_batches=stream,
                        val_batches=val, activation_batches=2, methods=("activation", "learned"),
                        learned_options=dict(lam=(0.3, 0.7)))
    assert stream.asked == [0, 1] + list(range(5))  # activation sample, then one batch per learned step
    learned = res["learned"]["match"]
    j = interpolated_objective(a, a.state_dict(), res["learned"]["state"], val, lam=(0.3, 0.7))
    assert learned["objective"] == pytest.approx(j, rel=1e-9) and learned["objective"] <= learned["objective_init"]
    assert "a fresh batch every step" in learned["notes"][0] and "U(0.3, 0.7)" in learned["notes"][0]


def _toy_dataset(n=20):
    """Image i is filled with the value i, so a batch names the examples it holds."""
    x = torch.arange(n, dtype=torch.float32)[:, None, None, None].expand(n, 1, 2, 2).clone()
    y = torch.arange(n) % 3
    return Dataset("toy", "classification", x, y, x[:2], y[:2], x[:2], y[:2], n_classes=3, input_shape=(1, 2, 2))


def test_train_stream_does_not_repeat_within_an_epoch():
    ds = _toy_dataset(20)
    stream = TrainStream(ds, batch_size=6, seed=3)  # 3 full batches per epoch, the ragged tail dropped
    ids = lambda step: stream(step)[0][:, 0, 0, 0].long().tolist()  # noqa: E731
    for epoch in range(3):
        seen = [i for s in range(3 * epoch, 3 * epoch + 3) for i in ids(s)]
        assert len(seen) == 18 and len(set(seen)) == 18  # no example twice in an epoch
        assert all(stream(s)[1].tolist() == [i % 3 for i in ids(s)] for s in range(3 * epoch, 3 * epoch + 3))
    assert ids(0) != ids(3)  # each epoch is a new permutation
    assert TrainStream(ds, 6, 3)(4)[0].equal(stream(4)[0])  # a pure function of the step
    listed = train_stream(ds, 4, 6, 3)
    assert all(x.equal(stream(s)[0]) for s, (x, _) in enumerate(listed)) and len(stream.take(4)) == 4
