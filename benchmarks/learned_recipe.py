r"""Learned matching's recipe, one change at a time, over seed pairs: why the default recipe is what it is.

For every experiment and every pair (a ``--runs`` directory per pair holding ``RUNS/EXPERIMENT/full/seed{A,B}``,
written by ``symalign experiment --scope full``), B is aligned to A in the rewritten coordinates
(:func:`symalign.experiments.protocol.alignment_models`) by learned matching
(:func:`symalign.match.learned.learn_matching`, started from whole-model weight matching, selected on the
validation split) with each recipe of :data:`RECIPES`:

* ``seed002``: seed 002's recipe -- 40 training batches of 128, cycled; 200 Adam steps at a constant ``1e-2``;
  ``lambda ~ U(0.4, 0.6)``;
* ``stream``: a fresh training batch every step (:class:`~symalign.experiments.methods.TrainStream`), ``--steps``
  steps, constant rate, ``U(0.4, 0.6)``;
* ``stream+cosine``: the same with the rate decayed by ``(1 + cos(pi s / steps)) / 2``;
* ``default``: the same with ``lambda ~ U(0.2, 0.8)``: the library's default recipe at ``--steps`` steps;
* ``default, U(0, 1)``: the same with ``lambda ~ U(0, 1)``.

Each cell is the test loss barrier of the aligned pair as a percentage of the vanilla barrier, both measured in the
rewritten coordinates on the same test batches (the protocol's ``naive`` curve of the pair's ``full/results.json``):
``100 * B(A, B') / B(A, B)``; every B' is checked to compute B's function. The result file is rewritten after every
pair (``--out``, atomically) and a rerun keeps the pairs it already holds, so a stopped run resumes::

    python benchmarks/learned_recipe.py vit-fmnist-sinusoidal-deep --runs runs/fd/p1-2 --runs runs/fd/p3-4 \
        --runs runs/fd/p5-6 --steps 1000 --out results/learned-recipe.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from symalign.atomic import write_json  # noqa: E402
from symalign.checkpoint import load_model  # noqa: E402
from symalign.data import eval_batches, load_dataset  # noqa: E402
from symalign.experiments.config import parse_config  # noqa: E402
from symalign.experiments.docs_tables import make_table  # noqa: E402
from symalign.experiments.methods import TrainStream, align_methods, train_stream  # noqa: E402
from symalign.experiments.protocol import alignment_models  # noqa: E402
from symalign.provenance import provenance  # noqa: E402

#: name -> (cycled batches or None for a stream, steps or None for --steps, schedule, lambda range)
RECIPES: dict[str, tuple[int | None, int | None, str, tuple[float, float]]] = {
    "seed002": (40, 200, "constant", (0.4, 0.6)),
    "stream": (None, None, "constant", (0.4, 0.6)),
    "stream+cosine": (None, None, "cosine", (0.4, 0.6)),
    "default": (None, None, "cosine", (0.2, 0.8)),
    "default, U(0, 1)": (None, None, "cosine", (0.0, 1.0)),
}
BATCH, STREAM_SEED, LR = 128, 12345, 1e-2


def measure(root: Path, experiment: str, steps: int, progress) -> dict:
    """One pair: the vanilla barrier and, per recipe, the aligned barrier, its percentage and seconds."""
    cfg = parse_config(json.loads((root / experiment / "config.json").read_text()))
    full = root / experiment / "full"
    seeds = sorted(p.name for p in full.glob("seed*"))
    a, _ = load_model(full / seeds[0])
    b, _ = load_model(full / seeds[1])
    arch_a, arch_b, _ = alignment_models(a.eval(), b.eval(), "full")
    ds = load_dataset(cfg.data, **cfg.data_options)
    context = int(cfg.train.get("context", 128))
    test = list(eval_batches(ds, "test", 256, context, cfg.protocol.eval_items))
    val = list(eval_batches(ds, "val", 256, context, cfg.protocol.eval_items))
    naive = json.loads((full / "results.json").read_text())["naive"]
    row: dict = {"experiment": experiment, "seeds": "-".join(s.removeprefix("seed") for s in seeds),
                 "vanilla": naive["loss_barrier"]}
    for name, (cycled, n_steps, schedule, lam) in RECIPES.items():
        data = train_stream(ds, cycled, BATCH, STREAM_SEED, context) if cycled else \
            TrainStream(ds, BATCH, STREAM_SEED, context)
        e = align_methods(arch_a, arch_b, test, ds.task, methods=["learned"], points=cfg.protocol.points,
                          learned_steps=n_steps or steps, learned_lr=LR, seed=0, train_batches=data,
                          val_batches=val, naive=naive,
                          learned_options={"schedule": schedule, "lam": lam})["learned"]
        row[name] = e["loss_barrier"]
        row[f"{name}_pct"] = e["loss_barrier_ratio_percent"]
        row[f"{name}_s"] = e["seconds"]
        row[f"{name}_change"] = e["function_change"]
        progress(f"{experiment} {row['seeds']} {name}: {e['loss_barrier']:.4f} "
                 f"({e['loss_barrier_ratio_percent']:.1f} %, {e['seconds']:.0f} s)")
    return row


def summarise(rows: list[dict]) -> list[dict]:
    """Per experiment and recipe: mean +- sample std of the percentage and the barrier over the pairs."""
    out = []
    for exp in dict.fromkeys(r["experiment"] for r in rows):
        sel = [r for r in rows if r["experiment"] == exp]
        best = {id(r): min(RECIPES, key=lambda n: r[f"{n}_pct"]) for r in sel}
        for name, (cycled, n_steps, schedule, lam) in RECIPES.items():
            pct = [r[f"{name}_pct"] for r in sel]
            nats = [r[name] for r in sel]
            sd = statistics.stdev(pct) if len(pct) > 1 else 0.0
            out.append({"experiment": exp, "recipe": name, "pairs": len(sel),
                        "batches": f"{cycled} cycled" if cycled else "fresh each step",
                        "schedule": schedule, "lam": f"U({lam[0]:g}, {lam[1]:g})",
                        "pct_cell": f"{statistics.mean(pct):.1f} ± {sd:.1f} %",
                        "nats_mean": statistics.mean(nats), "pct_mean": statistics.mean(pct), "pct_std": sd,
                        "best_on": f"{sum(best[id(r)] == name for r in sel)} of {len(sel)}"})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("experiments", nargs="+", help="experiment names (e.g. vit-fmnist-sinusoidal-deep)")
    ap.add_argument("--runs", action="append", required=True, type=Path, help="a runs directory per seed pair")
    ap.add_argument("--steps", type=int, default=1000, help="learned-matching steps of every recipe but seed002's")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, required=True, help="result file (JSON, written atomically; resumed)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    old = json.loads(args.out.read_text()) if args.out.exists() else {}
    if old and old.get("steps") != args.steps:
        raise SystemExit(f"{args.out} was measured with --steps {old.get('steps')}; pass that or another --out")
    done = {(r["experiment"], r["seeds"]): r for r in old.get("rows", [])}
    rows: list[dict] = []
    t0 = time.time()

    def say(msg: str) -> None:
        print(f"{time.time() - t0:7.1f} s  {msg}", flush=True)

    command = shlex.join(["python", "benchmarks/learned_recipe.py", *sys.argv[1:]])
    for exp in args.experiments:
        for runs in args.runs:
            seeds = sorted(p.name for p in (runs / exp / "full").glob("seed*"))
            key = (exp, "-".join(s.removeprefix("seed") for s in seeds))
            rows.append(done.get(key) or measure(runs, exp, args.steps, say))
            summary = summarise(rows)
            pairs = min(s["pairs"] for s in summary)
            write_json(args.out, {
                "provenance": provenance(command, threads=args.threads, seed_pairs=pairs), "pairs": pairs,
                "steps": args.steps, "batch_size": BATCH, "stream_seed": STREAM_SEED, "lr": LR,
                "coordinates": "rewritten (vanilla and aligned)", "summary": summary, "rows": rows,
                "tables": {
                    "summary": make_table(summary, [
                        ("experiment", "experiment"), ("recipe", "recipe"), ("pairs", "pairs"),
                        ("batches", "training batches"), ("schedule", "rate"), ("lam", "lambda"),
                        ("pct_cell", "test barrier (% of vanilla)"), ("nats_mean", "mean barrier (nats)", ".4f"),
                        ("best_on", "lowest on")]),
                    "pairs": make_table(rows, [("experiment", "experiment"), ("seeds", "seeds"),
                                               ("vanilla", "vanilla (nats)", ".3f")]
                                        + [(f"{n}_pct", f"{n} %", ".1f") for n in RECIPES])}})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
