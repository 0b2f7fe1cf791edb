r"""What the residual stream's symmetry adds to whole-model weight matching, per stage-2 variant, over seed pairs.

For every experiment and every pair (a ``--runs`` directory per pair holding ``RUNS/EXPERIMENT/full/seed{A,B}``,
written by ``symalign experiment --scope full``), B is aligned to A by data-free whole-model weight matching
(:func:`symalign.match.whole.match_whole`, the protocol's settings) over the rewritten models
(:func:`symalign.experiments.protocol.alignment_models`), twice per stage-2 variant:

* **before**: every space but the residual stream (FF units, heads, Q-K and V-O: ``spec.restrict``);
* **after**: the whole spec, the residual stream included (``O(D)``; under a sinusoidal table the rotations that
  fix it, ``O(k)``: docs/whole-model.md section 1a).

Variants: stage 2 ``none`` / ``orthogonal`` / ``full`` with stage 1, and ``full`` without stage 1. Each cell is the
test loss barrier of the aligned pair as a percentage of the vanilla barrier, both measured in the rewritten
coordinates on the same test batches (the protocol's ``naive`` curve of the pair's ``full/results.json``):
``100 * B(A, B') / B(A, B)``. Every B' is checked to compute B's function. Writes a result file (atomically) that
``symalign docs`` renders: per-pair rows and the mean +- sample std per experiment::

    python benchmarks/residual_ablation.py vit-fmnist-sinusoidal-deep vit-fmnist-rope-deep \
        --runs runs/fd/p1-2 --runs runs/fd/p3-4 --runs runs/fd/p5-6 --out results/residual-ablation.json
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

from symalign import lmc  # noqa: E402
from symalign.atomic import write_json  # noqa: E402
from symalign.checkpoint import load_model  # noqa: E402
from symalign.data import eval_batches, load_dataset  # noqa: E402
from symalign.experiments.config import parse_config  # noqa: E402
from symalign.experiments.docs_tables import make_table  # noqa: E402
from symalign.experiments.metrics import relative_output_change  # noqa: E402
from symalign.experiments.protocol import alignment_models  # noqa: E402
from symalign.match.whole import PROTOCOL_SETTINGS, match_whole, model_states  # noqa: E402
from symalign.provenance import provenance  # noqa: E402
from symalign.tolerance import function_tolerance  # noqa: E402

VARIANTS = (("none", True, "none"), ("orthogonal", True, "orthogonal"), ("full", True, "full"),
            ("full, no stage 1", False, "full"))


def measure(root: Path, experiment: str) -> list[dict]:
    """One pair: a row per variant with the barrier ratio before and after the residual space."""
    cfg = parse_config(json.loads((root / experiment / "config.json").read_text()))
    full = root / experiment / "full"
    seeds = sorted(p.name for p in full.glob("seed*"))
    a, _ = load_model(full / seeds[0])
    b, _ = load_model(full / seeds[1])
    arch_a, arch_b, _ = alignment_models(a.eval(), b.eval(), "full")
    ds = load_dataset(cfg.data, **cfg.data_options)
    test = list(eval_batches(ds, "test", 256, int(cfg.train.get("context", 128)), cfg.protocol.eval_items))
    naive = json.loads((full / "results.json").read_text())["naive"]["loss_barrier"]
    spec, ra, rb = model_states(arch_a, arch_b)
    spec_b = arch_b.symmetry_spec()
    fa, fb = lmc.full_state(arch_a), lmc.full_state(arch_b)
    tol = function_tolerance(next(iter(fb.values())).dtype)
    x0 = test[0][0]
    residual = [n for n in spec.spaces if spec.role(n) == "residual"]
    rest = [n for n in spec.spaces if n not in residual]
    rows = []
    for label, stage1, stage2 in VARIANTS:
        row = {"experiment": experiment, "seeds": "-".join(s.removeprefix("seed") for s in seeds),
               "variant": label, "vanilla": naive, "residual_group": ", ".join(spec.spaces[n].describe()
                                                                                for n in residual) or "none"}
        for key, keep in (("before", rest), ("after", list(spec.spaces))):
            t0 = time.perf_counter()
            m = match_whole(spec.restrict(keep), ra, rb, stage1=stage1, stage2=stage2, max_sweeps=10,
                            spec_b=spec_b.restrict(keep), **PROTOCOL_SETTINGS)
            fb2 = {**fb, **m.apply(fb)}
            change = relative_output_change(arch_a, fb2, fb, x0, arch_b)
            if not change <= tol:
                raise SystemExit(f"{experiment} {row['seeds']} {label} {key}: B' changed B's function ({change:.2e})")
            barrier = lmc.curve(arch_a, fa, fb2, lambda: test, ds.task, cfg.protocol.points).loss_barrier
            row[key] = barrier
            row[f"{key}_pct"] = lmc.barrier_ratio(barrier, naive)
            row[f"{key}_change"] = change
            row[f"{key}_s"] = time.perf_counter() - t0
        print(f"{time.strftime('%H:%M:%S')} {row}", file=sys.stderr, flush=True)
        rows.append(row)
    return rows


def summarise(rows: list[dict]) -> list[dict]:
    """Per experiment and variant: mean +- sample std of the two ratios over the pairs."""
    out = []
    for exp in dict.fromkeys(r["experiment"] for r in rows):
        for label, _, _ in VARIANTS:
            sel = [r for r in rows if r["experiment"] == exp and r["variant"] == label]
            s = {"experiment": exp, "variant": label, "pairs": len(sel), "residual_group": sel[0]["residual_group"]}
            for key in ("before", "after"):
                xs = [r[f"{key}_pct"] for r in sel]
                s[f"{key}_mean"], s[f"{key}_std"] = statistics.mean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0
                s[f"{key}_cell"] = f"{s[f'{key}_mean']:.1f} ± {s[f'{key}_std']:.1f} %"
            s["lower_after"] = f"{sum(r['after_pct'] < r['before_pct'] for r in sel)} of {len(sel)}"
            out.append(s)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("experiments", nargs="+", help="experiment names (e.g. vit-fmnist-sinusoidal-deep)")
    ap.add_argument("--runs", action="append", required=True, type=Path, help="a runs directory per seed pair")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, required=True, help="result file (JSON, written atomically)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for exp in args.experiments:
        for runs in args.runs:
            rows += measure(runs, exp)
    summary = summarise(rows)
    pairs = min(s["pairs"] for s in summary)
    res = {
        "provenance": provenance("python benchmarks/residual_ablation.py " + shlex.join(sys.argv[1:]),
                                 threads=args.threads, seed_pairs=pairs),
        "pairs": pairs, "coordinates": "rewritten (vanilla and aligned)", "summary": summary, "rows": rows,
        "tables": {
            "summary": make_table(summary, [("experiment", "experiment"), ("variant", "stage 2"),
                                            ("pairs", "pairs"), ("residual_group", "residual group"),
                                            ("before_cell", "before: FF + attention (% of vanilla)"),
                                            ("after_cell", "after: + residual stream"),
                                            ("lower_after", "pairs lower after")]),
            "pairs": make_table(rows, [("experiment", "experiment"), ("seeds", "seeds"), ("variant", "stage 2"),
                                       ("vanilla", "vanilla (nats)", ".3f"), ("before_pct", "before %", ".1f"),
                                       ("after_pct", "after %", ".1f")]),
        },
    }
    write_json(args.out, res)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
