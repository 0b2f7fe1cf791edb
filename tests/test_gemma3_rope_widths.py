"""Gemma 3 whose layer types rotate different widths of each head (#19: an exact group per layer, not a refusal).

In the pinned transformers the only runnable way is ``rope_type="proportional"`` with a
``partial_rotary_factor`` on one layer type: Gemma 3 applies each type's table to the whole
head (``rotate_half`` planes ``(k, k + d/2)``), and proportional RoPE zeroes the frequencies
of all but the first ``floor(p d / 2)`` planes. Here the sliding layer (0) turns all 8 planes
of a ``d = 16`` head and the full layer (1) the first 4 (``p = 0.5``):

* each layer gets its own Q-K group (``PlaneSigns``, proportional layout on layer 1) and
  gain scales; random elements of both scopes leave HF's forward unchanged, and the same
  scales in the wrong layout (partial RoPE's first-``r``-dimensions planes) do not;
* planted pairs are recovered exactly through ``symalign align`` (both scopes; OUT loads
  with ``from_pretrained`` and computes B's function: <= 1e-10 float64, <= 1e-5 float32);
* the probe's Jacobian nullity of the real sliding and full layers equals the declared
  dimension (the old single-width declaration under-counted the full layer's gain scales);
* another RoPE type with ``p < 1`` gives a table transformers' Gemma 3 cannot apply (its own
  forward fails): refused naming ``rope_parameters``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from _cli_util import run_symalign
from hf_families import make, plant_checkpoints
from hf_tiny import output, rel

from symalign.arch.base import UnsupportedArchitectureError
from symalign.families import get_adapter, prepare
from symalign.groups import PlaneScales, PlaneSigns
from symalign.probe.families import float64_numerics
from symalign.spec import apply, sample

T = pytest.importorskip("transformers")

ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 1e6}}
"""Sliding layers rotate all of a head, full layers (proportional RoPE) its first half of planes."""


def _model(dtype=torch.float64, seed=0):
    return make("gemma3_text", dtype=dtype, seed=seed, rope_parameters=copy.deepcopy(ROPE))


def _ids(seed=0):
    return {"input_ids": torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(seed))}


def _load(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_proportional_planes():
    """Partial RoPE turns the planes of the first r dims; proportional RoPE the first r/2 planes of the head."""
    assert PlaneSigns(8, "half", 4).plane_index().tolist() == [0, 1, 0, 1, 2, 3, 4, 5]
    assert PlaneSigns(8, "half", 4, proportional=True).plane_index().tolist() == [0, 1, 2, 3, 0, 1, 4, 5]
    assert PlaneSigns(8, "half", 8, proportional=True).plane_index().tolist() == \
        PlaneSigns(8, "half", 8).plane_index().tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    g = PlaneScales(8, "half", 4, proportional=True)
    a = g.sample(3)
    assert g.contains(a) and not PlaneScales(8, "half", 4).contains(a) and g.dim == 6
    assert torch.equal(g.from_units(g.units_of(a)), a)


def test_each_layer_gets_the_group_of_its_width():
    model = _model()
    rot = model.model.rotary_emb  # transformers' own tables: the full type's last planes have frequency 0
    assert (rot.sliding_attention_inv_freq != 0).sum() == 8 and (rot.full_attention_inv_freq != 0).sum() == 4
    d = {k: g.describe() for k, g in get_adapter(model).spec(model).spaces.items()}
    assert d["qk.0"] == "signs(Z2^8,half)^2" and d["qkgain.0"] == "scales(R+^8,half)^1 on (w + 1)"
    assert d["qk.1"] == "signs(Z2^4+Z2^8,half,proportional)^2"
    assert d["qkgain.1"] == "scales(R+^12,half,proportional)^1 on (w + 1)"


def test_declared_groups_are_exact_and_the_partial_layout_is_not():
    model = _model()
    fam = get_adapter(model)
    x = _ids()
    y = output(float64_numerics(copy.deepcopy(model)), x)
    att = fam.spec(model)
    st = {k: v.detach().clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    prep = prepare(model.config, st, fam.spec(model.config, st.keys()), type(model).__name__)
    for seed in (1, 2):
        for spec, state in ((att, model.state_dict()), (prep.spec, prep.state)):
            m = copy.deepcopy(model)
            m.load_state_dict(apply(spec, sample(spec, seed), state), strict=False)
            assert rel(output(float64_numerics(m), x), y) <= 1e-10
    wrong = att.restrict(list(att.spaces))  # the full layer's gain scales on partial RoPE's planes instead
    wrong.spaces["qkgain.1"] = dataclasses.replace(att.spaces["qkgain.1"], inner=PlaneScales(16, "half", 8))
    m = copy.deepcopy(model)
    m.load_state_dict(apply(wrong, sample(wrong, 3), model.state_dict()))
    assert rel(output(float64_numerics(m), x), y) >= 1e-3


def _planted(scope, dtype, tmp_path):
    p = plant_checkpoints(_model(), scope, dtype, tmp_path)
    return p.target, p.element


def _function(tmp_path, dtype):
    cls = T.Gemma3ForCausalLM
    o, b = (cls.from_pretrained(tmp_path / n, dtype=dtype, attn_implementation="eager").eval() for n in ("OUT", "B"))
    if dtype == torch.float64:
        o, b = float64_numerics(o), float64_numerics(b)
    return rel(output(o, _ids()), output(b, _ids()))


@pytest.mark.parametrize("scope", ["attention", "model"])
@pytest.mark.slow
def test_planted_recovery_cli(scope, tmp_path, capsys, monkeypatch):
    target, t = _planted(scope, torch.float64, tmp_path)
    code, stdout, err = run_symalign(monkeypatch, capsys, "align", tmp_path / "A", tmp_path / "B", "-o",
                                     tmp_path / "OUT", "--scope", scope, "--json")
    assert code == 0, err
    info = json.loads(stdout)
    assert info["distance"]["before"]["total"] > 0.1 and info["distance"]["after"]["total"] <= 1e-8
    out = _load(tmp_path / "OUT")
    num = sum(float((target[k].double() - out[k].double()).pow(2).sum()) for k in target)
    assert (num / sum(float(v.double().pow(2).sum()) for v in target.values())) ** 0.5 <= 1e-8
    if scope == "attention":
        perms = [lay["permutation"] for lay in info["match"]["layers"]]
        assert perms == [torch.argsort(t[f"heads.{i}"]).tolist() for i in range(2)]
    assert _function(tmp_path, torch.float64) <= 1e-10


@pytest.mark.parametrize("scope", ["attention", "model"])
@pytest.mark.slow
def test_float32_pair_stays_exact(scope, tmp_path, capsys, monkeypatch):
    _planted(scope, torch.float32, tmp_path)
    code, stdout, err = run_symalign(monkeypatch, capsys, "align", tmp_path / "A", tmp_path / "B", "-o",
                                     tmp_path / "OUT", "--scope", scope, "--json")
    assert code == 0, err
    assert json.loads(stdout)["dtype"] == "float32"
    assert _function(tmp_path, torch.float32) <= 1e-5


@pytest.mark.parametrize("layer,declared", [(0, 64 + 4), (1, 64 + 6)])
def test_probe_nullity_equals_declared_on_a_sliding_and_a_full_layer(layer, declared):
    """The real layer (its type's RoPE table, the sliding window's mask), float64, on a smaller model for a dense
    Jacobian: D=16, 2 heads of d=8, 1 K/V head: V-O GL(8) + gain scales (sliding: 4 planes; full: 2 planes + 4
    unrotated coordinates); the Q-K signs are discrete. The old single-width declaration gave the full layer 68.
    QK-norm: ``eps = 0.1`` keeps the norm's near-symmetry (singular values ~ eps) out of the ambiguity band."""
    from symalign.probe.hf import probe_hf

    config = make("gemma3_text", rope_parameters=copy.deepcopy(ROPE), hidden_size=16, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=8, query_pre_attn_scalar=8, intermediate_size=16,
                  rms_norm_eps=0.1).config
    (row,) = probe_hf(config, layer, ad="forward")
    res = row.result
    assert row.declared == declared and row.undeclared == {} and res.nullity == declared and row.match
    assert res.singular_value_gap > 1e8
    assert ("proportional" in row.group[f"qkgain.{layer}"]) == (layer == 1)
    assert len(res.rope_planes) == (4 if layer == 0 else 2)  # zero frequencies are not reported as RoPE planes


def test_a_table_shorter_than_the_head_is_refused_naming_rope_parameters():
    """``linear`` RoPE honours ``partial_rotary_factor`` with a shorter table, which transformers' Gemma 3 cannot
    apply to the head (its own forward fails): nothing exact to declare, so refused, naming the option."""
    rope = {**copy.deepcopy(ROPE), "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                      "partial_rotary_factor": 0.5, "rope_theta": 1e6}}
    model = make("gemma3_text", rope_parameters=rope)
    with pytest.raises(RuntimeError):
        output(model, _ids())
    with pytest.raises(UnsupportedArchitectureError, match="rope_parameters.*full_attention RoPE table has 4 "
                                                           "frequencies for head_dim=16"):
        get_adapter(model).spec(model)
