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

from hf_families import FAMILIES, float64_numerics, make
from hf_tiny import output, rel

from symalign.arch import layout_spec
from symalign.families import get_adapter
from symalign.families import Family, get_family
from symalign.groups import GeneralLinear, Orthogonal, PlaneSigns, RotaryPlanes
from symalign.families import prepare
from symalign.spec import apply, sample

VARIANTS = [
    ("llama", {}), ("llama", {"attention_bias": True}), ("llama", {"tie_word_embeddings": True}), ("mistral", {}),
    ("qwen2", {}), ("qwen2", {"tie_word_embeddings": True}),
    ("llama", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "rope_theta": 10000.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 16}}),
    ("gpt_neox", {}), ("gpt_neox", {"attention_bias": False}), ("gpt_neox", {"use_parallel_residual": False}),
    ("gpt_neox", {"hidden_act": "relu"}), ("gpt_neox", {"tie_word_embeddings": True}),
    ("qwen3", {}), ("qwen3", {"attention_bias": True}), ("qwen3", {"tie_word_embeddings": True}),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}),
    ("phi3", {}), ("phi3", {"tie_word_embeddings": True}),
    ("olmo2", {}), ("olmo2", {"attention_bias": True}),
    ("gemma", {}), ("gemma", {"tie_word_embeddings": False}), ("gemma2", {}), ("gemma3_text", {}),
    ("gemma2", {"attn_logit_softcapping": None, "final_logit_softcapping": None}),
    ("gptj", {}), ("gptj", {"tie_word_embeddings": True}), ("phi", {}), ("phi", {"partial_rotary_factor": 1.0}),
    ("falcon", {}), ("falcon", {"tie_word_embeddings": True}),
    ("falcon", {"new_decoder_architecture": True, "num_kv_heads": 2}),
    ("falcon", {"new_decoder_architecture": True, "num_kv_heads": 2, "num_ln_in_parallel_attn": 1}),
    ("falcon", {"multi_query": False, "bias": True}), ("falcon", {"parallel_attn": False}),
    # ALiBi: heads pinned by their slopes, GL(d) on Q-K (tests/test_family_falcon.py)
    ("falcon", {"alibi": True}), ("falcon", {"alibi": True, "new_decoder_architecture": True, "num_kv_heads": 2}),
    ("falcon", {"alibi": True, "multi_query": False, "bias": True}),
    ("falcon", {"alibi": True, "parallel_attn": False}),
    # RoPE width and scaling: the declared planes follow the model's own rotary module
    ("gpt_neox", {"rotary_pct": 1.0}), ("phi3", {"partial_rotary_factor": 0.5}),
    ("gpt_neox", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0,
                                      "partial_rotary_factor": 0.25}}),
    ("qwen3", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}),
]
IDS = [f + "".join(f"-{k}={v if not isinstance(v, dict) else v.get('rope_type')}" for k, v in kw.items())
       for f, kw in VARIANTS]


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


@pytest.mark.parametrize("family,kw", VARIANTS, ids=IDS)
def test_declared_groups_are_exact(family, kw):
    model = make(family, **kw)
    fam = get_adapter(model)
    assert isinstance(fam, Family) and get_family(model) is fam
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
    untied = make(family, **{**kw, "tie_word_embeddings": False}) if prep.untied else model
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


@pytest.mark.parametrize("family", FAMILIES)
def test_larger_groups_are_not_symmetries(family):
    model = float64_numerics(make(family))
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


PROBE = [("llama", {}), ("mistral", {}), ("qwen2", {}), ("gpt_neox", {}), ("gpt_neox", {"attention_bias": False}),
         ("qwen3", {}), ("phi3", {}), ("olmo2", {}),
         ("qwen3", {"attention_bias": True}), ("gemma", {}), ("gemma2", {}), ("gemma3_text", {}),
         ("gptj", {}), ("phi", {}), ("falcon", {}), ("falcon", {"new_decoder_architecture": True, "num_kv_heads": 1}),
         ("falcon", {"multi_query": False, "bias": True}), ("falcon", {"alibi": True}),
         ("falcon", {"alibi": True, "new_decoder_architecture": True, "num_kv_heads": 1}),
         ("falcon", {"alibi": True, "multi_query": False, "bias": True})]


@pytest.mark.parametrize("family,kw", PROBE, ids=[f + "".join(f"-{k}={v}" for k, v in kw.items()) for f, kw in PROBE])
def test_declared_dimension_equals_probe_nullity(family, kw):
    """Layer 0 of the real transformers model, float64, generic weights and inputs (small widths: the
    Jacobian is dense)."""
    small = dict(hidden_size=16, num_attention_heads=2, intermediate_size=16)
    if family in ("qwen3", "gemma", "gemma2", "gemma3_text", "llama", "mistral", "qwen2"):
        small.update(head_dim=4, num_key_value_heads=1)
    elif family == "gptj":
        small.update(rotary_dim=4)
    elif family in ("phi3", "olmo2"):
        small.update(num_key_value_heads=1)
    if family in ("qwen3", "gemma3_text", "olmo2"):
        # QK-norm: scaling one head's W_Q (or W_K) rows is undone by the norm except for its eps, so it is
        # a near-symmetry with singular values ~ eps; with the default 1e-6 they fall inside the probe's
        # ambiguity band (1e-11..1e-7 relative) and the probe rightly refuses. A larger eps separates them.
        small.update(rms_norm_eps=1e-2)
    from symalign.probe.families import probe_layer

    model = make(family, **small, **kw)
    res = probe_layer(get_adapter(model), model, 0)
    assert res.match, res
    assert res.gap > 1e4


@pytest.mark.parametrize("family,kw,qk", [
    ("gpt_neox", {}, "H(4,half)+GL(4)^4"), ("gpt_neox", {"rotary_pct": 1.0}, "H(8,half)^4"),
    ("phi3", {"partial_rotary_factor": 0.5}, "H(4,half)+GL(4)^2"), ("phi3", {}, "H(8,half)^2"),
    ("gptj", {}, "H(4,interleaved)+GL(4)^4"), ("phi", {}, "H(4,half)+GL(4)^4"), ("qwen3", {}, "signs(Z2^4,half)^2"),
    ("olmo2", {}, "signs(Z2^4,half)^2"), ("gemma2", {}, "H(16,half)^2"),
])
def test_declared_groups_follow_the_options(family, kw, qk):
    """The Q-K group read from the model's own rotary module and QK-norm (the exactness of each is above)."""
    spec = get_adapter(make(family, **kw)).spec(make(family, **kw))
    assert spec.describe()["qk.0"] == qk
    if family in ("qwen3", "olmo2"):
        n_blocks = 1 if family == "qwen3" else 2  # shared gains: one element per layer; all-heads: per K/V head
        assert spec.spaces["qkgain.0"].n_blocks == n_blocks and spec.spaces["qkgain.0"].dim == 4 * n_blocks



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




@pytest.mark.parametrize("cls_name,note", [("Qwen3Model", "outputs the stream itself"),
                                           ("Qwen3ForSequenceClassification", "is not mapped")])
def test_models_without_an_lm_head_get_no_residual_space(cls_name, note):
    """The stream is the output of a bare model (a residual map would change it); other heads are not mapped."""
    import transformers

    model = getattr(transformers, cls_name)._from_config(make("qwen3").config).double().eval()
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
        kw = {"sinusoidal_pos": m.encoder.embed_positions(x.shape[:-1])[None, None]} if self.family == "roformer" else {}
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
