"""``--scope model`` for ViT (``O_1(D)``), BERT/RoFormer (post-LN: ``S_D``) and ModernBERT (``S_D``).

HF's own forward is the reference throughout: the rewrite and every element of the
declared group leave the outputs unchanged, the declared group is the right one
(a rotation where only permutations are exact breaks the model), planted elements
are recovered through the CLI, and independent pairs get closer.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hf_tiny import T, config, inputs, randomize, rel
from _cli_util import run_symalign

from symalign.checkpoint import hf as hf_io, output as hf_out
from symalign.families import get_adapter
from symalign.arch.check import _first_output
from symalign.errors import ConfigError
from symalign.groups import Orthogonal, Permutation, PositiveMonomial
from symalign.families import prepare
from symalign.groups import CenteredOrthogonal
from symalign.match.whole import match_whole
from symalign.spec import SymmetrySpec, apply, sample

# ModernBERT's rotary embedding computes Q/K in float32 even in a float64 model: a transformed
# attention rounds differently, so its outputs are checked to the adapter's floor, not to 1e-10.
FLOOR = {"modernbert": 1e-6}

CASES = [  # family, model class, config overrides, residual group
    ("vit", "ViTForImageClassification", {}, CenteredOrthogonal),
    ("vit", "ViTForImageClassification", {"qkv_bias": False}, CenteredOrthogonal),
    ("vit", "ViTForMaskedImageModeling", {}, CenteredOrthogonal),
    ("bert", "BertForMaskedLM", {}, Permutation),
    ("bert", "BertForSequenceClassification", {}, Permutation),
    ("bert", "BertForTokenClassification", {"hidden_act": "relu"}, Permutation),
    ("roformer", "RoFormerForMaskedLM", {}, Permutation),
    ("roformer", "RoFormerForMaskedLM", {"embedding_size": 16}, Permutation),
    ("roformer", "RoFormerForSequenceClassification", {}, Permutation),
    ("modernbert", "ModernBertForMaskedLM", {}, Permutation),
    ("modernbert", "ModernBertForSequenceClassification",
     {"norm_bias": True, "mlp_bias": True, "attention_bias": True, "classifier_bias": True}, Permutation),
    ("modernbert", "ModernBertForMaskedLM", {"tie_word_embeddings": False, "norm_bias": True}, Permutation),
    ("gpt2", "GPT2LMHeadModel", {"activation_function": "relu", "tie_word_embeddings": False}, CenteredOrthogonal),
]


def _model(family: str, cls: str, seed: int = 0, **kw):
    m = getattr(T, cls)._from_config(config(family, **kw), attn_implementation="eager").to(torch.float64)
    randomize(m, seed)
    return m.eval()


@torch.no_grad()
def _out(model, x) -> torch.Tensor:
    return _first_output(model(**x)).double()


def _prepared(model):
    st = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return prepare(model.config, st, get_adapter(model).spec(model.config, st.keys()), arch=type(model).__name__)


def _load(model, state):
    model.load_state_dict(state, strict=False)
    return model


@pytest.mark.parametrize("family,cls,kw,group", CASES, ids=lambda v: v if isinstance(v, str) else None)
def test_rewrite_and_group_are_exact_in_format(family, cls, kw, group):
    m = _model(family, cls, **kw)
    x = inputs(m)
    y = _out(m, x)
    pr = _prepared(m)
    assert type(pr.spec.spaces["residual"]) is group
    relu = "relu" in (kw.get("hidden_act"), kw.get("activation_function"))
    assert type(pr.spec.spaces["ff.0"]) is (PositiveMonomial if relu else Permutation)
    assert rel(_out(_load(m, pr.state), x), y) <= 1e-12  # the fold (ViT) changes nothing
    tol = FLOOR.get(family, 1e-10)
    g = sample(pr.spec, 3)
    assert rel(_out(_load(m, apply(pr.spec, g, pr.state)), x), y) <= tol
    # the stream and FF alone (permutations/rotations, no attention GL) are exact to rounding in every family
    g_stream = {k: v for k, v in g.items() if k == "residual" or k.startswith("ff.")}
    assert rel(_out(_load(m, apply(pr.spec, g_stream, pr.state)), x), y) <= 1e-12


@pytest.mark.parametrize("family,cls,kw,group", CASES, ids=lambda v: v if isinstance(v, str) else None)
def test_planted_recovery_every_variant(family, cls, kw, group):
    """match_whole on the rewritten states returns a planted element's B to A (ReLU variants: with scales)."""
    pr = _prepared(_model(family, cls, **kw))
    sb = apply(pr.spec, sample(pr.spec, 5), pr.state)
    res = match_whole(pr.spec, pr.state, sb)
    out = res.apply(sb)
    num = sum(float((pr.state[k] - out[k]).pow(2).sum()) for k in pr.spec.tensors)
    den = sum(float(pr.state[k].pow(2).sum()) for k in pr.spec.tensors)
    assert (num / den) ** 0.5 <= 1e-8


