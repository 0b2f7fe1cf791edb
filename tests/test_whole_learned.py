"""Learned matching over every space: exact output, never above weight matching, resumable; needs data."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.func import functional_call

from _whole_util import inputs, model, rel_out, rel_state

from symalign.errors import MatchError
from symalign.groups import PerHead
from symalign.lmc import interpolate
from symalign.match.latents import Latents
from symalign.match.learned import learn_matching
from symalign.match.optimise import lr_factor
from symalign.match.whole import align_whole
from symalign.rewrite import rewrite_model
from symalign.spec import apply, sample


def _data(cfg, n_batches=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n_batches):
        x = inputs(cfg, n=4, seed=seed + i)
        y = torch.randint(0, cfg.vocab_size, x.shape, generator=g) if cfg.family == "gpt" else \
            torch.randint(0, cfg.n_classes, (x.shape[0],), generator=g)
        out.append((x, y))
    return out


def _pair(family, pe, **kw):
    return rewrite_model(model(family, pe, seed=1, **kw)), rewrite_model(model(family, pe, seed=2, **kw))


class _Stream:
    """A stream ``batch(step)`` that records the steps asked for (and can fail at a given call)."""

    def __init__(self, cfg, fail_at: int | None = None):
        self.cfg, self.fail_at, self.asked = cfg, fail_at, []

    def __call__(self, step):
        if self.fail_at is not None and len(self.asked) == self.fail_at:
            raise KeyboardInterrupt("simulated interruption")
        self.asked.append(step)
        return _data(self.cfg, 1, seed=1000 + 7 * step)[0]


def test_learned_is_exact_and_resumable(tmp_path):
    """An interrupted run resumes from its checkpoint and reproduces the uninterrupted run; the stream
    is consumed once, in step order, across the interruption; the result is exact."""
    a, b = _pair("gpt", "rope")
    x = inputs(a.cfg)
    yb = b(x)
    wm = align_whole(a, b, max_sweeps=2, stage2="orthogonal")
    ck = tmp_path / "latents.pt"
    sel = _data(a.cfg, 1, seed=99)
    kw = dict(steps=5, lr=0.05, init=wm, select_batches=sel)
    broken = _Stream(a.cfg, fail_at=3)
    with pytest.raises(KeyboardInterrupt):
        learn_matching(a, b, broken, checkpoint=ck, save_every=1, progress=True, **kw)
    assert ck.exists() and broken.asked == [0, 1, 2]
    rest = _Stream(a.cfg)
    res = learn_matching(a, b, rest, checkpoint=ck, **kw)
    assert rest.asked == [3, 4]  # no batch seen twice, none skipped
    whole = _Stream(a.cfg)
    straight = learn_matching(a, b, whole, **kw)  # batch, lambda and learning rate depend on the step only
    assert whole.asked == [0, 1, 2, 3, 4]
    assert res.start_step == 3 and len(res.losses) == 5
    assert np.allclose(res.losses, straight.losses, rtol=1e-12, atol=0)
    for s in res.transform:
        assert torch.allclose(res.transform[s].double(), straight.transform[s].double(), rtol=0, atol=1e-12), s
    st = res.apply(b.state_dict())
    b.load_state_dict(st)
    assert rel_out(b(x), yb) <= 1e-9
    assert res.to_dict()["method"] == "learned"
    with pytest.raises(MatchError, match="other spaces"):
        learn_matching(a, b, _Stream(a.cfg), checkpoint=ck, spaces=["ff.0"], **kw)
    with pytest.raises(MatchError, match="other settings.*steps"):  # the cosine schedule depends on steps
        learn_matching(a, b, _Stream(a.cfg), checkpoint=ck, **{**kw, "steps": 8})


def test_constant_schedule_run_can_be_extended(tmp_path):
    a, b = _pair("vit", "rope")
    wm = align_whole(a, b, max_sweeps=2)
    data = _data(a.cfg, 2)
    ck = tmp_path / "latents.pt"
    kw = dict(lr=0.05, init=wm, schedule="constant")
    first = learn_matching(a, b, data, steps=3, checkpoint=ck, **kw)
    res = learn_matching(a, b, data, steps=5, checkpoint=ck, **kw)
    straight = learn_matching(a, b, data, steps=5, **kw)
    assert res.start_step == 3 and res.losses[:3] == first.losses
    assert np.allclose(res.losses, straight.losses, rtol=1e-12, atol=0)


def test_learning_rate_schedule():
    assert [lr_factor(s, 4) for s in range(4)] == pytest.approx([1.0, (1 + 2 ** -0.5) / 2, 0.5, (1 - 2 ** -0.5) / 2])
    assert [lr_factor(s, 6, warmup=2) for s in range(6)] == pytest.approx([0.5, 1.0, 1.0, (1 + 2 ** -0.5) / 2, 0.5,
                                                                           (1 - 2 ** -0.5) / 2])
    assert [lr_factor(s, 5, "constant", warmup=2) for s in range(5)] == [0.5, 1.0, 1.0, 1.0, 1.0]


def test_the_optimiser_follows_the_schedule(monkeypatch):
    """Adam's learning rate at each step is lr * lr_factor(step) (recorded at every ``opt.step``)."""
    seen = []
    step = torch.optim.Adam.step

    def spy(self, *args, **kw):
        seen.append(self.param_groups[0]["lr"])
        return step(self, *args, **kw)

    monkeypatch.setattr(torch.optim.Adam, "step", spy)
    a, b = _pair("vit", "rope")
    learn_matching(a, b, _data(a.cfg), steps=4, lr=0.04, warmup=1, init=align_whole(a, b, max_sweeps=1))
    assert seen == pytest.approx([0.04 * lr_factor(s, 4, warmup=1) for s in range(4)], rel=1e-15)


