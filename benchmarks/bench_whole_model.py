"""Benchmark of whole-model weight matching (:func:`symalign.match.whole.match_whole`).

Shapes (two independent random rewritten built-in GPTs, float32, learned PE):

* ``small``: 6 layers, D=256, 8 heads, d_ff=1024, vocab 256 (the paper's GPT-2 on Tiny Shakespeare);
* ``gpt2``: GPT-2-small shapes -- 12 layers, D=768, 12 heads, d_ff=3072, vocab 50257, 1024 positions.

Each shape runs in a fresh subprocess; reported: time of the match (and per
sweep), number of sweeps, distance before/after, and peak memory (``ru_maxrss``
minus the RSS once both models exist). Single-threaded by default (shared
machine); set ``SYMALIGN_BENCH_THREADS``. GPT-2 runs ``max_sweeps`` sweeps with the
orthogonal attention stage 2 unless ``--full`` is passed.

Run: ``.venv/bin/python benchmarks/bench_whole_model.py [--full]``. ``--out FILE`` writes a result file (JSON,
atomically, with its provenance) whose ``timing`` table is docs/whole-model.md's "Benchmarks" (``symalign docs``
renders it); ``--threads N`` sets ``SYMALIGN_BENCH_THREADS`` for the subprocesses::

    python benchmarks/bench_whole_model.py --threads 1 --out benchmarks/results/whole_model.json
"""

from __future__ import annotations

import json
import os

_THREADS = os.environ.get("SYMALIGN_BENCH_THREADS", "1")
for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_v] = _THREADS
import resource  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

LABELS = {"small": "6 layers, D=256, 8 heads, d_ff=1024",
          "gpt2": "GPT-2 small shapes (12 x 768, d_ff 3072, V=50257, untied head)"}
SHAPES = {
    "small": dict(d_model=256, n_layers=6, n_heads=8, d_ff=1024, vocab_size=256, max_len=256, max_sweeps=20,
                  stage2="full"),
    "gpt2": dict(d_model=768, n_layers=12, n_heads=12, d_ff=3072, vocab_size=50257, max_len=1024, max_sweeps=3,
                 stage2="orthogonal"),
}


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def one(name: str, full: bool) -> dict:
    import torch

    torch.set_num_threads(int(_THREADS))
    from symalign.match.whole import align_whole
    from symalign.models import ModelConfig, build_model
    from symalign.rewrite import rewrite_model

    s = dict(SHAPES[name])
    max_sweeps, stage2 = s.pop("max_sweeps"), s.pop("stage2")
    if full:
        stage2 = "full"
    cfg = ModelConfig(family="gpt", pe="learned", **s)
    a = rewrite_model(build_model(cfg, seed=1)).eval()
    b = rewrite_model(build_model(cfg, seed=2)).eval()
    for p in a.parameters():
        p.requires_grad_(False)
    for p in b.parameters():
        p.requires_grad_(False)
    base = _rss_mb()
    t0 = time.perf_counter()
    res = align_whole(a, b, max_sweeps=max_sweeps, stage2=stage2)
    dt = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    n_params = sum(p.numel() for p in a.parameters())
    return {"shape": name, "params": n_params, "stage2": stage2, "sweeps": res.iterations,
            "converged": res.converged, "time_s": dt, "time_per_sweep_s": dt / max(res.iterations, 1),
            "distance_before": res.distances[0], "distance_after": res.distances[-1],
            "relative_distance_after": res.to_dict()["relative_distance_after"],
            "peak_extra_mb": peak - base, "rss_models_mb": base, "threads": int(_THREADS)}


def tables(rows: list[dict]) -> dict:
    """The ``timing`` table of docs/whole-model.md: one row per shape that ran."""
    from symalign.experiments.docs_tables import make_table

    shown = [{"shape": LABELS[r["shape"]], "params": f"{r['params'] / 1e6:.1f} M", "stage2": r["stage2"],
              "sweeps": f"{r['sweeps']}" + ("" if r["converged"] else " (cap)"), "time": r["time_s"],
              "per_sweep": r["time_per_sweep_s"],
              "distance": f"{r['distance_before']:.0f} -> {r['distance_after']:.0f} "
                          f"(relative {r['relative_distance_after']:.2f})",
              "peak": f"{r['peak_extra_mb']:.0f} MB (models: {r['rss_models_mb']:.0f} MB)"}
             for r in rows if "error" not in r]
    return {"timing": make_table(shown, [
        ("shape", "shape"), ("params", "params"), ("stage2", "stage 2"), ("sweeps", "sweeps"),
        ("time", "time s", ".1f"), ("per_sweep", "per sweep s", ".1f"), ("distance", "distance before -> after"),
        ("peak", "peak extra memory (process RSS with both models)")])}


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="Whole-model weight matching on random GPTs (small and GPT-2-small "
                                             "shapes), each in a fresh subprocess.")
    ap.add_argument("--full", action="store_true", help="GPT-2: the full stage 2 instead of the orthogonal one.")
    ap.add_argument("--threads", type=int, default=None, help="threads of each run (default: "
                    "SYMALIGN_BENCH_THREADS, else 1)")
    ap.add_argument("--out", default=None, help="write a result file (with the docs' timing table) here")
    ap.add_argument("--one", choices=list(SHAPES), help=argparse.SUPPRESS)  # internal: one shape per subprocess
    args = ap.parse_args()
    full = args.full
    if args.one:
        print(json.dumps(one(args.one, full)))
        return
    threads = args.threads if args.threads is not None else int(_THREADS)
    prov = None
    if args.out:
        from symalign.provenance import provenance

        prov = provenance(["python", "benchmarks/bench_whole_model.py", *sys.argv[1:]], threads=threads,
                          seed_pairs=1)  # one independent pair (seeds 1, 2) per shape
    env = {**os.environ, "SYMALIGN_BENCH_THREADS": str(threads)}
    rows = []
    for name in SHAPES:
        cmd = [sys.executable, __file__, "--one", name] + (["--full"] if full else [])
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if r.returncode:
            rows.append({"shape": name, "error": r.stderr[-2000:]})
            print(json.dumps(rows[-1]))
            continue
        rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        from symalign.atomic import write_json

        if any("error" in r for r in rows):
            raise SystemExit(f"a shape failed; {args.out} not written")
        write_json(args.out, {"provenance": prov, "load_average_end": [round(x, 2) for x in os.getloadavg()],
                              "shapes": rows, "tables": tables(rows)})


if __name__ == "__main__":
    main()
