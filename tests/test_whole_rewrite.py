"""The LayerNorm -> gainless RMSNorm rewrite is exact, and its residual O(D) is a symmetry."""

from __future__ import annotations

import pytest

from _whole_util import FAMILIES, PES, config, inputs, model, rel_out

from symalign.errors import ConfigError
from symalign.groups import Orthogonal
from symalign.rewrite import plan, rewrite_model, rewrite_state, rewritten_model, whole_spec
from symalign.spec import apply, sample


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("pe", PES)
@pytest.mark.parametrize("family", FAMILIES)
def test_rewrite_exact_and_whole_symmetry(family, pe, norm):
    m = model(family, pe, norm=norm)
    x = inputs(m.cfg)
    y = m(x)
    r = rewrite_model(m)
    assert not any("norm" in k for k in r.state_dict()), "gainless norms have no parameters"
    assert rel_out(r(x), y) <= 1e-12
    spec = r.symmetry_spec()
    p = plan(m.cfg)
    assert ("residual" in spec.spaces) == (p.residual_dims > 0)
    if pe != "sinusoidal":
        assert type(spec.spaces["residual"]) is Orthogonal and p.residual and p.residual_dims == m.cfg.d_model
    else:  # only the rotations fixing the table (tests/test_whole_sinusoidal.py)
        assert not p.residual and p.residual_dims < m.cfg.d_model
    r.load_state_dict(apply(spec, sample(spec, 3), r.state_dict()))
    assert rel_out(r(x), y) <= 1e-9


def test_stream_is_mean_free_after_rewrite():
    m = rewrite_model(model("gpt", "learned"))
    seen = []
    h = m.blocks[1].register_forward_pre_hook(lambda mod, inp: seen.append(inp[0]))
    m(inputs(m.cfg))
    h.remove()
    assert float(seen[0].detach().mean(-1).abs().max()) <= 1e-12


def test_rotation_is_not_a_symmetry_without_rewrite():
    """Control: on the original LayerNorm model (gains != 1) a residual rotation changes the function."""
    m = model("gpt", "rope")
    spec = whole_spec(m.cfg)
    x = inputs(m.cfg)
    y = m(x)
    st = {k: v for k, v in m.state_dict().items()}
    st2 = apply(spec, {"residual": spec.spaces["residual"].sample(1)}, st)
    m.load_state_dict(st2)
    assert rel_out(m(x), y) > 1e-3


def test_sinusoidal_restricts_residual_and_says_why():
    p = plan(model("gpt", "sinusoidal").cfg)  # 16 positions at D = 16: nothing stays free
    assert not p.residual and "sinusoidal" in p.reason and p.residual_dims == 0
    assert "0 of 16 dimensions remain free" in p.reason
    assert p.norm == "centred"
    p = plan(config("vit", "sinusoidal", d_model=64, image_size=28, patch_size=7, max_len=32))  # 17 positions
    assert p.residual_dims == 46 and "46 of 64 dimensions remain free" in p.reason


def test_tied_gpt_is_untied_and_float32_exact():
    m = model("gpt", "rope", tie_embeddings=True).float()
    r = rewrite_model(m)
    assert r.head.weight.data_ptr() != r.tok_emb.weight.data_ptr()
    x = inputs(m.cfg)
    assert rel_out(r(x).double(), m(x).double()) <= 1e-5


def test_post_ln_refused():
    m = model("gpt", "rope", pre_norm=False)
    with pytest.raises(ConfigError, match="pre-LN"):
        rewrite_state(m.cfg, m.state_dict())
    with pytest.raises(ConfigError, match="post-LN"):
        rewritten_model(m.cfg)


VARIANTS = [
    ("encoder", "learned", dict(pooling="mean")),
    ("vit", "rope", dict(pooling="mean", bias=False)),
    ("gpt", "rope", dict(n_kv_heads=2, activation="relu", bias=False, tie_embeddings=False)),
    ("gpt", "rope", dict(rope_pairing="interleaved", rotary_fraction=0.5, head_dim=4)),
]


@pytest.mark.parametrize("family,pe,kw", VARIANTS)
def test_rewrite_variants(family, pe, kw):
    m = model(family, pe, **kw)
    x = inputs(m.cfg)
    y = m(x)
    r = rewrite_model(m)
    assert rel_out(r(x), y) <= 1e-12
    spec = r.symmetry_spec()
    r.load_state_dict(apply(spec, sample(spec, 3), r.state_dict()))
    assert rel_out(r(x), y) <= 1e-9
