"""The prepared device check: the ``gpu`` tests, then a synthetic sharded bfloat16 pair aligned, merged and
interpolated, streamed, on one device, against the floor measured in the same run.

Steps (each a ``symalign`` command in its own process, ``--json``, timed, its peak RSS taken; device memory from
the command's own ``memory`` report):

1. ``pytest -m gpu`` (``--cpu-smoke``: ``tests/test_device.py`` on the CPU, its CUDA cases skipped);
2. two random Llama-shaped checkpoints (``--shape``: ``7b`` = 32 layers, D 4096, 32/8 heads, FF 11008, vocab
   32000, 5 GB shards; ``tiny`` = 4 layers, D 256) written to ``--tmp`` by ``bench_align_stream.write_random``;
3. the floor: reading both checkpoints once (sequential 64 MiB reads) plus the device's GEMM time for one product
   per weight matrix pair (``W_A^T W_B`` in float32 with TF32 off -- the size of the Gram products the matchers
   form), measured here;
4. ``align --stream --scope attention``, ``align --stream --scope model --max-sweeps 1``, ``merge --stream
   --scope attention`` and a 5-point ``interpolate --stream`` on synthetic token data, each with ``--device``;
   the model-scope alignment and the merge under ``--max-device-memory`` (``--cap``; default 90 % of the GPU's
   memory, ``1GiB`` in the smoke run, where it is recorded and bounds nothing); with ``--cpu-smoke`` (or
   ``--prefetch-check``) the attention alignment again with ``SYMALIGN_PREFETCH=0``, whose weights must be
   the same bytes (``prefetch_identical``);
5. wall time, wall / floor, host peak RSS, device peak memory, the cap and exit code per step, with the provenance
   (commit, command, threads, versions, device and GPU name), to ``--json`` (default
   ``benchmarks/results/gpu_7b.json`` for ``--shape 7b`` on CUDA; a smoke run writes only where asked).

The temporary folder is deleted at the end, also on failure. ``bash benchmarks/gpu_check.sh --cpu-smoke`` runs
the same steps at the tiny shape on the CPU (under 2 minutes), and ``make test`` runs that mode, so the script
cannot rot without a failing test.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

PREFETCH_ENV = "SYMALIGN_PREFETCH"

from bench_align_stream import SHAPES, llama_config, measured, read_floor, write_random  # noqa: E402


def gemm_floor(a_dir: Path, b_dir: Path, device: torch.device) -> float:
    """Seconds for ``W_A^T W_B`` (float32, TF32 off) of every 2-D weight pair, on ``device``: the size of the
    exact Gram products the matchers form, with the reading not counted (it is the other half of the floor)."""
    from symalign.device import exact_matmul
    from symalign.io.tensors import open_tensors

    a, b = open_tensors(a_dir), open_tensors(b_dir)
    total = 0.0
    with exact_matmul():
        for name, shape in a.shapes.items():
            if len(shape) != 2:
                continue
            xa = a.read([name], torch.float32)[name].to(device)
            xb = b.read([name], torch.float32)[name].to(device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            _ = xa.T @ xb if shape[0] <= shape[1] else xa @ xb.T
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            total += time.perf_counter() - t0
            del xa, xb, _
    return total


def weights_digest(folder: Path) -> str | None:
    """SHA-256 over a checkpoint's weight files (names and bytes), ``None`` when there are none."""
    import hashlib

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def step(name: str, args: list[str], floor_s: float, threads: int, limit_s: float | None, tmp: Path,
         env: dict[str, str] | None = None) -> dict:
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        r = measured(args, limit_s, threads)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    out: dict = {"command": [*(f"{k}={v}" for k, v in (env or {}).items()), "symalign",
                             *(a.replace(str(tmp), "TMP") for a in args)],
                 "rc": r["rc"], "timed_out": r["timed_out"], "wall_s": round(r["wall_s"], 2),
                 "wall_over_floor": round(r["wall_s"] / floor_s, 2) if floor_s > 0 else None,
                 "host_peak_rss_bytes": r["peak_rss"]}
    try:
        res = json.loads(r["out"])
        mem = res.get("memory") or {}
        out["device_peak_bytes"] = mem.get("device_peak_bytes")
        out["max_device_memory_bytes"] = mem.get("max_device_memory_bytes")
        out["device_memory_fraction"] = mem.get("device_memory_fraction")
        out["device"] = (res.get("provenance") or {}).get("device") or res.get("device")
    except (ValueError, AttributeError):
        out["device_peak_bytes"] = None
    if r["rc"] != 0:
        out["error"] = r["err"][-600:]
    print(json.dumps({name: out}), flush=True)
    return out


