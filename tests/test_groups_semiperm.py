"""Semi-permutations (:class:`symalign.groups.SemiPermutation`): splitting ReLU units and attention heads into
copies and merging them back, exact in float64 and float32; the matched split recovers a planted one; splits
outside the group (shares not summing to one, a homogeneous split through GELU) change the function; the
probe's nullity of a split model is its declared dimension."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from symalign.errors import GroupError
from symalign.groups import PositiveMonomial, SemiPermutation
from symalign.probe import probe
from symalign.spec import SymmetrySpec, apply
from symalign.tolerance import TOLERANCE


def _mlp(widths: list[int], act=nn.ReLU, dtype=torch.float64, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for k in range(len(widths) - 1):
        layers += [nn.Linear(widths[k], widths[k + 1]), act()]
    return nn.Sequential(*layers[:-1]).to(dtype)


def _split_spec(groups: list[SemiPermutation]) -> SymmetrySpec:
    """Hidden layer ``k`` of an ``nn.Sequential`` MLP (Linear at index ``2 k``) split by ``groups[k]``."""
    spec = SymmetrySpec()
    for k, g in enumerate(groups):
        spec.add_space(f"ff.{k}", g, role="ff", layer=k)
        spec.act_on(f"{2 * k}.weight", f"ff.{k}", 0, "co")
        spec.act_on(f"{2 * k}.bias", f"ff.{k}", 0, "co")
        spec.act_on(f"{2 * k + 2}.weight", f"ff.{k}", 1, "contra")
    return spec


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("homogeneous", [True, False])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_split_and_merge_keep_the_function(homogeneous, dtype):
    narrow, wide = [6, 5, 4, 3], [6, 9, 7, 3]
    groups = [SemiPermutation(5, 9, homogeneous), SemiPermutation(4, 7, homogeneous)]
    spec = _split_spec(groups)
    a = _mlp(narrow, dtype=dtype)
    elems = {f"ff.{k}": g.sample(k + 3) for k, g in enumerate(groups)}
    assert all(g.contains(elems[f"ff.{k}"]) for k, g in enumerate(groups))
    w = _mlp(wide, dtype=dtype)
    w.load_state_dict(apply(spec, elems, a.state_dict()))
    x = torch.randn(300, 6, dtype=dtype)
    tol = TOLERANCE[dtype] if dtype == torch.float32 else 1e-10
    with torch.no_grad():
        assert _rel(w(x), a(x)) <= tol
        # merging is the left inverse: the narrow weights come back
        for t, acts in spec.tensors.items():
            back = w.state_dict()[t]
            for act in reversed(acts):
                back = spec.spaces[act.space].merge(elems[act.space], back, act.axis, act.variance, act.rep)
            assert float((back - a.state_dict()[t]).abs().max()) <= 10 * tol * float(a.state_dict()[t].abs().max())


def test_the_two_forms_differ_by_a_positive_monomial():
    g, h = SemiPermutation(4, 7, True), SemiPermutation(4, 7, False)
    e = g.sample(0)
    src, alpha = g.parts(e)
    x = torch.randn(4, 5, dtype=torch.float64)
    scale = PositiveMonomial(7).pack(torch.arange(7), alpha)  # diag(alpha): the homogeneous form's copies
    assert torch.allclose(PositiveMonomial(7).act(scale, h.act(e, x, 0, "co"), 0, "co"), g.act(e, x, 0, "co"))
    assert torch.allclose(PositiveMonomial(7).act(scale, h.act(e, x, 0, "contra"), 0, "contra"),
                          g.act(e, x, 0, "contra"))


def test_gelu_units_split_exactly_on_the_output_side():
    a, w = _mlp([5, 4, 3], nn.GELU), _mlp([5, 8, 3], nn.GELU)
    g = SemiPermutation(4, 8, homogeneous=False)
    w.load_state_dict(apply(_split_spec([g]), {"ff.0": g.sample(2)}, a.state_dict()))
    x = torch.randn(100, 5, dtype=torch.float64)
    with torch.no_grad():
        assert _rel(w(x), a(x)) <= 1e-10


@pytest.mark.parametrize("case", ["shares-not-one", "homogeneous-gelu"])
def test_a_larger_set_of_splits_breaks_the_function(case):
    act = nn.GELU if case == "homogeneous-gelu" else nn.ReLU
    a, w = _mlp([5, 4, 3], act), _mlp([5, 8, 3], act)
    g = SemiPermutation(4, 8, homogeneous=True)
    e = g.sample(2)
    if case == "shares-not-one":
        e = e.clone()
        e[1] *= 1.3
        assert not g.contains(e)
    w.load_state_dict(apply(_split_spec([g]), {"ff.0": e}, a.state_dict()))
    x = torch.randn(100, 5, dtype=torch.float64)
    with torch.no_grad():
        assert _rel(w(x), a(x)) > 1e-3


def test_planted_split_is_recovered():
    """Split B's units, shuffle the copies: the matched split of B onto that target is the planted one."""
    b = _mlp([6, 5, 3])
    g = SemiPermutation(5, 9)
    planted = g.sample(7)
    spec = _split_spec([g])
    target = apply(spec, {"ff.0": planted}, b.state_dict())
    rows = [(target[t].movedim(a.axis, 0), b.state_dict()[t].movedim(a.axis, 0), a.variance)
            for t, acts in spec.tensors.items() for a in acts]
    rows = [(xa.reshape(xa.shape[0], -1), xb.reshape(xb.shape[0], -1), v) for xa, xb, v in rows]
    got = g.fit(rows)
    assert g.contains(got)
    assert torch.equal(g.parts(got)[0], g.parts(planted)[0])
    assert float((g.parts(got)[1] - g.parts(planted)[1]).abs().max()) <= 1e-12


