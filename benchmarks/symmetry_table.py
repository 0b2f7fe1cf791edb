"""The measured-vs-predicted nullity table of docs/symmetry.md, from the probe tour, as a result file.

Dense float64 probes of every tour variant with and without biases (:func:`symalign.probe.probe_tour`:
D=8, h=2, d_h=4, T=6; GQA rows use h=4, h_kv=2; learned PE uses max_len = T). About 10 s. ``--out FILE`` writes
a result file (JSON, atomically, with its provenance) whose ``tour`` table ``symalign docs`` renders; without
it the table is printed as Markdown::

    python benchmarks/symmetry_table.py --threads 1 --out results/probe-tour.json
    symalign docs
"""

from __future__ import annotations

import argparse
import sys

import torch

from symalign.probe import probe_tour

COLUMNS = [("variant", "variant"), ("bias", "bias"), ("parameters", "params"), ("measured", "measured nullity"),
           ("predicted", "predicted"), ("terms", "terms"), ("group", "declared group"),
           ("head_swap", "head swap preserved")]


def table_rows(rows: list[dict]) -> list[dict]:
    """One table row per probe: the breakdown's non-zero terms, the declared group, a mismatch flagged."""
    out = []
    for r in rows:
        out.append({"variant": r["variant"], "bias": "yes" if r["bias"] else "no", "parameters": r["parameters"],
                    "measured": f"{r['nullity']}" + ("" if r["match"] else " **MISMATCH**"),
                    "predicted": r["predicted"],
                    "terms": " + ".join(f"{k} {v}" for k, v in r["breakdown"].items() if v),
                    "group": " x ".join(r["group"].values()), "head_swap": str(r["head_permutations_preserved"])})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="write the result file here (default: print Markdown)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = probe_tour()
    shown = table_rows(rows)
    if args.out is None:
        print("| " + " | ".join(h for _, h in COLUMNS) + " |")
        print("|" + "|".join("---" for _ in COLUMNS) + "|")
        for r in shown:
            print("| " + " | ".join(str(r[k]) for k, _ in COLUMNS) + " |")
        return 0
    from symalign.atomic import write_json
    from symalign.experiments.docs_tables import make_table
    from symalign.provenance import provenance

    prov = provenance(["python", "benchmarks/symmetry_table.py", *sys.argv[1:]], threads=args.threads)
    write_json(args.out, {"provenance": prov, "probes": rows, "mismatches": sum(not r["match"] for r in rows),
                          "tables": {"tour": make_table(shown, COLUMNS)}})
    print(f"{len(rows)} probes, {sum(not r['match'] for r in rows)} mismatches -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