CASES = [("gpt", "rope", {}), ("vit", "rope", {}), ("vit", "sinusoidal", {}),
         ("gpt", "sinusoidal", dict(d_model=32, max_len=10)),
         ("encoder", "sinusoidal", dict(d_model=32, max_len=10, norm="rmsnorm")),
         ("gpt", "rope", dict(n_kv_heads=2, bias=False, activation="relu")),
         ("gpt", "rope", dict(rope_pairing="interleaved", rotary_fraction=0.5, head_dim=4))]


@pytest.mark.parametrize("family,pe,kw", CASES)
def test_every_space_is_learned_and_the_result_is_exact(family, pe, kw):
    a, b = _pair(family, pe, **kw)
    spec = a.symmetry_spec()
    x = inputs(a.cfg)
    yb = b(x)
    wm = align_whole(a, b, max_sweeps=2)
    res = learn_matching(a, b, _data(a.cfg), steps=6, lr=0.05, init=wm)
    assert set(res.transform) == set(spec.spaces)
    for s, g in spec.spaces.items():
        assert g.contains(res.transform[s]), s
    moved = [s for s, g in spec.spaces.items()
             if isinstance(g, PerHead) and not torch.equal(res.transform[s], wm.transform[s])]
    assert any(s.startswith("qk.") for s in moved) and any(s.startswith("vo.") for s in moved)
    if res.selected == "learned" and "residual" in spec.spaces:
        assert not torch.equal(res.transform["residual"], wm.transform["residual"])
    b.load_state_dict(res.apply(b.state_dict()))
    assert rel_out(b(x), yb) <= 1e-9


@pytest.mark.parametrize("family,pe,kw", CASES)
def test_training_forward_starts_at_weight_matching(family, pe, kw):
    """The differentiable dense action at the initial latents is `apply` of the weight-matching element."""
    a, b = _pair(family, pe, **kw)
    wm = align_whole(a, b, max_sweeps=2)
    lat = Latents(wm.spec, wm.transform)
    with torch.no_grad():
        soft = lat.soft_apply(b.state_dict())
    assert rel_state(wm.apply(b.state_dict()), soft) <= 1e-13
    final, fallbacks = lat.project()
    assert not fallbacks
    for s, g in wm.spec.spaces.items():
        assert torch.allclose(g.matrix(final[s]), g.matrix(wm.transform[s]), rtol=0, atol=1e-12), s


def _objective(a, sa, sb, data, points=5, lam=(0.2, 0.8)):
    """Independent J: mean cross-entropy over lambda in linspace(*lam) and the batches."""
    vals = []
    for t in np.linspace(lam[0], lam[1], points):
        st = interpolate(sa, sb, float(t))
        for xx, yy in data:
            logits = functional_call(a, st, (xx,))
            vals.append(float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), yy.reshape(-1))))
    return float(np.mean(vals))


