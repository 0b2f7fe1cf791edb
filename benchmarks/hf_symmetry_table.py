"""Print the Hugging Face families table of docs/symmetry.md: each family's real attention layer, measured vs declared.

For every ``model_type`` with an adapter (``symalign.families.model_types()``: new families appear
without touching this script) the probe builds a tiny random config with transformers' own
config class (D=16, 4 heads of d_h=4, 2 K/V heads where the family has GQA, 8 tokens), measures
the Jacobian nullity of layer 0's attention in float64 (forward- and reverse-mode Jacobians,
clean gap required) and prints it beside the dimension the adapter declares. An adapter with
several kinds of attention site (``probe_sites``: T5's encoder, decoder and cross-attention) gets
one row per kind.

Usage: ``.venv/bin/python benchmarks/hf_symmetry_table.py [--block] [--json] [--only TYPE ...] [--out FILE]``
(about 5 s a family; ``--block`` adds the whole block, about 30 s more a family). ``--out`` writes the rows
and the rendered table (``tables.hf``) with provenance to a result file that ``symalign docs`` writes into
docs/symmetry.md.
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--block", action="store_true", help="also probe the whole block (slower)")
    ap.add_argument("--json", action="store_true", help="print JSON rows instead of markdown")
    ap.add_argument("--only", nargs="*", default=None, metavar="TYPE", help="model_types to probe (default: all)")
    ap.add_argument("--out", default=None, help="write a result file (rows, table, provenance) for `symalign docs`")
    args = ap.parse_args(argv)

    import torch
    from transformers.utils import logging

    torch.set_num_threads(1)

    logging.set_verbosity_error()
    from symalign.errors import ConfigError
    from symalign.families import get_adapter, model_types
    from symalign.probe.hf import hf_config, probe_hf

    types = args.only or model_types()
    rows, failures = [], 0
    for mt in types:
        try:  # layer 0 of every kind of attention site the adapter has (T5: encoder, decoder, cross)
            sites = getattr(get_adapter(hf_config(mt)), "probe_sites", ((None, False),))
            found = []
            for site in sites:
                try:
                    found.append((site, probe_hf(mt, stack=site[0], cross=site[1], block=args.block)))
                except ConfigError as exc:  # --block refused (too large to probe here): the attention layer alone
                    if not args.block or "--block" not in str(exc):
                        raise
                    found.append((site, probe_hf(mt, stack=site[0], cross=site[1]) + [str(exc)]))
        except Exception as exc:  # a refusal or an unsupported option: shown in the table, not hidden
            failures += 1
            rows.append({"model_type": mt, "error": f"{type(exc).__name__}: {exc}"})
            continue
        for (stack, cross), probes in found:
            row = probes[0].to_dict()
            if args.block and len(probes) > 1:
                row["block"] = probes[1] if isinstance(probes[1], str) else probes[1].to_dict()
            rows.append(row)
            where = f" {stack}{' cross' if cross else ''}" if stack else ""
            print(f"{mt}{where}: measured {row['nullity']}, expected {row['expected']}", file=sys.stderr)
    if args.json:
        print(json.dumps(rows))
        return 1 if failures else 0
    table = [_cells(r, args.block) for r in rows]
    cols = [("family", "family (`model_type`)"), ("parameters", "attention params"),
            ("nullity", "measured nullity"), ("declared", "declared by the adapter"),
            ("undeclared", "exact, undeclared"), ("verdict", "verdict"), ("near_null", "near-null < 1e-3 / 1e-4"),
            ("planes", "slow RoPE planes"), ("upcasts", "computed in float64")]
    if args.block:
        cols.append(("block", "block nullity (params)"))
    if args.out:
        import shlex
        from pathlib import Path

        from symalign.atomic import write_json
        from symalign.experiments.docs_tables import make_table
        from symalign.provenance import provenance

        command = shlex.join(["python", "benchmarks/hf_symmetry_table.py",
                              *(argv if argv is not None else sys.argv[1:])])
        doc = {"provenance": provenance(command, 1), "tables": {"hf": make_table(table, cols)}, "rows": rows}
        write_json(Path(args.out), doc)
    print("| " + " | ".join(c[1] for c in cols) + " |")
    print("|" + "---|" * len(cols))
    for t in table:
        print("| " + " | ".join("-" if t.get(c[0]) is None else str(t[c[0]]) for c in cols) + " |")
    return 1 if failures else 0


def _cells(r: dict, block: bool) -> dict:
    """One table row's cells (strings) from a probe row (``probe_hf(...)[0].to_dict()``) or a refusal."""
    if "error" in r:
        return {"family": f"`{r['model_type']}`", "nullity": "refused", "verdict": r["error"]}
    site = f", {r['stack']} {'cross-attention' if r['site'] == 'cross-attention' else 'self-attention'}" \
        if r.get("stack") else ""
    out = {"family": f"{r['family']} (`{r['model_type']}`{site})", "parameters": r["parameters"],
           "nullity": r["nullity"], "declared": f"{r['declared']} ({' x '.join(r['group'].values())})",
           "undeclared": " + ".join(f"{k} {v}" for k, v in r["undeclared"].items()) or "-",
           "verdict": "match" if r["match"] else "**MISMATCH**",
           "near_null": f"{r['near_null']['1e-3']} / {r['near_null']['1e-4']}",
           "planes": "-" if r["slow_planes"] is None else f"{r['slow_planes']} of {len(r['rope_planes'])}",
           "upcasts": ", ".join(f"`{u}`" for u in r["upcasts"]) or "-"}
    if block:
        b = r.get("block")
        why = "" if not isinstance(b, str) else "data-dependent routing" if "experts" in b else "too large here"
        out["block"] = f"not probed ({why})" if isinstance(b, str) else \
            f"{b['nullity']} ({b['parameters']})" if b else "-"
    return out


if __name__ == "__main__":
    sys.exit(main())
