"""Benchmark of the symmetry probe: matrix-free at full size, dense vs matrix-free agreement, dense limits.

Usage: ``.venv/bin/python benchmarks/bench_probe.py [--probes N] [--rtol R] [--maxiter K] [--skip-large]``.
Prints wall time, peak RSS, estimated nullity +- standard error vs predicted.
"""

from __future__ import annotations

import argparse
import math
import resource
import time

import torch

from symalign.nn.attention import AttentionConfig
from symalign.probe import attention_parameter_count, probe_attention


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def dense_limit(mem_gib: float = 24.0, ratio: float = 2.0) -> int:
    """Largest P whose dense probe fits: Jacobian ``ratio P x P`` float64, plus as much again for the SVD.

    ``torch.linalg.svdvals`` (LAPACK gesdd, values only) copies the matrix and needs
    O(m P) workspace, so we budget ``2 * 8 * ratio * P^2`` bytes.
    """
    return int(math.sqrt(mem_gib * 2 ** 30 / (2 * 8 * ratio)))


def agreement(sizes, probes: int) -> list[tuple]:
    rows = []
    for kw in sizes:
        cfg = AttentionConfig(**kw)
        d = probe_attention(cfg, 8, method="dense")
        m = probe_attention(cfg, 8, method="matrix-free", probes=probes, tol=1e-6)
        z = abs(m.nullity - d.nullity) / max(m.stderr, 1e-12)
        rows.append((kw, d.parameters, d.nullity, d.predicted, d.seconds,
                     m.nullity, m.stderr, m.iterations, m.seconds, z))
        print(f"  {kw}: P={d.parameters}  dense {d.nullity} (pred {d.predicted}, {d.seconds:.1f}s)  "
              f"matrix-free {m.nullity:.1f} +- {m.stderr:.1f} ({m.iterations} CGLS it, {m.seconds:.1f}s)  "
              f"|diff|/se = {z:.2f}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--probes", type=int, default=8)
    ap.add_argument("--rtol", type=float, default=1e-4)
    ap.add_argument("--maxiter", type=int, default=400)
    ap.add_argument("--small-probes", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--skip-large", action="store_true")
    ap.add_argument("--skip-small", action="store_true", help="skip the dense vs matrix-free agreement runs")
    ap.add_argument("--skip-dense", action="store_true", help="skip the dense timing run (the limit is still printed)")
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)

    if not args.skip_small:
        print(f"\n[1] dense vs matrix-free (float64, {args.small_probes} probes, CGLS rtol 1e-6)", flush=True)
        agreement([dict(d_model=16, n_heads=2, head_dim=8, pe="none"),
                   dict(d_model=16, n_heads=4, head_dim=4, pe="rope", bias=True)], probes=args.small_probes)

    print("\n[2] dense path: cost and the largest size that fits", flush=True)
    pmax = dense_limit(24.0)
    print(f"  24 GiB budget (Jacobian 2P x P float64 + equal SVD workspace = 32 P^2 bytes): P_max = {pmax}"
          f" = one layer with D ~ {int(math.sqrt(pmax / 4))} (4 D^2 parameters)")
    if not args.skip_dense:
        cfg = AttentionConfig(d_model=24, n_heads=3, head_dim=8, pe="none")
        t = time.perf_counter()
        d = probe_attention(cfg, 8, method="dense")
        dt = time.perf_counter() - t
        print(f"  measured: P={d.parameters}, outputs={d.outputs}: {dt:.1f}s, nullity {d.nullity} (pred {d.predicted})")
        print(f"  time at P_max ~ {dt * (pmax / d.parameters) ** 3 / 3600:.1f} h by cubic extrapolation of that run "
              "(an upper bound: small runs are overhead-dominated)")

    if args.skip_large:
        return
    print(f"\n[3] matrix-free at full size: D=256, h=8, d_h=32, T={args.seq_len}, "
          f"{args.probes} probes, CGLS rtol {args.rtol:g}, maxiter {args.maxiter}", flush=True)
    cfg = AttentionConfig(d_model=256, n_heads=8, head_dim=32, pe="none")
    p = attention_parameter_count(cfg)
    t = time.perf_counter()
    r = probe_attention(cfg, args.seq_len, method="matrix-free", probes=args.probes, tol=args.rtol,
                        maxiter=args.maxiter)
    dt = time.perf_counter() - t
    print(f"  P={p}, outputs={r.outputs}, wall {dt:.0f}s, peak RSS {peak_rss_mib():.0f} MiB, "
          f"CGLS iterations {r.iterations}, worst relative residual {r.residual:.1e}")
    print(f"  nullity {r.nullity:.0f} +- {r.stderr:.0f} (1 s.e.) vs predicted {r.predicted} "
          f"({(r.nullity - r.predicted) / r.stderr:+.2f} s.e.); head swap preserved: {r.head_permutations_preserved}")


if __name__ == "__main__":
    main()
