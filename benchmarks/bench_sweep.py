"""Sweep throughput: an 8-run tiny grid with 1 and 2 workers, on the local pool and a local Ray instance.

The grid is configs/grids/tiny.toml with four seed pairs instead of two (2 encodings x 4
seed pairs = 8 runs, one torch thread each) and ``--steps`` training steps (default 200, so
that a run's compute outweighs a worker's start-up: importing torch & co. takes seconds).
Every configuration starts from an empty output directory; wall times include starting the
pool / Ray and importing torch in the workers. Reported (medians over ``--trials``
interleaved trials): wall seconds, the speed-up (1 worker / 2 workers) per backend, each
backend's overhead per task with 1 worker ((wall - sum of task seconds) / runs) and Ray's
overhead per task ((Ray 1 worker - local 1 worker) / runs).

    .venv/bin/python benchmarks/bench_sweep.py [--trials 2] [--json] [--out benchmarks/results/sweep.json]

``--out`` writes a result file (atomically, with provenance and the load averages at the start and the end) whose
table ``symalign docs`` renders.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent


def bench_grid(seed_pairs: int, steps: int):
    """tiny.toml with ``seed_pairs`` seed pairs (2 x seed_pairs runs) and ``steps`` training steps."""
    from symalign.experiments.sweep import parse_grid

    d = tomllib.loads((ROOT / "configs" / "grids" / "tiny.toml").read_text())
    d["name"] = "bench"
    d["grid"]["protocol.seeds"] = [[2 * i + 1, 2 * i + 2] for i in range(seed_pairs)]
    d["train"]["steps"] = steps
    return parse_grid(d, "bench")


def timed_sweep(grid, workers: int, ray: str | None) -> tuple[float, float]:
    """Wall seconds of one sweep from scratch, and the sum of its tasks' own seconds."""
    from symalign.experiments.sweep import STORE_FILE, read_rows, run_sweep

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        s = run_sweep(grid, Path(tmp) / "sweep", workers=workers, ray=ray, progress=False)
        wall = time.perf_counter() - t0
        task_s = sum(r["seconds"] for r in read_rows(Path(tmp) / "sweep" / STORE_FILE).values())
    if s.failed or s.done != len(grid.runs):
        raise RuntimeError(f"sweep failed: {s.failures}")
    return wall, task_s


def write_result(path: Path, out: dict, backends: list, task: dict) -> None:
    """``out`` with provenance and a ``tables.backends`` entry (one row per backend), written atomically."""
    import shlex

    from symalign.atomic import write_json
    from symalign.experiments.docs_tables import make_table
    from symalign.provenance import provenance

    n = out["runs"]
    rows = [{"backend": label, "wall_1w": out["wall_s"][f"{label}_1w"], "wall_2w": out["wall_s"][f"{label}_2w"],
             "speedup": f"{out[f'{label}_speedup_2v1']:.2f}x",
             "tasks": f"{task[f'{label}_1w'] / n:.1f} / {task[f'{label}_2w'] / n:.1f}",
             "overhead": out[f"{label}_own_overhead_per_task_s"],
             "load": f"{out['load_average_at_start']:.1f} / {out['load_average_at_end']:.1f}"} for label, _ in backends]
    table = make_table(rows, [("backend", "backend"), ("wall_1w", "1 worker: wall (s)", ".1f"),
                              ("wall_2w", "2 workers: wall (s)", ".1f"), ("speedup", "speed-up 2 vs 1"),
                              ("tasks", "mean task (s), 1 / 2 workers"),
                              ("overhead", "overhead per task, 1 worker (s)", ".2f"),
                              ("load", "load average start / end")])
    cmd = "python benchmarks/bench_sweep.py " + shlex.join(sys.argv[1:])
    write_json(path, {"provenance": provenance(cmd, threads=1), **out, "tables": {"backends": table}})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed-pairs", type=int, default=4, help="runs = 2 x seed pairs (default 8 runs)")
    ap.add_argument("--steps", type=int, default=200, help="training steps of each model (default 200)")
    ap.add_argument("--trials", type=int, default=1, help="interleaved trials; medians are reported")
    ap.add_argument("--no-ray", action="store_true", help="local backend only")
    ap.add_argument("--json", action="store_true", help="print the numbers as JSON")
    ap.add_argument("--out", type=Path, default=None, help="also write a result file (JSON) with a docs table")
    args = ap.parse_args()
    grid = bench_grid(args.seed_pairs, args.steps)
    n = len(grid.runs)
    backends = [("local", None)] + ([] if args.no_ray else [("ray", "local")])
    walls: dict[str, list[float]] = {}
    tasks: dict[str, list[float]] = {}
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    for trial in range(args.trials):  # configurations interleaved: robust to a drifting machine load
        for label, ray in backends:
            for workers in (1, 2):
                key = f"{label}_{workers}w"
                w, t = timed_sweep(grid, workers, ray)
                walls.setdefault(key, []).append(w)
                tasks.setdefault(key, []).append(t)
                print(f"trial {trial}: {label:5s} {workers} worker(s): {w:7.1f} s wall for {n} runs "
                      f"({t / n:.1f} s per task)", file=sys.stderr, flush=True)
    wall = {k: statistics.median(v) for k, v in walls.items()}
    task = {k: statistics.median(v) for k, v in tasks.items()}
    out = {"runs": n, "steps": args.steps, "trials": args.trials, "cpus": os.cpu_count(),
           "load_average_at_start": load, "wall_s": wall, "task_s_mean": {k: v / n for k, v in task.items()}}
    for label, _ in backends:
        out[f"{label}_speedup_2v1"] = wall[f"{label}_1w"] / wall[f"{label}_2w"]
    # 1 worker: wall = start-up + sum of task times + dispatch; (wall - sum) / n is each backend's overhead
    # per task, independent of how fast the (shared) CPU happened to compute.
    for label, _ in backends:
        out[f"{label}_own_overhead_per_task_s"] = (wall[f"{label}_1w"] - task[f"{label}_1w"]) / n
    if not args.no_ray:
        out["ray_overhead_per_task_s"] = (wall["ray_1w"] - wall["local_1w"]) / n
    out["load_average_at_end"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    if args.out:
        write_result(args.out, out, backends, task)
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"{n} runs of {args.steps} steps, {out['cpus']} CPUs, load average {load:.1f} at start, "
          f"median of {args.trials} trial(s)\n")
    print("| backend | 1 worker: wall (s) | 2 workers: wall (s) | speed-up 2 vs 1 | mean task (s), 1 / 2 workers |")
    print("|---|---|---|---|---|")
    for label, _ in backends:
        print(f"| {label} | {wall[f'{label}_1w']:.1f} | {wall[f'{label}_2w']:.1f} | "
              f"{out[f'{label}_speedup_2v1']:.2f}x | {task[f'{label}_1w'] / n:.1f} / {task[f'{label}_2w'] / n:.1f} |")
    print()
    for label, _ in backends:
        print(f"{label} overhead per task, 1 worker ((wall - sum of task times) / {n}): "
              f"{out[f'{label}_own_overhead_per_task_s']:.2f} s")
    if not args.no_ray:
        print(f"Ray overhead per task (Ray 1 worker - local 1 worker) / {n} runs: "
              f"{out['ray_overhead_per_task_s']:+.2f} s")


if __name__ == "__main__":
    main()
