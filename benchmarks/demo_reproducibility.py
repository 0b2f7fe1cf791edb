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

``--sweep`` measures, on this one machine, what another x86-64 machine would change. For one torch
build, CPUs differ in which SIMD code each library picks, and an environment variable caps each level
below what the CPU would pick for itself:

* torch's own kernels (element-wise ops, reductions): ``ATEN_CPU_CAPABILITY`` (``default`` / ``avx2``);
* MKL's matrix products: ``MKL_ENABLE_INSTRUCTIONS`` (``SSE4_2`` / ``AVX2``);
* oneDNN (torch's float32 convolutions and some linear layers): ``ONEDNN_MAX_CPU_ISA``;
* glibc's libm: ``GLIBC_TUNABLES``.

So an AVX-512 machine can run the code of an AVX2 or a baseline x86-64 CPU. Each setting
(:data:`SETTINGS`) runs the demo from scratch, in native or portable arithmetic
(:mod:`symalign.arithmetic`), and compares it with ``results/demo.json`` or with an earlier setting. The
level each setting really ran at is read back from the child: torch's reported capability, and MKL's
``MKL_VERBOSE`` banner and reproducibility mode. A variable that had no effect therefore shows. The
sweep is written to ``results/demo-reproducibility.json`` and rendered into docs/results.md.

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
DEMO_JSON = "results/demo.json"
#: the first portable mode's demo (oneDNN on, CNR without STRICT), made on an Intel machine at ab7a6d0: until
#: 3f896b7 the README's table
FIRST_PORTABLE_JSON = "results/demo-first-portable.json"
_FIRST_PORTABLE = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "ONEDNN_MAX_CPU_ISA": "SSE41"}
NATIVE_HERE = "native arithmetic on this machine (the fastest kernels each library picks here)"

#: ``(label, environment, threads, arithmetic, compared with)``: the demo on the code paths of other x86-64
#: CPUs, emulated here (``threads`` None: the demo's default, 1; ``compared with``: results/demo.json or an
#: earlier label). An emulated CPU caps torch's kernels, MKL's, oneDNN's and glibc's (``GLIBC_TUNABLES``: its
#: libm picks FMA/AVX variants by CPU) at that CPU's level. ``portable`` (the demo's default) then sets the
#: variables of :data:`symalign.arithmetic.PORTABLE_ENV` on top, as it does on a real CPU.
SETTINGS: tuple[tuple[str, dict[str, str], int | None, str, str], ...] = (
    ("portable arithmetic (the default) on this machine", {}, None, "portable", DEMO_JSON),
    ("portable arithmetic on an AVX2 CPU", _AVX2, None, "portable", DEMO_JSON),
    ("portable arithmetic on a baseline x86-64 CPU", _BASELINE, None, "portable", DEMO_JSON),
    ("portable arithmetic at 2 threads", {}, 2, "portable", DEMO_JSON),
    (NATIVE_HERE, {}, None, "native", DEMO_JSON),
    ("native arithmetic on an AVX2 CPU: torch, MKL, oneDNN and libm at AVX2", _AVX2, None, "native", NATIVE_HERE),
    ("native arithmetic on a baseline x86-64 CPU: torch without AVX, MKL at SSE4.2, oneDNN at SSE4.1, libm "
     "without AVX/FMA", _BASELINE, None, "native", NATIVE_HERE),
    ("native, MKL alone at AVX2", {"MKL_ENABLE_INSTRUCTIONS": "AVX2"}, None, "native", NATIVE_HERE),
    ("native, torch's kernels alone at AVX2", {"ATEN_CPU_CAPABILITY": "avx2"}, None, "native", NATIVE_HERE),
    # its variables without STRICT are not the portable mode's: the process runs as native, oneDNN on
    ("the first portable mode (oneDNN on, CNR not strict) on this machine", _FIRST_PORTABLE, None, "native",
     FIRST_PORTABLE_JSON),
)

