r"""Seed 002's table over seed pairs: vanilla, weight, activation, learned and permutation-only learned matching.

For every experiment and every pair (a ``--runs`` directory per pair, holding
``RUNS/EXPERIMENT/full/seed{A,B}`` written by ``symalign experiment``), loads models A and B,
rewrites them as the protocol does (:func:`symalign.experiments.protocol.alignment_models`) and
runs :func:`symalign.experiments.methods.align_methods`:

* ``weight``: data-free whole-model weight matching (:func:`symalign.match.whole.match_whole`);
* ``activation``: the inputs of 40 training batches (:func:`symalign.match.activations.match_activations`);
* ``learned``: learned matching over every space, started from weight matching (``--steps`` Adam steps,
  a fresh training batch per step from a :class:`TrainStream`, cosine decay, selection on the
  validation split);
* ``learned-perm``: the same recipe learning only the permutation spaces (heads, FF units); the
  continuous spaces keep their weight-matching values -- seed 002's "permutation-only" row.

**One set of coordinates throughout:** every barrier, the vanilla one included, is measured
between A and B in the rewritten coordinates the methods align in (the protocol's ``naive``
curve), on the same test batches (``protocol.eval_items``), so each ratio divides two barriers
of one kind: ``ratio = 100 * B(A, B') / B(A, B)``.

Writes a result file (atomically) that ``symalign docs`` renders: per-pair rows, and per
experiment the mean and sample standard deviation over pairs beside seed 002's numbers
(``paper``; its CIFAR-10 ViT and Tiny-Shakespeare GPT-2, not these models)::

    symalign experiment configs/vit-digits-rope.toml --threads 1 --seeds 1 --seeds 2 --out runs/p1-2   # per pair
    python benchmarks/seed002_table.py vit-digits-rope vit-digits-sinusoidal --runs runs/p1-2 --runs runs/p3-4 \
        --runs runs/p5-6 --steps 2000 --out results/seed002.json
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
from symalign.experiments.methods import TrainStream, align_methods  # noqa: E402
from symalign.experiments.protocol import alignment_models  # noqa: E402
from symalign.provenance import provenance  # noqa: E402

# Seed 002 (NeurIPS 2025), loss barriers in nats: what the paper measured on its models, not targets.
PAPER = {"vit_cifar10": {"vanilla": 1.69, "weight": 0.36, "learned": 0.00, "activation": 1.27},
         "gpt2_tiny_shakespeare": {"vanilla": 2.02, "weight": 0.34, "learned": 0.02, "activation": 1.43},
         "note": "seed 002's CIFAR-10 ViT and Tiny-Shakespeare GPT-2 (activation: its two activation-matching rows); "
                 "weight matching leaves 17-21 % of vanilla, learned matching 0.00-0.02 nats"}
ORDER = ("weight", "activation", "learned", "learned-perm")
DEFAULTS = {"steps": 6000, "batch_size": 128, "stream_seed": 12345}


def pair_seeds(root: Path, experiment: str) -> list[str]:
    """The pair's seed folders, A first: name order (``"seed10" < "seed9"``, so pair 9-10 is aligned 10 -> 9)."""
    return sorted(p.name for p in (root / experiment / "full").glob("seed*"))


def seeds_label(seeds: list[str]) -> str:
    return "-".join(s.removeprefix("seed") for s in seeds)


def measure(root: Path, experiment: str, steps: int, batch_size: int, stream_seed: int, methods: list[str]) -> dict:
    """One pair: ``{method: entry}`` plus the vanilla barrier, in the rewritten coordinates (see the docstring)."""
    cfg = parse_config(json.loads((root / experiment / "config.json").read_text()))
    full = root / experiment / "full"
    seeds = pair_seeds(root, experiment)
    a, _ = load_model(full / seeds[0])
    b, _ = load_model(full / seeds[1])
    arch_a, arch_b, _ = alignment_models(a.eval(), b.eval(), "full")
    ds = load_dataset(cfg.data, **cfg.data_options)
    context = int(cfg.train.get("context", 128))
    test = list(eval_batches(ds, "test", 256, context, cfg.protocol.eval_items))
    val = list(eval_batches(ds, "val", 256, context, cfg.protocol.eval_items))
    naive = json.loads((full / "results.json").read_text())["naive"]
    common = dict(points=cfg.protocol.points, learned_steps=steps, seed=0, val_batches=val, naive=naive,
                  activation_batches=40, train_batches=TrainStream(ds, batch_size, stream_seed, context))
    base = [m for m in methods if m != "learned-perm"]
    res = align_methods(arch_a, arch_b, test, ds.task, methods=base, **common) if base else {}
    if "learned-perm" in methods:
        spec = arch_a.symmetry_spec()
        perm = [n for n, g in spec.spaces.items() if g.is_permutation or g.permutes_heads]
        res["learned-perm"] = align_methods(arch_a, arch_b, test, ds.task, methods=["learned"],
                                            learned_options={"spaces": perm}, **common)["learned"]
    out = {"seeds": seeds_label(seeds), "vanilla": naive["loss_barrier"]}
    for m, e in res.items():
        out[m] = e["loss_barrier"]
        out[f"{m}_pct"] = e["loss_barrier_ratio_percent"]
        out[f"{m}_s"] = e["seconds"]
        out[f"{m}_change"] = e["function_change"]
    return out


