"""``symalign interpolate --stream``: every point built by streaming into one model, bit-identical to in memory."""

from __future__ import annotations

import json

import pytest
import torch

from _cli_util import run_symalign
from test_interpolate_cli import _gpt2
from test_stream import _pair


def _curve(monkeypatch, capsys, a, b, out, *extra):
    code, o, err = run_symalign(monkeypatch, capsys, "interpolate", a, b, "--data", "synthetic", "--data-option",
                                "kind=lm", "--points", "4", "--eval-items", "4", "--context", "16", "--out", out,
                                "--json", "--no-progress", *extra)
    assert code in (0, None), err
    return json.loads(o)


@pytest.mark.parametrize("kind", ["llama-bf16-sharded", "gpt2-tied"])
@pytest.mark.slow
def test_streamed_points_bit_identical_to_in_memory(kind, tmp_path, capsys, monkeypatch):
    if kind == "gpt2-tied":
        a, b = _gpt2(tmp_path, "A", 0), _gpt2(tmp_path, "B", 1)
    else:
        _, _, a, b = _pair(tmp_path, dtype=torch.bfloat16, vocab_size=256)
    mem = _curve(monkeypatch, capsys, a, b, tmp_path / "m", "--no-stream", "--baseline", a)
    st = _curve(monkeypatch, capsys, a, b, tmp_path / "s", "--stream", "--baseline", a)
    assert st["streamed"] is True
    assert st["points"] == mem["points"] and st["naive_points"] == mem["naive_points"]
    assert st["curve"] == mem["curve"] and st["curve"]["loss"][0] != st["curve"]["loss"][-1]


def test_streamed_interpolate_refuses_model_scope(tmp_path, capsys, monkeypatch):
    a, b = _gpt2(tmp_path, "A", 0), _gpt2(tmp_path, "B", 1)
    code, out, err = run_symalign(monkeypatch, capsys, "interpolate", a, b, "--data", "synthetic", "--data-option",
                                  "kind=lm", "--stream", "--scope", "model", "--out", tmp_path / "o")
    assert code == 2 and "--no-stream" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o" / "results.json").exists()
