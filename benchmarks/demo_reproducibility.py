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

``--sweep`` measures what another x86-64 machine would change, on this one. What distinguishes
CPUs for one torch build is which SIMD kernels run: torch's own element-wise and reduction
kernels dispatch on ``ATEN_CPU_CAPABILITY`` (``default`` / ``avx2`` / ``avx512``) and MKL's GEMMs
on ``MKL_ENABLE_INSTRUCTIONS`` (``SSE4_2`` / ``AVX2`` / ``AVX512``); both variables cap the level a
CPU would pick for itself, so an AVX-512 machine can run the code paths of an AVX2 or a baseline
x86-64 one; so do ``ONEDNN_MAX_CPU_ISA`` for oneDNN (torch's float32 convolutions and some linear
layers) and ``GLIBC_TUNABLES`` for glibc's libm. Each setting (:data:`SETTINGS`) runs the demo from scratch and is compared with
``results/demo.json``; the level each setting really ran at is read back from the child
(torch's reported capability and MKL's ``MKL_VERBOSE`` banner), so a variable that had no effect
shows. Written to ``results/demo-reproducibility.json`` and rendered into docs/results.md.

    python benchmarks/demo_reproducibility.py [--json OUT]
    python benchmarks/demo_reproducibility.py --sweep [--out results/demo-reproducibility.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMINGS = ("seconds",)  # wall-clock leaves: not results

_AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2",
         "GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX512F,-AVX512DQ,-AVX512BW,-AVX512VL"}
_BASELINE = {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "ONEDNN_MAX_CPU_ISA": "SSE41",
             "GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX,-AVX2,-FMA,-AVX512F"}
#: the same code on every x86-64 CPU: torch's baseline kernels, MKL's conditional numerical reproducibility
#: and oneDNN (torch's float32 convolutions and some linear layers) capped at SSE4.1
PORTABLE = {"MKL_CBWR": "COMPATIBLE", "ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41"}
DEMO_JSON = "results/demo.json"

#: ``(label, environment, threads, compared with)``: the code paths of other x86-64 CPUs, emulated here
#: (``threads`` None: the demo's default, 1; ``compared with``: results/demo.json or an earlier label).
#: An emulated CPU caps torch's kernels, MKL's and glibc's (``GLIBC_TUNABLES``: its libm picks FMA/AVX
#: variants by CPU) at that CPU's level.
SETTINGS: tuple[tuple[str, dict[str, str], int | None, str], ...] = (
    ("this machine: AVX-512 kernels, MKL AVX-512", {}, None, DEMO_JSON),
    ("an AVX2 CPU: torch, MKL and libm at AVX2", _AVX2, None, DEMO_JSON),
    ("a baseline x86-64 CPU: torch without AVX, MKL at SSE4.2, libm without AVX/FMA", _BASELINE, None, DEMO_JSON),
    ("MKL alone at AVX2 (torch's kernels AVX-512)", {"MKL_ENABLE_INSTRUCTIONS": "AVX2"}, None, DEMO_JSON),
    ("torch's kernels alone at AVX2 (MKL AVX-512)", {"ATEN_CPU_CAPABILITY": "avx2"}, None, DEMO_JSON),
    ("this machine at 2 threads", {}, 2, DEMO_JSON),
    ("portable mode on this machine", PORTABLE, None, DEMO_JSON),
    ("portable mode on an AVX2 CPU", {**_AVX2, **PORTABLE}, None, "portable mode on this machine"),
    ("portable mode on a baseline x86-64 CPU", {**_BASELINE, **PORTABLE}, None, "portable mode on this machine"),
)

_ISA_PROBE = ("import torch; a = torch.ones(8, 8); a @ a; "
              "print('CAPABILITY', torch.backends.cpu.get_cpu_capability())")


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


def code_paths(env: dict[str, str]) -> dict[str, str]:
    """The SIMD levels a child process with ``env`` really runs at: torch's capability and MKL's
    banner (the instruction set named in ``MKL_VERBOSE``'s first line)."""
    r = subprocess.run([sys.executable, "-c", _ISA_PROBE], capture_output=True, text=True,
                       env={**os.environ, **env, "MKL_VERBOSE": "1"})
    text = r.stdout + r.stderr
    cap = next((ln.split()[1] for ln in text.splitlines() if ln.startswith("CAPABILITY")), "?")
    banner = next((ln for ln in text.splitlines() if ln.startswith("MKL_VERBOSE oneMKL")), "")
    m = re.search(r"\(Intel\(R\) ([A-Z0-9.\-]+)\)", banner.split("architecture", 1)[-1])
    mkl = m.group(1) if m else ("generic" if "Architecture processors" in banner else "?")
    cnr = next((w.split(":", 1)[1] for ln in text.splitlines() if ln.startswith("MKL_VERBOSE") and "GEMM" in ln
                for w in ln.split() if w.startswith("CNR:")), "?")
    return {"torch": cap, "mkl": mkl + (f" (CNR {cnr})" if cnr not in ("OFF", "?") else "")}


