"""What one run of the paper grid costs (configs/paper/*.toml): FLOPs, and time on this machine.

For every config the model is built from its ``[model]`` section against a stand-in dataset
with the real dataset's shapes (vocabulary, text length, image size, classes), so the public
datasets need not be installed. Counted with ``torch.utils.flop_counter`` on the real model:

* one training example (forward + backward; the AdamW update is O(params) and ignored);
* one evaluation example (forward).

One run = one scope of one config (what ``configs/grids/paper.toml`` schedules):

* trainings: 3 for the scopes that re-initialise part of a base (the base, then seeds A and B),
  2 for ``full`` (A and B from scratch) -- counted as full training, an upper bound (frozen
  parameters skip their weight gradients);
* validation during training (``steps // eval_every`` passes over ``train.eval_items``) and the
  final test pass;
* curves: ``(1 + variants + stage-1 ablation) x points`` passes over ``protocol.eval_items``
  test examples (capped by the test split; LM: windows of ``context`` tokens).

Time here: a training step and an evaluation batch of ``--batch`` examples are timed
(median of ``--trials``) with ``--threads`` threads, giving this machine's FLOP rate for each,
and the run's FLOPs are divided by it. The GPU column divides by ``--gpu-tflops`` sustained
TFLOP/s: an assumption to replace by your own measurement (``config.json`` of every trained
checkpoint records ``tok_per_s`` / ``img_per_s`` / ``seq_per_s``). ``--no-time`` counts FLOPs only (no CPU
columns; about 4 minutes for the 24 configs at one thread, where timing them takes about 20).

``--out FILE`` writes a result file (JSON, atomically, with its provenance) whose ``cost`` table is
docs/paper-setting.md's "Cost per run" (``symalign docs`` renders it)::

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_paper_cost.py --threads 2 --json
    python benchmarks/bench_paper_cost.py --threads 1 --batch 1 --no-time --out benchmarks/results/paper_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
# Test-split sizes (examples) of the public datasets; LM test streams hold more windows than the configs ask.
TEST_SIZE = {"mnist": 10_000, "cifar10": 10_000, "cifar100": 10_000, "ag_news": 7_600, "imdb": 25_000,
             "dbpedia": 70_000}
IMAGE = {"mnist": (1, 28, 28, 10), "cifar10": (3, 32, 32, 10), "cifar100": (3, 32, 32, 100)}
CLASSES = {"ag_news": 4, "imdb": 2, "dbpedia": 14}


def stand_in(name: str):
    """A Dataset with the shapes of public dataset ``name`` (random contents, a few examples)."""
    from symalign.data.base import BYTE_VOCAB, Dataset
    from symalign.data.public import SPECS

    g = torch.Generator().manual_seed(0)
    spec = SPECS[name]
    if spec.modality == "lm":
        x = torch.randint(0, 256, (1 << 16,), generator=g, dtype=torch.uint8)
        return Dataset(name, "lm", x, None, x, None, x, None, vocab_size=BYTE_VOCAB, modality="lm")
    if spec.modality == "image":
        c, h, w, k = IMAGE[name]
        x, y = torch.rand(64, c, h, w, generator=g), torch.randint(0, k, (64,), generator=g)
        return Dataset(name, "classification", x, y, x, y, x, y, n_classes=k, input_shape=(c, h, w))
    seq = spec.seq_len[0]
    x, y = torch.randint(0, 256, (64, seq), generator=g), torch.randint(0, CLASSES[name], (64,), generator=g)
    return Dataset(name, "classification", x, y, x, y, x, y, n_classes=CLASSES[name], vocab_size=BYTE_VOCAB,
                   input_shape=(seq,), modality="text")


def flops(model, x, y, train: bool) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        if train:
            out = model(x)
            F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)).backward()
        else:
            with torch.no_grad():
                model(x)
    model.zero_grad(set_to_none=True)
    return float(counter.get_total_flops())


def timed(fn, trials: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(trials):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure(path: Path, batch: int, trials: int, gpu_tflops: float, timing: bool = True) -> dict:
    from symalign.data import train_batch
    from symalign.experiments.config import load_experiment_config
    from symalign.models import build_model
    from symalign.train import TrainConfig, fit_config

    cfg = load_experiment_config(path)
    tc = TrainConfig(**cfg.train)
    ds = stand_in(cfg.data)
    model = build_model(fit_config(cfg.model, ds, tc.context), seed=0)
    n_params = sum(p.numel() for p in model.parameters())
    x, y = train_batch(ds, 0, batch, 0, tc.context)
    per_train = flops(model, x, y, True) / batch
    per_eval = flops(model, x, y, False) / batch
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        out = model(x)
        F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def evaluate():
        with torch.no_grad():
            model(x)

    rate_train = rate_eval = None
    if timing:
        model.train()
        t_step = timed(step, trials)
        model.eval()
        t_eval = timed(evaluate, trials)
        rate_train, rate_eval = per_train * batch / t_step, per_eval * batch / t_eval

    p = cfg.protocol
    n_test = TEST_SIZE.get(cfg.data)
    curve_items = p.eval_items if n_test is None else min(p.eval_items, n_test)
    val_items = tc.eval_items if tc.eval_items is not None else (n_test or curve_items)
    val_passes = (tc.steps // tc.eval_every if tc.eval_every else 1) + 1  # + the final test pass
    n_curves = 1 + len(p.variants) + (1 if p.stage1_ablation else 0)
    rows = {}
    for scope, trainings in (("attention/block scopes", 3), ("full", 2)):
        train_f = trainings * (tc.steps * tc.batch_size * per_train + val_passes * val_items * per_eval)
        curve_f = n_curves * p.points * curve_items * per_eval
        rows[scope] = {"train_flops": train_f, "curve_flops": curve_f,
                       "cpu_hours_here": (train_f / rate_train + curve_f / rate_eval) / 3600 if timing else None,
                       "gpu_hours_at_assumed_rate": (train_f + curve_f) / (gpu_tflops * 1e12) / 3600}
    return {"config": path.stem, "params": n_params, "train_flops_per_example": per_train,
            "eval_flops_per_example": per_eval, "steps": tc.steps, "batch_size": tc.batch_size,
            "curve_items": curve_items, "curves": n_curves,
            "cpu_gflops_train": rate_train / 1e9 if timing else None,
            "cpu_gflops_eval": rate_eval / 1e9 if timing else None, "runs": rows}


def tables(configs: list[dict], gpu_tflops: float) -> dict:
    """The ``cost`` table of docs/paper-setting.md: per config its parameters, FLOPs per training example, and
    per run (the attention/block scopes: 3 trainings) its training and curve PFLOPs and GPU hours at the
    assumed rate; the ``full`` run's GPU hours; a config's 4 runs (3 scopes of 3 trainings + ``full``)."""
    from symalign.experiments.docs_tables import make_table

    rows = []
    for r in configs:
        a, f = r["runs"]["attention/block scopes"], r["runs"]["full"]
        rows.append({"config": f"`{r['config']}`", "params": f"{r['params'] / 1e6:.1f} M",
                     "train_gflop": r["train_flops_per_example"] / 1e9, "train_pflop": a["train_flops"] / 1e15,
                     "curve_pflop": a["curve_flops"] / 1e15, "gpu_h": a["gpu_hours_at_assumed_rate"],
                     "gpu_h_full": f["gpu_hours_at_assumed_rate"],
                     "gpu_h_config": 3 * a["gpu_hours_at_assumed_rate"] + f["gpu_hours_at_assumed_rate"],
                     "cpu_gflops": r["cpu_gflops_train"], "cpu_h": a["cpu_hours_here"]})
    columns = [("config", "config"), ("params", "params"), ("train_gflop", "train GFLOP / example", ".2f"),
               ("train_pflop", "training PFLOP / run", ".1f"), ("curve_pflop", "curves PFLOP / run", ".2f"),
               ("gpu_h", f"GPU h / run at {gpu_tflops:g} TFLOP/s", ".2f"), ("gpu_h_full", "`full` run", ".2f"),
               ("gpu_h_config", "config, 4 runs", ".1f")]
    if any(r["cpu_h"] is not None for r in rows):  # timed: this machine's training rate and hours per run
        columns += [("cpu_gflops", "CPU GFLOP/s here (training)", ".0f"), ("cpu_h", "CPU h / run here", ".0f")]
    scoped = [(r["runs"]["attention/block scopes"], r["runs"]["full"]) for r in configs]
    runs = [3 * (a["train_flops"] + a["curve_flops"]) + f["train_flops"] + f["curve_flops"] for a, f in scoped]
    total = {"configs": len(configs), "runs": 4 * len(configs), "eflop": sum(runs) / 1e18,
             "gpu_h": sum(runs) / (gpu_tflops * 1e12) / 3600}
    return {"cost": make_table(rows, columns), "total": make_table([total], [
        ("configs", "configs"), ("runs", "runs (4 scopes each)"), ("eflop", "EFLOP", ".2f"),
        ("gpu_h", f"GPU h at {gpu_tflops:g} TFLOP/s", ".0f")])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4, help="examples per timed step")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--gpu-tflops", type=float, default=10.0, help="assumed sustained TFLOP/s of one GPU")
    ap.add_argument("--only", nargs="*", default=None, help="config stems to measure (default: all)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-time", action="store_true", help="count FLOPs only (no CPU timing)")
    ap.add_argument("--out", default=None, help="write a result file (with the docs' cost table) here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    from symalign.provenance import provenance

    prov = provenance(["python", "benchmarks/bench_paper_cost.py", *sys.argv[1:]], threads=args.threads)  # at start
    paths = sorted((ROOT / "configs" / "paper").glob("*.toml"))
    if args.only:
        paths = [p for p in paths if p.stem in args.only]
    out = []
    for path in paths:
        r = measure(path, args.batch, args.trials, args.gpu_tflops, timing=not args.no_time)
        out.append(r)
        a, f = r["runs"]["attention/block scopes"], r["runs"]["full"]
        here = "" if args.no_time else (f"  here {a['cpu_hours_here']:7.1f} h  cpu {r['cpu_gflops_train']:.0f}/"
                                        f"{r['cpu_gflops_eval']:.0f} GFLOP/s")
        print(f"{r['config']:20s} {r['params'] / 1e6:5.2f}M params  train {r['train_flops_per_example'] / 1e9:7.2f}"
              f" GFLOP/ex  run {(a['train_flops'] + a['curve_flops']) / 1e15:7.2f} PFLOP (curves "
              f"{a['curve_flops'] / 1e15:5.2f})  GPU@{args.gpu_tflops:g}TF "
              f"{a['gpu_hours_at_assumed_rate']:5.2f} h  (full: {f['gpu_hours_at_assumed_rate']:5.2f} h){here}",
              flush=True)
    meta = {"threads": args.threads, "batch": args.batch, "gpu_tflops_assumed": args.gpu_tflops,
            "load_average": os.getloadavg(), "torch": torch.__version__, "timed": not args.no_time}
    if args.out:
        from symalign.atomic import write_json

        write_json(args.out, {"provenance": prov, "meta": meta, "configs": out,
                              "tables": tables(out, args.gpu_tflops)})
    if args.json:
        print(json.dumps({"meta": meta, "configs": out}, indent=1))


if __name__ == "__main__":
    main()
