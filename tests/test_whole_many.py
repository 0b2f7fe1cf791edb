"""Dirichlet-sampled learned refinement of a three-model merge: exact, never above universe matching."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.func import functional_call

from _whole_util import inputs, model, rel_out
from test_whole_learned import _Stream, _data

from symalign.errors import MatchError
from symalign.match.learned_many import learn_many
from symalign.match.universe import load_merged, match_universe, save_merged
from symalign.rewrite import rewrite_model
from symalign.spec import apply


def _models(family="vit", pe="rope", seeds=(1, 2, 3), **kw):
    return [rewrite_model(model(family, pe, seed=s, **kw)) for s in seeds]


def _uniform_merge_loss(models, transforms, data):
    """Independent reference: average the aligned states by hand, mean cross-entropy over the batches."""
    spec = models[0].symmetry_spec()
    aligned = [apply(spec, t, m.state_dict()) for m, t in zip(models, transforms)]
    merged = {k: sum(a[k] for a in aligned) / len(aligned) for k in aligned[0]}
    vals = []
    for x, y in data:
        logits = functional_call(models[0], merged, (x,))
        vals.append(float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))))
    return float(np.mean(vals)), merged


@pytest.mark.parametrize("family,pe,kw", [("vit", "rope", {}), ("gpt", "sinusoidal", dict(d_model=32, max_len=10))])
def test_three_model_refinement_is_exact_and_not_above_universe(tmp_path, family, pe, kw):
    ms = _models(family, pe, **kw)
    spec = ms[0].symmetry_spec()
    data = _data(ms[0].cfg, 2)
    uni = match_universe(ms, rounds=2, max_sweeps=3, stage2="orthogonal")
    res = learn_many(ms, data, steps=10, lr=0.02, init=uni, alpha=1.0)  # uniform on the simplex
    assert len(res.transforms) == 3 and len(res.losses) == 10
    x = inputs(ms[0].cfg)
    for m, t in zip(ms, res.transforms):
        for s, g in spec.spaces.items():
            assert g.contains(t[s]), s
        y = m(x)
        m2 = rewrite_model(model(family, pe, seed=1, **kw))
        m2.load_state_dict(apply(spec, t, m.state_dict()))
        assert rel_out(m2(x), y) <= 1e-9
    assert all(torch.equal(res.transforms[0][s], uni.transforms[0][s]) for s in spec.spaces)  # the reference
    l_uni, _ = _uniform_merge_loss(ms, uni.transforms, data)
    l_new, merged = _uniform_merge_loss(ms, res.transforms, data)
    assert abs(res.merged_loss_init - l_uni) <= 1e-9 * l_uni and abs(res.merged_loss - l_new) <= 1e-9 * l_new
    assert l_new <= l_uni
    assert res.selected == "learned" and l_new < 0.9 * l_uni  # ten steps already help on random tiny models
    assert max(float((merged[k] - res.merged[k]).abs().max()) for k in merged) <= 1e-12
    out = save_merged(tmp_path / "merged", ms[0], res.merged, res.to_dict())
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]  # no temporary files left
    assert rel_out(load_merged(out)(x), functional_call(ms[0], res.merged, (x,))) <= 1e-12


def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    """Interrupted after 3 of 5 steps (cosine schedule) and resumed: the same losses as one straight run,
    and the stream is consumed once, in order."""
    ms = _models("gpt", "rope")
    uni = match_universe(ms, rounds=1, max_sweeps=2, stage2="orthogonal")
    ck = tmp_path / "many.pt"
    held = _data(ms[0].cfg, 1, seed=99)
    kw = dict(steps=5, init=uni, select_batches=held)
    broken = _Stream(ms[0].cfg, fail_at=3)
    with pytest.raises(KeyboardInterrupt):
        learn_many(ms, broken, checkpoint=ck, save_every=1, **kw)
    rest, whole = _Stream(ms[0].cfg), _Stream(ms[0].cfg)
    res = learn_many(ms, rest, checkpoint=ck, **kw)
    straight = learn_many(ms, whole, **kw)
    assert broken.asked == [0, 1, 2] and rest.asked == [3, 4] and whole.asked == list(range(5))
    assert res.start_step == 3
    assert np.allclose(res.losses, straight.losses, rtol=1e-12, atol=0)
    assert res.merged_loss == pytest.approx(_uniform_merge_loss(ms, res.transforms, held)[0], rel=1e-9)
    with pytest.raises(MatchError, match="2 models|3 models"):
        learn_many(ms[:2], _Stream(ms[0].cfg), steps=6, checkpoint=ck, rounds=1)
    with pytest.raises(MatchError, match="other settings"):
        learn_many(ms, _Stream(ms[0].cfg), checkpoint=ck, **{**kw, "lr": 0.5})


def test_bad_input():
    ms = _models("gpt", "rope", seeds=(1, 2))
    data = _data(ms[0].cfg, 1)
    with pytest.raises(MatchError, match="needs data"):
        learn_many(ms, None)
    with pytest.raises(MatchError, match="needs data"):
        learn_many(ms, [])
    with pytest.raises(MatchError, match="two models"):
        learn_many(ms[:1], data)
    with pytest.raises(MatchError, match="depth"):
        learn_many(ms + [rewrite_model(model("gpt", "rope", n_layers=3))], data)
    with pytest.raises(MatchError, match="FF widths differ"):
        learn_many(ms + [rewrite_model(model("gpt", "rope", d_ff=48))], data)
    with pytest.raises(MatchError, match="alpha"):
        learn_many(ms, data, alpha=0.0)
    with pytest.raises(MatchError, match="schedule"):
        learn_many(ms, data, schedule="step")


def test_default_dirichlet_concentration_is_seed_002s():
    """The default draws ``w ~ Dirichlet(0.1 1_M)`` (seed 002's value), recorded in the notes; the
    never-above-universe guarantee holds with it."""
    ms = _models("vit", "rope")
    data = _data(ms[0].cfg, 2)
    uni = match_universe(ms, rounds=1, max_sweeps=3, stage2="orthogonal")
    res = learn_many(ms, data, steps=4, lr=0.02, init=uni)
    assert any("alpha=0.1" in n for n in res.notes)
    assert _uniform_merge_loss(ms, res.transforms, data)[0] <= _uniform_merge_loss(ms, uni.transforms, data)[0]
