"""Stage 1 ranked by the loss barrier after stage 2 (the paper's ablation), on tiny float64 ViTs."""

from __future__ import annotations

import itertools

import pytest
import torch

from _whole_util import model
from test_whole_learned import _data

from symalign import lmc
from symalign.errors import MatchError
from symalign.experiments.protocol import attention_spec
from symalign.experiments.stage1_rank import pearson, rank_heads_by_barrier
from symalign.match import match_attention
from symalign.spec import apply, sample


def _planted(pe: str):
    """A, and B = g . A for a random g of the attention spaces of both layers (B computes A's function)."""
    a = model("vit", pe, seed=1)
    spec = attention_spec(a, [0, 1])
    sa = {k: v.detach().clone() for k, v in a.state_dict().items()}
    g = sample(spec, 7)
    g["heads.0"] = torch.tensor([2, 0, 3, 1])  # a non-identity permutation on the ranked layer
    sb = apply(spec, g, sa)
    return a, spec, sa, sb


@pytest.mark.parametrize("pe", ["sinusoidal", "rope"])
@pytest.mark.slow
def test_planted_pair_the_chosen_permutation_is_rank_1_with_lhat_0(pe):
    a, spec, sa, sb = _planted(pe)
    batches = _data(a.cfg, 2, seed=5)
    ranks = rank_heads_by_barrier(a, spec, sa, sb, batches, points=5, layers=["heads.0"])
    assert [r.heads_space for r in ranks] == ["heads.0"]
    r = ranks[0]
    assert r.n_permutations == 24 and len(r.permutations) == 24
    assert sorted(tuple(p.permutation) for p in r.permutations) == list(itertools.permutations(range(4)))
    assert r.chosen != [0, 1, 2, 3]  # the planted permutation was undone, not the identity kept
    assert r.rank == 1 and r.chosen_barrier == pytest.approx(0.0, abs=1e-8)
    assert r.lhat == pytest.approx(0.0, abs=1e-5) and r.naive_barrier > 1e-3
    others = [p.loss_barrier for p in r.permutations if p.permutation != r.chosen]
    assert sorted(others)[len(others) // 2] > 1e-3  # most wrong assignments are not connected on this pair
    assert r.chosen_is_distance_minimum


@pytest.mark.slow
def test_each_permutation_is_the_single_layer_match_it_claims():
    """The barrier of the identity permutation equals stage 2 alone (stage 1 off) on a one-layer spec,
    measured independently; the chosen one equals the full two-stage matcher's."""
    a = model("vit", "sinusoidal", seed=1)
    b = model("vit", "sinusoidal", seed=2)
    spec = attention_spec(a, [0])
    sa, sb = dict(a.state_dict()), dict(b.state_dict())
    batches = _data(a.cfg, 2, seed=3)
    (r,) = rank_heads_by_barrier(a, spec, sa, sb, batches, points=5)
    by = {tuple(p.permutation): p for p in r.permutations}
    for stage1, perm in ((False, (0, 1, 2, 3)), (True, tuple(r.chosen))):
        m = match_attention(spec, sa, sb, stage1=stage1, stage2="full")
        c = lmc.curve(a, sa, apply(spec, m.transform, sb), lambda: batches, "classification", 5)
        assert by[perm].loss_barrier == pytest.approx(c.loss_barrier, rel=1e-6, abs=1e-9)
        assert by[perm].distance == pytest.approx(m.totals["distance_after"], rel=1e-6)
    assert r.naive_barrier == pytest.approx(
        lmc.curve(a, sa, sb, lambda: batches, "classification", 5).loss_barrier, rel=1e-12)
    assert 1 <= r.rank <= 24
    assert r.rank == 1 + sum(p.loss_barrier < r.chosen_barrier - 1e-9 * max(
        abs(q.loss_barrier) for q in r.permutations) for p in r.permutations)
    assert r.best_barrier == min(p.loss_barrier for p in r.permutations)


def test_pearson_and_bad_input():
    assert pearson([1, 2, 3], [2, 4, 7]) == pytest.approx(float(torch.corrcoef(
        torch.tensor([[1.0, 2, 3], [2, 4, 7]], dtype=torch.float64))[0, 1]), rel=1e-12)
    a = model("vit", "sinusoidal", seed=1)
    spec = attention_spec(a, [0])
    sa = dict(a.state_dict())
    with pytest.raises(MatchError, match="heads.5"):
        rank_heads_by_barrier(a, spec, sa, sa, _data(a.cfg, 1), points=3, layers=["heads.5"])


def test_descent_starts_at_procrustes_and_lowers_the_distance_towards_lbfgs():
    from symalign.experiments.stage2_descent import descent_path

    a = model("vit", "sinusoidal", seed=1)
    b = model("vit", "sinusoidal", seed=2)
    spec = attention_spec(a, [0, 1])
    sa, sb = dict(a.state_dict()), dict(b.state_dict())
    batches = _data(a.cfg, 1, seed=3)
    pts = descent_path(a, spec, sa, sb, batches, points=3, etas=(0.5,), checkpoints=(0, 5, 50))
    ref = {p.variant: p for p in pts if p.variant != "gd"}
    gd = [p for p in pts if p.variant == "gd"]
    assert [p.steps for p in gd] == [0, 5, 50]
    assert gd[0].distance == pytest.approx(ref["orthogonal"].distance, rel=1e-9)
    assert gd[0].loss_barrier == pytest.approx(ref["orthogonal"].loss_barrier, rel=1e-9)
    assert gd[0].distance > gd[1].distance > gd[2].distance >= ref["full"].distance * (1 - 1e-9)
    assert ref["none"].distance > ref["orthogonal"].distance
    none = match_attention(spec, sa, sb, stage1=True, stage2="none")
    c = lmc.curve(a, sa, apply(spec, none.transform, sb), lambda: batches, "classification", 3)
    assert ref["none"].loss_barrier == pytest.approx(c.loss_barrier, rel=1e-12)
