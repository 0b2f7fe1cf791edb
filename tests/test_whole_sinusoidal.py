"""The residual rotations that survive a fixed sinusoidal table: exact, correctly sized, recoverable."""

from __future__ import annotations

import pytest
import scipy.linalg
import torch

from _whole_util import FAMILIES, config, inputs, model, rel_out, rel_state

from symalign.groups import random_orthogonal
from symalign.groups import FixingOrthogonal, stabiliser
from symalign.match.residual import procrustes
from symalign.match.whole import align_whole
from symalign.nn.positional import sinusoidal_table
from symalign.rewrite import plan, rewrite_model
from symalign.spec import apply, compose, invert, sample

NORMS = ("layernorm", "rmsnorm")


def sin_model(family: str, norm: str, seed: int = 1):
    """A tiny sinusoidal model whose table leaves free directions (few positions for the width)."""
    kw = dict(norm=norm) if family == "vit" else dict(norm=norm, d_model=32, max_len=10)
    return model(family, "sinusoidal", seed=seed, **kw)


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("family", FAMILIES)
def test_fixing_rotations_are_exact_and_the_rest_are_not(family, norm):
    m = sin_model(family, norm)
    cfg = m.cfg
    x = inputs(cfg)
    y = m(x)
    r = rewrite_model(m)
    spec = r.symmetry_spec()
    g = spec.spaces["residual"]
    table = m.pos.table.double()
    assert torch.equal(table, sinusoidal_table(cfg.n_positions, cfg.d_model).double())  # the buffer the group fixes
    centred = norm == "layernorm"
    # the fixed span: every table row (+ 1), and nothing else; scipy's null space is the reference
    fixed = torch.cat([table, torch.ones(1, cfg.d_model, dtype=torch.float64)]) if centred else table
    null = torch.as_tensor(scipy.linalg.null_space(fixed.numpy(), rcond=1e-9))
    assert isinstance(g, FixingOrthogonal) and g.k == null.shape[1] == plan(cfg).residual_dims
    # same subspace; both are resolved to ~eps / s_min (the smallest fixed singular value is ~5e-8 here)
    assert float((g.free @ g.free.T - null @ null.T).abs().max()) <= 1e-6
    assert float((fixed @ g.free).norm(dim=1).max() / fixed.norm(dim=1).min()) <= 1e-12
    el = sample(spec, 3)
    assert g.contains(el["residual"])
    r.load_state_dict(apply(spec, el, r.state_dict()))
    assert rel_out(r(x), y) <= 1e-9
    # controls: a general rotation of the stream, and (centred norm) one fixing the table but not 1
    controls = [random_orthogonal(cfg.d_model, torch.Generator().manual_seed(5))]
    if centred:
        controls.append(stabiliser(table).sample(5))
    for o in controls:
        r = rewrite_model(m)
        r.load_state_dict(apply(spec, {"residual": o}, r.state_dict()))
        assert rel_out(r(x), y) > 1e-3


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("family", FAMILIES)
def test_planted_recovery_with_the_fixing_rotation(family, norm):
    a = rewrite_model(sin_model(family, norm))
    spec = a.symmetry_spec()
    b = rewrite_model(sin_model(family, norm))
    b.load_state_dict(apply(spec, sample(spec, 7), a.state_dict()))
    x = inputs(a.cfg)
    yb = b(x)
    res = align_whole(a, b)
    out = res.apply(b.state_dict())
    assert spec.spaces["residual"].contains(res.transform["residual"])
    assert rel_state(a.state_dict(), out) <= 1e-8
    assert any("residual: O(" in n for n in res.notes)
    b.load_state_dict(out)
    assert rel_out(b(x), yb) <= 1e-9


def test_gpt_with_a_long_context_has_no_free_direction():
    cfg = config("gpt", "sinusoidal", d_model=32, max_len=40)  # 40 positions >= D
    p = plan(cfg)
    assert p.residual_dims == 0 and "residual" not in rewrite_model(model("gpt", "sinusoidal", d_model=32,
                                                                         max_len=40)).symmetry_spec().spaces


def test_vit_fashion_mnist_shape_leaves_46_dimensions():
    cfg = config("vit", "sinusoidal", d_model=64, image_size=28, patch_size=7, max_len=32)
    assert cfg.n_positions == 17 and plan(cfg).residual_dims == 64 - 17 - 1


def test_numerical_rank_rule():
    """Directions are freed only while every fixed vector moves by <= 1e-12 of its length."""
    e = torch.eye(4, dtype=torch.float64)
    for delta, k in ((1e-14, 3), (1e-10, 2), (0.0, 3)):  # two nearly parallel vectors: is e1 free?
        v = torch.stack([e[0], e[0] + delta * e[1]])
        g = stabiliser(v)
        assert g.k == k
        for seed in range(5):
            o = g.sample(seed)
            assert float(((o @ v.T - v.T).norm(dim=0) / v.norm(dim=1)).max()) <= 1e-12
    assert stabiliser(e) is None  # nothing free
    assert stabiliser(e[:3], fix_ones=True) is None  # e1, e2, e3 and 1 span R^4


def test_restricted_procrustes():
    g = stabiliser(sinusoidal_table(5, 12).double(), fix_ones=True)
    gen = torch.Generator().manual_seed(0)
    o = g.sample(1)
    x = torch.randn(12, 40, generator=gen, dtype=torch.float64)
    sol = procrustes(x @ (o @ x).T, g)  # argmin ||X - O' (O X)||: O' = O^T
    assert g.contains(sol) and float((sol - o.T).abs().max()) <= 1e-10
    m = torch.randn(12, 12, generator=gen, dtype=torch.float64)
    best = float((procrustes(m, g) * m).sum())
    assert all(float((g.sample(s) * m).sum()) <= best + 1e-12 for s in range(20))


def test_group_operations_stay_in_the_group():
    r = rewrite_model(sin_model("gpt", "layernorm"))
    spec = r.symmetry_spec()
    g = spec.spaces["residual"]
    t1, t2 = sample(spec, 1), sample(spec, 2)
    c = compose(spec, t1, t2)
    assert g.contains(c["residual"]) and g.contains(invert(spec, t1)["residual"])
    st = r.state_dict()
    assert rel_state(apply(spec, c, st), apply(spec, t1, apply(spec, t2, st))) <= 1e-12
    assert rel_state(apply(spec, invert(spec, t1), apply(spec, t1, st)), st) <= 1e-12
    assert g.dim == g.k * (g.k - 1) // 2 and spec.describe()["residual"].startswith(f"O({g.k}) fixing")