def test_matched_pairing_is_the_best_onto_map():
    """Brute force over every onto map of 6 target units to 3 source units."""
    g = SemiPermutation(3, 6)
    torch.manual_seed(1)
    xa, xb = torch.randn(6, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    src, _ = g.parts(g.fit([(xa, xb, "co")]))
    sims = (xa / xa.norm(dim=1, keepdim=True)) @ (xb / xb.norm(dim=1, keepdim=True)).T
    best = max(sum(float(sims[j, s[j]]) for j in range(6))
               for s in itertools.product(range(3), repeat=6) if len(set(s)) == 3)
    assert abs(sum(float(sims[j, src[j]]) for j in range(6)) - best) <= 1e-12


def test_probe_nullity_of_a_split_model_is_its_declared_dimension():
    """A split ReLU MLP: the wide layer's positive monomials plus the split's degeneracy, measured."""
    a = _mlp([4, 5, 3])
    g = SemiPermutation(5, 8)
    w = _mlp([4, 8, 3])
    w.load_state_dict(apply(_split_spec([g]), {"ff.0": g.sample(4)}, a.state_dict()))
    x = torch.randn(200, 4, dtype=torch.float64)
    declared = PositiveMonomial(8).dim + g.dim + g.degeneracy(4, 3)
    assert g.dim == 0
    assert probe(a, x, method="dense").nullity == PositiveMonomial(5).dim
    assert probe(w, x, method="dense").nullity == declared


def _attention(state: dict[str, torch.Tensor], x: torch.Tensor, head_dim: int) -> torch.Tensor:
    q, k, v = x @ state["q"].T, x @ state["k"].T, x @ state["v"].T
    h = q.shape[-1] // head_dim
    split = lambda t: t.reshape(t.shape[0], h, head_dim).transpose(0, 1)  # noqa: E731
    att = torch.softmax(split(q) @ split(k).transpose(1, 2) / head_dim ** 0.5, -1)
    return (att @ split(v)).transpose(0, 1).reshape(x.shape[0], -1) @ state["o"].T


@pytest.mark.parametrize("homogeneous", [True, False])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_head_split_sums_the_ov_products_and_copies_qk(homogeneous, dtype):
    d_model, head_dim, heads, wide = 8, 2, 3, 5
    torch.manual_seed(0)
    state = {n: torch.randn(heads * head_dim, d_model, dtype=dtype) for n in "qkv"}
    state["o"] = torch.randn(d_model, heads * head_dim, dtype=dtype)
    g = SemiPermutation(heads, wide, homogeneous, block=head_dim)
    spec = SymmetrySpec()
    spec.add_space("heads.0", g)
    spec.act_on("q", "heads.0", 0, "co", "copy")
    spec.act_on("k", "heads.0", 0, "contra", "copy")
    spec.act_on("v", "heads.0", 0, "co")
    spec.act_on("o", "heads.0", 1, "contra")
    e = g.sample(5)
    out = apply(spec, {"heads.0": e}, state)
    x = torch.randn(7, d_model, dtype=dtype)
    tol = TOLERANCE[dtype] if dtype == torch.float32 else 1e-10
    assert _rel(_attention(out, x, head_dim), _attention(state, x, head_dim)) <= tol
    src, _ = g.parts(e)
    sl = lambda i: slice(i * head_dim, (i + 1) * head_dim)  # noqa: E731
    for i in range(heads):
        ov = sum(out["o"][:, sl(j)].double() @ out["v"][sl(j)].double() for j in range(wide) if src[j] == i)
        ref = state["o"][:, sl(i)].double() @ state["v"][sl(i)].double()
        assert float((ov - ref).abs().max()) <= 10 * tol * float(ref.abs().max())
        for j in range(wide):
            if src[j] == i:
                assert torch.equal(out["q"][sl(j)], state["q"][sl(i)])


def test_elements_composition_and_refusals():
    g = SemiPermutation(3, 5)
    e = g.sample(0)
    assert g.contains(e) and g.dim == 0 and g.changes_width and g.matcher is None
    assert g.contains(g.uniform())
    bad = g.uniform().clone()
    bad[0, :] = 0  # not onto
    assert not g.contains(bad)
    with pytest.raises(GroupError, match="no inverse"):
        g.inverse(e)
    with pytest.raises(GroupError, match="no identity"):
        g.identity()
    sq = SemiPermutation(5, 5)
    p = sq.pack(torch.randperm(5, generator=torch.Generator().manual_seed(2)), torch.ones(5))
    both = sq.compose(p, e)  # split, then permute the copies
    x = torch.randn(3, 4, dtype=torch.float64)
    assert torch.allclose(g.act(both, x, 0, "co"), sq.act(p, g.act(e, x, 0, "co"), 0, "co"))
    assert torch.allclose(g.act(both, x, 0, "contra"), sq.act(p, g.act(e, x, 0, "contra"), 0, "contra"))
    assert torch.equal(sq.compose(sq.inverse(p), p)[0], torch.arange(5, dtype=torch.float64))
    dense_co, dense_contra = g.matrix(e), g.matrix(e, variance="contra")
    assert torch.allclose(dense_contra.T @ dense_co, torch.eye(3, dtype=torch.float64))
    with pytest.raises(GroupError, match="m >= n"):
        SemiPermutation(4, 3)
