r"""The flop floor of one Llama layer's attention match (docs/matching.md), from GEMM rates measured here.

Measures, on one thread, three rates in Gflop per CPU second (``time.process_time``, so that other jobs on a
shared machine slow the wall clock but not the count; the best of ``--repeats``):

* ``float64``: an ``n x n`` by ``n x n`` product (``2 n^3`` flop), ``--n`` (default 2048);
* ``float32``: the same in float32;
* ``batched``: ``--blocks`` float64 ``d x d`` blocks, per block one inverse and two products (counted
  ``6 d^3``: ``2 d^3`` each), the unit of the batched GL solver's V-O evaluation.

Then counts the work of one Llama layer (``h d = D = R``; defaults ``h = 32``, ``d = 128``, ``R = 4096``) for the
batched matcher and a per-head loop, and divides by those rates:

* stage-1 cross Grams: ``4 x 2 (h d)^2 R`` (the four weight matrices' ``X_A^T X_B``); batched in float32,
  the loop in float64 (4 ``d x d`` products per head pair: the same flops);
* per-head norms / self Grams: ``4 x 2 x h x 2 d^2 R`` (four matrices, two models);
* stage-2 Grams (batched only, float64): ``2 x 2 x 2 x h x 2 d^2 R`` (Q-K and V-O; rows and columns;
  ``B^T B`` and ``A^T B``);
* stage 2, V-O: ``h`` blocks x evaluations x ``6 d^3`` (batched) against ``h`` heads x evaluations x
  ``(8 R d^2 + 2 d^3)`` (the loop's four ``R x d x d`` products and an inverse per evaluation). The evaluation
  counts are inputs (``--evals-batched``, ``--evals-loop``; defaults from the ``bench_match.py --quick --only
  llama`` run quoted in docs/matching.md: ~117 per V-O block batched, ~110 per head in the loop).

    python benchmarks/gemm_floor.py --threads 1 --out benchmarks/results/gemm_floor.json
    symalign docs
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def best_rate(fn, flops: float, repeats: int) -> float:
    """``flops / t`` in Gflop per CPU second, ``t`` the shortest of ``repeats`` runs of ``fn`` (after a warm-up)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.process_time()
        fn()
        best = min(best, time.process_time() - t)
    return flops / best / 1e9


