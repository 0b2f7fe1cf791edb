"""Cost of a 25-point LMC curve vs 25 plain evaluation passes of one model, in one run.

The curve interpolates the state dicts at each point and evaluates through
``torch.func.functional_call``; the reference evaluates a single ``nn.Module``
25 times with its own weights on the same batches (``model(x)`` under ``no_grad``).
Both dispatch the same kernels, so the reference is a lower bound of the curve up to
the interpolation itself; the two are interleaved point by point (one reference pass
after each curve point) so that a shared machine's load falls on both alike.
Goal: ratio <= 1.1x.

    .venv/bin/python benchmarks/bench_lmc.py [--family vit|gpt] [--repeats 3]
"""

from __future__ import annotations

import argparse
import resource
import time

import torch
import torch.nn.functional as F

from symalign import lmc
from symalign.models import build_model


def make(family: str):
    if family == "vit":
        cfg = dict(family="vit", pe="rope", d_model=128, n_layers=4, n_heads=4, d_ff=512, image_size=28,
                   patch_size=7, channels=1, n_classes=10, max_len=17)
        g = torch.Generator().manual_seed(0)
        x = torch.rand(512, 1, 28, 28, generator=g)
        y = torch.randint(0, 10, (512,), generator=g)
        batches = [(x[i:i + 128], y[i:i + 128]) for i in range(0, 512, 128)]
        return cfg, batches, "classification"
    cfg = dict(family="gpt", pe="rope", d_model=128, n_layers=2, n_heads=4, d_ff=512, vocab_size=256, max_len=128)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (64, 129), generator=g)
    batches = [(ids[i:i + 16, :-1], ids[i:i + 16, 1:]) for i in range(0, 64, 16)]
    return cfg, batches, "lm"


@torch.no_grad()
def plain_passes(model, batches, task, n):
    model.eval()
    for _ in range(n):
        for x, y in batches:
            logits = model(x)
            if task == "lm":
                logits, y = logits.reshape(-1, logits.shape[-1]), y.reshape(-1)
            F.cross_entropy(logits.double(), y, reduction="sum").item()
            (logits.argmax(-1) == y).sum().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", choices=("vit", "gpt", "both"), default="both")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--points", type=int, default=25)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: on a shared machine more "
                                                           "threads make both timings noisy)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for family in ("vit", "gpt") if args.family == "both" else (args.family,):
        cfg, batches, task = make(family)
        a, b = build_model(cfg, seed=1), build_model(cfg, seed=2)
        sa, sb = lmc.full_state(a), lmc.full_state(b)
        plain_passes(a, batches, task, 1)  # warm-up
        ratios, t_curve, t_plain = [], [], []
        for _ in range(args.repeats):
            # Interleaved: after each curve point, one plain pass (timed apart and subtracted), so
            # that both sides see the same machine load.
            plain = []

            def reference(_i: int) -> None:
                t = time.perf_counter()
                plain_passes(a, batches, task, 1)
                plain.append(time.perf_counter() - t)

            t0 = time.perf_counter()
            lmc.curve(a, sa, sb, lambda: batches, task, args.points, progress=reference)
            total = time.perf_counter() - t0
            t_plain.append(sum(plain))
            t_curve.append(total - sum(plain))
            ratios.append(t_curve[-1] / t_plain[-1])
        n_params = sum(v.numel() for v in sa.values())
        print(f"{family}: {n_params / 1e6:.2f}M params, {len(batches)} batches, {args.points} points, "
              f"{args.threads} thread(s)")
        print(f"  curve        {min(t_curve):7.3f} s (best of {args.repeats})")
        print(f"  plain passes {min(t_plain):7.3f} s ({args.points} passes interleaved with the curve's points)")
        print(f"  ratio curve / plain = {sorted(ratios)[len(ratios) // 2]:.3f}x (median of {args.repeats} "
              "interleaved repeats; goal <= 1.1x)")
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