_ISA_PROBE = ("import torch; from symalign import arithmetic; arithmetic.apply(); "
              "a = torch.ones(8, 8); a @ a; torch.nn.Conv2d(1, 4, 4, 4)(torch.randn(2, 1, 8, 8)); "
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

    from symalign.provenance import cpu_model

    return {"cpu": cpu_model() or "unknown", "cores": os.cpu_count(), "arch": platform.machine(),
            "kernel": platform.release(), "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "python": platform.python_version()}


def code_paths(env: dict[str, str]) -> dict[str, str]:
    """The SIMD levels a child process with environment ``env`` really runs at: torch's capability and MKL's
    banner (the instruction set named in ``MKL_VERBOSE``'s first line) and reproducibility mode."""
    r = subprocess.run([sys.executable, "-c", _ISA_PROBE], capture_output=True, text=True,
                       env={**env, "MKL_VERBOSE": "1", "ONEDNN_VERBOSE": "1"})
    text = r.stdout + r.stderr
    cap = next((ln.split()[1] for ln in text.splitlines() if ln.startswith("CAPABILITY")), "?")
    banner = next((ln for ln in text.splitlines() if ln.startswith("MKL_VERBOSE oneMKL")), "")
    m = re.search(r"\(Intel\(R\) ([A-Z0-9.\-]+)\)", banner.split("architecture", 1)[-1])
    mkl = m.group(1) if m else ("generic" if "Architecture processors" in banner else "?")
    cnr = next((w.split(":", 1)[1] for ln in text.splitlines() if ln.startswith("MKL_VERBOSE") and "GEMM" in ln
                for w in ln.split() if w.startswith("CNR:")), "?")
    isa = next((ln.split("isa:", 1)[1].strip() for ln in text.splitlines()
                if "onednn_verbose" in ln and "isa:" in ln), "?")
    if "primitive,exec" not in text:  # torch's oneDNN backend off (portable arithmetic): no primitive ran
        isa = "off"
    return {"torch": cap, "mkl": mkl + (f" (CNR {cnr})" if cnr not in ("OFF", "?") else ""),
            "onednn": isa.removeprefix("Intel ").split(" and ")[0]}


def child_env(env: dict[str, str], arithmetic: str) -> dict[str, str]:
    """This process's environment with the emulation ``env`` and, in portable arithmetic, its variables on top."""
    from symalign.arithmetic import environment

    return environment(arithmetic, {**os.environ, **env}) if arithmetic == "portable" else {
        **{k: v for k, v in os.environ.items() if k != "SYMALIGN_ARITHMETIC"}, **env}


def run_demo(env: dict[str, str] | None = None, threads: int | None = None,
             arithmetic: str | None = None) -> tuple[dict, float]:
    """``symalign demo`` from scratch in a temporary folder (``--arithmetic`` when given): its ``results.json``
    and wall seconds.

    Raises ``RuntimeError`` with the demo's last error line when it fails."""
    exe = Path(sys.executable).with_name("symalign")
    with tempfile.TemporaryDirectory(prefix="symalign-demo-repro-") as tmp:
        cmd = [str(exe), "demo", "--out", tmp] + (["--threads", str(threads)] if threads else []) + (
            ["--arithmetic", arithmetic] if arithmetic else [])
        t0 = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=dict(os.environ) if env is None else env)
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


def machines_table(rows: list[dict]) -> dict:
    """The ``machines`` table of the sweep's result file from its rows."""
    from symalign.experiments.docs_tables import make_table

    return make_table(rows, [("setting", "setting"), ("paths", "code paths (read back)"), ("threads", "threads"),
                             ("against", "compared with"), ("identical", "numbers identical"),
                             ("max_rel_diff", "max rel diff", ".2g"),
                             ("sin_naive", "sinusoidal naive barrier", ".3f"), ("sin_full", "sinusoidal full %", ".1f"),
                             ("rope_naive", "RoPE naive barrier", ".3f"), ("rope_full", "RoPE full %", ".1f"),
                             ("whole", "whole model aligned %", ".1f"), ("wall_s", "seconds", ".0f")])


def retable(path: Path) -> None:
    """Rewrite the table layout of a sweep's result file from its own rows (nothing is re-measured)."""
    from symalign.atomic import write_text

    res = json.loads(path.read_text())
    res["tables"]["machines"] = machines_table(res["tables"]["machines"]["rows"])
    write_text(path, json.dumps(res, indent=1) + "\n")


def sweep(ref: dict, out: Path, settings=SETTINGS) -> dict:
    """Run the demo under every setting, compare with ``ref`` and write the result file ``out``."""
    from symalign.provenance import provenance

    rows = [{"setting": "results/demo.json (the README's table)", "env": "-", "paths": "-", "identical": "-",
             **headline(ref["demo"])}]
    results = {DEMO_JSON: ref["demo"]}
    for label, env, threads, mode, against in settings:
        full = child_env(env, mode)
        paths = code_paths(full)
        got, wall = run_demo(full, threads, mode)
        results.setdefault(label, got)
        if against not in results:  # another committed demo result
            results[against] = json.loads((ROOT / against).read_text())["demo"]
        c = compare(results[against], got)
        row = {"setting": label, "env": " ".join(f"{k}={v}" for k, v in env.items()) or "(none)", "arithmetic": mode,
               "paths": f"torch {paths['torch']}, MKL {paths['mkl']}, oneDNN {paths['onednn']}",
               "threads": threads or 1, "against": against,
               "identical": f"{c['identical']} / {c['numbers']}", "max_rel_diff": c["max_rel_diff"],
               "wall_s": round(wall, 1), **headline(got)}
        rows.append(row)
        print(f"{label}: {row['paths']}: {row['identical']} identical, max rel diff {c['max_rel_diff']:.3g}; "
              f"sinusoidal {row['sin_full']:.1f} %, RoPE {row['rope_full']:.1f} %, whole {row['whole']:.1f} %",
              flush=True)
    table = machines_table(rows)
    here = machine()
    res = {"provenance": {**provenance(threads=1, seed_pairs=1), "cpu": here["cpu"],
                          "cpu_capability": here["cpu_capability"]},
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
    p.add_argument("--retable", type=Path, help="only rewrite this sweep file's table layout from its rows")
    a = p.parse_args(argv)
    if a.retable:
        retable(a.retable)
        return 0
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
    mode = (got.get("arithmetic") or {}).get("mode", "native")
    out["demo_arithmetic"] = got.get("arithmetic")
    print(f"demo reproducibility on {m['cpu']} ({m['cores']} cores, torch {m['torch']}, {m['cpu_capability']}; "
          f"demo in {mode} arithmetic): "
          f"{out['identical']} of {out['numbers']} numbers of results/demo.json identical; {verdict}; "
          f"demo {out['demo_wall_s']} s")
    print(json.dumps(out))
    if a.json:
        a.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
