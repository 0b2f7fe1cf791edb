"""benchmarks/demo_reproducibility.py's comparison: leaf by leaf, float bits, timings left out."""

import importlib.util
import math
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("demo_reproducibility", ROOT / "benchmarks" / "demo_reproducibility.py")
dr = importlib.util.module_from_spec(spec)
spec.loader.exec_module(dr)


def test_identical_results_are_reported_identical_and_timings_ignored():
    ref = {"encodings": {"rope": {"ratio": 33.917971634679134, "acc": [0.8, 0.9]}}, "seconds": 59.0, "data": "digits"}
    got = {"encodings": {"rope": {"ratio": 33.917971634679134, "acc": [0.8, 0.9]}}, "seconds": 61.5, "data": "digits"}
    c = dr.compare(ref, got)
    assert (c["numbers"], c["identical"], c["different"]) == (3, 3, 0)


def test_one_last_bit_difference_is_found_with_its_path():
    x = 33.917971634679134
    y = math.nextafter(x, 100.0)  # the next float: the last bit differs
    c = dr.compare({"r": {"ratio": x}, "n": 3}, {"r": {"ratio": y}, "n": 3})
    assert (c["identical"], c["different"]) == (1, 1)
    assert c["first_differences"][0]["path"] == "r.ratio" and 0 < c["max_rel_diff"] < 1e-14


def test_a_missing_number_is_listed():
    c = dr.compare({"a": 1.0, "b": 2.0}, {"a": 1.0})
    assert c["only_in_committed"] == ["b"] and c["numbers"] == 1


def test_sweep_table_and_its_relayout_keep_every_row(tmp_path):
    import json

    rows = [{"setting": "results/demo.json (the README's table)", "paths": "-", "identical": "-", "sin_full": 33.0,
             "sin_naive": 1.7, "rope_full": 29.2, "rope_naive": 2.6, "whole": 72.0},
            {"setting": "native here", "paths": "torch AVX512", "threads": 1, "against": "results/demo.json",
             "identical": "13 / 152", "max_rel_diff": 0.6, "sin_full": 18.4, "sin_naive": 1.8, "rope_full": 33.9,
             "rope_naive": 2.5, "whole": 69.1, "wall_s": 61.2}]
    t = dr.machines_table(rows)
    assert t["rows"] == rows and t["columns"][-1]["key"] == "wall_s"
    f = tmp_path / "sweep.json"
    f.write_text(json.dumps({"provenance": {}, "tables": {"machines": {"columns": t["columns"][:3], "rows": rows}}}))
    dr.retable(f)
    assert json.loads(f.read_text())["tables"]["machines"] == t
