"""benchmarks/paper_run.py, the prepared paper-scale GPU run: its refusals, and its steps end to end on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "paper_run.py"


def _run(*args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "runs"), "--result",
                           str(tmp_path / "r.json"), *args], capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where there is no CUDA")
def test_refuses_without_cuda_before_training(tmp_path: Path) -> None:
    p = _run("--budget-min", "1", tmp_path=tmp_path)
    assert p.returncode == 2
    assert p.stderr.strip().count("\n") == 0 and "no CUDA device" in p.stderr and "--smoke" in p.stderr
    assert not (tmp_path / "runs").exists() and not (tmp_path / "r.json").exists()


def test_unknown_config_is_one_line(tmp_path: Path) -> None:
    p = _run("--config", "nope", "--smoke", tmp_path=tmp_path)
    assert p.returncode == 2 and "no config configs/paper/nope.toml" in p.stderr
    assert not (tmp_path / "r.json").exists()


@pytest.mark.slow
def test_smoke_runs_the_steps_and_writes_the_table(tmp_path: Path) -> None:
    p = _run("--smoke", "--config", "vit-rope-cifar10", "--scope", "first-attention", "--scope", "full",
             "--threads", "1", tmp_path=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads((tmp_path / "r.json").read_text())
    assert [s["status"] for s in r["paper_run"]["steps"]] == ["ok", "ok"]
    rows = r["tables"]["barriers"]["rows"]
    assert {row["scope"] for row in rows} == {"first-attention", "full"}
    assert all(row["naive"] > 0 for row in rows) and r["max_function_change"] < 1e-4
    assert r["paper_run"]["device"] == "cpu" and r["provenance"]["command"].startswith("python")
