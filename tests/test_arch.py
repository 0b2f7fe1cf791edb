"""Every HF adapter declares an exact symmetry, and nothing larger.

Each family: a tiny random float64 model, a random element of the adapter's spec
planted into a copy, outputs compared (<= 1e-9 relative); a random element of a
strictly larger group (GL instead of H on Q-K under RoPE, the wrong RoPE pairing,
a wrong variance on K, per-query-head Q-K under GQA) must change the outputs.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from hf_tiny import FAMILIES, inputs, make_model, output, rel

from symalign.arch import UnsupportedArchitectureError, layout_spec
from symalign.families import FAMILIES as FAMILIES_REGISTERED, get_adapter, model_types
from symalign.arch.base import AttentionLayout
from symalign.groups import GeneralLinear, RotaryPlanes
from symalign.nn.attention import AttentionConfig, attention_spec
from symalign.spec import apply, sample

ROPE = {"llama", "mistral", "qwen2", "roformer", "modernbert"}


def _transformed(model, spec, seed=1):
    t = sample(spec, seed)
    m2 = copy.deepcopy(model)
    m2.load_state_dict(apply(spec, t, model.state_dict()))
    return m2


def _layouts(model):
    ad = get_adapter(model)
    keys = set(model.state_dict())
    from symalign.arch.base import find_prefix

    return ad.layouts(model.config, find_prefix(keys, ad.probe, ad.family), keys)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_declared_group_is_exact(family, attn):
    if attn == "sdpa" and family == "roformer":
        pytest.skip("RoFormer has no SDPA implementation in transformers 5.x")
    model = make_model(family, attn=attn)
    spec = get_adapter(model).spec(model)
    assert spec.dim > 0 and len([s for s in spec.spaces if s.startswith("heads.")]) == 2
    x = inputs(model)
    y = output(model, x)
    tol = max(1e-9, get_adapter(model).precision_floor / 10)  # ModernBERT rotates Q/K in float32
    for seed in (1, 2):
        assert rel(output(_transformed(model, spec, seed), x), y) <= tol


def test_float32_tolerance():
    model = make_model("gpt2", dtype=torch.float32)
    spec = get_adapter(model).spec(model)
    x = inputs(model)
    assert rel(output(_transformed(model, spec), x), output(model, x)) <= 1e-4


def _broken(family, lays: list[AttentionLayout]) -> dict[str, list[AttentionLayout]]:
    d = lays[0].head_dim
    out: dict[str, list[AttentionLayout]] = {}
    if family in ROPE:
        other = "interleaved" if lays[0].qk.pairing == "half" else "half"
        out["GL on Q-K"] = [dataclasses.replace(lay, qk=GeneralLinear(d)) for lay in lays]
        out["wrong pairing"] = [dataclasses.replace(lay, qk=RotaryPlanes(d, other)) for lay in lays]
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_larger_groups_are_not_symmetries(family):
    model = make_model(family)
    x = inputs(model)
    y = output(model, x)
    lays = _layouts(model)
    cases = _broken(family, lays)
    # wrong variance: label K covariant (q^T k is then not invariant)
    spec = layout_spec(lays)
    for acts in spec.tensors.values():
        for i, a in enumerate(acts):
            if a.space.startswith("qk.") and a.variance == "contra":
                acts[i] = dataclasses.replace(a, variance="co")
    changes = {"K covariant": rel(output(_transformed(model, spec), x), y)}
    for name, ls in cases.items():
        changes[name] = rel(output(_transformed(model, layout_spec(ls)), x), y)
    assert all(v >= 1e-3 for v in changes.values()), changes


def test_gqa_needs_shared_qk_per_group():
    """Under GQA one Q-K element per K/V group: a per-query-head element is not a symmetry."""
    model = make_model("llama")
    spec = get_adapter(model).spec(model)
    assert spec.spaces["qk.0"].n_blocks == 2 and spec.spaces["heads.0"].describe() == "S_2 wr S_2"
    x = inputs(model)
    y = output(model, x)
    # distinct transforms for the two query heads of a group: apply per-head to Q only with the K/V-sized group
    t = sample(spec, 3)
    sd = apply(spec, t, model.state_dict())
    q = "model.layers.0.self_attn.q_proj.weight"
    sd[q] = sd[q].clone()
    sd[q][:8] = torch.linalg.qr(torch.randn(8, 8, dtype=torch.float64))[0] @ sd[q][:8]
    m2 = copy.deepcopy(model)
    m2.load_state_dict(sd)
    assert rel(output(m2, x), y) >= 1e-3


def test_llama_spec_equals_reference_attention_spec():
    model = make_model("llama")
    spec = get_adapter(model).spec(model)
    cfg = AttentionConfig(d_model=32, n_heads=4, n_kv_heads=2, pe="rope", rope_pairing="half")
    ref = attention_spec(cfg, prefix="model.layers.0.self_attn.", tag="0")
    sub = spec.restrict(["heads.0", "qk.0", "vo.0"])
    assert sub.describe() == ref.describe()
    assert sub.tensors == ref.tensors
    assert sub.couplings == ref.couplings


def test_gpt2_fused_segments_and_prefix():
    model = make_model("gpt2")
    spec = get_adapter(model).spec(model)
    acts = spec.tensors["transformer.h.0.attn.c_attn.weight"]
    assert [(a.space, a.axis, a.variance, a.rep, a.segment) for a in acts][::2] == [
        ("heads.0", 1, "co", "query", (0, 16)), ("heads.0", 1, "co", "kv", (16, 16)),
        ("heads.0", 1, "co", "kv", (32, 16))]
    assert [a.variance for a in acts][1::2] == ["co", "contra", "co"]
    assert spec.tensors["transformer.h.0.attn.c_proj.weight"][1].axis == 0
    assert "transformer.h.0.attn.c_attn.bias" in spec.tensors
    # the bare config (no keys) describes the base model
    assert "h.0.attn.c_attn.weight" in get_adapter(model.config).spec(model.config).tensors


def test_partial_rotary_is_honoured_only_when_the_model_does():
    from symalign.arch.rope import rotary_dims

    from hf_tiny import config

    cfg = config("llama")  # Llama's default RoPE rotates the whole head, whatever partial_rotary_factor says
    assert rotary_dims(cfg, 8) == 8
    model = make_model("modernbert")
    spec = get_adapter(model).spec(model)
    assert spec.spaces["qk.0"].inner == RotaryPlanes(8, "half", 8)
    assert spec.spaces["qk.1"].inner == RotaryPlanes(8, "half", 8)


def test_roformer_rotary_value_restricts_vo():
    model = make_model("roformer", rotary_value=True)
    spec = get_adapter(model).spec(model)
    assert isinstance(spec.spaces["vo.0"].inner, RotaryPlanes)
    x = inputs(model)
    assert rel(output(_transformed(model, spec), x), output(model, x)) <= 1e-9
    lays = [dataclasses.replace(lay, vo=GeneralLinear(8)) for lay in _layouts(model)]
    assert rel(output(_transformed(model, layout_spec(lays)), x), output(model, x)) >= 1e-3


def test_unknown_and_refused_architectures():
    import transformers

    with pytest.raises(UnsupportedArchitectureError, match="docs/adapters.md") as e:
        get_adapter(transformers.MambaConfig())
    assert all(mt in str(e.value) for mt in model_types())  # every registered family is listed
    with pytest.raises(UnsupportedArchitectureError, match="ALiBi"):
        get_adapter(transformers.BloomConfig())
    # every registered family is found through the same entry point, from its config class's defaults
    for fam in FAMILIES_REGISTERED:
        if fam.tiny is not None:
            assert get_adapter(fam.tiny.classes()[1]()).family == fam.family
    assert get_adapter(transformers.T5Config()).family == "T5"