def summarise(experiment: str, rows: list[dict]) -> dict:
    """Mean and sample std over pairs of each barrier and ratio (``std``: ``None`` for one pair)."""
    agg: dict = {"experiment": experiment, "pairs": len(rows), "seeds": ", ".join(r["seeds"] for r in rows)}
    for m in ("vanilla", *ORDER):
        for key in (m, f"{m}_pct"):
            vals = [r[key] for r in rows if key in r]
            if vals:
                agg[f"{key}_mean"] = statistics.fmean(vals)
                agg[f"{key}_std"] = statistics.stdev(vals) if len(vals) > 1 else None
        if m in rows[0]:
            mean, std = agg[f"{m}_mean"], agg[f"{m}_std"]
            cell = f"{mean:.3f} ± {std:.3f}" if std is not None else f"{mean:.3f}"
            if m != "vanilla":
                pm, ps = agg[f"{m}_pct_mean"], agg[f"{m}_pct_std"]
                cell += f" ({pm:.1f} ± {ps:.1f} %)" if ps is not None else f" ({pm:.1f} %)"
            agg[f"{m}_cell"] = cell
    return agg


def reusable(files: list[Path], recipe: dict, methods: list[str]) -> dict[tuple[str, str], dict]:
    """The pair rows of earlier result files, by ``(experiment, seeds)``; a file measured with another learned-matching
    recipe (``steps``, ``batch_size``, ``stream_seed``: files without the last two used the defaults) or other
    methods is refused, since its rows would not be this table's."""
    old: dict[tuple[str, str], dict] = {}
    for f in files:
        d = json.loads(f.read_text())
        have = [m for m in ORDER if any(m in r for r in d["rows"])]
        theirs = {k: d.get(k, DEFAULTS.get(k)) for k in recipe}
        if theirs != recipe or have != [m for m in ORDER if m in methods]:
            raise SystemExit(f"--reuse {f}: measured with {theirs} and methods {have}, not {recipe} and "
                             f"{methods}; rerun without --reuse")
        old.update({(r["experiment"], r["seeds"]): r for r in d["rows"]})
    return old


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("experiments", nargs="+", help="experiment names (e.g. vit-digits-rope)")
    ap.add_argument("--runs", action="append", required=True, type=Path, help="a runs directory per seed pair")
    ap.add_argument("--steps", type=int, default=DEFAULTS["steps"], help="learned-matching steps")
    ap.add_argument("--batch-size", type=int, default=DEFAULTS["batch_size"], help="training-stream batch size")
    ap.add_argument("--stream-seed", type=int, default=DEFAULTS["stream_seed"], help="training-batch stream seed")
    ap.add_argument("--methods", default=",".join(ORDER))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reuse", type=Path, action="append", default=[],
                    help="an earlier result file of this script with the same --steps, --batch-size, --stream-seed "
                         "and --methods (repeatable): its pairs (same experiment and seeds) are kept, not recomputed")
    ap.add_argument("--out", type=Path, required=True, help="result file (JSON, written atomically)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    methods = args.methods.split(",")
    recipe = {"steps": args.steps, "batch_size": args.batch_size, "stream_seed": args.stream_seed}
    old = reusable(args.reuse, recipe, methods)
    rows, summary = [], []
    t0 = time.time()
    for exp in args.experiments:
        mine = []
        for runs in args.runs:
            if not (runs / exp / "full" / "results.json").exists():
                print(f"skipping {runs}/{exp}: its full scope has not run", file=sys.stderr)
                continue
            key = (exp, seeds_label(pair_seeds(runs, exp)))
            r = old.get(key) or {"experiment": exp, **measure(runs, exp, args.steps, args.batch_size,
                                                                args.stream_seed, methods)}
            print(f"{time.time() - t0:7.1f} s  {'(reused) ' if key in old else ''}{r}", flush=True)
            mine.append(r)
        rows += mine
        summary.append(summarise(exp, mine))
    pair_cols = [("experiment", "experiment"), ("seeds", "seeds"), ("vanilla", "vanilla", ".3f")]
    pair_cols += [c for m in ORDER if m in methods for c in ((m, m, ".3f"), (f"{m}_pct", f"{m} %", ".1f"))]
    mean_cols = [("experiment", "experiment"), ("pairs", "pairs"), ("vanilla_cell", "vanilla")]
    mean_cols += [(f"{m}_cell", m + (" (% of vanilla)" if m == "weight" else "")) for m in ORDER if m in methods]
    command = shlex.join(["python", "benchmarks/seed002_table.py", *sys.argv[1:]])
    write_json(args.out, {"provenance": provenance(command, args.threads, min(s["pairs"] for s in summary)),
                          "pairs": min(s["pairs"] for s in summary), "paper": PAPER, **recipe,
                          "coordinates": "rewritten (every barrier, vanilla included)",
                          "reused_from": [json.loads(f.read_text())["provenance"] for f in args.reuse],
                          "summary": summary, "rows": rows,
                          "tables": {"pairs": make_table(rows, pair_cols), "means": make_table(summary, mean_cols)}})


if __name__ == "__main__":
    main()
