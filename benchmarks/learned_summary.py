"""The ``learned`` stage-2 variant against the data-free ``full`` one, over every seed-pair result file that has both.

Reads the ``pairs`` table of each result file written by ``benchmarks/results_table.py --pairs-table pairs`` over
runs with ``--variant learned`` (mean and sample std over the pairs, the per-pair ratios), and writes one row per
(experiment, scope): the ratio aligned / naive loss barrier in % for ``full`` (data-free: weight distance) and
``learned`` (the same spaces, refined on training data, kept only if not worse on the validation split), how many
pair-rows are at or below the paper's 12 % (the top of its 7-12 % for the attention scopes) under each, and the
learned-matching steps. The steps come from the experiment's config (``configs/<experiment>.toml``,
``protocol.learned_steps``) unless the file's command overrode them (``--learned-steps N``).

Nothing is measured here: every number is one of the source files' (``derived_from``). Seconds::

    python benchmarks/learned_summary.py --out results/learned-summary.json
    symalign docs
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

SOURCES = ("results/vit-digits-learned.json", "results/vit-fmnist-deep-learned.json",
           "results/encoder-wordnet-pairs.json", "results/encoder-wordnet-all-pairs.json")
"""The seed-pair result files with the ``learned`` variant, in the table's order."""

PAPER_TOP = 12.0
"""The top of the paper's 7-12 % (its full stage 2, attention scopes), in %."""


def learned_steps(experiment: str, command: str) -> int:
    """Learned-matching steps of a run: ``--learned-steps N`` in its command, else its config's."""
    from symalign.experiments.config import load_experiment_config

    m = re.search(r"--learned-steps[ =](\d+)", command)
    if m:
        return int(m.group(1))
    return int(load_experiment_config(ROOT / "configs" / f"{experiment}.toml").protocol.learned_steps)


def _per_pair(s: str) -> list[float]:
    return [float(x) for x in s.split(",")]


def rows_of(path: str) -> list[dict]:
    """The summary rows of one source file (its ``pairs`` table rows that have a ``learned`` column)."""
    d = json.loads((ROOT / path).read_text())
    command = str(d["provenance"].get("command", ""))
    out = []
    for r in d["tables"]["pairs"]["rows"]:
        if "learned_per_pair" not in r:
            continue
        full, learned = _per_pair(r["full_per_pair"]), _per_pair(r["learned_per_pair"])
        out.append({
            "experiment": r["experiment"], "scope": r["scope"], "pairs": int(r["pairs"]), "naive": r["naive"],
            "steps": learned_steps(r["experiment"], command),
            "full_pm": r["full_pm"], "learned_pm": f"**{r['learned_pm']}**",
            "full_mean": r["full_mean"], "learned_mean": r["learned_mean"],
            "full_in": f"{sum(x <= PAPER_TOP for x in full)} of {len(full)}",
            "learned_in": f"{sum(x <= PAPER_TOP for x in learned)} of {len(learned)}",
            "lower": f"{sum(b < a for a, b in zip(full, learned))} of {len(full)}",
            "source": f"`{path}`", "commit": str(d["provenance"].get("commit", ""))[:10]})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "results" / "learned-summary.json"))
    args = ap.parse_args()

    from symalign.atomic import write_json
    from symalign.experiments.docs_tables import make_table
    from symalign.provenance import provenance

    missing = [p for p in SOURCES if not (ROOT / p).is_file()]
    if missing:
        print(f"error: no {missing[0]}: regenerate it first (docs/results.md, \"How to regenerate\")", file=sys.stderr)
        return 2
    rows = [r for p in SOURCES for r in rows_of(p)]
    table = make_table(rows, [
        ("experiment", "experiment"), ("scope", "scope"), ("pairs", "pairs"), ("steps", "learned steps"),
        ("naive", "mean naive loss barrier", ".3f"), ("full_pm", "full % (mean ± std)"),
        ("learned_pm", "**learned % (mean ± std)**"), ("full_in", "pairs <= 12 %, full"),
        ("learned_in", "pairs <= 12 %, learned"), ("lower", "pairs where learned < full"),
        ("source", "from"), ("commit", "its commit")])
    prov = provenance(["python", "benchmarks/learned_summary.py", *sys.argv[1:]], threads=1,
                      seed_pairs=min(r["pairs"] for r in rows))
    prov["derived_from"] = list(SOURCES)
    write_json(args.out, {"provenance": prov, "paper_top_percent": PAPER_TOP, "rows": rows,
                          "tables": {"summary": table}})
    for r in rows:
        print(r["experiment"], r["scope"], r["pairs"], r["steps"], r["full_pm"], r["learned_pm"], r["learned_in"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
