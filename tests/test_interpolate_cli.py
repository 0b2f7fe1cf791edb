"""``symalign interpolate`` on Hugging Face checkpoints: curves, barriers, plots, and refusals."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from _cli_util import run_symalign  # noqa: E402


def _run(monkeypatch, capsys, *args):
    return run_symalign(monkeypatch, capsys, *args)


def _gpt2(tmp_path, name, seed, vocab=256):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=vocab, n_positions=64)
    m = transformers.GPT2LMHeadModel(cfg)
    m.save_pretrained(tmp_path / name)
    return tmp_path / name


def _vit(tmp_path, name, seed, labels=10):
    torch.manual_seed(seed)
    cfg = transformers.ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                                 image_size=8, patch_size=4, num_channels=1, num_labels=labels)
    transformers.ViTForImageClassification(cfg).save_pretrained(tmp_path / name)
    return tmp_path / name


def test_lm_curve_with_baseline(monkeypatch, capsys, tmp_path):
    a, b = _gpt2(tmp_path, "a", 0), _gpt2(tmp_path, "b", 1)
    code, out, err = _run(monkeypatch, capsys, "interpolate", str(a), str(b), "--data", "synthetic",
                          "--data-option", "kind=lm", "--points", "5", "--eval-items", "8", "--context", "32",
                          "--baseline", str(a), "--out", str(tmp_path / "o"), "--json")
    assert code in (0, None), err
    res = json.loads(out)
    assert res["task"] == "causal-lm" and len(res["curve"]["t"]) == 5
    assert res["naive"]["loss_barrier"] == pytest.approx(0.0, abs=1e-9)  # A -> A
    assert (tmp_path / "o" / "curves.png").stat().st_size > 1000
    on_disk = json.loads((tmp_path / "o" / "results.json").read_text())
    assert on_disk["curve"]["loss"] == res["curve"]["loss"]


def test_image_classifier_on_digits(monkeypatch, capsys, tmp_path):
    a, b = _vit(tmp_path, "a", 0), _vit(tmp_path, "b", 1)
    code, out, err = _run(monkeypatch, capsys, "interpolate", str(a), str(b), "--data", "digits", "--points", "3",
                          "--eval-items", "64", "--out", str(tmp_path / "o"))
    assert code in (0, None), err
    assert "loss barrier" in out


@pytest.mark.parametrize("make, data, msg", [
    (lambda p: (_gpt2(p, "a", 0, vocab=100), _gpt2(p, "b", 1, vocab=100)), ["synthetic", "--data-option", "kind=lm"],
     "does not cover the 256 tokens"),
    (lambda p: (_vit(p, "a", 0, labels=3), _vit(p, "b", 1, labels=3)), ["digits"], "num_labels=3"),
    (lambda p: (_gpt2(p, "a", 0), _gpt2(p, "b", 1)), ["digits"], "holds images"),
    (lambda p: (_gpt2(p, "a", 0), _vit(p, "b", 1)), ["digits"], "same architecture"),
])
def test_refusals_are_one_line(monkeypatch, capsys, tmp_path, make, data, msg):
    a, b = make(tmp_path)
    code, out, err = _run(monkeypatch, capsys, "interpolate", str(a), str(b), "--data", *data,
                          "--out", str(tmp_path / "o"))
    assert code == 2 and msg in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()