def rates(n: int, blocks: int, d: int, repeats: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for name, dtype in (("float64", torch.float64), ("float32", torch.float32)):
        a, b = torch.randn(n, n, generator=g, dtype=dtype), torch.randn(n, n, generator=g, dtype=dtype)
        out[name] = best_rate(lambda a=a, b=b: a @ b, 2.0 * n ** 3, repeats)
    m = torch.randn(blocks, d, d, generator=g, dtype=torch.float64) + d ** 0.5 * torch.eye(d, dtype=torch.float64)
    c = torch.randn(blocks, d, d, generator=g, dtype=torch.float64)

    def unit():
        v = torch.linalg.inv(m)
        return (m @ c) @ v

    out["batched"] = best_rate(unit, 6.0 * blocks * d ** 3, repeats)
    return out


def floor(r: dict[str, float], h: int, d: int, R: int, evals_batched: float, evals_loop: float) -> dict:
    """The flops of each piece of work and its time at the rates ``r`` (Gflop/s), batched and loop."""
    G = 1e9
    hd = h * d
    cross = 4 * 2 * hd ** 2 * R
    self_grams = 4 * 2 * h * 2 * d ** 2 * R
    stage2_grams = 2 * 2 * 2 * h * 2 * d ** 2 * R
    vo_b_unit, vo_l_unit = 6 * d ** 3, 8 * R * d ** 2 + 2 * d ** 3
    vo_b, vo_l = h * evals_batched * vo_b_unit, h * evals_loop * vo_l_unit
    rows = [
        {"work": "stage-1 cross Grams, `4 x 2 (h d)^2 R`",
         "batched": f"{cross / G:.0f} Gflop, float32: {cross / G / r['float32']:.1f} s",
         "loop": f"the same {cross / G:.0f} Gflop (4 `d x d` products per head pair), float64: "
                 f"{cross / G / r['float64']:.1f} s",
         "batched_s": cross / G / r["float32"], "loop_s": cross / G / r["float64"]},
        {"work": "per-head norms / self Grams",
         "batched": f"{self_grams / G:.0f} Gflop float32: {self_grams / G / r['float32']:.1f} s",
         "loop": f"{self_grams / G:.0f} Gflop float64: {self_grams / G / r['float64']:.1f} s",
         "batched_s": self_grams / G / r["float32"], "loop_s": self_grams / G / r["float64"]},
        {"work": "stage-2 Grams (float64)",
         "batched": f"{stage2_grams / G:.0f} Gflop: {stage2_grams / G / r['float64']:.1f} s", "loop": "--",
         "batched_s": stage2_grams / G / r["float64"], "loop_s": 0.0},
        {"work": "stage 2, V-O",
         "batched": f"{h} blocks x ~{evals_batched:.0f} evaluations x (inverse + 2 products, "
                    f"{vo_b_unit / 1e6:.1f} Mflop) = {vo_b / G:.0f} Gflop: {vo_b / G / r['batched']:.1f} s",
         "loop": f"{h} heads x ~{evals_loop:.0f} evaluations x (4 `R x d x d` products + inverse, "
                 f"{vo_l_unit / 1e6:.0f} Mflop) = {vo_l / 1e12:.2f} Tflop: {vo_l / G / r['float64']:.0f} s",
         "batched_s": vo_b / G / r["batched"], "loop_s": vo_l / G / r["float64"]},
    ]
    tb, tl = sum(x["batched_s"] for x in rows), sum(x["loop_s"] for x in rows)  # the four pieces of work
    rows.append({"work": "floor per layer", "batched": f"**{tb:.1f} s**", "loop": f"**{tl:.0f} s**",
                 "batched_s": tb, "loop_s": tl})
    rows.append({"work": "loop floor / batched floor", "batched": f"{tl / tb:.1f}x", "loop": ""})
    rows.append({"work": "stage 1's share of the floor", "batched": f"{rows[0]['batched_s'] / tb:.0%}",
                 "loop": f"{rows[0]['loop_s'] / tl:.0%}"})
    return {"rows": rows, "batched_s": tb, "loop_s": tl, "loop_over_batched": tl / tb,
            "stage1_share_of_batched": rows[0]["batched_s"] / tb}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--n", type=int, default=2048, help="GEMM size for the float64/float32 rates")
    ap.add_argument("--blocks", type=int, default=32, help="blocks of the batched d x d rate")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--rows", type=int, default=4096, help="R: the rows (model width) of each weight")
    ap.add_argument("--evals-batched", type=float, default=117)
    ap.add_argument("--evals-loop", type=float, default=110)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gemm_floor.json"))
    args = ap.parse_args()
    from symalign.atomic import write_json
    from symalign.experiments.docs_tables import make_table
    from symalign.provenance import provenance

    torch.set_num_threads(args.threads)
    prov = provenance(["python", "benchmarks/gemm_floor.py", *sys.argv[1:]], threads=args.threads)
    import os

    load = [round(x, 2) for x in os.getloadavg()]
    r = rates(args.n, args.blocks, args.head_dim, args.repeats)
    f = floor(r, args.heads, args.head_dim, args.rows, args.evals_batched, args.evals_loop)
    rate_rows = [{"what": f"{args.n} x {args.n} GEMM, float64", "rate": r["float64"]},
                 {"what": f"{args.n} x {args.n} GEMM, float32", "rate": r["float32"]},
                 {"what": f"{args.blocks} blocks {args.head_dim} x {args.head_dim}, float64: inverse + 2 products",
                  "rate": r["batched"]}]
    write_json(args.out, {
        "provenance": prov, "load_average_start": load, "rates_gflops_per_cpu_s": r,
        "shape": {"heads": args.heads, "head_dim": args.head_dim, "rows": args.rows},
        "evaluations": {"batched": args.evals_batched, "loop": args.evals_loop,
                        "source": "bench_match.py --quick --only llama (docs/matching.md)"},
        "floor": f,
        "tables": {"rates": make_table(rate_rows, [("what", "work"), ("rate", "Gflop per CPU second, 1 thread",
                                                                         ".0f")]),
                   "floor": make_table(f["rows"], [("work", "work"), ("batched", "batched"), ("loop", "loop")])}})
    print(f"rates {r}; floor batched {f['batched_s']:.1f} s, loop {f['loop_s']:.0f} s "
          f"({f['loop_over_batched']:.1f}x); stage 1 {f['stage1_share_of_batched']:.0%} of the batched floor")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
