"""Sweeps: grid expansion and validation, the SQLite store, kill + resume, fault tolerance,
and bit-identical results under the local pool and a local Ray instance."""

from __future__ import annotations

import copy
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from symalign.errors import ConfigError, SymalignError
from symalign.experiments.sweep import (STORE_FILE, ResultsStore, load_grid, parse_grid, read_rows, run_sweep,
                                        stored_results)

pytestmark = pytest.mark.slow  # trains models / starts Ray: `pytest -m "not slow"` skips it

ROOT = Path(__file__).parent.parent
TINY = ROOT / "configs" / "grids" / "tiny.toml"

BASE = {"name": "g", "data": "digits",
        "model": {"family": "vit", "d_model": 16, "n_layers": 1, "n_heads": 2, "d_ff": 32, "patch_size": 4},
        "train": {"steps": 20, "batch_size": 32, "eval_every": 0},
        "protocol": {"scopes": ["first-attention"], "points": 3, "eval_items": 64, "variants": ["full"]}}


def grid(**axes) -> dict:
    return {**copy.deepcopy(BASE), "grid": axes}


def cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "symalign.cli", *args], capture_output=True, text=True,
                          timeout=300, **kw)


def strip_timings(obj):
    """Results without wall-clock fields (everything else must be bit-identical)."""
    if isinstance(obj, dict):
        return {k: strip_timings(v) for k, v in obj.items() if "time" not in k and "seconds" not in k}
    if isinstance(obj, list):
        return [strip_timings(v) for v in obj]
    return obj


def results_by_run(out: Path) -> dict[str, str]:
    return {n: json.dumps(strip_timings(json.loads(r["results"])), sort_keys=True)
            for n, r in read_rows(out / STORE_FILE).items()}


RAY_PATTERNS = ("raylet", "gcs_server", "default_worker.py", "ray::", "log_monitor.py", "dashboard/agent.py")


