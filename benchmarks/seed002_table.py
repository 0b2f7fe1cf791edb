r"""Seed 002's table on a finished ``full``-scope pair: weight, activation and learned matching.

Loads models A and B of ``RESULTS/EXPERIMENT/full/seed{1,2}`` (written by ``symalign experiment``),
rewrites them as the protocol does (:func:`symalign.experiments.protocol.alignment_models`), and
runs :func:`symalign.experiments.methods.align_methods` with the default learned-matching recipe
(a fresh training batch per step from a :class:`TrainStream`, cosine decay, selection on the
validation split); every curve is on the same test batches as the protocol's (``eval_items``
of the config). Prints the table and writes it as JSON (atomically).

This is the computation behind ``protocol.methods`` (``seed002_methods``) with the training-stream
seed exposed; ``docs/results.md``'s seed 002 table used ``--stream-seed 12345``::

    .venv/bin/python benchmarks/seed002_table.py vit-fmnist-sinusoidal --steps 6000 \
        --out runs/seed002/vit-fmnist-sinusoidal.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from symalign.atomic import write_json  # noqa: E402
from symalign.checkpoint import load_model  # noqa: E402
from symalign.data import eval_batches, load_dataset  # noqa: E402
from symalign.experiments.config import parse_config  # noqa: E402
from symalign.experiments.methods import TrainStream, align_methods  # noqa: E402
from symalign.experiments.protocol import alignment_models  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("experiment", help="experiment name under --results (e.g. vit-fmnist-rope)")
    ap.add_argument("--results", default="runs/results", help="the protocol's output directory")
    ap.add_argument("--steps", type=int, default=6000, help="learned-matching steps")
    ap.add_argument("--batch-size", type=int, default=128, help="training-stream batch size")
    ap.add_argument("--stream-seed", type=int, default=12345, help="seed of the training-batch stream")
    ap.add_argument("--methods", default="weight,activation,learned")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, required=True, help="JSON output (written atomically)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    root = Path(args.results) / args.experiment
    cfg = parse_config(json.loads((root / "config.json").read_text()))
    a, _ = load_model(root / "full" / "seed1")
    b, _ = load_model(root / "full" / "seed2")
    arch_a, arch_b, notes = alignment_models(a.eval(), b.eval(), "full")
    ds = load_dataset(cfg.data, **cfg.data_options)
    context = int(cfg.train.get("context", 128))
    test = list(eval_batches(ds, "test", 256, context, cfg.protocol.eval_items))
    val = list(eval_batches(ds, "val", 256, context, cfg.protocol.eval_items))
    naive = json.loads((root / "full" / "results.json").read_text())["naive"]
    t0 = time.time()
    res = align_methods(arch_a, arch_b, test, ds.task, methods=args.methods.split(","), points=cfg.protocol.points,
                        learned_steps=args.steps, seed=0, train_batches=TrainStream(ds, args.batch_size,
                                                                                    args.stream_seed, context),
                        val_batches=val, naive=naive, activation_batches=40,
                        progress=lambda s: print(f"{time.time() - t0:7.1f} s  {s}", flush=True))
    out = {"experiment": args.experiment, "notes": notes, "naive_loss_barrier": naive["loss_barrier"],
           "naive_acc_barrier": naive["acc_barrier"], "steps": args.steps, "stream_seed": args.stream_seed,
           "methods": {}}
    for m, e in res.items():
        entry = {k: v for k, v in e.items() if k != "state"}
        entry["match"] = {k: v for k, v in entry["match"].items() if k != "losses"}
        out["methods"][m] = entry
    write_json(args.out, out)
    print(f"{'method':<12}{'loss barrier':>14}{'% of naive':>12}{'acc barrier':>13}{'seconds':>10}")
    print(f"{'vanilla':<12}{naive['loss_barrier']:>14.4f}{100.0:>12.1f}{naive['acc_barrier']:>13.4f}")
    for m, e in out["methods"].items():
        print(f"{m:<12}{e['loss_barrier']:>14.4f}{e['loss_barrier_ratio_percent']:>12.1f}"
              f"{e['acc_barrier']:>13.4f}{e['seconds']:>10.1f}")


if __name__ == "__main__":
    main()
