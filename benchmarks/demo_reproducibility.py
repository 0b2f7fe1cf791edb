"""Does `make demo` on this machine give the committed numbers? A measurement across machines.

Runs ``symalign demo`` (what ``make demo`` runs: default settings and threads) into a temporary
folder and compares every number of its ``results.json`` with ``results/demo.json`` (the run the
README's table is written from), leaf by leaf:

* ``identical``: the same float bits (``a == b``; the JSON round trip keeps floats exactly);
* otherwise the largest absolute and relative difference, and the paths of the first few.

It prints what identifies the machine (CPU model, torch's CPU capability -- the SIMD kernels it
dispatches to --, threads, library versions) beside the verdict, so that run on another machine
(`.ci/run` runs it after the tests on CI's fresh machine) it measures what the README promises
across machines. It never fails the build: it is a measurement, and its exit code is 0 whenever
the demo ran (2 when it could not).

    python benchmarks/demo_reproducibility.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMINGS = ("seconds",)  # wall-clock leaves: not results


def leaves(x, path: str = "") -> dict[str, float]:
    """``{path: number}`` of every int/float leaf of a JSON value (bools, strings and :data:`TIMINGS` left out)."""
    if isinstance(x, dict):
        return {k: v for key, val in x.items() if key not in TIMINGS
                for k, v in leaves(val, f"{path}.{key}" if path else key).items()}
    if isinstance(x, list):
        return {k: v for i, val in enumerate(x) for k, v in leaves(val, f"{path}[{i}]").items()}
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return {path: float(x)}
    return {}


def compare(ref: dict, got: dict) -> dict:
    """Leaf-by-leaf comparison of two results (``ref``: the committed one)."""
    a, b = leaves(ref), leaves(got)
    common = sorted(set(a) & set(b))
    same = [k for k in common if a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k]))]
    diff = [k for k in common if k not in same]
    abs_d = max((abs(a[k] - b[k]) for k in diff), default=0.0)
    rel_d = max((abs(a[k] - b[k]) / max(abs(a[k]), 1e-300) for k in diff), default=0.0)
    return {"numbers": len(common), "identical": len(same), "different": len(diff),
            "only_in_committed": sorted(set(a) - set(b))[:10], "only_in_this_run": sorted(set(b) - set(a))[:10],
            "max_abs_diff": abs_d, "max_rel_diff": rel_d,
            "first_differences": [{"path": k, "committed": a[k], "this_run": b[k]} for k in diff[:8]]}


def machine() -> dict:
    """What identifies this machine's arithmetic: CPU model, torch's dispatched SIMD level, versions."""
    import torch

    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        cpu = platform.processor() or "unknown"
    return {"cpu": cpu, "cores": os.cpu_count(), "arch": platform.machine(), "kernel": platform.release(),
            "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "python": platform.python_version()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, help="also write the comparison here")
    p.add_argument("--reference", type=Path, default=ROOT / "results" / "demo.json")
    a = p.parse_args(argv)
    ref = json.loads(a.reference.read_text())
    exe = Path(sys.executable).with_name("symalign")
    with tempfile.TemporaryDirectory(prefix="symalign-demo-repro-") as tmp:
        t0 = time.perf_counter()
        r = subprocess.run([str(exe), "demo", "--out", tmp], capture_output=True, text=True, cwd=ROOT)
        wall = time.perf_counter() - t0
        if r.returncode != 0:
            print(f"demo reproducibility: symalign demo failed (exit {r.returncode}): "
                  f"{(r.stderr.strip().splitlines() or ['?'])[-1]}")
            return 2
        got = json.loads((Path(tmp) / "results.json").read_text())
    out = {"reference": str(a.reference.relative_to(ROOT)) if a.reference.is_relative_to(ROOT) else str(a.reference),
           "reference_commit": ref.get("provenance", {}).get("commit"),
           "reference_machine": ref.get("provenance", {}).get("machine"),
           "this_machine": machine(), "demo_wall_s": round(wall, 1), **compare(ref["demo"], got)}
    m = out["this_machine"]
    verdict = ("bit-for-bit identical" if out["different"] == 0 and not out["only_in_committed"] else
               f"{out['different']} differ (max abs {out['max_abs_diff']:.3g}, max rel {out['max_rel_diff']:.3g})")
    print(f"demo reproducibility on {m['cpu']} ({m['cores']} cores, torch {m['torch']}, {m['cpu_capability']}): "
          f"{out['identical']} of {out['numbers']} numbers of results/demo.json identical; {verdict}; "
          f"demo {out['demo_wall_s']} s")
    print(json.dumps(out))
    if a.json:
        a.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
