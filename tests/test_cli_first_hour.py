"""A new user's first hour (issue 24): every bad argument is one line on stderr, exit code 2,
checked before any expensive work and with nothing written; plus the smaller defects
(patch size, --force on a foreign folder, NaN in JSON, file modes, --version/-h, help text,
table width, benchmark --help)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from _cli_util import run_symalign

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "vit-digits-rope.toml"


def _one_line_error(code: int, err: str, *words: str) -> None:
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("symalign: error:"), err
    for w in words:
        assert w in lines[0], (w, err)


def _listing(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@pytest.fixture
def afile(tmp_path: Path) -> Path:
    f = tmp_path / "afile"
    f.write_text("user data\n")
    return f


@pytest.mark.parametrize("argv, words", [
    (["train", "--steps", "1", "--out", "{afile}"], ["afile", "not a folder"]),
    (["train", "--steps", "1", "--threads", "-1", "--out", "{tmp}/t"], ["--threads"]),
    (["experiment", str(CONFIG), "--out", "{afile}"], ["afile", "not a folder"]),
    (["experiment", str(CONFIG), "--threads", "-1", "--out", "{tmp}/e"], ["--threads"]),
    (["experiment", "{tmp}"], ["folder", "TOML"]),
    (["demo", "--no-tour", "--out", "{afile}"], ["afile"]),
    (["demo", "--no-tour", "--threads", "-1", "--out", "{tmp}/d"], ["--threads"]),
    (["train", "--steps", "1", "--patch-size", "3", "--out", "{tmp}/p3"], ["patch size 3", "8x8", "1, 2, 4, 8"]),
    (["report", "{tmp}", "-o", "{tmp}"], ["existing folder"]),
    (["train", "--steps", "1", "--pe", "none", "--rotary-fraction", "0.5", "--out", "{tmp}/rf"], ["--pe rope"]),
])
def test_bad_arguments_are_one_line(argv, words, tmp_path, afile, monkeypatch, capsys):
    argv = [a.format(afile=afile, tmp=tmp_path) for a in argv]
    before = _listing(tmp_path)
    code, _, err = run_symalign(monkeypatch, capsys, *argv)
    _one_line_error(code, err, *words)
    assert _listing(tmp_path) == before and afile.read_text() == "user data\n"


def _vit(path: Path, seed: int, heads: int = 2) -> Path:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    cfg = transformers.ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=heads,
                                 intermediate_size=32, image_size=8, patch_size=4, num_channels=1, num_labels=10)
    transformers.ViTForImageClassification(cfg).save_pretrained(path)
    return path


@pytest.mark.parametrize("extra, words", [
    (["--context", "0"], ["--context"]),
    (["--data-option", "colour=red"], ["colour", "known keys"]),
    (["--data-option", "subset=abc"], ["subset", "integer"]),
    (["--out", "{afile}"], ["afile", "not a folder"]),
    (["--baseline", "{tmp}/B-typo"], ["B-typo"]),
    (["--out", "{tmp}/A"], ["input checkpoint"]),
    (["--out", "{tmp}/B/sub"], ["input checkpoint"]),
])
def test_interpolate_checks_arguments_first(extra, words, tmp_path, afile, monkeypatch, capsys):
    a, b = _vit(tmp_path / "A", 0), _vit(tmp_path / "B", 1)
    import symalign.jobs.interpolate

    def no_work(*args, **kwargs):
        raise AssertionError("evaluation started before the arguments were checked")

    monkeypatch.setattr(symalign.jobs.interpolate, "curve", no_work)  # the one engine interpolate evaluates with
    before = _listing(tmp_path)
    extra = [e.format(afile=afile, tmp=tmp_path) for e in extra]
    code, _, err = run_symalign(monkeypatch, capsys, "interpolate", a, b, "--data", "digits", *extra)
    _one_line_error(code, err, *words)
    assert _listing(tmp_path) == before


def test_align_force_refuses_a_foreign_folder(tmp_path, monkeypatch, capsys):
    a, b = _vit(tmp_path / "A", 0), _vit(tmp_path / "B", 1)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    code, _, err = run_symalign(monkeypatch, capsys, "align", a, b, "-o", mine, "--force")
    _one_line_error(code, err, "not an output of symalign")
    assert (mine / "notes.txt").read_text() == "keep me"
    out = tmp_path / "out"
    code, _, err = run_symalign(monkeypatch, capsys, "align", a, b, "-o", out)
    assert code == 0, err
    marker = json.loads((out / "symalign.json").read_text())
    assert marker["tool"] == "symalign" and marker["folded"] is False
    code, _, err = run_symalign(monkeypatch, capsys, "align", a, b, "-o", out, "--force")  # its own output: replaced
    assert code == 0, err


def test_json_with_zero_baseline_is_valid(tmp_path):
    from symalign.atomic import write_json
    from symalign.lmc import barrier_ratio

    path = tmp_path / "results.json"
    write_json(path, {"barrier_ratio_percent": barrier_ratio(0.1, 0.0), "x": [float("inf"), 1.5]})
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text) == {"barrier_ratio_percent": None, "x": [None, 1.5]}


def test_outputs_follow_the_umask(tmp_path):
    from symalign.atomic import write_json
    from symalign.checkpoint import save_run

    old = os.umask(0o022)
    try:
        write_json(tmp_path / "r.json", {"a": 1})
        save_run(tmp_path / "run", torch.nn.Linear(2, 2), {"model": {}, "step": 3})
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "r.json").stat().st_mode) == 0o644
    ck = tmp_path / "run" / "ckpt-00000003"
    assert stat.S_IMODE(ck.stat().st_mode) == 0o755
    assert stat.S_IMODE((ck / "model.safetensors").stat().st_mode) == 0o644


def test_version_and_short_help(monkeypatch, capsys):
    from symalign import __version__

    code, out, _ = run_symalign(monkeypatch, capsys, "--version")
    assert code == 0 and out.strip() == f"symalign {__version__}"
    code, out, _ = run_symalign(monkeypatch, capsys, "align", "-h")
    assert code == 0 and "--scope" in out


@pytest.mark.parametrize("command", ["train", "demo", "experiment", "interpolate", "align", "report", "sweep"])
def test_help_text(command, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "200")
    code, out, _ = run_symalign(monkeypatch, capsys, command, "--help")
    assert code == 0
    assert "<bool>" not in out
    if "--out" in out:
        assert "-o" in out.replace("--out", "")
    if command == "align":
        assert "--scope attention" in out and "--scope model" in out
    for placeholder in ("{config}", "{a_dir}", "{b_dir}", "{runs_dir}"):
        assert placeholder not in out


def test_tables_keep_their_width_in_logs(monkeypatch):
    from rich.table import Table

    from symalign.commands.checks import console

    monkeypatch.delenv("COLUMNS", raising=False)
    c = console()
    table = Table()
    for i in range(10):
        table.add_column(f"a long column name {i}")
    table.add_row(*[f"{i}.1234" for i in range(10)])
    with c.capture() as cap:
        c.print(table)
    lines = cap.get().splitlines()
    assert max(map(len, lines)) > 200 and "a long column name 9" in cap.get()


def test_interpolate_output_has_no_loading_bars(tmp_path, monkeypatch, capsys):
    a, b = _vit(tmp_path / "A", 0), _vit(tmp_path / "B", 1)
    code, out, err = run_symalign(monkeypatch, capsys, "interpolate", a, b, "--data", "digits", "--points", "3",
                                  "--eval-items", "32", "-o", tmp_path / "i")
    assert code == 0, err
    assert "Loading weights" not in out + err


@pytest.mark.parametrize("script", ["bench_match.py", "bench_whole_model.py", "symmetry_table.py", "rope_near_null.py",
                                    "whole_hf_tiny.py", "dataset_splits.py", "gemm_floor.py", "sinusoidal_residual.py",
                                    "bench_paper_cost.py", "bench_align_hf.py", "bench_train.py"])
@pytest.mark.slow
def test_benchmark_help_starts_no_work(script):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--help"], capture_output=True,
                       text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert "usage" in r.stdout.lower()


@pytest.mark.slow
def test_align_json_records_threads_and_model_scope_reports_each_sweep(tmp_path, monkeypatch, capsys):
    """Every result records its thread count; --scope model says where each sweep got to (stderr)."""
    import json

    from _cli_util import run_symalign
    from hf_tiny import make_model

    for i, name in enumerate(("A", "B")):
        make_model("gpt2", dtype=torch.float32, seed=i).save_pretrained(tmp_path / name)
    code, out, err = run_symalign(monkeypatch, capsys, "align", tmp_path / "A", tmp_path / "B", "-o",
                                  tmp_path / "O1", "--json")
    assert code == 0, err
    assert json.loads(out)["threads"] == torch.get_num_threads()
    code, out, err = run_symalign(monkeypatch, capsys, "align", tmp_path / "A", tmp_path / "B", "-o",
                                  tmp_path / "O2", "--scope", "model", "--max-sweeps", "2")
    assert code == 0, err
    assert "sweep 1/2: squared distance" in err
