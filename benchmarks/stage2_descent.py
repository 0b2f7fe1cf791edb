"""Stage 2's refinement the paper's way: barrier against plain gradient-descent steps and rate from the Procrustes
start.

For every finished attention scope of the protocol's runs (``symalign experiment CONFIG --out RUNS``),
loads A and B of ``RUNS/EXPERIMENT/SCOPE/seed{a,b}`` and runs
:func:`symalign.experiments.stage2_descent.descent_path` (head permutations from stage 1, the
orthogonal start, plain gradient descent on the GL blocks at relative rates ``--etas``, the barrier
on the experiment's evaluation split at ``--checkpoints`` steps; references ``none``,
``orthogonal`` and ``full`` = L-BFGS). With ``--ranks`` (the file of ``benchmarks/stage1_rank.py``)
it adds the Pearson correlation between weight distance and barrier across the stage-2 variants
and, from that file, across the 24 head permutations. Writes a result file (JSON, atomically)::

    python benchmarks/stage2_descent.py --runs runs/p12 vit-digits-rope vit-digits-sinusoidal \\
        --ranks results/stage1_rank.json --out results/stage2_descent.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from symalign.atomic import write_json  # noqa: E402
from symalign.experiments.run_pair import load_run_pair  # noqa: E402
from symalign.experiments.docs_tables import make_table  # noqa: E402
from symalign.experiments.stage1_rank import pearson  # noqa: E402
from symalign.experiments.stage2_descent import descent_path  # noqa: E402
from symalign.lmc import barrier_ratio, full_state  # noqa: E402
from symalign.provenance import provenance  # noqa: E402


def run_scope(root: Path, scope: str, etas, checkpoints, points) -> dict:
    run = load_run_pair(root, scope)
    cfg, seeds, split, a, batches, spec = run.cfg, run.seeds, run.split, run.a, run.batches, run.spec
    sa, sb = full_state(a), full_state(run.b)
    from symalign.lmc import curve

    naive = curve(a, sa, sb, lambda: batches, run.task, points or cfg.protocol.points).loss_barrier
    pts = descent_path(a, spec, sa, sb, batches, run.task, points or cfg.protocol.points, etas, checkpoints,
                       progress=lambda s: print(f"  {root.name} {scope}: {s}", file=sys.stderr))
    rows = [{**p.to_dict(), "ratio_percent": barrier_ratio(p.loss_barrier, naive)} for p in pts]
    return {"experiment": root.name, "scope": scope, "seeds": f"{seeds[0]},{seeds[1]}", "eval_split": split,
            "naive_barrier": naive, "points": rows,
            "distance_barrier_correlation": pearson([r["distance"] for r in rows], [r["loss_barrier"] for r in rows])}


def _label(p: dict) -> str:
    return p["variant"] if p["variant"] != "gd" else f"gd eta={p['eta']:g} steps={p['steps']}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("experiments", nargs="+")
    ap.add_argument("--runs", action="append", required=True, help="a runs directory (repeat: one per seed pair)")
    ap.add_argument("--scopes", default="first-attention,all-attention")
    ap.add_argument("--etas", default="0.1,0.5,1.0", help="relative rates (eta / L_s)")
    ap.add_argument("--checkpoints", default="0,10,100,1000", help="step counts at which the barrier is measured")
    ap.add_argument("--points", type=int, default=None)
    ap.add_argument("--ranks", type=Path, default=None, help="results of benchmarks/stage1_rank.py")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--command", default=None)
    ap.add_argument("--reuse", type=Path, action="append", default=[],
                    help="an earlier result file of this script (repeatable, same --etas and --checkpoints): its "
                         "scopes (same experiment, scope, seeds) are kept instead of recomputed")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    etas = [float(x) for x in args.etas.split(",")]
    checkpoints = [int(x) for x in args.checkpoints.split(",")]
    old = []
    for f in args.reuse:
        prev = json.loads(f.read_text())
        if (prev["etas"], prev["checkpoints"]) != (etas, checkpoints):
            sys.exit(f"{f} was measured with other --etas / --checkpoints; recompute it")
        old += prev["scopes"]
    scopes = []
    for runs in args.runs:
        for exp in args.experiments:
            for scope in args.scopes.split(","):
                if (Path(runs) / exp / scope).is_dir():
                    res = Path(runs) / exp / scope / "results.json"
                    seeds = json.loads(res.read_text()).get("seeds") if res.exists() else None
                    seeds = seeds or json.loads((Path(runs) / exp / "config.json").read_text())["protocol"]["seeds"]
                    kept = [s for s in old if (s["experiment"], s["scope"], s["seeds"]) == (exp, scope,
                                                                                          f"{seeds[0]},{seeds[1]}")]
                    scopes += kept or [run_scope(Path(runs) / exp, scope, etas, checkpoints, args.points)]
    # the barrier table: one row per scope, columns = variants
    last = max(checkpoints)
    rows, corr_rows = [], []
    for s in scopes:
        row = {"experiment": s["experiment"], "scope": s["scope"], "seeds": s["seeds"], "naive": s["naive_barrier"]}
        for p in s["points"]:
            key = p["variant"] if p["variant"] != "gd" else f"gd_{p['eta']:g}_{p['steps']}"
            row[key] = p["ratio_percent"]
        rows.append(row)
        corr_rows.append({"experiment": s["experiment"], "scope": s["scope"], "seeds": s["seeds"],
                          "over": f"all {len(s['points'])} points (none, orthogonal, descent, L-BFGS)",
                          "corr": s["distance_barrier_correlation"]})
        refine = [p for p in s["points"] if p["variant"] != "none"]
        corr_rows.append({"experiment": s["experiment"], "scope": s["scope"], "seeds": s["seeds"],
                          "over": f"the {len(refine)} refinement points (orthogonal, descent, L-BFGS; none left out)",
                          "corr": pearson([p["distance"] for p in refine], [p["loss_barrier"] for p in refine])})
    if args.ranks is not None:
        for lay in json.loads(args.ranks.read_text())["layers"]:
            if lay["experiment"] not in args.experiments or lay["scope"] not in args.scopes.split(","):
                continue  # the ranks file may hold other experiments' layers
            corr_rows.append({"experiment": lay["experiment"], "scope": lay["scope"], "seeds": lay["seeds"],
                              "over": f"{lay['n_permutations']} head permutations of layer {lay['layer']}",
                              "corr": lay["distance_barrier_correlation"]})
    cols = [("experiment", "experiment"), ("scope", "scope"), ("seeds", "seeds"), ("naive", "naive barrier", ".3f"),
            ("none", "none %", ".1f"), ("orthogonal", "orthogonal %", ".1f"),
            *[(f"gd_{e:g}_{c}", "GD start (0 steps) %" if c == 0 else f"GD eta={e:g}, {c} steps %", ".1f")
              for e in etas for c in checkpoints if c in (0, last) and not (c == 0 and e != etas[0])],
            ("full", "L-BFGS (full) %", ".1f")]
    steps_cols = [("experiment", "experiment"), ("scope", "scope"), ("seeds", "seeds"),
                  *[(f"gd_{etas[len(etas) // 2]:g}_{c}", f"{c} steps %", ".1f") for c in checkpoints],
                  ("full", "L-BFGS %", ".1f")]
    tables = {"descent": make_table(rows, cols), "steps": make_table(rows, steps_cols),
              "correlation": make_table(corr_rows, [("experiment", "experiment"), ("scope", "scope"),
                                                    ("seeds", "seeds"), ("over", "across"),
                                                    ("corr", "corr(weight distance, barrier)", ".2f")])}
    pairs = max((len({s["seeds"] for s in scopes if s["experiment"] == e}) for e in args.experiments), default=0)
    command = args.command or shlex.join(["python", "benchmarks/stage2_descent.py", *sys.argv[1:]])
    write_json(args.out, {"provenance": provenance(command, args.threads, pairs), "tables": tables,
                          "etas": etas, "checkpoints": checkpoints, "scopes": scopes})
    for s in scopes:
        print(s["experiment"], s["scope"], s["seeds"], f"naive {s['naive_barrier']:.3f}",
              "; ".join(f"{_label(p)}: {p['ratio_percent']:.1f}% d={p['distance']:.2f}" for p in s["points"]))


if __name__ == "__main__":
    main()
