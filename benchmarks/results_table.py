"""The protocol's barrier table for finished runs, as a result file that ``symalign docs`` renders.

Reads ``RUNS/EXPERIMENT/SCOPE/results.json`` (written by ``symalign experiment CONFIG --out RUNS``)
for every experiment and scope given and writes one row per (experiment, scope, seed pair): the
endpoints' accuracies (and test losses with ``--loss``), the naive loss barrier, the ratio of every
stage-2 variant (stage 1 off: ``full-no-stage1``), the aligned (``full``) loss barrier and the
largest function change of an aligned B'. Writes a result file (JSON, atomically) with the
provenance of the whole pipeline::

    symalign experiment configs/vit-digits-rope.toml --threads 1 --out runs/r
    symalign experiment configs/vit-digits-sinusoidal.toml --threads 1 --out runs/r
    python benchmarks/results_table.py --runs runs/r vit-digits-rope vit-digits-sinusoidal \\
        --command "..." --out results/vit-digits.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path

from symalign.atomic import write_json
from symalign.experiments.docs_tables import make_table
from symalign.provenance import provenance

SCOPES = ("first-attention", "all-attention", "first-block", "full")
# Seed 000's stage-2 ablation (6-layer, 4-head ViT / BERT, first layer replaced): the loss-barrier ratio of each
# variant, in % of the naive barrier. What the paper measured, not a threshold of this project.
PAPER = {"setting": "seed 000: 6-layer 4-head ViT/BERT on CIFAR-10/100, IMDB, DBPedia, first layer replaced",
         "none": "60-90 %", "orthogonal": "10-16 %", "full": "7-12 %"}
VARIANTS = ("none", "orthogonal", "full", "learned")


def row(res: dict) -> dict:
    v = res["variants"]
    out = {"experiment": res.get("experiment"), "scope": res["scope"],
           "seeds": "-".join(str(s) for s in res.get("seeds", [])),
           "loss": f"{res['endpoints']['A']['loss']:.3f} / {res['endpoints']['B']['loss']:.3f}",
           "acc": f"{res['endpoints']['A']['acc']:.3f} / {res['endpoints']['B']['acc']:.3f}",
           "naive": res["naive"]["loss_barrier"], "naive_acc": res["naive"]["acc_barrier"],
           "function_change": max(x["function_change"] for x in v.values())}
    if "naive_original_coordinates" in res:
        out["naive_original"] = res["naive_original_coordinates"]["loss_barrier"]
    for key, x in v.items():
        out[key] = x["loss_barrier_ratio_percent"]
    if "full" in v:
        out["aligned"] = v["full"]["curve"]["loss_barrier"]
        out["aligned_acc"] = v["full"]["curve"]["acc_barrier"]
    ranks = [str(r.get("rank", "-")) for r in res.get("stage1", [])]
    out["stage1_rank_cost"] = ", ".join(ranks)
    return out


def pair_rows(rows: list[dict]) -> list[dict]:
    """One row per (experiment, scope) over its seed pairs: each variant's ratio per pair, its mean and sample std.

    ``mean = sum(r_i) / n``, ``std = sqrt(sum((r_i - mean)^2) / (n - 1))`` (``None`` for one pair); ``r_i`` is the
    loss-barrier ratio of pair ``i`` in % of that pair's naive barrier (the protocol's ``loss_barrier_ratio_percent``).
    """
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["experiment"], r["scope"]), []).append(r)
    out = []
    for (exp, scope), rs in groups.items():
        agg = {"experiment": exp, "scope": scope, "pairs": len(rs), "seeds": ", ".join(r["seeds"] for r in rs),
               "naive": statistics.fmean(r["naive"] for r in rs)}
        for v in VARIANTS:
            vals = [r[v] for r in rs if v in r]
            if not vals:
                continue
            agg[f"{v}_per_pair"] = ", ".join(f"{x:.1f}" for x in vals)
            agg[f"{v}_mean"] = statistics.fmean(vals)
            agg[f"{v}_std"] = statistics.stdev(vals) if len(vals) > 1 else None
            agg[f"{v}_pm"] = f"{agg[f'{v}_mean']:.1f} ± {agg[f'{v}_std']:.1f}" if len(vals) > 1 else f"{vals[0]:.1f}"
            agg[f"{v}_paper"] = PAPER.get(v, "-")
        out.append(agg)
    return out


PAIR_COLUMNS = [("experiment", "experiment"), ("scope", "scope"), ("pairs", "pairs"), ("seeds", "seed pairs"),
                ("naive", "mean naive loss barrier", ".3f"), ("none_pm", "none % (mean ± std)"),
                ("orthogonal_pm", "orthogonal % (mean ± std)"), ("full_per_pair", "full % per pair"),
                ("full_pm", "**full % (mean ± std)**"), ("full_paper", "paper's full %"),
                ("learned_per_pair", "learned % per pair"), ("learned_pm", "**learned % (mean ± std)**")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("experiments", nargs="+")
    ap.add_argument("--runs", action="append", required=True, help="a runs directory (repeat: one per seed pair)")
    ap.add_argument("--scopes", default=",".join(SCOPES))
    ap.add_argument("--threads", type=int, default=1, help="the thread count the runs used (recorded)")
    ap.add_argument("--table", default="barriers")
    ap.add_argument("--loss", action="store_true",
                    help="add the endpoints' test loss (A / B; nats per token for the language models)")
    ap.add_argument("--command", default=None, help="the full pipeline to record (default: this command)")
    ap.add_argument("--pairs-table", default=None, metavar="NAME",
                    help="also write table NAME: one row per experiment and scope, each variant's ratio per seed "
                         "pair with its mean and std, beside the paper's (a --runs directory per pair)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    rows = []
    for exp in args.experiments:
        for scope in args.scopes.split(","):
            for runs in args.runs:
                path = Path(runs) / exp / scope / "results.json"
                if path.exists():
                    rows.append(row(json.loads(path.read_text())))
    if not rows:
        ap.error(f"no RUNS/EXPERIMENT/SCOPE/results.json under {', '.join(args.runs)} for these experiments and scopes")
    cols = [("experiment", "experiment"), ("scope", "scope"), ("seeds", "seeds"), ("acc", "acc A / B"),
            ("naive", "naive loss barrier", ".3f"), ("naive_acc", "naive acc barrier", ".3f"),
            ("none", "none %", ".1f"), ("orthogonal", "orthogonal %", ".1f"), ("full", "full %", ".1f"),
            ("full-no-stage1", "full-no-stage1 %", ".1f"), ("learned", "learned %", ".1f"),
            ("aligned", "aligned loss barrier", ".4f"),
            ("aligned_acc", "aligned acc barrier", ".4f"), ("stage1_rank_cost", "stage-1 rank by cost")]
    if any("naive_original" in r for r in rows):
        cols.insert(5, ("naive_original", "naive (original coordinates)", ".3f"))
    if args.loss:
        cols.insert(3, ("loss", "test loss A / B"))
    cols = [c for c in cols if any(c[0] in r for r in rows)]  # e.g. no full-no-stage1 without stage1_ablation
    pairs = max((len({r["seeds"] for r in rows if r["experiment"] == e}) for e in args.experiments), default=0)
    command = args.command or shlex.join(["python", "benchmarks/results_table.py", *sys.argv[1:]])
    tables = {args.table: make_table(rows, cols)}
    result = {"provenance": provenance(command, args.threads, pairs), "tables": tables,
              "max_function_change": max((r["function_change"] for r in rows), default=None)}
    if args.pairs_table:
        agg = pair_rows(rows)
        tables[args.pairs_table] = make_table(agg, [c for c in PAIR_COLUMNS if any(c[0] in r for r in agg)])
        result["pairs"] = min(r["pairs"] for r in agg)
        result["paper"] = PAPER
        result["summary"] = {f"{r['experiment']}/{r['scope']}": {k: r[k] for k in r if k.endswith(("_mean", "_std"))}
                             | {"pairs": r["pairs"]} for r in agg}
    write_json(args.out, result)
    for r in rows:
        print(r)


if __name__ == "__main__":
    main()
