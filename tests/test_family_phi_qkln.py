"""Phi with ``qk_layernorm=True``: a LayerNorm (centring, gain, bias; shared by the heads) on every Q and K head.

The exact group (docs/symmetry.md, "A centring QK-norm"): head permutations, the identity on each head's
pre-norm Q-K rows, ``GL(d)`` on V-O, per-plane rescalings of both affine norms (gain and bias together);
plus, not group orbits on the spec's axes and named beside it, the centring gauge of every Q/K head and the
unrotated part of the key norm's bias. Checked here on tiny random transformers models:

* a random element of the attention spec and of the whole-model spec is exact (the model's own forward,
  float64); the centring gauge is exact; a scale of one head's Q, ``GL(d)`` or ``H`` on Q-K, or a gain
  scale without its bias change the function;
* the declared dimension plus the named gauges equals the Jacobian nullity of the real layer (both probes);
* ``symalign align`` recovers a planted element through saved checkpoints (both scopes, float64 and
  float32): A's weights to <= 1e-8 (float64), the exact head permutation, and the aligned output loads with
  ``from_pretrained`` and computes B's function (<= 1e-10 float64, <= 1e-5 float32).
"""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

from _cli_util import run_symalign
from hf_families import float64_numerics, make, plant_checkpoints
from hf_tiny import output, rel

from symalign.arch import layout_spec
from symalign.arch.base import find_prefix
from symalign.families import get_adapter, prepare
from symalign.groups import GeneralLinear, PlaneIdentity, PlaneScales, RotaryPlanes
from symalign.spec import apply, sample

QKLN = dict(qk_layernorm=True)


def _ids(seed=0):
    return {"input_ids": torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(seed))}


def _loaded(model, state):
    m = copy.deepcopy(model)
    m.load_state_dict(state)
    return m


def test_declared_group_follows_the_option():
    spec = get_adapter(make("phi")).spec(make("phi", **QKLN))
    d = spec.describe()
    assert d["qk.0"] == "id(8)^4" and d["vo.0"] == "GL(8)^4" and d["heads.0"] == "S_4"
    assert d["qkgain.0"] == "scales(R+^6,half)^1" and spec.spaces["qkgain.0"].dim == 2 + 4  # r/2 + (d - r)
    acts = {t.split("self_attn.")[-1]: [(a.space, a.variance) for a in v] for t, v in spec.tensors.items()
            if t.startswith("model.layers.0.self_attn.") and "layernorm" in t}
    assert acts == {"q_layernorm.weight": [("qkgain.0", "co")], "q_layernorm.bias": [("qkgain.0", "co")],
                    "k_layernorm.weight": [("qkgain.0", "contra")], "k_layernorm.bias": [("qkgain.0", "contra")]}
    assert "qkgain.0" not in get_adapter(make("phi")).spec(make("phi")).spaces  # without the option: as before


@pytest.mark.parametrize("kw", [{}, {"partial_rotary_factor": 1.0}, {"num_key_value_heads": 2}],
                         ids=["partial0.5", "full-rotary", "gqa"])
def test_declared_group_is_exact(kw):
    model = make("phi", **QKLN, **kw)
    fam = get_adapter(model)
    x = _ids()
    y = output(model, x)
    st = {k: v.detach().clone() for k, v in model.state_dict().items()}
    att = fam.spec(model)
    prep = prepare(model.config, st, fam.spec(model.config, st.keys()), type(model).__name__)
    assert prep.spec.describe()["residual"] == "O_1(32)" and not prep.untied
    for seed in (1, 2):
        for name, spec, state in (("attention", att, st), ("model", prep.spec, prep.state)):
            t = sample(spec, seed)
            assert float((t["qkgain.0"] - torch.eye(8)).abs().max()) > 0.05  # the gain scales are exercised
            assert rel(output(_loaded(model, apply(spec, t, state)), x), y) <= 1e-10, (name, seed)


def _head_rows(state, name, head, d=8):
    return state[name][head * d:(head + 1) * d]


