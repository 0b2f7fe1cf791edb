"""The near-null spectrum of one RoPE head (docs/symmetry.md, "Near-null spectrum"), as a result file.

Dense float64 probes (:func:`symalign.probe.probe_attention`, seed 0) of one attention head with
``d_h = 16`` over ``T = 17`` positions (RoPE base ``10^4``), at ``D = 16`` and ``D = 32``, and the same head
without positional encoding. Recorded per probe: the measured nullity and the predicted one, the count of
non-null singular values below ``1e-3`` and ``1e-4`` of the largest (``near_null``), the smallest kept and the
largest null singular value (relative), and each RoPE plane's total rotation over the context,
``theta_j (T - 1)`` radians (slow: below 0.1 rad). Seconds at one thread::

    python benchmarks/rope_near_null.py --threads 1 --out results/rope-near-null.json
    symalign docs
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

PROBES = (("16", dict(d_model=16, pe="rope")), ("32", dict(d_model=32, pe="rope")),
          ("16, no PE", dict(d_model=16, pe="none")))
"""(label, config overrides) of each probe; every one has one head of width 16."""


def planes_text(planes: list[dict] | None) -> str:
    """The plane angles, 3 significant digits, slow ones (below 0.1 rad) in bold; ``-`` without RoPE."""
    if not planes:
        return "-"
    return ", ".join(f"**{p['angle']:.3g}**" if p["slow"] else f"{p['angle']:.3g}" for p in planes)


def measure(seq_len: int, head_dim: int, seed: int) -> list[dict]:
    from symalign.nn.attention import AttentionConfig
    from symalign.probe import probe_attention

    rows = []
    for label, over in PROBES:
        cfg = AttentionConfig(n_heads=1, head_dim=head_dim, max_len=seq_len, **over)
        r = probe_attention(cfg, seq_len, seed=seed, method="dense")
        rows.append({"D": label, "pe": cfg.pe, "nullity": int(r.nullity), "predicted": r.predicted,
                     "below_1e-3": r.near_null["1e-3"], "below_1e-4": r.near_null["1e-4"],
                     "smallest_kept": r.smallest_kept, "largest_null": r.largest_null,
                     "slow_planes": sum(p["slow"] for p in r.rope_planes or []),
                     "angles": [p["angle"] for p in r.rope_planes or []], "planes": planes_text(r.rope_planes),
                     "seconds": r.seconds})
    return rows


def tables(rows: list[dict], seq_len: int) -> dict:
    from symalign.experiments.docs_tables import make_table

    return {"near_null": make_table(rows, [
        ("D", "`D`"), ("nullity", "measured nullity"), ("predicted", "predicted"), ("below_1e-3", "below `1e-3`"),
        ("below_1e-4", "below `1e-4`"), ("smallest_kept", "smallest kept", ".1e"),
        ("largest_null", "largest null", ".1e"), ("planes", f"plane angles over {seq_len} positions (rad)")])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=17)
    ap.add_argument("--head-dim", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "results" / "rope-near-null.json"))
    args = ap.parse_args()
    from symalign.atomic import write_json
    from symalign.provenance import provenance

    torch.set_num_threads(args.threads)
    prov = provenance(["python", "benchmarks/rope_near_null.py", *sys.argv[1:]], threads=args.threads)
    rows = measure(args.seq_len, args.head_dim, args.seed)
    write_json(args.out, {"provenance": prov, "seq_len": args.seq_len, "head_dim": args.head_dim,
                          "seed": args.seed, "probes": rows, "tables": tables(rows, args.seq_len)})
    for r in rows:
        print(f"D {r['D']}: nullity {r['nullity']} (predicted {r['predicted']}), near-null {r['below_1e-3']} / "
              f"{r['below_1e-4']}, smallest kept {r['smallest_kept']:.2e}, planes {r['planes']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
