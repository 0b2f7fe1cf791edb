"""The example scripts honour the thread setting (``--threads``, else ``$SYMALIGN_THREADS``, else 1, read
through :func:`symalign.commands.checks.default_threads`) and record the count torch really ran with;
none writes into ``results/`` unless told to (issue 33, item 7)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _run(script: str, *args, env: dict | None = None, cwd: Path) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": str(ROOT / "src"), **(env or {})}
    full.pop("SYMALIGN_THREADS", None) if env is None or "SYMALIGN_THREADS" not in env else None
    return subprocess.run([sys.executable, str(EXAMPLES / script), *map(str, args)], env=full, cwd=cwd,
                          capture_output=True, text=True, timeout=600)


@pytest.fixture
def module(monkeypatch):
    """Import an example script as a module (examples/ on the path; torch's threads restored after)."""
    import torch

    monkeypatch.syspath_prepend(str(EXAMPLES))
    before = torch.get_num_threads()

    def load(name: str):
        spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    yield load
    torch.set_num_threads(before)


@pytest.mark.slow
def test_vit_pair_uses_the_environment_threads_and_records_them(tmp_path):
    r = _run("hf_bert_vit_pairs.py", "pair", "--only", "vit", "--seeds", 0, 1, "--vit-epochs", 1, "--width", 16,
             "--layers", 1, "--heads", 2, "--batch", 256, env={"SYMALIGN_THREADS": "3"}, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    rec = json.loads((tmp_path / "pair" / "vit-pair.json").read_text())
    assert rec["threads"] == 3 and rec["provenance"]["threads"] == 3 and rec["checkpoints"] == ["vit-s0", "vit-s1"]
    assert "torch threads: 3" in r.stdout
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("script", ["hf_gpt2_pair.py", "hf_bert_vit_pairs.py", "hf_bert_vit_results.py"])
@pytest.mark.slow
def test_a_bad_thread_count_is_refused_in_one_line(script, tmp_path):
    r = _run(script, "out", "--threads", 0, cwd=tmp_path)
    assert r.returncode == 2 and "--threads must be at least 1, got 0" in r.stderr and "Traceback" not in r.stderr
    assert list(tmp_path.iterdir()) == []


def test_gpt2_pair_records_the_threads_of_the_option(tmp_path):
    from symalign.data import text
    from symalign.errors import DatasetError

    try:
        text.shakespeare_files()
    except DatasetError as exc:
        pytest.skip(str(exc))
    r = _run("hf_gpt2_pair.py", "pair", "--steps", 1, "--seeds", 0, "--vocab", 300, "--width", 16, "--layers", 1,
             "--heads", 2, "--context", 16, "--batch", 2, "--threads", 2, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "pair" / "gpt2-pair.json").read_text())["threads"] == 2


def _fake_cli(used: int, calls: list):
    """``cli(threads, *args)`` as the commands answer it, reporting ``used`` threads."""
    curve = {"t": [0, 1], "loss": [1.0, 1.2], "acc": [0.5, 0.4], "loss_barrier": 0.1, "acc_barrier": 0.01}

    def cli(threads, *args):
        calls.append((threads, args))
        if args[0] == "align":
            return {"threads": used}
        return {"threads": used, "naive": {**curve, "loss_barrier": 0.4}, "curve": curve,
                "evaluation": {"items": 10}}
    return cli


def test_results_script_writes_beside_the_pair_by_default_and_records_threads(tmp_path, monkeypatch, module):
    mod = module("hf_bert_vit_results")
    calls: list = []
    monkeypatch.setattr(mod, "cli", _fake_cli(2, calls))
    monkeypatch.chdir(tmp_path)
    pair = tmp_path / "pair"
    pair.mkdir()
    (pair / "vit-pair.json").write_text(json.dumps({"threads": 2}))
    mod.main([str(pair), "--models", "vit", "--threads", "2"])
    assert not (tmp_path / "results").exists()  # the committed result is replaced only with -o
    res = json.loads((pair / "hf-bert-vit.json").read_text())
    assert res["provenance"]["threads"] == 2 and {r["threads"] for r in res["rows"]} == {2}
    assert {r["pair_threads"] for r in res["rows"]} == {2}
    assert calls and all(t == 2 for t, _ in calls)
    # commands that ran with another count than asked for stop the script
    monkeypatch.setattr(mod, "cli", _fake_cli(1, []))
    with pytest.raises(SystemExit) as info:
        mod.main([str(pair), "--models", "vit", "--threads", "2", "-o", str(tmp_path / "other.json")])
    assert "ran with [1]" in str(info.value) and not (tmp_path / "other.json").exists()


def test_results_script_passes_the_thread_count_to_each_command(monkeypatch, module):
    mod = module("hf_bert_vit_results")
    seen = {}

    def fake_run(argv, env, capture_output, text):
        seen.update(env=env, argv=argv)
        return subprocess.CompletedProcess(argv, 0, stdout='{"threads": 4}', stderr="")

    monkeypatch.setattr(mod.subprocess, "run", fake_run)
    assert mod.cli(4, "align", "a", "b") == {"threads": 4}
    assert seen["env"]["SYMALIGN_THREADS"] == "4" and seen["env"]["OMP_NUM_THREADS"] == "4"