def run_demo(env: dict[str, str] | None = None, threads: int | None = None) -> tuple[dict, float]:
    """``symalign demo`` from scratch in a temporary folder: its ``results.json`` and wall seconds.

    Raises ``RuntimeError`` with the demo's last error line when it fails."""
    exe = Path(sys.executable).with_name("symalign")
    with tempfile.TemporaryDirectory(prefix="symalign-demo-repro-") as tmp:
        cmd = [str(exe), "demo", "--out", tmp] + (["--threads", str(threads)] if threads else [])
        t0 = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, **(env or {})})
        wall = time.perf_counter() - t0
        if r.returncode != 0:
            raise RuntimeError(f"symalign demo failed (exit {r.returncode}): "
                               f"{(r.stderr.strip().splitlines() or ['?'])[-1]}")
        return json.loads((Path(tmp) / "results.json").read_text()), wall


def headline(demo: dict) -> dict[str, float]:
    """The README table's main numbers: first-attention full stage-2 ratio per encoding, and the
    whole-model aligned ratio."""
    enc = demo["encodings"]
    return {"sin_full": enc["sinusoidal"]["barrier_ratio_percent"], "rope_full": enc["rope"]["barrier_ratio_percent"],
            "sin_naive": enc["sinusoidal"]["naive_loss_barrier"], "rope_naive": enc["rope"]["naive_loss_barrier"],
            "whole": demo["whole_model"]["barrier_ratio_percent"]}


def sweep(ref: dict, out: Path, settings=SETTINGS) -> dict:
    """Run the demo under every setting, compare with ``ref`` and write the result file ``out``."""
    from symalign.experiments.docs_tables import make_table
    from symalign.provenance import provenance

    rows = [{"setting": "results/demo.json (the README's table)", "env": "-", "paths": "-", "identical": "-",
             **headline(ref["demo"])}]
    results = {DEMO_JSON: ref["demo"]}
    for label, env, threads, against in settings:
        paths = code_paths(env)
        got, wall = run_demo(env, threads)
        results.setdefault(label, got)
        c = compare(results[against], got)
        row = {"setting": label, "env": " ".join(f"{k}={v}" for k, v in env.items()) or "(none)",
               "paths": f"torch {paths['torch']}, MKL {paths['mkl']}", "threads": threads or 1,
               "against": against,
               "identical": f"{c['identical']} / {c['numbers']}", "max_rel_diff": c["max_rel_diff"],
               "wall_s": round(wall, 1), **headline(got)}
        rows.append(row)
        print(f"{label}: {row['paths']}: {row['identical']} identical, max rel diff {c['max_rel_diff']:.3g}; "
              f"sinusoidal {row['sin_full']:.1f} %, RoPE {row['rope_full']:.1f} %, whole {row['whole']:.1f} %",
              flush=True)
    table = make_table(rows, [("setting", "setting"), ("paths", "code paths (read back)"), ("threads", "threads"),
                              ("against", "compared with"), ("identical", "numbers identical"),
                              ("max_rel_diff", "max rel diff", ".2g"),
                              ("sin_naive", "sinusoidal naive barrier", ".3f"), ("sin_full", "sinusoidal full %", ".1f"),
                              ("rope_naive", "RoPE naive barrier", ".3f"), ("rope_full", "RoPE full %", ".1f"),
                              ("whole", "whole model aligned %", ".1f")])
    res = {"provenance": {**provenance(threads=1, seed_pairs=1), "cpu": machine()["cpu"],
                          "cpu_capability": machine()["cpu_capability"]},
           "settings": [{"setting": r["setting"], "env": r["env"], "wall_s": r.get("wall_s")} for r in rows[1:]],
           "reference": {"commit": ref.get("provenance", {}).get("commit")},
           "tables": {"machines": table}}
    from symalign.atomic import write_text

    write_text(out, json.dumps(res, indent=1) + "\n")
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, help="also write the comparison here")
    p.add_argument("--reference", type=Path, default=ROOT / "results" / "demo.json")
    p.add_argument("--sweep", action="store_true", help="run the demo under every setting of SETTINGS")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "demo-reproducibility.json",
                   help="the sweep's result file")
    a = p.parse_args(argv)
    ref = json.loads(a.reference.read_text())
    try:
        if a.sweep:
            sweep(ref, a.out)
            return 0
        got, wall = run_demo()
    except RuntimeError as exc:
        print(f"demo reproducibility: {exc}")
        return 2
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
