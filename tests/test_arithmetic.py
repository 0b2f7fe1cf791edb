"""Portable arithmetic (``SYMALIGN_ARITHMETIC=portable``, ``symalign demo``'s default): the variables that make
torch, MKL and oneDNN run the same code on every x86-64 CPU, and the restart that sets them before the
libraries read them. The libraries are the reference: torch reports the SIMD level it dispatches to."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from symalign import arithmetic
from symalign.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
CLEAN = {k: v for k, v in os.environ.items() if k not in arithmetic.PORTABLE_ENV and k != arithmetic.ENV_VAR}


def test_modes_from_the_environment():
    assert arithmetic.active({}) == "native"
    env = arithmetic.environment("portable", {"PATH": "/bin"})
    assert arithmetic.active(env) == "portable" and env["PATH"] == "/bin" and env[arithmetic.ENV_VAR] == "portable"
    assert arithmetic.active({**env, "MKL_CBWR": "AUTO"}) == "native"  # one variable off: not portable
    back = arithmetic.environment("native", env)
    assert arithmetic.active(back) == "native" and not set(arithmetic.PORTABLE_ENV) & set(back)
    assert arithmetic.requested({}) is None and arithmetic.requested({arithmetic.ENV_VAR: " Portable "}) == "portable"
    with pytest.raises(ConfigError, match="SYMALIGN_ARITHMETIC must be one of native, portable"):
        arithmetic.requested({arithmetic.ENV_VAR: "fast"})


def test_a_library_call_keeps_its_mode_and_says_so(monkeypatch):
    monkeypatch.setattr(arithmetic, "ENTRY_ARGV", None)
    for k in arithmetic.PORTABLE_ENV:
        monkeypatch.delenv(k, raising=False)
    assert arithmetic.ensure("portable") == "native"  # not restartable: the caller records "native"
    assert arithmetic.describe()["mode"] == "native"


@pytest.mark.slow
def test_restart_runs_torch_and_mkl_in_portable_code(tmp_path):
    """A command restarted by ensure() gets the same arguments and runs torch's baseline kernels and MKL's
    strict reproducible mode (read back from torch and from MKL's own report), and a convolution runs no oneDNN
    primitive (oneDNN's own verbose log): its cache-blocked product made the demo CPU-dependent."""
    script = tmp_path / "command"  # not *.py: restarted as a script, as the console script is
    script.write_text("import json, sys, torch\nfrom symalign import arithmetic\n"
                      "arithmetic.ENTRY_ARGV = sys.argv[1:]\nmode = arithmetic.ensure(sys.argv[1])\n"
                      "a = torch.ones(8, 8); a @ a\n"
                      "torch.nn.Conv2d(1, 4, 4, 4)(torch.randn(2, 1, 8, 8)).sum().backward()\n"
                      "print(json.dumps({**arithmetic.describe(), 'argv': sys.argv[1:]}))\n")
    r = subprocess.run([sys.executable, str(script), "portable", "x y"], capture_output=True, text=True, timeout=120,
                       env={**CLEAN, "PYTHONPATH": str(ROOT / "src"), "MKL_VERBOSE": "1", "ONEDNN_VERBOSE": "1"})
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["mode"] == "portable" and out["torch_cpu_capability"] == "DEFAULT" and out["argv"] == ["portable", "x y"]
    assert "CNR:COMPATIBLE,STRICT" in r.stdout + r.stderr  # MKL's own report of its mode
    assert out["onednn"] is False and "primitive,exec" not in r.stdout + r.stderr


@pytest.mark.slow
def test_cli_portable_alignment_is_exact_and_recorded(tmp_path):
    from test_align_cli import save_pair

    _, _, da, db = save_pair(tmp_path, "llama")
    env = {**CLEAN, "PYTHONPATH": str(ROOT / "src"), arithmetic.ENV_VAR: "portable"}
    r = subprocess.run([sys.executable, "-m", "symalign.cli", "align", str(da), str(db), "-o", str(tmp_path / "OUT"),
                        "--json"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["check"]["passed"] and info["check"]["rel"] <= 1e-5
    rec = info["provenance"]["arithmetic"]
    assert rec["mode"] == "portable" and rec["torch_cpu_capability"] == "DEFAULT"
    assert rec["MKL_CBWR"] == "COMPATIBLE,STRICT"
    assert rec["onednn"] is False


@pytest.mark.slow
def test_cli_refuses_an_unknown_mode_in_one_line(tmp_path):
    env = {**CLEAN, "PYTHONPATH": str(ROOT / "src"), arithmetic.ENV_VAR: "fast"}
    r = subprocess.run([sys.executable, "-m", "symalign.cli", "demo", "-o", str(tmp_path / "d")], capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "SYMALIGN_ARITHMETIC" in r.stderr, r.stderr
    assert not (tmp_path / "d").exists()


@pytest.mark.slow
def test_training_records_its_arithmetic(tmp_path):
    from symalign.train import TrainConfig, train

    meta = train({"family": "vit", "pe": "rope", "d_model": 8, "n_layers": 1, "n_heads": 2, "d_ff": 8, "patch_size": 4},
                 "synthetic", TrainConfig(steps=2, batch_size=8, eval_every=2, eval_items=16, seed=1), tmp_path / "m",
                 threads=1, progress=False)
    (meta_file,) = [p for p in (tmp_path / "m").glob("ckpt-*/*.json") if "arithmetic" in p.read_text()]
    on_disk = json.loads(meta_file.read_text())
    assert meta["arithmetic"] == on_disk["arithmetic"] == arithmetic.describe()
