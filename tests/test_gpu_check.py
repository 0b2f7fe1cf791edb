"""``benchmarks/gpu_check.sh --cpu-smoke``: the prepared device check runs end to end at a tiny shape on the CPU,
so the script a GPU session runs cannot rot unnoticed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_check_cpu_smoke_passes(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "smoke.json"
    r = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--cpu-smoke", "--no-tests", "--threads",
                        "1", "--json", str(out), "--tmp", str(tmp_path)], capture_output=True, text=True,
                       env={**__import__("os").environ, "PYTHON": sys.executable}, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["passed"] and res["smoke"] and res["device"] == {"device": "cpu"}
    assert set(res["steps"]) == {"align_attention", "align_model", "merge", "interpolate",
                                 "align_attention_prefetch_off"}
    for name, st in res["steps"].items():
        assert st["rc"] == 0 and st["wall_s"] > 0 and st["wall_over_floor"] > 0, name
        assert st["host_peak_rss_bytes"] > 0 and st["device"] == "cpu", name
        assert st["device_peak_bytes"] is None, name  # no device memory on the CPU
    for name in ("align_model", "merge"):  # --max-device-memory: accepted and recorded on the CPU
        assert res["steps"][name]["max_device_memory_bytes"] == 1 << 30, name
        assert res["steps"][name]["device_memory_fraction"] is None, name
    assert res["steps"]["align_attention"]["max_device_memory_bytes"] is None
    assert res["prefetch_identical"] is True  # SYMALIGN_PREFETCH=0 wrote the same bytes
    assert res["floor"]["read_s"] > 0 and res["floor"]["gemm_s"] > 0
    assert [p.name for p in tmp_path.iterdir()] == ["smoke.json"]  # the temporary checkpoints are gone
    assert not (ROOT / "benchmarks" / "results" / "gpu_7b.json").exists() or "smoke" not in json.loads(
        (ROOT / "benchmarks" / "results" / "gpu_7b.json").read_text()) or not json.loads(
        (ROOT / "benchmarks" / "results" / "gpu_7b.json").read_text())["smoke"]
