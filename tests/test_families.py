"""The families of :mod:`symalign.families`: declared groups exact, nothing larger, measured on the real layer.

Per family (tiny random float64 models, D=32, 2 layers) and per variant (options that
change the layout or the symmetry):

* a random element of the attention spec and of the whole-model spec (after the exact
  rewrite) leaves the model's own forward unchanged: <= 1e-10 with float64-faithful
  numerics (``float64_numerics``: transformers' RMSNorm/softmax upcast to float32
  otherwise), <= the family's precision floor through the unmodified forward;
* a strictly larger group on Q-K (GL / H instead of H / signs, unrestricted O(d) under
  QK-norm) changes the function;
* the declared dimension of one layer's attention group (plus the bias-shift gauge
  directions, named) equals the Jacobian nullity of the real transformers layer.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from hf_families import FAMILIES, case_id, cases, family, float64_numerics, make, registered
from hf_tiny import output, rel

from symalign.arch import layout_spec
from symalign.families import get_adapter
from symalign.families import Family
from symalign.groups import GeneralLinear, Orthogonal, PlaneSigns, RotaryPlanes
from symalign.families import prepare
from symalign.spec import apply, sample

# every declared case of every registered family (its module's ``cases``)
VARIANTS = [(f, c.kw) for f, c in cases(lambda c: c.exact)]
IDS = [case_id(f, kw) for f, kw in VARIANTS]


def _ids(seed=0, batch=2, seq=8):
    return {"input_ids": torch.randint(0, 64, (batch, seq), generator=torch.Generator().manual_seed(seed))}


def _state(model):
    st = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        st.pop("lm_head.weight", None)
    return st


def _loaded(model, state):
    m = copy.deepcopy(model)
    missing, unexpected = m.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return m


@pytest.mark.parametrize("name,kw", VARIANTS, ids=IDS)
def test_declared_groups_are_exact(name, kw):
    model = make(name, **kw)
    fam = get_adapter(model)
    assert isinstance(fam, Family) and get_adapter(model) is fam
    x = _ids()
    exact = float64_numerics(copy.deepcopy(model))
    y, y64 = output(model, x), output(exact, x)
    att = fam.spec(model)
    st = _state(model)
    prep = prepare(model.config, st, fam.spec(model.config, st.keys()), type(model).__name__)
    if prep.untied:  # the head written under its on-disk name; in memory it is lm_head
        head = [k for k in prep.state if k.endswith(fam.decl.heads[0] + ".weight")][0]
        prep.state["lm_head.weight"] = prep.state.pop(head)
        prep.spec.tensors["lm_head.weight"] = prep.spec.tensors.pop(head)
    untied = make(name, **{**kw, "tie_word_embeddings": False}) if prep.untied else model
    for seed in (1, 2):
        a = apply(att, sample(att, seed), model.state_dict())
        w = apply(prep.spec, sample(prep.spec, seed), prep.state)
        for name, state, like in (("attention", a, model), ("model", w, untied)):
            m64 = float64_numerics(_loaded(like, state))
            assert rel(output(m64, x), y64) <= 1e-10, (name, seed)
            assert rel(output(_loaded(like, state), x), y) <= max(1e-10, fam.precision_floor), (name, seed)


def _widened(lays, how):
    d = lays[0].head_dim
    if how == "GL":
        return [dataclasses.replace(lay, qk=GeneralLinear(d)) for lay in lays]
    if how == "H":  # RoPE commutant without the QK-norm restriction
        return [dataclasses.replace(lay, qk=RotaryPlanes(d, lay.qk.pairing, lay.qk.r)) for lay in lays]
    return [dataclasses.replace(lay, qk=Orthogonal(d)) for lay in lays]


@pytest.mark.parametrize("name", FAMILIES)
def test_larger_groups_are_not_symmetries(name):
    model = float64_numerics(make(name))
    fam = get_adapter(model)
    x = _ids()
    y = output(model, x)
    from symalign.arch.base import find_prefix

    keys = set(model.state_dict())
    lays = fam.layouts(model.config, find_prefix(keys, fam.probe, fam.family), keys)
    cases = ["GL"] + (["H", "O"] if isinstance(lays[0].qk, PlaneSigns) else [])
    for how in cases:
        spec = layout_spec(_widened(lays, how))
        m2 = _loaded(model, apply(spec, sample(spec, 3), model.state_dict()))
        assert rel(output(m2, x), y) >= 1e-3, how


PROBE = [(f, c.kw) for f, c in cases(lambda c: c.probe)]


@pytest.mark.parametrize("name,kw", PROBE, ids=[case_id(f, kw) for f, kw in PROBE])
def test_declared_dimension_equals_probe_nullity(name, kw):
    """Layer 0 of the real transformers model, float64, generic weights and inputs (small widths: the
    Jacobian is dense; the family's ``probe_kw`` on top, e.g. a larger eps under QK-norm)."""
    from symalign.families.declared import PROBE as WIDTHS
    from symalign.probe.families import probe_layer

    model = make(name, **{**WIDTHS, **family(name).probe_kw, **kw})
    res = probe_layer(get_adapter(model), model, 0)
    assert res.match, res
    assert res.gap > 1e4


GROUPS = [(f, c.kw, c.groups) for f, c in cases(lambda c: bool(c.groups))]


@pytest.mark.parametrize("name,kw,groups", GROUPS, ids=[case_id(f, kw) for f, kw, _ in GROUPS])
def test_declared_groups_follow_the_options(name, kw, groups):
    """The Q-K group read from the model's own rotary module and QK-norm, the gain scales' blocks (shared gains:
    one element per layer; a norm over all heads: one per K/V head) (the exactness of each is above)."""
    model = make(name, **kw)
    described = get_adapter(model).spec(model).describe()
    assert {site: described.get(site) for site in groups} == dict(groups)


REFUSED = [(f, kw) for f, fam in registered() for kw in fam.refusals]


@pytest.mark.parametrize("name,kw", REFUSED, ids=[case_id(f, kw) for f, kw in REFUSED])
def test_declared_refusals_are_one_line(name, kw):
    """A config option a family declares it refuses (``Family.refusals``): one line naming the option."""
    from symalign.arch.base import UnsupportedArchitectureError

    model = make(name, **kw)
    with pytest.raises(UnsupportedArchitectureError, match=next(iter(kw))) as e:
        get_adapter(model).spec(model)
    assert len(str(e.value).splitlines()) == 1


OLDER = {"gpt2": dict(n_embd=8, n_head=2), "vit": dict(hidden_size=8, num_attention_heads=2)}


class _Layer(torch.nn.Module):
    """An attention module without positional inputs (GPT-2, ViT), as ``x -> attn(x)``."""

    def __init__(self, attn):
        super().__init__()
        self.attn = attn

    def forward(self, x):
        y = self.attn(x, attention_mask=None)
        return y[0] if isinstance(y, tuple) else y


@pytest.mark.parametrize("family", ["gpt2", "vit"])
def test_older_families_declared_dimension_equals_probe_nullity(family):
    """The same measurement for GPT-2 and ViT (their layer 0, float64, dense Jacobian; no positional inputs)."""
    from hf_tiny import make_model

    from symalign.arch.base import find_prefix
    from symalign.families.base import bias_gauge
    from symalign.probe import probe

    model = float64_numerics(make_model(family, **OLDER[family]))
    ad = get_adapter(model)
    keys = set(model.state_dict())
    lay = ad.layouts(model.config, find_prefix(keys, ad.probe, ad.family), keys)[0]
    declared = ad.spec(model).restrict(["heads.0", "qk.0", "vo.0"]).dim
    mod = _Layer(model.transformer.h[0].attn if family == "gpt2" else model.vit.layers[0].attention)
    D = model.config.hidden_size
    n = sum(p.numel() for p in mod.parameters())
    x = torch.randn(-(-3 * n // (6 * D)), 6, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    res = probe(mod, x, method="dense", check_heads=False)
    gauge = bias_gauge(lay, keys)
    assert res.nullity == declared + sum(gauge.values()), (res.nullity, declared, gauge)
    assert res.singular_value_gap > 1e4




# the first registered causal LM with a QK-norm shared by the heads (its gains carry qkgain.i)
QK_NORMED = next(f for f, fam in registered() if fam.decl.q_norm and fam.decl.qk_norm_over == "head"
                 and fam.tiny.model.endswith("ForCausalLM") and fam.cases)


@pytest.mark.parametrize("suffix,note", [("Model", "outputs the stream itself"),
                                         ("ForSequenceClassification", "is not mapped")])
def test_models_without_an_lm_head_get_no_residual_space(suffix, note):
    """The stream is the output of a bare model (a residual map would change it); other heads are not mapped."""
    import transformers

    cls_name = family(QK_NORMED).tiny.model.replace("ForCausalLM", suffix)
    model = getattr(transformers, cls_name)._from_config(make(QK_NORMED).config).double().eval()
    fam = get_adapter(model)
    st = _state(model)
    prep = prepare(model.config, st, fam.spec(model.config, st.keys()), cls_name)
    assert "residual" not in prep.spec.spaces and note in prep.notes[0]
    assert {"ff.0", "ff.1", "qkgain.0"} <= set(prep.spec.spaces)
    x = _ids()
    out = model(**x)
    y = (out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state).double()
    m2 = _loaded(model, apply(prep.spec, sample(prep.spec, 4), prep.state))
    out2 = m2(**x)
    y2 = (out2.logits if getattr(out2, "logits", None) is not None else out2.last_hidden_state).double()
    assert rel(y2, y) <= fam.precision_floor


class _EncoderAttention(torch.nn.Module):
    """BERT/RoFormer self-attention + output projection (without the post-LayerNorm of the residual sum), or
    ModernBERT's attention, as ``x -> attn(x)``."""

    def __init__(self, model, family):
        super().__init__()
        self.family, self.model = family, [model]
        if family == "modernbert":
            self.attn = model.model.layers[0].attn
        else:
            block = model.encoder.layer[0].attention
            self.self_attn, self.dense = block.self, block.output.dense

    def forward(self, x):
        m = self.model[0]
        if self.family == "modernbert":
            pos = torch.arange(x.shape[1]).unsqueeze(0).expand(x.shape[0], -1)
            kind = m.config.layer_types[0]
            return self.attn(x, position_embeddings=m.model.rotary_emb(x, pos, kind), attention_mask=None)[0]
        if self.family == "roformer":
            kw = {"sinusoidal_pos": m.encoder.embed_positions(x.shape[:-1])[None, None]}
        else:
            kw = {}
        return self.dense(self.self_attn(x, attention_mask=None, **kw)[0])


@pytest.mark.parametrize("family", ["bert", "roformer", "modernbert"])
def test_encoder_families_declared_dimension_equals_probe_nullity(family, monkeypatch):
    """BERT, RoFormer and ModernBERT, layer 0. ModernBERT rotates Q/K in float32 whatever the dtype; its
    rotation is evaluated in float64 here (same formula) so that rounding does not hide null directions."""
    from hf_tiny import make_model
    import transformers.models.modernbert.modeling_modernbert as mb

    from symalign.arch.base import find_prefix
    from symalign.families.base import bias_gauge
    from symalign.probe import probe

    def rotate(q, k, cos, sin, unsqueeze_dim=1):
        cos, sin = cos.unsqueeze(unsqueeze_dim).to(q.dtype), sin.unsqueeze(unsqueeze_dim).to(q.dtype)
        return q * cos + mb.rotate_half(q) * sin, k * cos + mb.rotate_half(k) * sin

    monkeypatch.setattr(mb, "apply_rotary_pos_emb", rotate)
    small = dict(hidden_size=8, num_attention_heads=2) | ({"embedding_size": 8} if family == "roformer" else {})
    model = float64_numerics(make_model(family, **small))
    ad = get_adapter(model)
    keys = set(model.state_dict())
    lay = ad.layouts(model.config, find_prefix(keys, ad.probe, ad.family), keys)[0]
    declared = ad.spec(model).restrict(["heads.0", "qk.0", "vo.0"]).dim
    mod = _EncoderAttention(model, family)
    n = sum(p.numel() for p in mod.parameters())
    x = torch.randn(-(-3 * n // 48), 6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    res = probe(mod, x, method="dense", check_heads=False)
    assert res.nullity == declared + sum(bias_gauge(lay, keys).values())
    assert res.singular_value_gap > 1e4
