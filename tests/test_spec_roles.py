"""Spaces carry a role and a layer; solvers and scopes read those, not the names."""

from __future__ import annotations

import pytest
import torch

from _whole_util import inputs, model, rel_out
from symalign.errors import SpecError
from symalign.experiments.protocol import scope_spaces
from symalign.groups import GeneralLinear, HeadPermutation, PerHead, Permutation
from symalign.match.distance import attention_distance
from symalign.match.views import find_layers
from symalign.match.whole import match_whole
from symalign.rewrite import rewrite_model
from symalign.spec import ROLES, SpaceInfo, SymmetrySpec, apply, implied_info, sample


def renamed(spec: SymmetrySpec, names: dict[str, str]) -> SymmetrySpec:
    """The same spec with every space renamed (roles and layers kept): nothing may depend on names."""
    out = SymmetrySpec()
    for s, g in spec.spaces.items():
        out.add_space(names[s], g, spec.role(s), spec.layer(s))
    for t, acts in spec.tensors.items():
        for a in acts:
            out.act_on(t, names[a.space], a.axis, a.variance, a.rep, a.segment)
    for p, bs in spec.couplings.items():
        out.couple(names[p], *(names[b] for b in bs))
    return out


def test_add_space_roles_select_restrict_merge():
    sp = SymmetrySpec()
    sp.add_space("h", HeadPermutation(2, 3), "heads", 0)
    sp.add_space("a", PerHead(GeneralLinear(3), 2), "qk", 0)
    sp.add_space("b", PerHead(GeneralLinear(3), 2), "vo", 0)
    sp.add_space("u1", Permutation(4), "ff", 1)
    sp.add_space("stream", Permutation(6), "residual")
    sp.add_space("ff.7", Permutation(4))  # a built-in name implies its role and layer
    assert sp.role("a") == "qk" and sp.layer("a") == 0 and sp.layer("stream") is None
    assert sp.info["ff.7"] == SpaceInfo("ff", 7) == implied_info("ff.7")
    assert sp.select(role="ff") == ["u1", "ff.7"]
    assert sp.select(role=("heads", "qk", "vo"), layer=0) == ["h", "a", "b"]
    assert sp.select(layer=[1, 7]) == ["u1", "ff.7"]
    assert sp.layers() == [0, 1, 7] and sp.layers("ff") == [1, 7]
    sub = sp.restrict(["a", "stream"])
    assert sub.info == {"a": SpaceInfo("qk", 0), "stream": SpaceInfo("residual", None)}
    other = SymmetrySpec()
    other.add_space("x", Permutation(3), "experts", 2)
    merged = sp.merge(other, prefix="m.")
    assert merged.role("x") == "experts" and merged.layer("x") == 2 and merged.role("u1") == "ff"
    assert set(ROLES) >= {"heads", "qk", "vo", "ff", "residual", "experts"}
    with pytest.raises(SpecError, match="unknown role 'units'"):
        sp.add_space("y", Permutation(2), "units")


def test_builders_declare_roles():
    a = rewrite_model(model("gpt", "rope"))
    spec = a.symmetry_spec()
    for s in spec.spaces:
        assert spec.role(s) in ROLES, s
    assert spec.select(role="residual") == ["residual"]
    assert spec.select(role="ff") == ["ff.0", "ff.1"]
    assert spec.select(layer=1) == ["heads.1", "qk.1", "vo.1", "ff.1"]


def test_matching_and_scopes_do_not_read_names():
    """Renaming every space to an arbitrary string changes nothing: the spec's roles carry the meaning."""
    a = rewrite_model(model("gpt", "rope"))
    spec = a.symmetry_spec()
    b = rewrite_model(model("gpt", "rope"))
    b.load_state_dict(apply(spec, sample(spec, 3), a.state_dict()))
    names = {s: f"space{i}" for i, s in enumerate(spec.spaces)}
    rspec = renamed(spec, names)
    sa, sb = a.state_dict(), b.state_dict()
    res, rres = match_whole(spec, sa, sb), match_whole(rspec, sa, sb)
    assert rres.distances[-1] <= 1e-16 * rres.distances[0]
    assert rres.distances == pytest.approx(res.distances, rel=1e-9, abs=1e-20)
    assert [layer.tag for layer in find_layers(rspec)] == ["0", "1"]
    assert scope_spaces(rspec, "first-block", 2) == [names[s] for s in ("heads.0", "qk.0", "vo.0", "ff.0")]
    assert scope_spaces(rspec, "all-attention", 2) == [names[s] for s in spec.spaces
                                                       if spec.role(s) in ("heads", "qk", "vo")]
    assert attention_distance(rspec, sa, sb) == attention_distance(spec, sa, sb)
    x = inputs(a.cfg)
    yb = b(x)
    b.load_state_dict(rres.apply(sb))
    assert rel_out(b(x), yb) <= 1e-9


def test_attention_layer_without_head_space_pairs_qk_vo_by_layer():
    """ALiBi layers have no head permutation: ``qk``/``vo`` are paired by their layer."""
    a = model("gpt", "alibi")
    spec = a.symmetry_spec().restrict(a.symmetry_spec().select(role=("qk", "vo")))
    rspec = renamed(spec, {s: s.upper().replace(".", "_") for s in spec.spaces})
    layers = find_layers(rspec)
    assert [(la.tag, la.qk.name, la.vo.name) for la in layers] == [("0", "QK_0", "VO_0"), ("1", "QK_1", "VO_1")]
    assert torch.is_tensor(sample(rspec, 0)["QK_0"])
