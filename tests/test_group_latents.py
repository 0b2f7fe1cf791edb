"""What solvers need of a group lives in the group: nearest element, latents, soft action, projection."""

from __future__ import annotations

import itertools

import pytest
import torch

from symalign.errors import GroupError
from symalign.groups import (GeneralLinear, HeadPermutation, Orthogonal, PerHead, Permutation, PositiveMonomial,
                             RotaryPlanes)
from symalign.groups import CenteredOrthogonal

LEARNABLE = [
    Permutation(5),
    PositiveMonomial(5),
    HeadPermutation(4, 3),
    HeadPermutation(6, 2, 2),  # GQA
    Orthogonal(4),
    CenteredOrthogonal(5),
    PerHead(GeneralLinear(3), 2),
    PerHead(RotaryPlanes(4, "interleaved"), 3),
    PerHead(RotaryPlanes(6, "half", rotary_dims=2), 2),
]


@pytest.mark.parametrize("g", LEARNABLE, ids=lambda g: g.describe())
@pytest.mark.parametrize("variance", ["co", "contra"])
def test_latents_start_at_the_element_and_act_like_it(g, variance):
    el = g.sample(3)
    lat = {k: v.clone().requires_grad_(True) for k, v in g.latent(el).items()}
    back, fallbacks = g.from_latent(lat, el)
    assert not fallbacks and g.contains(back)
    assert torch.allclose(g.matrix(back), g.matrix(el), rtol=0, atol=1e-12)
    x = torch.randn(g.n, 7, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    soft = g.soft(lat, el)
    y = g.soft_act(soft, x, 0, variance, None)
    assert torch.allclose(y, g.act(el, x, 0, variance, None), rtol=1e-10, atol=1e-10)
    y.pow(2).sum().backward()
    assert all(v.grad is not None and torch.isfinite(v.grad).all() for v in lat.values())


def test_unsupported_groups_say_so():
    with pytest.raises(GroupError, match="GL\\(3\\) has no latent parametrisation"):
        GeneralLinear(3).latent(torch.eye(3))
    with pytest.raises(GroupError, match="per-block latent parametrisation"):
        PerHead(Orthogonal(3), 2).latent(PerHead(Orthogonal(3), 2).identity())


def test_nearest_elements_against_brute_force():
    gen = torch.Generator().manual_seed(1)
    m = torch.randn(5, 5, generator=gen, dtype=torch.float64)
    best = max(itertools.permutations(range(5)), key=lambda p: float(m[torch.arange(5), torch.tensor(p)].sum()))
    assert Permutation(5).nearest(m).tolist() == list(best)
    hg = HeadPermutation(4, 2, 2)  # S_2 wr S_2: 8 elements
    s = torch.randn(4, 4, generator=gen, dtype=torch.float64)
    elements = {tuple(hg.sample(k).tolist()) for k in range(200)}
    assert len(elements) == hg.order()
    score = {p: float(s[torch.arange(4), torch.tensor(p)].sum()) for p in elements}
    assert score[tuple(hg.nearest(s).tolist())] == pytest.approx(max(score.values()), rel=1e-14)
    for g in (Orthogonal(4), CenteredOrthogonal(4)):
        mm = torch.randn(4, 4, generator=gen, dtype=torch.float64)
        o = g.nearest(mm)
        assert g.contains(o)
        assert all(float((g.sample(k) * mm).sum()) <= float((o * mm).sum()) + 1e-12 for k in range(200))
