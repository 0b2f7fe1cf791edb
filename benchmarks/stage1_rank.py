r"""Stage 1 the paper's way: rank the chosen head permutation among all h! by the loss barrier after stage 2.

For every finished scope of the protocol's runs (``symalign experiment CONFIG --out RUNS``), loads
models A and B of ``RUNS/EXPERIMENT/SCOPE/seed{a,b}``, and for each attention layer of the scope
runs :func:`symalign.experiments.stage1_rank.rank_heads_by_barrier` (every permutation of the
layer's heads, full stage 2 for that layer, the 25-point curve on the experiment's evaluation
split -- the test split by default -- with every other layer aligned by the matcher's choice).
Writes a result file (JSON, atomically) with the provenance, the per-permutation barriers and
the ``rank`` table that ``docs/results.md`` shows (``symalign docs``)::

    symalign experiment configs/vit-digits-rope.toml --threads 1 --out runs/p12
    symalign experiment configs/vit-digits-sinusoidal.toml --threads 1 --out runs/p12
    python benchmarks/stage1_rank.py --runs runs/p12 vit-digits-rope vit-digits-sinusoidal \
        --out results/stage1_rank.json

Several ``--runs`` directories (one per seed pair) go into one file.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from symalign.atomic import write_json  # noqa: E402
from symalign.experiments.run_pair import load_run_pair  # noqa: E402
from symalign.experiments.docs_tables import make_table  # noqa: E402
from symalign.experiments.stage1_rank import rank_heads_by_barrier  # noqa: E402
from symalign.lmc import full_state  # noqa: E402
from symalign.provenance import provenance  # noqa: E402

COLUMNS = [("experiment", "experiment"), ("scope", "scope"), ("seeds", "seeds"), ("layer", "layer"),
           ("rank", "rank of 24"), ("chosen_barrier", "chosen barrier", ".4f"), ("best_barrier", "best barrier", ".4f"),
           ("identity_barrier", "identity barrier", ".4f"), ("naive_barrier", "naive barrier", ".4f"),
           ("lhat", "L-hat (%)", ".1f"), ("distance_barrier_correlation", "corr(distance, barrier)", ".2f"),
           ("cost_barrier_correlation", "corr(stage-1 cost, barrier)", ".2f"),
           ("least_distance", "chosen = least distance")]


def rank_scope(root: Path, scope: str, points: int | None = None) -> list[dict]:
    run = load_run_pair(root, scope)
    cfg, seeds, split, a = run.cfg, run.seeds, run.split, run.a
    t0 = time.perf_counter()
    ranks = rank_heads_by_barrier(a, run.spec, full_state(a), full_state(run.b), run.batches, run.task,
                                  points or cfg.protocol.points, "full",
                                  progress=lambda s: print(f"  {root.name} {scope} {s}", file=sys.stderr, end="\r"))
    print(file=sys.stderr)
    out = []
    for r in ranks:
        d = r.to_dict()
        d.update(experiment=root.name, scope=scope, seeds=f"{seeds[0]},{seeds[1]}", eval_split=split,
                 layer=int(r.layer) if r.layer.isdigit() else r.layer, seconds=time.perf_counter() - t0)
        out.append(d)
    return out


def kept_without_runs(rows: list[dict], old: list[dict], experiments: list[str], scopes: list[str]) -> list[dict]:
    """``rows`` plus the ``--reuse`` rows of the requested experiments and scopes that no ``--runs`` folder holds
    (pairs whose run folders are gone keep their measured rows), ordered by experiment as requested."""
    have = {(r["experiment"], r["scope"], r["seeds"]) for r in rows}
    extra = [r for r in old if r["experiment"] in experiments and r["scope"] in scopes
             and (r["experiment"], r["scope"], r["seeds"]) not in have]
    return sorted(rows + extra, key=lambda r: experiments.index(r["experiment"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("experiments", nargs="+", help="experiment names under each --runs (e.g. vit-digits-rope)")
    ap.add_argument("--runs", action="append", required=True, help="a runs directory (repeat: one per seed pair)")
    ap.add_argument("--scopes", default="first-attention,all-attention")
    ap.add_argument("--points", type=int, default=None, help="curve points (default: the config's)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--command", default=None, help="the full command to record (default: this one)")
    ap.add_argument("--reuse", type=Path, action="append", default=[],
                    help="an earlier result file of this script (repeatable): its scopes (same experiment, scope, "
                         "seeds) are kept instead of recomputed, and kept too where no --runs folder holds them")
    ap.add_argument("--out", type=Path, required=True, help="result file (JSON, written atomically)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    old = [lay for f in args.reuse if f.exists() for lay in json.loads(f.read_text())["layers"]]
    for runs in args.runs:
        for exp in args.experiments:
            for scope in args.scopes.split(","):
                if not (Path(runs) / exp / scope).is_dir():
                    print(f"skipping {runs}/{exp}/{scope}: not run", file=sys.stderr)
                    continue
                cfg = json.loads((Path(runs) / exp / "config.json").read_text())
                res = Path(runs) / exp / scope / "results.json"
                seeds = json.loads(res.read_text()).get("seeds") if res.exists() else None
                seeds = "{},{}".format(*(seeds or cfg["protocol"]["seeds"]))
                kept = [r for r in old if (r["experiment"], r["scope"], r["seeds"]) == (exp, scope, seeds)]
                rows += kept or rank_scope(Path(runs) / exp, scope, args.points)
    rows = kept_without_runs(rows, old, args.experiments, args.scopes.split(","))
    pairs = len({(r["experiment"], r["seeds"]) for r in rows})
    seed_pairs = max((sum(1 for e in {(r["experiment"], r["seeds"]) for r in rows} if e[0] == x)
                      for x in args.experiments), default=0)
    command = args.command or shlex.join(["python", "benchmarks/stage1_rank.py", *sys.argv[1:]])
    for r in rows:
        r["least_distance"] = "yes" if r["chosen_is_distance_minimum"] else "no"
    summary = [{k: r[k] for k, *_ in COLUMNS} for r in rows]
    write_json(args.out, {"provenance": provenance(command, args.threads, seed_pairs),
                          "tables": {"rank": make_table(summary, COLUMNS)},
                          "pairs_measured": pairs, "layers": rows})
    for r in summary:
        print(r)


if __name__ == "__main__":
    main()