STEP_COLUMNS = [("step", "step"), ("rc", "exit code"), ("timed_out", "killed at --limit-s"),
                ("wall_s", "wall (s)", ".1f"), ("wall_over_floor", "wall / floor", ".1f"),
                ("host_peak_gib", "host peak RSS (GiB)", ".2f"), ("device_peak_gib", "device peak (GiB)", "")]


def steps_table(res: dict) -> dict:
    """The ``tables`` entry of a result: one row per step (a step without a device figure shows ``-``)."""
    from symalign.experiments.docs_tables import make_table

    rows = []
    for name, st in res["steps"].items():
        dev = st.get("device_peak_bytes")
        rows.append({"step": name, "rc": st["rc"], "timed_out": "yes" if st["timed_out"] else "no",
                     "wall_s": st["wall_s"], "wall_over_floor": st["wall_over_floor"],
                     "host_peak_gib": st["host_peak_rss_bytes"] / 2**30,
                     "device_peak_gib": "-" if dev is None else f"{dev / 2**30:.2f}"})
    return {"steps": make_table(rows, STEP_COLUMNS)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="The tiny shape on the CPU (the script's own test).")
    ap.add_argument("--shape", choices=tuple(SHAPES), default=None, help="Default 7b (tiny with --cpu-smoke).")
    ap.add_argument("--device", default=None, help="Default cuda (cpu with --cpu-smoke).")
    ap.add_argument("--tmp", default=None, help="Parent of the temporary checkpoints (default: system temp).")
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--limit-s", type=float, default=None, help="Kill a step after this many seconds.")
    ap.add_argument("--no-tests", action="store_true", help="Skip step 1 (the gpu tests).")
    ap.add_argument("--cap", default=None, help="--max-device-memory of the model-scope alignment and the merge "
                    "(default: 90%% of the GPU's memory; 1GiB on the CPU).")
    ap.add_argument("--prefetch-check", action="store_true", help="Also align the attention with "
                    "SYMALIGN_PREFETCH=0 and require the same bytes (always with --cpu-smoke).")
    ap.add_argument("--json", default=None, help="Where to write the results.")
    ap.add_argument("--retable", default=None, help="Only rewrite the docs table of this existing result file.")
    args = ap.parse_args()
    if args.retable:
        res = json.loads(Path(args.retable).read_text())
        res["tables"] = steps_table(res)
        Path(args.retable).write_text(json.dumps(res, indent=2) + "\n")
        return 0
    shape = args.shape or ("tiny" if args.cpu_smoke else "7b")
    from symalign.device import describe, resolve
    from symalign.provenance import provenance

    device = resolve(args.device or ("cpu" if args.cpu_smoke else "cuda"))
    out_json = args.json or (str(ROOT / "benchmarks" / "results" / "gpu_7b.json")
                             if shape == "7b" and device.type == "cuda" else None)
    res: dict = {"shape": shape, "device": describe(device), "smoke": args.cpu_smoke,
                 "provenance": provenance(threads=args.threads, device=device), "steps": {}}
    ok = True
    if not args.no_tests:
        marker = [] if args.cpu_smoke else ["-m", "gpu"]
        t0 = time.perf_counter()
        tests = [str(ROOT / "tests" / "test_device.py")] if args.cpu_smoke else [str(ROOT / "tests")]
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *marker, *tests],
                           capture_output=True, text=True, cwd=ROOT)
        res["tests"] = {"rc": r.returncode, "wall_s": round(time.perf_counter() - t0, 1),
                        "summary": (r.stdout.strip().splitlines() or [""])[-1]}
        print(json.dumps({"tests": res["tests"]}), flush=True)
        ok &= r.returncode == 0
    tmp = Path(tempfile.mkdtemp(prefix="symalign-gpu-check-", dir=args.tmp))
    try:
        shard = "5GB" if shape == "7b" else "20MB"
        for seed, name in ((1, "A"), (2, "B")):
            write_random(tmp / name, llama_config(shape), seed, max_shard_size=shard)
        read_s, n = read_floor(tmp / "A", tmp / "B")
        gemm_s = gemm_floor(tmp / "A", tmp / "B", device)
        floor_s = read_s + gemm_s
        res["floor"] = {"read_s": round(read_s, 2), "bytes": n, "gemm_s": round(gemm_s, 3),
                        "total_s": round(floor_s, 2)}
        print(json.dumps({"floor": res["floor"]}), flush=True)
        dev = ["--device", str(device)]
        a, b = str(tmp / "A"), str(tmp / "B")
        cap = args.cap or (str(int(0.9 * torch.cuda.get_device_properties(device).total_memory))
                           if device.type == "cuda" else "1GiB")
        capped = ["--max-device-memory", cap]
        plan = [
            ("align_attention", ["align", a, b, "-o", str(tmp / "OA"), "--stream", "--scope", "attention", "--json",
                                 *dev]),
            ("align_model", ["align", a, b, "-o", str(tmp / "OM"), "--stream", "--scope", "model", "--max-sweeps",
                             "1", "--json", *dev, *capped]),
            ("merge", ["merge", a, str(tmp / "OA"), "-o", str(tmp / "MG"), "--stream", "--scope", "attention",
                       "--json", "--no-progress", *dev, *capped]),
            ("interpolate", ["interpolate", a, str(tmp / "OA"), "--stream", "--data", "synthetic", "--data-option",
                             "kind=lm", "--points", "5", "--eval-items", "8", "--context", "64", "-o", str(tmp / "I"),
                             "--json", "--no-progress", *dev]),
        ]
        if args.cpu_smoke or args.prefetch_check:  # the steps read ahead (the default only on CUDA)
            os.environ[PREFETCH_ENV] = "1"
        for name, cmd in plan:
            res["steps"][name] = step(name, cmd, floor_s, args.threads, args.limit_s, tmp)
            ok &= res["steps"][name]["rc"] == 0
            if out_json:
                Path(out_json).write_text(json.dumps(res, indent=2) + "\n")
        if args.cpu_smoke or args.prefetch_check:  # the reader thread changes no byte
            name = "align_attention_prefetch_off"  # the run above read ahead: on CUDA by default, else forced below
            res["steps"][name] = step(name, ["align", a, b, "-o", str(tmp / "OA0"), "--stream", "--scope",
                                             "attention", "--json", *dev], floor_s, args.threads, args.limit_s, tmp,
                                      env={"SYMALIGN_PREFETCH": "0"})
            on, off = weights_digest(tmp / "OA"), weights_digest(tmp / "OA0")
            res["prefetch_identical"] = on is not None and on == off
            ok &= res["steps"][name]["rc"] == 0 and res["prefetch_identical"]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res["passed"] = bool(ok)
    res["tables"] = steps_table(res)
    if out_json:
        Path(out_json).parent.mkdir(parents=True, exist_ok=True)
        Path(out_json).write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps({"passed": res["passed"], "json": out_json}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
