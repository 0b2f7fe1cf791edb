"""Print the measured-vs-predicted nullity table of docs/symmetry.md (markdown) from the probe tour.

Usage: ``.venv/bin/python benchmarks/symmetry_table.py`` (about 10 s; dense float64 probes, D=8, h=2, d_h=4, T=6;
GQA rows use h=4, h_kv=2; learned PE uses max_len = T).
"""

from __future__ import annotations

from symalign.probe import probe_tour


def main() -> None:
    import argparse

    argparse.ArgumentParser(description="Print docs/symmetry.md's measured-vs-predicted nullity table (markdown) "
                                        "from the probe tour (about 10 s).").parse_args()
    rows = probe_tour()
    print("| variant | bias | params | measured nullity | predicted | terms | declared group | head swap preserved |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        terms = " + ".join(f"{k} {v}" for k, v in r["breakdown"].items() if v)
        group = " x ".join(r["group"].values())
        flag = "" if r["match"] else " **MISMATCH**"
        print(f"| {r['variant']} | {'yes' if r['bias'] else 'no'} | {r['parameters']} | {r['nullity']}{flag} | "
              f"{r['predicted']} | {terms} | {group} | {r['head_permutations_preserved']} |")


if __name__ == "__main__":
    main()
