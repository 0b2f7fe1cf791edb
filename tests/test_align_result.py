"""``symalign align --json``: one shape for every scope and path (in memory, streamed), read from the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from _cli_util import run_symalign
from hf_tiny import make_model
from symalign.align_result import AlignResult, CheckReport, PhaseClock
from symalign.tolerance import TOLERANCE, FunctionCheck, function_tolerance

KEYS = set(AlignResult.__dataclass_fields__) - {"transform"}
CHECK_KEYS = {"kind", "dtype", "rel", "max_abs", "tolerance", "passed", "exact", "layers"}
TIMING_KEYS = {"read_s", "prepare_s", "match_s", "verify_s", "write_s", "total_s"}


def _pair(tmp: Path) -> tuple[Path, Path]:
    for name, seed in (("A", 0), ("B", 1)):
        make_model("llama", dtype=torch.float64, seed=seed).save_pretrained(tmp / name, max_shard_size="20KB")
    return tmp / "A", tmp / "B"


@pytest.mark.slow
def test_every_scope_and_path_prints_one_shape(tmp_path, capsys, monkeypatch):
    da, db = _pair(tmp_path)
    seen = {}
    for scope in ("attention", "model"):
        for stream in ("--stream", "--no-stream"):
            out = tmp_path / f"{scope}{stream}"
            code, text, err = run_symalign(monkeypatch, capsys, "align", str(da), str(db), "-o", str(out),
                                           "--scope", scope, stream, "--max-sweeps", "2", "--json")
            assert code == 0, err
            info = json.loads(text)
            assert set(info) == KEYS, (scope, stream, set(info) ^ KEYS)
            assert set(info["check"]) == CHECK_KEYS and set(info["timings"]) == TIMING_KEYS
            assert info["scope"] == scope and info["path"] == ("streamed" if stream == "--stream" else "in-memory")
            assert info["check"]["passed"] and info["check"]["kind"] == ("per-layer" if stream == "--stream"
                                                                         else "whole")
            assert info["check"]["rel"] <= info["check"]["tolerance"]
            t = info["timings"]
            assert all(t[k] >= 0 for k in TIMING_KEYS) and t["match_s"] > 0 and t["verify_s"] > 0
            assert t["total_s"] >= sum(t[k] for k in TIMING_KEYS - {"total_s"}) - 1e-6
            assert info["provenance"]["threads"] == info["threads"] == torch.get_num_threads()
            assert info["folded"] is (scope == "model") and info["sweeps"] >= 1
            assert info["distance"]["after"]["total"] < info["distance"]["before"]["total"]
            seen[scope, stream] = info
    for scope in ("attention", "model"):  # the two paths agree on what they found
        s, m = seen[scope, "--stream"], seen[scope, "--no-stream"]
        assert s["group"] == m["group"] and s["sweeps"] == m["sweeps"]
        assert abs(s["distance"]["after"]["total"] - m["distance"]["after"]["total"]) <= 1e-6


def test_check_report_takes_the_worst_layer_and_fails_when_one_does():
    ok = [FunctionCheck.of(1e-13, 1e-12, torch.float64, 1e-10, layer=i) for i in range(3)]
    exact = [FunctionCheck.of(1e-14, 1e-13, torch.float64, 1e-10, layer=i, stored=False) for i in range(3)]
    r = CheckReport.per_layer(ok + exact)
    assert r.passed and r.rel == 1e-13 and r.exact is not None and r.exact.rel == 1e-14 and len(r.layers) == 6
    bad = FunctionCheck.of(1e-3, 1e-2, torch.float64, 1e-10, layer=1)
    r = CheckReport.per_layer([ok[0], bad, ok[2]])
    assert not r.passed and r.rel == 1e-3 and r.max_abs == 1e-2
    with pytest.raises(Exception, match="layer 1.*1.00e-03.*a bug in the matcher"):
        bad.require("refusing to write OUT: the output differs", "the matcher")


def test_tolerance_table_and_clock():
    assert TOLERANCE[torch.float64] == 1e-10 and TOLERANCE[torch.float32] == 1e-5
    assert TOLERANCE[torch.bfloat16] == 8 * 2.0 ** -7 and TOLERANCE[torch.float16] == 8 * 2.0 ** -10
    assert function_tolerance(torch.float64, torch.float32) == 1e-5
    assert function_tolerance(torch.float64, floor=1e-6) == 1e-6
    clock = PhaseClock()
    for _ in range(2):
        with clock("match"):
            sum(range(1000))
    with pytest.raises(ValueError, match="unknown phase"):
        with clock("nap"):
            pass
    t = clock.timings()
    assert t.match_s > 0 and t.read_s == 0 and t.total_s >= t.match_s
