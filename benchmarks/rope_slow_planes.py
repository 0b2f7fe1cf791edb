"""Do RoPE barriers fall when the slow planes are aligned in a larger, approximate group (GL on their span)?

For every finished attention scope of a RoPE experiment (``symalign experiment CONFIG --out RUNS``) loads
A and B of ``RUNS/EXPERIMENT/SCOPE/seed{a,b}``, aligns B to A with the two-stage matcher (stage 1, stage 2
``full``: the exact group, as the protocol's ``full`` variant) and then, for each ``--thresholds`` value
``tau`` (radians), aligns the planes whose total rotation over the context ``theta_j (T - 1)`` is below
``tau`` over ``GL`` on their span (:func:`symalign.match.slow_planes.align_slow_planes`; *not* a
symmetry). Per threshold it reports the planes relaxed, the Q-K distance on their columns before and
after, the function change of B'' against B on the evaluation data (relative logit change, largest over
the batches, and the change of B's loss and accuracy), and the loss barrier of the curve A -> B'' (its
own endpoints) as a percentage of the naive barrier. The exact-group row (``tau = 0``) is checked
against the run's ``results.json``. Writes a result file (JSON, atomically)::

    python benchmarks/rope_slow_planes.py --runs runs/r vit-digits-rope --thresholds 0,0.1,0.5,2 \\
        --out results/rope_slow_planes.json
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
from torch.func import functional_call  # noqa: E402

from symalign import lmc  # noqa: E402
from symalign.atomic import write_json  # noqa: E402
from symalign.experiments.docs_tables import make_table  # noqa: E402
from symalign.experiments.run_pair import load_run_pair  # noqa: E402
from symalign.match import match_attention  # noqa: E402
from symalign.match.slow_planes import align_slow_planes  # noqa: E402
from symalign.probe.theory import reference_frequencies, rope_planes  # noqa: E402


def context_length(model, batches) -> int:
    """Positions one attention layer sees: a ViT's tokens, else the batch's sequence length (+ CLS)."""
    cfg = model.cfg
    if cfg.family == "vit":
        return cfg.seq_len
    return int(batches[0][0].shape[1]) + (1 if cfg.has_cls else 0)


def function_change(model, state, state_b, batches) -> float:
    """Largest over the batches of ``||f(x) - f_B(x)|| / ||f_B(x)||`` (logits, float64)."""
    worst = 0.0
    with torch.no_grad():
        for x, _ in batches:
            yb = lmc._logits(functional_call(model, state_b, (x,))).double()
            y = lmc._logits(functional_call(model, state, (x,))).double()
            worst = max(worst, float((y - yb).norm() / yb.norm().clamp_min(1e-30)))
    return worst


def run_scope(root: Path, scope: str, thresholds: list[float], points: int | None) -> list[dict]:
    run = load_run_pair(root, scope)
    a, batches, task = run.a, run.batches, run.task
    if a.cfg.pe != "rope":
        sys.exit(f"{root.name} is not a RoPE model (pe={a.cfg.pe!r})")
    pts = points or run.cfg.protocol.points
    sa, sb = lmc.full_state(a), lmc.full_state(run.b)
    T = context_length(a, batches)
    planes = rope_planes(reference_frequencies(a.cfg.attention_config()), T)
    naive = lmc.curve(a, sa, sb, lambda: batches, task, pts)
    exact = match_attention(run.spec, sa, sb, stage1=True, stage2="full")
    bp = exact.apply(sb)
    recorded = json.loads((root / scope / "results.json").read_text())["variants"]["full"]
    rows = []
    for tau in thresholds:
        slow = [p["plane"] for p in planes if p["angle"] < tau]
        m = align_slow_planes(run.spec, sa, bp, slow)
        b2 = m.apply(bp)
        c = lmc.curve(a, sa, b2, lambda: batches, task, pts)
        row = {"experiment": root.name, "scope": scope, "seeds": f"{run.seeds[0]}-{run.seeds[1]}",
               "threshold": tau, "planes": ", ".join(str(j) for j in slow) or "-",
               "angles": ", ".join(f"{planes[j]['angle']:.3g}" for j in slow) or "-",
               "group": "exact (H)" if m.exact else f"GL({2 * len(slow)}) on them",
               "distance_before": m.distance_before, "distance_after": m.distance_after,
               "function_change": function_change(a, b2, sb, batches),
               "loss_b": naive.loss[-1], "loss_b2": c.loss[-1], "acc_b": naive.acc[-1], "acc_b2": c.acc[-1],
               "naive": naive.loss_barrier, "barrier": c.loss_barrier,
               "ratio": lmc.barrier_ratio(c.loss_barrier, naive.loss_barrier), "condition": m.condition}
        if m.exact:
            row["matches_results_json"] = abs(c.loss_barrier - recorded["curve"]["loss_barrier"]) <= 1e-9
        rows.append(row)
        print(f"{root.name} {scope} tau={tau}: planes {row['planes']}  change {row['function_change']:.2e}  "
              f"barrier {c.loss_barrier:.4f} ({row['ratio']:.1f} %)", file=sys.stderr)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("experiments", nargs="+")
    ap.add_argument("--runs", action="append", required=True, help="a runs directory (repeat: one per seed pair)")
    ap.add_argument("--scopes", default="first-attention,all-attention")
    ap.add_argument("--thresholds", default="0,0.1,0.5,2", help="plane-angle thresholds in radians (0: exact group)")
    ap.add_argument("--points", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--command", default=None, help="the full pipeline to record (default: this command)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    thresholds = [float(x) for x in args.thresholds.split(",")]
    rows = []
    for runs in args.runs:
        for exp in args.experiments:
            for scope in args.scopes.split(","):
                if (Path(runs) / exp / scope / "results.json").exists():
                    rows.extend(run_scope(Path(runs) / exp, scope, thresholds, args.points))
    if not rows:
        sys.exit("no finished scope found under --runs")
    cols = [("experiment", "experiment"), ("scope", "scope"), ("seeds", "seeds"),
            ("threshold", "threshold (rad)", "g"), ("planes", "planes relaxed"), ("angles", "their angles (rad)"),
            ("group", "Q-K group"), ("distance_before", "Q-K distance on them, B'", ".3g"),
            ("distance_after", "after", ".3g"), ("function_change", "function change", ".2e"),
            ("loss_b2", "loss of B''", ".4f"), ("acc_b2", "acc of B''", ".3f"),
            ("barrier", "loss barrier", ".4f"), ("ratio", "% of naive", ".1f")]
    pairs = len({(r["experiment"], r["seeds"]) for r in rows})
    command = args.command or shlex.join(["python", "benchmarks/rope_slow_planes.py", *sys.argv[1:]])
    from symalign.provenance import provenance

    write_json(args.out, {"provenance": provenance(command, args.threads, pairs),
                          "tables": {"slow_planes": make_table(rows, cols)}, "rows": rows})


if __name__ == "__main__":
    main()
