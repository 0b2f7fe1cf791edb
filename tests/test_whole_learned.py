"""Learned matching: exact output, starts at weight matching, resumable; needs data."""

from __future__ import annotations

import pytest
import torch

from _whole_util import inputs, model, rel_out, rel_state, one_thread  # noqa: F401  (autouse fixture)

from symalign.errors import MatchError
from symalign.match.learned import learn_matching
from symalign.match.whole import align_whole
from symalign.rewrite import rewrite_model


def _data(cfg, n_batches=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n_batches):
        x = inputs(cfg, n=4, seed=seed + i)
        y = torch.randint(0, cfg.vocab_size, x.shape, generator=g) if cfg.family == "gpt" else \
            torch.randint(0, cfg.n_classes, (x.shape[0],), generator=g)
        out.append((x, y))
    return out


def test_learned_is_exact_and_resumable(tmp_path):
    a = rewrite_model(model("gpt", "rope", seed=1))
    b = rewrite_model(model("gpt", "rope", seed=2))
    x = inputs(a.cfg)
    yb = b(x)
    wm = align_whole(a, b, max_iter=2, stage2="orthogonal")
    ck = tmp_path / "latents.pt"
    first = learn_matching(a, b, _data(a.cfg), steps=3, lr=0.05, init=wm, checkpoint=ck)
    assert ck.exists() and len(first.losses) == 3
    res = learn_matching(a, b, _data(a.cfg), steps=5, lr=0.05, init=wm, checkpoint=ck)
    assert res.start_step == 3 and len(res.losses) == 5 and res.losses[:3] == first.losses
    st = res.apply(b.state_dict())
    b.load_state_dict(st)
    assert rel_out(b(x), yb) <= 1e-9
    assert res.to_dict()["method"] == "learned"


def test_planted_pair_starts_at_the_solution():
    """On a planted pair the latents start at the exact solution: the permutations stay, O moves little."""
    a = rewrite_model(model("vit", "learned"))
    spec = a.symmetry_spec()
    from symalign.spec import apply, sample

    b = rewrite_model(model("vit", "learned"))
    b.load_state_dict(apply(spec, sample(spec, 4), a.state_dict()))
    wm = align_whole(a, b)
    assert rel_state(a.state_dict(), wm.apply(b.state_dict())) <= 1e-8
    res = learn_matching(a, b, _data(a.cfg, 1), steps=3, lr=1e-4, init=wm)
    for i in range(a.cfg.n_layers):
        assert torch.equal(res.transform[f"ff.{i}"], wm.transform[f"ff.{i}"])
    assert rel_state(a.state_dict(), res.apply(b.state_dict())) <= 1e-2


def test_needs_data():
    a = rewrite_model(model("gpt", "rope"))
    with pytest.raises(MatchError, match="needs data"):
        learn_matching(a, a, None)
    with pytest.raises(MatchError, match="needs data"):
        learn_matching(a, a, [])
