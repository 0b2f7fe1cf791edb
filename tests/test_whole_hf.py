"""``symalign align --scope model`` on tiny Llama and GPT-2 checkpoints (planted and independent pairs).

ViT, BERT, RoFormer and ModernBERT: tests/test_whole_hf_more.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hf_tiny import inputs, make_model, output, rel
from _cli_util import run_symalign

from symalign.families import get_adapter
from symalign.families import prepare
from symalign.spec import apply, sample


def run_cli(args, capsys, monkeypatch):
    return run_symalign(monkeypatch, capsys, "align", *args)


def _state(model) -> dict:
    st = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        st.pop("lm_head.weight", None)  # not saved for tied models
    return st


def _prepared(model):
    st = _state(model)
    return prepare(model.config, st, get_adapter(model).spec(model.config, st.keys()))


def _load_out(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def _rel_state(a: dict, b: dict) -> float:
    num = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a)
    den = sum(float(a[k].double().pow(2).sum()) for k in a)
    return (num / den) ** 0.5


@pytest.mark.parametrize("family,kw,tol", [("llama", {}, 1e-6), ("qwen2", {}, 1e-6), ("mistral", {}, 1e-6),
                                            ("gpt2", {"tie_word_embeddings": False}, 1e-9)])
@pytest.mark.slow
def test_planted_whole_model_recovery_cli(family, kw, tol, tmp_path, capsys, monkeypatch):
    a = make_model(family, dtype=torch.float64, seed=0, **kw)
    pa = _prepared(a)
    b = make_model(family, dtype=torch.float64, seed=0, **kw)
    b.load_state_dict(apply(pa.spec, sample(pa.spec, 11), pa.state), strict=False)
    da, db, out = tmp_path / "A", tmp_path / "B", tmp_path / "OUT"
    a.save_pretrained(da)
    b.save_pretrained(db)
    code, stdout, err = run_cli([da, db, "-o", out, "--scope", "model", "--json"], capsys, monkeypatch)
    assert code == 0, err
    info = json.loads(stdout)
    assert info["scope"] == "model" and "residual" in info["group"]["spaces"]
    assert info["distance"]["before"]["total"] > 0.1
    assert info["distance"]["after"]["total"] <= 1e-8
    assert _rel_state(pa.state, _load_out(out)) <= 1e-8
    o = type(b).from_pretrained(out, dtype=torch.float64, attn_implementation="eager").eval()
    x = inputs(b)
    assert rel(output(o, x), output(b, x)) <= tol


@pytest.mark.slow
def test_gpt2_tied_independent_pair_is_untied_and_exact(tmp_path, capsys, monkeypatch):
    a = make_model("gpt2", dtype=torch.float64, seed=0)
    b = make_model("gpt2", dtype=torch.float64, seed=1)
    da, db, out = tmp_path / "A", tmp_path / "B", tmp_path / "OUT"
    a.save_pretrained(da)
    b.save_pretrained(db)
    args = [da, db, "-o", out, "--scope", "model", "--json", "--stage2", "orthogonal"]
    code, stdout, err = run_cli(args, capsys, monkeypatch)
    assert code == 0, err
    info = json.loads(stdout)
    assert info["untied_head"] and json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    assert info["distance"]["after"]["total"] < info["distance"]["before"]["total"]
    assert info["match"]["distances"][-1] < info["match"]["distances"][0]
    o = type(b).from_pretrained(out, dtype=torch.float64, attn_implementation="eager").eval()
    x = inputs(b)
    assert rel(output(o, x), output(b, x)) <= 1e-9


@pytest.mark.slow
def test_float32_checkpoints_stay_float32(tmp_path, capsys, monkeypatch):
    """Every adapted family is mapped now (unmapped model types: tests/test_whole_hf_more.py); a float32
    pair is matched in float64 and written back in float32."""
    a = make_model("bert", dtype=torch.float32, seed=0)
    b = make_model("bert", dtype=torch.float32, seed=1)
    a.save_pretrained(tmp_path / "A")
    b.save_pretrained(tmp_path / "B")
    code, stdout, err = run_cli([tmp_path / "A", tmp_path / "B", "-o", tmp_path / "OUT", "--scope", "model",
                                 "--json"], capsys, monkeypatch)
    assert code == 0, err
    assert json.loads(stdout)["dtype"] == "float32"
    assert {t.dtype for t in _load_out(tmp_path / "OUT").values() if t.is_floating_point()} == {torch.float32}


@pytest.mark.slow
def test_tied_llama_aligns_its_stream_by_permutations(tmp_path, capsys, monkeypatch):
    """A tied head cannot take the final RMSNorm gain (it is also the embedding), so the stream gets S_D with
    every gain permuted along (exact), instead of O(D) after folding."""
    a = make_model("llama", dtype=torch.float64, seed=0, tie_word_embeddings=True)
    pa = _prepared(a)
    assert pa.spec.spaces["residual"].describe() == "S_32" and not pa.untied
    b = make_model("llama", dtype=torch.float64, seed=0, tie_word_embeddings=True)
    b.load_state_dict(apply(pa.spec, sample(pa.spec, 5), pa.state), strict=False)
    for name, m in (("A", a), ("B", b)):
        m.save_pretrained(tmp_path / name)
    code, stdout, err = run_cli([tmp_path / "A", tmp_path / "B", "-o", tmp_path / "OUT", "--scope", "model",
                                 "--json"], capsys, monkeypatch)
    assert code == 0, err
    info = json.loads(stdout)
    assert info["distance"]["after"]["total"] <= 1e-8 and not info["untied_head"]
    o = type(b).from_pretrained(tmp_path / "OUT", dtype=torch.float64, attn_implementation="eager").eval()
    x = inputs(b)
    assert rel(output(o, x), output(b, x)) <= 1e-6