def test_centring_gauge_is_exact_and_a_scale_is_not():
    """``W_Q^i + 1 v^T``, ``b_Q^i + c 1`` (and the same on a K head) is exact; scaling one head's pre-norm Q
    is not (the LayerNorm's ``eps``); ``beta_k``'s unrotated part is free, its rotated part is not. (The
    softmax in float64: transformers' float32 softmax would round a shift of the scores at ~1e-8.)"""
    model = float64_numerics(make("phi", **QKLN, layer_norm_eps=1e-2))
    x = _ids()
    y = output(model, x)
    g = torch.Generator().manual_seed(5)
    p = "model.layers.0.self_attn."
    st = {k: v.clone() for k, v in model.state_dict().items()}
    for proj, head in (("q_proj", 1), ("k_proj", 2)):
        _head_rows(st, p + proj + ".weight", head).add_(torch.randn(1, 32, generator=g, dtype=torch.float64))
        _head_rows(st, p + proj + ".bias", head).add_(0.7)
    assert rel(output(_loaded(model, st), x), y) <= 1e-12
    st = {k: v.clone() for k, v in model.state_dict().items()}
    st[p + "k_layernorm.bias"][4:] += torch.randn(4, generator=g, dtype=torch.float64)  # unrotated (r = 4)
    assert rel(output(_loaded(model, st), x), y) <= 1e-12
    st[p + "k_layernorm.bias"][:4] += 0.5  # rotated planes: the shift depends on the key's position
    assert rel(output(_loaded(model, st), x), y) >= 1e-3
    st = {k: v.clone() for k, v in model.state_dict().items()}
    for t in (p + "q_proj.weight", p + "q_proj.bias"):
        _head_rows(st, t, 1).mul_(0.1)
    assert rel(output(_loaded(model, st), x), y) >= 1e-4


@pytest.mark.parametrize("how", ["GL", "H", "gain-only"])
def test_larger_groups_are_not_symmetries(how):
    """``GL(d)`` or ``H`` on the pre-norm Q-K rows (co on Q, contra on K), or the gain scales without the biases."""
    model = make("phi", **QKLN)
    fam = get_adapter(model)
    x = _ids()
    y = output(model, x)
    keys = set(model.state_dict())
    lays = fam.layouts(model.config, find_prefix(keys, fam.probe, fam.family), keys)
    assert isinstance(lays[0].qk, PlaneIdentity)
    if how == "gain-only":
        spec = fam.spec(model)
        t = {"qkgain.0": sample(spec, 3, ["qkgain.0"])["qkgain.0"]}
        spec.tensors = {k: [a for a in v if not k.endswith("layernorm.bias")] for k, v in spec.tensors.items()}
    else:
        inner = GeneralLinear(8) if how == "GL" else RotaryPlanes(8, "half", lays[0].qk.r)
        spec = layout_spec([dataclasses.replace(lay, qk=inner) for lay in lays])
        t = sample(spec, 3)
    assert rel(output(_loaded(model, apply(spec, t, model.state_dict())), x), y) >= 1e-3, how


def test_gain_signs_are_exact_but_not_declared():
    """``-1`` on a plane of both affine norms (gain and bias) is exact too: discrete, not declared
    (:class:`PlaneScales` is positive); it changes no dimension."""
    model = make("phi", **QKLN)
    x = _ids()
    y = output(model, x)
    st = {k: v.clone() for k, v in model.state_dict().items()}
    s = PlaneScales(8, "half", 4).from_units(torch.tensor([-1.0, 1.0, -1.0, 1.0, 1.0, 1.0], dtype=torch.float64))
    for n in ("q_layernorm", "k_layernorm"):
        for t in ("weight", "bias"):
            key = f"model.layers.0.self_attn.{n}.{t}"
            st[key] = s @ st[key]
    assert rel(output(_loaded(model, st), x), y) <= 1e-12


@pytest.mark.parametrize("kw", [{}, pytest.param({"partial_rotary_factor": 1.0}, marks=pytest.mark.slow),
                                pytest.param({"partial_rotary_factor": 0.25}, marks=pytest.mark.slow),
                                pytest.param({"num_attention_heads": 4, "num_key_value_heads": 2},
                                             marks=pytest.mark.slow)],
                         ids=["partial0.5", "full-rotary", "partial0.25", "gqa"])
def test_declared_dimension_equals_probe_nullity(kw):
    """Layer 0 of the real transformers layer (D = 16, float64, dense Jacobian): nullity = declared group +
    named gauges, e.g. 2 heads, d = 8, r = 4: 222 = 134 (V-O 128, gains 6) + 16 (value bias) + 68 (centring)
    + 4 (key norm bias); GQA (4 query heads, 2 K/V heads, d = 4, r = 2): 147 = 35 + 8 + 102 + 2."""
    from symalign.probe.families import probe_layer

    kw = {"num_attention_heads": 2, **kw}
    model = make("phi", **QKLN, hidden_size=16, intermediate_size=16, **kw)
    fam = get_adapter(model)
    res = probe_layer(fam, model, 0)
    D, h = 16, kw["num_attention_heads"]
    kv, d = kw.get("num_key_value_heads", h), D // h
    r = int(d * kw.get("partial_rotary_factor", 0.5))
    assert res.group == kv * d * d + r // 2 + (d - r)
    assert res.gauge == {"value bias -> output bias": kv * d,
                         "Q/K centring (rows + 1 v^T, bias + c 1)": (h + kv) * (D + 1),
                         **({"key norm bias (softmax shift)": d - r} if d - r else {})}
    assert res.match and res.nullity == res.declared, res
    assert res.gap > 1e4


