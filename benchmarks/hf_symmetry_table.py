"""Print the Hugging Face families table of docs/symmetry.md: each family's real attention layer, measured vs declared.

For every ``model_type`` with an adapter (``symalign.families.supported()``: new families appear
without touching this script) the probe builds a tiny random config with transformers' own
config class (D=16, 4 heads of d_h=4, 2 K/V heads where the family has GQA, 8 tokens), measures
the Jacobian nullity of layer 0's attention in float64 (forward- and reverse-mode Jacobians,
clean gap required) and prints it beside the dimension the adapter declares. An adapter with
several kinds of attention site (``probe_sites``: T5's encoder, decoder and cross-attention) gets
one row per kind.

Usage: ``.venv/bin/python benchmarks/hf_symmetry_table.py [--block] [--json] [--only TYPE ...]``
(about 5 s a family; ``--block`` adds the whole block, about 30 s more a family).
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
    args = ap.parse_args(argv)

    from transformers.utils import logging

    logging.set_verbosity_error()
    from symalign.families import get_adapter, supported
    from symalign.probe.hf import hf_config, probe_hf

    types = args.only or supported()
    rows, failures = [], 0
    for mt in types:
        try:  # layer 0 of every kind of attention site the adapter has (T5: encoder, decoder, cross)
            sites = getattr(get_adapter(hf_config(mt)), "probe_sites", ((None, False),))
            found = [(site, probe_hf(mt, stack=site[0], cross=site[1], block=args.block)) for site in sites]
        except Exception as exc:  # a refusal or an unsupported option: shown in the table, not hidden
            failures += 1
            rows.append({"model_type": mt, "error": f"{type(exc).__name__}: {exc}"})
            continue
        for (stack, cross), probes in found:
            row = probes[0].to_dict()
            if args.block and len(probes) > 1:
                row["block"] = probes[1].to_dict()
            rows.append(row)
            where = f" {stack}{' cross' if cross else ''}" if stack else ""
            print(f"{mt}{where}: measured {row['nullity']}, expected {row['expected']}", file=sys.stderr)
    if args.json:
        print(json.dumps(rows))
        return 1 if failures else 0
    head = ("| family (`model_type`) | attention params | measured nullity | declared by the adapter | "
            "exact, undeclared | verdict | near-null < 1e-3 / 1e-4 | slow RoPE planes | computed in float64 |")
    if args.block:
        head += " block nullity (params) |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in rows:
        if "error" in r:
            print(f"| `{r['model_type']}` | | refused | | | {r['error']} | | | |" + (" |" if args.block else ""))
            continue
        extra = " + ".join(f"{k} {v}" for k, v in r["undeclared"].items()) or "-"
        groups = " x ".join(r["group"].values())
        planes = "-" if r["slow_planes"] is None else f"{r['slow_planes']} of {len(r['rope_planes'])}"
        nn_ = f"{r['near_null']['1e-3']} / {r['near_null']['1e-4']}"
        site = f", {r['stack']} {'cross-attention' if r['site'] == 'cross-attention' else 'self-attention'}" \
            if r.get("stack") else ""
        line = (f"| {r['family']} (`{r['model_type']}`{site}) | {r['parameters']} | {r['nullity']} | {r['declared']} "
                f"({groups}) | {extra} | {'match' if r['match'] else '**MISMATCH**'} | {nn_} | {planes} | "
                f"{', '.join(f'`{u}`' for u in r['upcasts']) or '-'} |")
        if args.block:
            b = r.get("block")
            line += f" {b['nullity']} ({b['parameters']}) |" if b else " - |"
        print(line)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