@pytest.mark.parametrize("family,cls,kw,bigger", [
    ("vit", "ViTForImageClassification", {}, Orthogonal),            # rotations moving the all-ones direction
    ("bert", "BertForMaskedLM", {}, CenteredOrthogonal),             # post-LN: rotations of the stream
    ("roformer", "RoFormerForMaskedLM", {}, CenteredOrthogonal),
    ("modernbert", "ModernBertForMaskedLM", {}, CenteredOrthogonal),  # embeddings-norm gain on the stream
    ("gpt2", "GPT2LMHeadModel", {"tie_word_embeddings": False}, Orthogonal),
], ids=lambda v: v if isinstance(v, str) else None)
def test_a_bigger_residual_group_is_not_a_symmetry(family, cls, kw, bigger):
    m = _model(family, cls, **kw)
    x = inputs(m)
    y = _out(m, x)
    pr = _prepared(m)
    D = int(m.config.hidden_size)
    spec = SymmetrySpec({**pr.spec.spaces, "residual": bigger(D)}, pr.spec.tensors, pr.spec.couplings)
    assert rel(_out(_load(m, apply(spec, sample(spec, 1, spaces=["residual"]), pr.state)), x), y) > 1e-3


def test_headless_models_get_no_residual_space():
    """A bare model outputs the stream (a residual map would change it): FF and attention only, exact. (GPT-2's
    bare ``GPT2Model`` used to get the residual group and an ``lm_head`` it does not have.)"""
    for family, cls in (("bert", "BertModel"), ("vit", "ViTModel"), ("modernbert", "ModernBertModel"),
                        ("gpt2", "GPT2Model")):
        m = _model(family, cls)
        pr = _prepared(m)
        assert "residual" not in pr.spec.spaces and "ff.0" in pr.spec.spaces
        assert "outputs the stream itself" in pr.notes[0]
        x = inputs(m)
        y = _out(m, x)
        assert rel(_out(_load(m, apply(pr.spec, sample(pr.spec, 2), pr.state)), x), y) <= FLOOR.get(family, 1e-10)
    pr = prepare(config("bert"), _prepared(_model("bert", "BertModel")).state,
                 get_adapter(config("bert")).spec(config("bert")), arch="BertForSomethingNew")
    assert "residual" not in pr.spec.spaces and "not mapped" in pr.notes[0]
    with pytest.raises(ConfigError, match="no adapter for architecture .opt.; supported: gpt2"):
        prepare(SimpleNamespace(model_type="opt"), {}, SymmetrySpec())



@pytest.mark.parametrize("family,cls", [("gpt2", "GPT2LMHeadModel"), ("bert", "BertLMHeadModel")])
def test_cross_attention_leaves_the_stream_unaligned(family, cls):
    """Cross-attention reads an external stream through the residual's coordinates: no residual space (FF and
    self-attention only, exact with the encoder states as input). GPT-2 used to get the residual group here."""
    m = _model(family, cls, add_cross_attention=True, is_decoder=True)
    pr = _prepared(m)
    assert "residual" not in pr.spec.spaces and "ff.1" in pr.spec.spaces and "cross-attention" in pr.notes[0]
    x = inputs(m)
    x["encoder_hidden_states"] = torch.randn(2, 5, m.config.hidden_size, dtype=torch.float64,
                                             generator=torch.Generator().manual_seed(3))
    y = _out(m, x)
    assert rel(_out(_load(m, apply(pr.spec, sample(pr.spec, 2), pr.state)), x), y) <= 1e-10


# -- through the CLI --------------------------------------------------------------

