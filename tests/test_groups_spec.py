"""Groups and spec: group axioms, exact actions, compose/invert, bad specs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from symalign import spec as S
from symalign.errors import ConfigError, GroupError, SpecError
from symalign.groups import (GeneralLinear, HeadPermutation, Orthogonal, PerHead, Permutation, RotaryPlanes,
                             apply_on_axis, rotary_pairs)
from symalign.nn.attention import AttentionConfig, MultiHeadAttention

GROUPS = [
    Permutation(5),
    GeneralLinear(4),
    Orthogonal(4),
    RotaryPlanes(6, "half"),
    RotaryPlanes(6, "interleaved"),
    RotaryPlanes(8, "half", rotary_dims=4),
    HeadPermutation(6, 2, 3),
    PerHead(GeneralLinear(3), 2),
    PerHead(RotaryPlanes(4, "interleaved"), 3),
]


def _mat(g, a):
    return g.matrix(a)


@pytest.mark.parametrize("g", GROUPS, ids=lambda g: g.describe())
@given(seed=st.integers(0, 2**31 - 1))
@settings(max_examples=20, deadline=None)
def test_group_axioms(g, seed):
    a, b = g.sample(seed), g.sample(seed + 1)
    assert g.contains(a) and g.contains(b)
    assert g.contains(g.compose(a, b)) and g.contains(g.inverse(a))
    # the representation is a homomorphism: T_{a b} = T_a T_b, T_{a^-1} = T_a^-1
    torch.testing.assert_close(_mat(g, g.compose(a, b)), _mat(g, a) @ _mat(g, b), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(_mat(g, g.inverse(a)) @ _mat(g, a), torch.eye(_mat(g, a).shape[0], dtype=torch.float64),
                               rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("g", [g for g in GROUPS if not isinstance(g, HeadPermutation)], ids=lambda g: g.describe())
def test_act_matches_dense_matrix(g):
    a = g.sample(3)
    n = _mat(g, a).shape[0]
    x = torch.randn(2, n, 3, dtype=torch.float64)
    t = _mat(g, a)
    torch.testing.assert_close(g.act(a, x, 1, "co"), torch.einsum("ij,bjc->bic", t, x))
    torch.testing.assert_close(g.act(a, x, 1, "contra"), torch.einsum("ij,bjc->bic", torch.linalg.inv(t).T, x))


def test_group_dimensions():
    assert GeneralLinear(5).dim == 25 and Orthogonal(5).dim == 10 and Permutation(5).dim == 0
    assert RotaryPlanes(8).dim == 8 and RotaryPlanes(8, rotary_dims=4).dim == 4 + 16
    assert PerHead(RotaryPlanes(4), 3).dim == 12
    assert HeadPermutation(6, 4, 2).order() == 2 * 6 * 6


def test_rotary_elements_commute_with_rotations():
    for pairing in ("half", "interleaved"):
        g = RotaryPlanes(6, pairing)
        a = g.sample(0)
        j0, j1 = rotary_pairs(6, pairing)
        rot = torch.zeros(6, 6, dtype=torch.float64)
        ang = torch.tensor([0.3, 1.1, 2.0], dtype=torch.float64)
        rot[j0, j0] = ang.cos()
        rot[j1, j1] = ang.cos()
        rot[j0, j1] = -ang.sin()
        rot[j1, j0] = ang.sin()
        torch.testing.assert_close(a @ rot, rot @ a)
        gl = GeneralLinear(6).sample(1)
        assert (gl @ rot - rot @ gl).abs().max() > 1e-3
        assert not g.contains(gl)


def test_head_permutation_respects_gqa_groups():
    g = HeadPermutation(8, 2, 2)
    for seed in range(20):
        pi = g.sample(seed)
        assert g.contains(pi)
        grp = (pi // 4).view(2, 4)
        assert (grp == grp[:, :1]).all()
    assert not g.contains(torch.tensor([0, 1, 2, 4, 3, 5, 6, 7]))  # splits a group
    with pytest.raises(GroupError):
        HeadPermutation(6, 2, 4)


def test_bad_rotary_groups():
    with pytest.raises(GroupError):
        RotaryPlanes(6, "half", rotary_dims=3)
    with pytest.raises(GroupError):
        RotaryPlanes(6, "diagonal")
    with pytest.raises(GroupError):
        apply_on_axis(torch.zeros(3, 4), 0, torch.eye(4))


# -- spec -------------------------------------------------------------------

CONFIGS = [
    dict(pe="none"), dict(pe="sinusoidal", bias=True), dict(pe="learned", n_kv_heads=2),
    dict(pe="rope"), dict(pe="rope", rope_pairing="interleaved", bias=True),
    dict(pe="rope", rotary_fraction=0.5, n_kv_heads=2, causal=True), dict(pe="alibi", bias=True),
]


def _layer(kw, dtype=torch.float64):
    torch.manual_seed(0)
    return MultiHeadAttention(AttentionConfig(d_model=16, n_heads=4, max_len=12, **kw)).to(dtype)


def _run(m, sd, x):
    m2 = MultiHeadAttention(m.cfg).to(x.dtype)
    m2.load_state_dict(sd)
    return m2(x)


@pytest.mark.parametrize("kw", CONFIGS, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
@given(seed=st.integers(0, 2**31 - 1))
@settings(max_examples=10, deadline=None)
def test_apply_compose_invert(kw, seed):
    m = _layer(kw)
    sp = m.symmetry_spec()
    sd = m.state_dict()
    a, b = S.sample(sp, seed), S.sample(sp, seed + 7)
    ab = S.apply(sp, S.compose(sp, a, b), sd)
    a_b = S.apply(sp, a, S.apply(sp, b, sd))
    for k in sd:
        torch.testing.assert_close(ab[k], a_b[k], rtol=1e-10, atol=1e-12)
    back = S.apply(sp, S.invert(sp, a), S.apply(sp, a, sd))
    for k in sd:
        torch.testing.assert_close(back[k], sd[k], rtol=1e-10, atol=1e-12)
    x = torch.randn(2, 12, 16, dtype=torch.float64)
    y = m(x)
    rel = ((_run(m, S.apply(sp, a, sd), x) - y).norm() / y.norm()).item()
    assert rel <= 1e-10


def test_apply_does_not_mutate_and_float32_exactness():
    m = _layer(dict(pe="rope", bias=True), torch.float32)
    sp = m.symmetry_spec()
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    out = S.apply(sp, S.sample(sp, 1), m.state_dict())
    for k, v in m.state_dict().items():
        assert torch.equal(v, sd[k])
        assert out[k].dtype == torch.float32
    x = torch.randn(2, 12, 16)
    y = m(x)
    assert ((_run(m, out, x) - y).norm() / y.norm()).item() <= 1e-5


def test_segment_actions_match_unfused():
    """A fused [Q|K|V] tensor labelled by segments transforms like the separate tensors."""
    m = _layer(dict(pe="none", bias=True))
    sp = m.symmetry_spec()
    t = S.sample(sp, 5)
    ref = S.apply(sp, t, m.state_dict())
    fused = SymmetrySpecFused(m)
    sd = {"qkv.weight": torch.cat([m.q_proj.weight, m.k_proj.weight, m.v_proj.weight]).detach(),
          "o.weight": m.o_proj.weight.detach()}
    out = S.apply(fused, t, sd)
    torch.testing.assert_close(out["qkv.weight"], torch.cat([ref["q_proj.weight"], ref["k_proj.weight"],
                                                             ref["v_proj.weight"]]))
    torch.testing.assert_close(out["o.weight"], ref["o_proj.weight"])


def SymmetrySpecFused(m):
    sp0 = m.symmetry_spec()
    sp = S.SymmetrySpec(dict(sp0.spaces), couplings=dict(sp0.couplings))
    D = 16
    for space, var, seg_i in (("qk.0", "co", 0), ("qk.0", "contra", 1), ("vo.0", "co", 2)):
        rep = "query" if seg_i == 0 else "kv"
        sp.act_on("qkv.weight", "heads.0", 0, "co", rep, segment=(seg_i * D, D))
        sp.act_on("qkv.weight", space, 0, var, rep, segment=(seg_i * D, D))
    sp.act_on("o.weight", "heads.0", 1, "co", "query")
    sp.act_on("o.weight", "vo.0", 1, "contra", "query")
    return sp


def test_spec_errors_name_the_tensor():
    m = _layer(dict(pe="none"))
    sp = m.symmetry_spec()
    sd = dict(m.state_dict())
    del sd["k_proj.weight"]
    with pytest.raises(SpecError, match="k_proj.weight"):
        S.apply(sp, S.sample(sp, 0), sd)
    sd = dict(m.state_dict())
    sd["v_proj.weight"] = torch.zeros(12, 16)
    with pytest.raises(SpecError, match="v_proj.weight"):
        S.apply(sp, S.sample(sp, 0), sd)
    with pytest.raises(SpecError, match="nope"):
        S.apply(sp, {"nope": torch.eye(2)}, m.state_dict())
    with pytest.raises(SpecError):
        sp.act_on("x", "undeclared", 0)


@pytest.mark.parametrize("kw, msg", [
    (dict(d_model=10, n_heads=4), "not divisible"),
    (dict(d_model=16, n_heads=4, n_kv_heads=3), "must divide"),
    (dict(d_model=12, n_heads=2, head_dim=5, pe="rope"), "even"),
    (dict(d_model=16, n_heads=4, pe="rope", rotary_fraction=0.25), "even"),
    (dict(d_model=16, n_heads=4, pe="xpos"), "unknown positional encoding"),
])
def test_attention_config_errors(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        AttentionConfig(**kw)


def test_signed_permutations_group():
    """Closed under compose/inverse, ``T^{-T} = T``; ``nearest`` is the exact optimum of ``<T, M>`` (brute force)."""
    import itertools

    from symalign.groups import SignedPermutations

    g = SignedPermutations(3)
    a, b = g.sample(1), g.sample(2)
    assert g.contains(a) and g.contains(g.compose(a, b)) and torch.equal(g.inverse(a) @ a, torch.eye(3, dtype=a.dtype))
    assert not g.contains(2 * a) and not g.contains(torch.eye(3, dtype=torch.float64)[[0, 0, 1]]) and g.dim == 0
    m = torch.randn(3, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    best = max((torch.tensor(s, dtype=torch.float64)[:, None] * torch.eye(3, dtype=torch.float64)[list(p)]
                for p in itertools.permutations(range(3)) for s in itertools.product((1, -1), repeat=3)),
               key=lambda t: float((t * m).sum()))
    assert torch.equal(g.nearest(m), best)
