"""Benchmark of whole-model weight matching (:func:`symalign.match.whole.match_whole`).

Shapes (two independent random rewritten built-in GPTs, float32, learned PE):

* ``small``: 6 layers, D=256, 8 heads, d_ff=1024, vocab 256 (the paper's GPT-2 on Tiny Shakespeare);
* ``gpt2``: GPT-2-small shapes -- 12 layers, D=768, 12 heads, d_ff=3072, vocab 50257, 1024 positions.

Each shape runs in a fresh subprocess; reported: time of the match (and per
sweep), number of sweeps, distance before/after, and peak memory (``ru_maxrss``
minus the RSS once both models exist). Single-threaded by default (shared
machine); set ``SYMALIGN_BENCH_THREADS``. GPT-2 runs ``max_sweeps`` sweeps with the
orthogonal attention stage 2 unless ``--full`` is passed.

Run: ``.venv/bin/python benchmarks/bench_whole_model.py [--full]``.
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


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="Whole-model weight matching on random GPTs (small and GPT-2-small "
                                             "shapes), each in a fresh subprocess.")
    ap.add_argument("--full", action="store_true", help="GPT-2: the full stage 2 instead of the orthogonal one.")
    ap.add_argument("--one", choices=list(SHAPES), help=argparse.SUPPRESS)  # internal: one shape per subprocess
    args = ap.parse_args()
    full = args.full
    if args.one:
        print(json.dumps(one(args.one, full)))
        return
    for name in SHAPES:
        cmd = [sys.executable, __file__, "--one", name] + (["--full"] if full else [])
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            print(json.dumps({"shape": name, "error": r.stderr[-2000:]}))
            continue
        print(r.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