def test_learned_objective_is_not_above_weight_matching():
    a, b = _pair("vit", "rope")
    data = _data(a.cfg, 2)
    wm = align_whole(a, b, max_sweeps=3)
    res = learn_matching(a, b, data, steps=12, lr=0.02, init=wm)
    sa, sb = a.state_dict(), b.state_dict()
    j_wm = _objective(a, sa, wm.apply(sb), data)
    j = _objective(a, sa, res.apply(sb), data)
    assert abs(res.objective_init - j_wm) <= 1e-9 * j_wm and abs(res.objective - j) <= 1e-9 * j
    assert j <= j_wm
    assert res.selected == "learned" and j < 0.9 * j_wm  # a few steps already help on this pair


def test_selection_uses_the_held_out_batches_and_a_stream():
    """With a stream, J is measured on ``select_batches`` (held-out data), never on the stream."""
    a, b = _pair("vit", "rope")
    held = _data(a.cfg, 2, seed=50)
    wm = align_whole(a, b, max_sweeps=3)
    stream = _Stream(a.cfg)
    res = learn_matching(a, b, stream, steps=6, lr=0.02, init=wm, select_batches=held)
    assert stream.asked == list(range(6))
    sa, sb = a.state_dict(), b.state_dict()
    assert res.objective_init == pytest.approx(_objective(a, sa, wm.apply(sb), held), rel=1e-9)
    assert res.objective == pytest.approx(_objective(a, sa, res.apply(sb), held), rel=1e-9)
    assert res.objective <= res.objective_init
    # without held-out batches, a stream is judged on its first select_n batches
    stream = _Stream(a.cfg)
    res = learn_matching(a, b, stream, steps=2, lr=0.02, init=wm, select_n=3)
    assert stream.asked == [0, 1, 0, 1, 2]
    first3 = [_Stream(a.cfg)(s) for s in range(3)]
    assert res.objective_init == pytest.approx(_objective(a, sa, wm.apply(sb), first3), rel=1e-9)


def test_ill_conditioned_blocks_fall_back_to_weight_matching():
    a, b = _pair("gpt", "rope")
    x = inputs(a.cfg)
    yb = b(x)
    wm = align_whole(a, b, max_sweeps=2)
    res = learn_matching(a, b, _data(a.cfg), steps=4, lr=0.2, init=wm, max_cond=1.0 + 1e-9, spaces=["vo.0"])
    assert res.fallbacks and all(f.startswith("vo.0 block") for f in res.fallbacks)
    n_blocks = wm.transform["vo.0"].shape[0]
    assert len(res.fallbacks) == n_blocks and torch.equal(res.transform["vo.0"], wm.transform["vo.0"])
    b.load_state_dict(res.apply(b.state_dict()))
    assert rel_out(b(x), yb) <= 1e-9


def test_planted_pair_starts_at_the_solution():
    """On a planted pair the latents start at the exact solution: the permutations stay, the rest moves little."""
    a = rewrite_model(model("vit", "learned"))
    spec = a.symmetry_spec()
    b = rewrite_model(model("vit", "learned"))
    b.load_state_dict(apply(spec, sample(spec, 4), a.state_dict()))
    wm = align_whole(a, b)
    assert rel_state(a.state_dict(), wm.apply(b.state_dict())) <= 1e-8
    res = learn_matching(a, b, _data(a.cfg, 1), steps=3, lr=1e-4, init=wm)
    for i in range(a.cfg.n_layers):
        assert torch.equal(res.transform[f"ff.{i}"], wm.transform[f"ff.{i}"])
        assert torch.equal(res.transform[f"heads.{i}"], wm.transform[f"heads.{i}"])
    assert rel_state(a.state_dict(), res.apply(b.state_dict())) <= 1e-2


def test_needs_data():
    a = rewrite_model(model("gpt", "rope"))
    with pytest.raises(MatchError, match="needs data"):
        learn_matching(a, a, None)
    with pytest.raises(MatchError, match="needs data"):
        learn_matching(a, a, [])
    with pytest.raises(MatchError, match="schedule"):
        learn_matching(a, a, _data(a.cfg), schedule="linear")