@pytest.mark.slow
def test_probe_hf_counts_the_centring_gauge():
    """``symalign probe --hf``'s path (b_O fixed): declared 134 + centring 68 + key norm bias 4 = 206 measured."""
    import transformers as T

    from symalign.probe.hf import probe_hf

    cfg = T.PhiConfig(qk_layernorm=True, hidden_size=16, num_attention_heads=2, intermediate_size=16,
                      num_hidden_layers=1, vocab_size=32)
    row = probe_hf(cfg)[0]
    assert row.declared == 134 and row.undeclared == {"qk_centring": 68, "key_norm_bias": 4}
    assert row.result.nullity == row.expected == 206 and row.match is True


def _load(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def _rel_state(a, b):
    num = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a)
    return (num / sum(float(a[k].double().pow(2).sum()) for k in a)) ** 0.5


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("scope", ["attention", "model"])
@pytest.mark.slow
def test_planted_recovery_cli(scope, dtype, tmp_path, capsys, monkeypatch):
    a = make("phi", dtype=torch.float64, seed=0, **QKLN)
    p = plant_checkpoints(a, scope, dtype, tmp_path)
    spec, target, t = p.spec, p.target, p.element
    out = tmp_path / "OUT"
    code, stdout, err = run_symalign(monkeypatch, capsys, "align", tmp_path / "A", tmp_path / "B", "-o", out,
                                     "--scope", scope, "--json")
    assert code == 0, err
    info = json.loads(stdout)
    exact = 1e-8 if dtype == torch.float64 else 1e-4
    assert info["distance"]["before"]["total"] > 0.1 and info["distance"]["after"]["total"] <= exact
    assert _rel_state({k: target[k] for k in spec.tensors}, {k: v for k, v in _load(out).items()
                                                             if k in spec.tensors}) <= exact
    if scope == "attention":
        assert [lay["permutation"] for lay in info["match"]["layers"]][0] == torch.argsort(t["heads.0"]).tolist()
    cls = type(a)
    o = cls.from_pretrained(out, dtype=dtype, attn_implementation="eager").eval()
    bb = cls.from_pretrained(tmp_path / "B", dtype=dtype, attn_implementation="eager").eval()
    assert o.config.qk_layernorm
    assert rel(output(o, _ids()), output(bb, _ids())) <= (1e-10 if dtype == torch.float64 else 1e-5)


@pytest.mark.slow
def test_model_scope_fixes_the_centring_gauge(tmp_path, capsys, monkeypatch):
    """B = g . A with, on top, a centring-gauge shift of every Q/K head (not a group element: exact all the same).
    ``--scope model`` centres both models' Q/K heads in its exact rewrite, so it aligns B to A's rewrite to
    rounding; ``--scope attention`` leaves the gauge (distance left), and both outputs compute B's function."""
    a = make("phi", seed=0, **QKLN)
    a.save_pretrained(tmp_path / "A")
    disk = _load(tmp_path / "A")
    spec = get_adapter(a.config).spec(a.config, disk.keys())
    b_state = apply(spec, sample(spec, 7), disk)
    g = torch.Generator().manual_seed(3)
    for i in range(2):
        for proj in ("q_proj", "k_proj"):
            w, b = (f"model.layers.{i}.self_attn.{proj}.{t}" for t in ("weight", "bias"))
            shift = torch.randn(4, 1, 32, generator=g, dtype=torch.float64)
            b_state[w] = (b_state[w].reshape(4, 8, 32) + shift).reshape(32, 32)
            b_state[b] = (b_state[b].reshape(4, 8) + torch.randn(4, 1, generator=g, dtype=torch.float64)).reshape(32)
    from safetensors.torch import save_file

    make("phi", seed=0, **QKLN).save_pretrained(tmp_path / "B")
    save_file({k: v.contiguous() for k, v in b_state.items()}, str(tmp_path / "B" / "model.safetensors"),
              metadata={"format": "pt"})
    bb = type(a).from_pretrained(tmp_path / "B", dtype=torch.float64, attn_implementation="eager").eval()
    assert rel(output(float64_numerics(copy.deepcopy(bb)), _ids()), output(float64_numerics(copy.deepcopy(a)),
                                                                           _ids())) <= 1e-12
    after = {}
    for scope in ("attention", "model"):
        out = tmp_path / f"OUT-{scope}"
        code, stdout, err = run_symalign(monkeypatch, capsys, "align", tmp_path / "A", tmp_path / "B", "-o", out,
                                         "--scope", scope, "--json")
        assert code == 0, err
        after[scope] = json.loads(stdout)["distance"]["after"]["total"]
        o = type(a).from_pretrained(out, dtype=torch.float64, attn_implementation="eager").eval()
        assert rel(output(o, _ids()), output(bb, _ids())) <= 1e-10, scope
    assert after["model"] <= 1e-8 and after["attention"] > 1.0, after