def ray_pids() -> set[int]:
    """Live processes that look like Ray's (from /proc; Linux only)."""
    pids = set()
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (p / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and any(s in cmd for s in RAY_PATTERNS):
            pids.add(int(p.name))
    return pids


# ---------------------------------------------------------------------------
# (1) expansion and errors before anything runs
# ---------------------------------------------------------------------------


def test_shipped_grids_expand():
    tiny = load_grid(TINY)
    assert [r.name for r in tiny.runs] == ["tiny_pe=sinusoidal_seeds=1+2", "tiny_pe=sinusoidal_seeds=3+4",
                                          "tiny_pe=rope_seeds=1+2", "tiny_pe=rope_seeds=3+4"]
    assert tiny.runs[3].config.model["pe"] == "rope" and tiny.runs[3].config.protocol.seeds == [3, 4]
    assert tiny.resources.threads_per_run == 1
    results = load_grid(ROOT / "configs" / "grids" / "results.toml")
    assert len(results.runs) == 5 * 2 * 4  # family/dataset cases x encodings x scopes
    names = {r.name for r in results.runs}
    assert "results_vit-digits_pe=rope_scopes=first-attention" in names
    fams = {(r.config.model["family"], r.config.data) for r in results.runs}
    assert fams == {("vit", "digits"), ("vit", "fashion-mnist"), ("gpt", "shakespeare"), ("gpt", "bible"),
                    ("encoder", "wordnet")}


def test_cartesian_product_cases_and_nested_keys():
    d = grid(model={"pe": ["sinusoidal", "rope"]}, data=["digits"])  # nested table == "model.pe"
    d["cases"] = [{"label": "small", "model": {"d_model": 16}}, {"label": "wide", "model": {"d_model": 32}}]
    g = parse_grid(d)
    assert len(g.runs) == 4
    assert g.runs[0].name == "g_small_pe=sinusoidal_data=digits"
    assert g.runs[-1].config.model == {**BASE["model"], "d_model": 32, "pe": "rope"}
    assert g.runs[-1].overrides == {"case": "wide", "model.pe": "rope", "data": "digits"}
    assert parse_grid(copy.deepcopy(BASE)).runs[0].name == "g"  # no axes: the base alone
    long = parse_grid(grid(**{"train.lr": [1e-3, 2e-3], "model.d_ff": [32 + i for i in range(40)]}))
    assert len({r.name for r in long.runs}) == 80  # readable names, all unique


@pytest.mark.parametrize("d, msg", [
    (grid(**{"model.widht": [16]}), r"unknown key \[model\] 'widht'"),
    (grid(**{"modle.pe": ["rope"]}), "unknown grid key 'modle.pe'"),
    (grid(**{"protocol.scopes": [["some-attention"]]}), "unknown scope 'some-attention'"),
    (grid(**{"model.pe": []}), "axis 'model.pe' is empty"),
    (grid(**{"model.pe": "rope"}), "must be a list"),
    (grid(**{"model.pe": ["rope", "rope"]}), "same run name"),
    (grid(data=["digits", "cifar-1000"]), "unknown dataset"),
    (grid(name=["a", "b"]), "'name' cannot vary"),
    (grid(**{"model.pe.x": ["rope"]}), "section or section.field"),
    ({**grid(), "resources": {"cpus": 1}}, r"unknown key \[resources\] 'cpus'"),
    ({**grid(), "extra": 1}, "unknown key 'extra'"),
])
def test_invalid_grids_fail_before_anything_runs(d, msg):
    with pytest.raises(ConfigError, match=msg):
        parse_grid(d)


def test_unreachable_ray_address_fails_before_anything_runs(tmp_path):
    pytest.importorskip("ray")
    out = tmp_path / "sweep"
    with pytest.raises(SymalignError, match="127.0.0.1:1"):
        run_sweep(parse_grid(grid()), out, ray="127.0.0.1:1", progress=False)
    assert not out.exists()
    toml = tmp_path / "g.toml"
    toml.write_text('name = "g"\ndata = "digits"\n[model]\nfamily = "vit"\n[grid]\n"model.pe" = ["rope"]\n')
    r = cli("sweep", str(toml), "--ray", "127.0.0.1:1", "--out", str(out))
    assert r.returncode == 2 and "127.0.0.1:1" in r.stderr and "Traceback" not in r.stderr
    assert not out.exists()
    toml.write_text(toml.read_text().replace("model.pe", "model.pee"))
    r = cli("sweep", str(toml), "--out", str(out))
    assert r.returncode == 2 and "'pee'" in r.stderr and not out.exists()


def test_stale_store_is_refused(tmp_path):
    g = parse_grid(grid())
    with ResultsStore(tmp_path / STORE_FILE) as store:
        store.record(g.runs[0], {"ok": True, "results_json": "{}"}, "local")
    changed = parse_grid({**grid(), "train": {"steps": 21, "batch_size": 32, "eval_every": 0}})
    with pytest.raises(ConfigError, match="different config"):
        run_sweep(changed, tmp_path, workers=1, progress=False)


# ---------------------------------------------------------------------------
# (3) SIGKILL mid-way, resume; every run recorded once, done  (the local baseline for (2))
# ---------------------------------------------------------------------------


def _wait_done(db: Path, proc: subprocess.Popen, at_least: int, timeout: float = 180) -> int:
    t0 = time.time()
    while time.time() - t0 < timeout:
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        try:
            n = sum(r["status"] == "done" for r in read_rows(db).values())
        except sqlite3.OperationalError:  # locked while the driver commits
            n = 0
        if n >= at_least:
            return n
        time.sleep(0.2)
    raise AssertionError("the sweep recorded no finished run in time")


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def local_sweep(tmp_path_factory) -> tuple[Path, int, dict]:
    """The tiny grid on the local pool with 1 worker, SIGKILLed after its first run, then resumed."""
    out = tmp_path_factory.mktemp("local")
    proc = subprocess.Popen([sys.executable, "-m", "symalign.cli", "sweep", str(TINY), "--workers", "1",
                             "--out", str(out), "--quiet"], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        killed_at = _wait_done(out / STORE_FILE, proc, 1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and its pool workers
        proc.wait(timeout=30)
    for _ in range(100):
        if not _group_alive(proc.pid):
            break
        time.sleep(0.1)
    assert not _group_alive(proc.pid), "a worker of the killed sweep survived"
    r = cli("sweep", str(TINY), "--workers", "1", "--out", str(out), "--json", "--quiet")
    assert r.returncode == 0, r.stderr
    return out, killed_at, json.loads(r.stdout)


def test_killed_sweep_resumes_every_run_once(local_sweep):
    out, killed_at, summary = local_sweep
    assert 1 <= killed_at < 4 or pytest.skip("the sweep finished before it could be killed")
    assert summary["runs"] == 4 and summary["skipped"] == killed_at and summary["failed"] == 0
    assert summary["done"] == 4 - killed_at
    conn = sqlite3.connect(out / STORE_FILE)
    rows = conn.execute("SELECT name, status, attempts, backend FROM runs").fetchall()
    conn.close()
    assert sorted(n for n, *_ in rows) == sorted(r.name for r in load_grid(TINY).runs)
    assert all(s == "done" and a == 1 and b == "local" for _, s, a, b in rows)
    assert len(stored_results(out / STORE_FILE)) == 4
    r = cli("report", str(out))  # report reads the sweep (results.json + store, deduplicated)
    assert r.returncode == 0, r.stderr
    assert "4 experiment results (one per run and scope) under" in (out / "report.md").read_text()


# ---------------------------------------------------------------------------
# (2) a local Ray instance gives bit-identical results
# ---------------------------------------------------------------------------


def test_ray_local_matches_local_pool_bit_for_bit(local_sweep, tmp_path):
    ray = pytest.importorskip("ray")
    out_local = local_sweep[0]
    before = ray_pids()
    summary = run_sweep(load_grid(TINY), tmp_path / "ray", workers=2, ray="local", progress=False)
    assert summary.backend == "ray" and summary.done == 4 and summary.failed == 0
    assert not ray.is_initialized()
    rows = read_rows(tmp_path / "ray" / STORE_FILE)
    assert {r["backend"] for r in rows.values()} == {"ray"} and {r["threads"] for r in rows.values()} == {1}
    local, remote = results_by_run(out_local), results_by_run(tmp_path / "ray")
    assert local.keys() == remote.keys() and len(local) == 4
    for name in local:
        assert local[name] == remote[name], name  # barriers, curves, matches: bit for bit
    for _ in range(100):  # Ray's processes are gone
        if not ray_pids() - before:
            break
        time.sleep(0.2)
    assert not ray_pids() - before


# ---------------------------------------------------------------------------
# fault tolerance: a failing run is recorded and retried; the others go on
# ---------------------------------------------------------------------------


def test_failed_run_is_recorded_and_retried(tmp_path):
    g = parse_grid(grid(**{"model.n_heads": [3, 2]}))  # d_model 16 is not divisible by 3: fails in the task
    s1 = run_sweep(g, tmp_path, workers=1, progress=False)
    assert (s1.done, s1.failed) == (1, 1) and s1.failures[0]["name"] == "g_n_heads=3"
    rows = read_rows(tmp_path / STORE_FILE)
    bad = rows["g_n_heads=3"]
    assert bad["status"] == "failed" and "not divisible" in bad["error"] and "Traceback" in bad["traceback"]
    assert rows["g_n_heads=2"]["status"] == "done"
    s2 = run_sweep(g, tmp_path, workers=1, progress=False)
    assert (s2.skipped, s2.done, s2.failed) == (1, 0, 1)
    assert read_rows(tmp_path / STORE_FILE)["g_n_heads=3"]["attempts"] == 2
