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