CLI_CASES = [("vit", "ViTForImageClassification", {}), ("bert", "BertForMaskedLM", {}),
             ("roformer", "RoFormerForMaskedLM", {}), ("modernbert", "ModernBertForMaskedLM", {})]


def _run(tmp_path: Path, capsys, monkeypatch, *extra) -> dict:
    args = [tmp_path / "A", tmp_path / "B", "-o", tmp_path / "OUT", "--scope", "model", "--json", *extra]
    code, stdout, err = run_symalign(monkeypatch, capsys, "align", *args)
    assert code == 0, err
    return json.loads(stdout)


def _check_out(family: str, cls: str, tmp_path: Path) -> None:
    """OUT loads with the Auto class and computes B's function (HF forward on both)."""
    auto = T.AutoModelForImageClassification if family == "vit" else T.AutoModelForMaskedLM
    b = auto.from_pretrained(tmp_path / "B", dtype=torch.float64, attn_implementation="eager").eval()
    o = auto.from_pretrained(tmp_path / "OUT", dtype=torch.float64, attn_implementation="eager").eval()
    assert type(o).__name__ == cls
    x = inputs(b)
    assert rel(_out(o, x), _out(b, x)) <= FLOOR.get(family, 1e-10)


@pytest.mark.parametrize("family,cls,kw", CLI_CASES, ids=lambda v: v if isinstance(v, str) else None)
@pytest.mark.slow
def test_planted_whole_model_recovery_cli(family, cls, kw, tmp_path, capsys, monkeypatch):
    a = _model(family, cls, **kw)
    a.save_pretrained(tmp_path / "A")
    ck = hf_io.load_checkpoint(tmp_path / "A")
    pa = prepare(ck.config, ck.state, ck.adapter.spec(ck.config, ck.state.keys()))
    hf_out.write_checkpoint(tmp_path / "B", apply(pa.spec, sample(pa.spec, 11), pa.state), tmp_path / "A")
    info = _run(tmp_path, capsys, monkeypatch)
    assert "residual" in info["group"]["spaces"] and info["notes"]
    assert info["distance"]["before"]["total"] > 0.1
    assert info["distance"]["after"]["total"] <= 1e-8
    out = hf_io.load_checkpoint(tmp_path / "OUT").state
    num = sum(float((pa.state[k].double() - out[k].double()).pow(2).sum()) for k in pa.spec.tensors)
    den = sum(float(pa.state[k].double().pow(2).sum()) for k in pa.spec.tensors)
    assert (num / den) ** 0.5 <= 1e-8
    _check_out(family, cls, tmp_path)


@pytest.mark.parametrize("family,cls,kw", CLI_CASES, ids=lambda v: v if isinstance(v, str) else None)
@pytest.mark.slow
def test_independent_pair_gets_closer_cli(family, cls, kw, tmp_path, capsys, monkeypatch):
    _model(family, cls, seed=0, **kw).save_pretrained(tmp_path / "A")
    _model(family, cls, seed=1, **kw).save_pretrained(tmp_path / "B")
    info = _run(tmp_path, capsys, monkeypatch, "--stage2", "orthogonal")
    assert info["distance"]["after"]["total"] < info["distance"]["before"]["total"]
    assert info["match"]["distances"][-1] < info["match"]["distances"][0]
    _check_out(family, cls, tmp_path)


@pytest.mark.slow
def test_headless_bert_cli_aligns_ff_and_attention_only(tmp_path, capsys, monkeypatch):
    for name, seed in (("A", 0), ("B", 1)):
        _model("bert", "BertModel", seed=seed).save_pretrained(tmp_path / name)
    info = _run(tmp_path, capsys, monkeypatch)
    assert "residual" not in info["group"]["spaces"] and "ff.1" in info["group"]["spaces"]
    assert any("outputs the stream itself" in n for n in info["notes"])
    assert info["distance"]["after"]["total"] < info["distance"]["before"]["total"]
    b = T.AutoModel.from_pretrained(tmp_path / "B", dtype=torch.float64, attn_implementation="eager").eval()
    o = T.AutoModel.from_pretrained(tmp_path / "OUT", dtype=torch.float64, attn_implementation="eager").eval()
    x = inputs(b)
    assert rel(_out(o, x), _out(b, x)) <= 1e-10
