"""Many-model merges and width pairs of ``benchmarks/universe_widths.py`` runs as a result file that
``symalign docs`` renders.

Reads the JSON of one or more ``universe_widths.py --same ... --learned-steps N --alpha A --out RUN.json``
runs on the same models and writes one table, ``merges``: each model alone, the vanilla average (and the
vanilla average of the rewritten models, where the run recorded it), universe matching (the same in every
run: it is checked equal, and taken from the first) and the ``learn_many`` merge of every run, with its
Dirichlet concentration ``alpha``, steps, whether the learned transforms were kept (``selected``) and the
largest function change of an aligned model. Test loss and accuracy are on the runs' test split (``items``
examples). ``--widths RUN.json`` (a ``universe_widths.py --wide A --narrow B`` run) adds the table
``widths``: the naive and the weight-matched curve from A to the embedded B, their loss and accuracy
barriers, the midpoint, the ratio to the naive barrier, and the function change of the embedded and
aligned B::

    python benchmarks/universe_table.py runs/alpha/universe-alpha0.1.json runs/alpha/universe-alpha1.json \\
        --command "..." --out results/learn-many-alpha.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from symalign.atomic import write_json
from symalign.errors import ConfigError
from symalign.experiments.docs_tables import make_table
from symalign.provenance import provenance


def rows(runs: list[dict]) -> list[dict]:
    """The table's rows from ``runs`` (``universe_widths.py`` results with a ``universe`` block)."""
    first = runs[0]["universe"]
    for r in runs[1:]:
        u = r["universe"]
        if u["universe"]["loss"] != first["universe"]["loss"] or u["names"] != first["names"]:
            raise ConfigError("the runs do not share their models and universe matching; give runs of one --same set")
    out = [{"merge": f"model {i + 1} alone ({Path(n).name})", "loss": m["loss"], "acc": 100 * m["acc"]}
           for i, (n, m) in enumerate(zip(first["names"], first["models"]))]
    out.append({"merge": "vanilla average", "loss": first["vanilla"]["loss"], "acc": 100 * first["vanilla"]["acc"]})
    if "vanilla-rewritten" in first:
        v = first["vanilla-rewritten"]
        out.append({"merge": "vanilla average of the rewritten models", "loss": v["loss"], "acc": 100 * v["acc"]})
    uni = first["universe"]
    out.append({"merge": f"universe matching ({uni['rounds']} rounds)", "loss": uni["loss"], "acc": 100 * uni["acc"],
                "function_change": uni["function_change"]})
    for r in runs:
        lm = r["universe"]["learned-many"]
        out.append({"merge": "learn_many", "alpha": r["args"]["alpha"], "steps": lm["steps"], "loss": lm["loss"],
                    "acc": 100 * lm["acc"], "selected": lm["selected"], "function_change": lm["function_change"],
                    "time_s": round(lm["time_s"])})
    return out


def width_rows(run: dict) -> list[dict]:
    """The ``widths`` table's rows from a ``universe_widths.py --wide A --narrow B`` run: the naive curve (A to
    the embedded B, unaligned) and the weight-matched one (``match_widths``)."""
    if "widths" not in run:
        raise ConfigError("the --widths run has no widths block (universe_widths.py --wide A --narrow B)")
    w = run["widths"]
    out = []
    for key, name in (("naive", "naive (embedded B, unaligned)"), ("weight", "weight matching (`match_widths`)")):
        c = w[key]
        mid = len(c["t"]) // 2
        row = {"curve": name, "loss_barrier": c["loss_barrier"], "acc_barrier": 100 * c["acc_barrier"],
               "mid_loss": c["loss"][mid], "mid_acc": 100 * c["acc"][mid]}
        if key == "weight":
            row |= {"ratio": w["loss_barrier_ratio_percent"], "seconds": round(w["match"]["seconds"]),
                    "embed_change": w["embed_change"], "aligned_change": w["aligned_change"]}
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path, help="universe_widths.py JSON results (one --same set)")
    p.add_argument("--widths", type=Path, help="a universe_widths.py --wide/--narrow JSON result (the widths table)")
    p.add_argument("--command", help="the commands that made the runs (recorded in the provenance)")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    runs = [json.loads(r.read_text()) for r in a.runs]
    if any("universe" not in r for r in runs):
        raise SystemExit("every run needs a universe block (universe_widths.py --same ...)")
    table = make_table(rows(runs), [("merge", "merge"), ("alpha", "Dirichlet alpha"), ("steps", "steps"),
                                    ("loss", "test loss", ".4f"), ("acc", "test acc %", ".2f"),
                                    ("selected", "kept"), ("function_change", "function change", ".1e"),
                                    ("time_s", "seconds")])
    tables = {"merges": table}
    if a.widths is not None:
        wrun = json.loads(a.widths.read_text())
        tables["widths"] = make_table(width_rows(wrun), [
            ("curve", "curve (A -> B)"), ("loss_barrier", "loss barrier", ".3f"), ("ratio", "% of naive", ".1f"),
            ("acc_barrier", "acc barrier %", ".1f"), ("mid_loss", "loss at t=0.5", ".3f"),
            ("mid_acc", "acc at t=0.5 %", ".1f"), ("embed_change", "embedded B: function change", ".1e"),
            ("aligned_change", "aligned B: function change", ".1e"), ("seconds", "matching s")])
    this = "python benchmarks/universe_table.py " + " ".join(map(str, a.runs)) + \
        (f" --widths {a.widths}" if a.widths is not None else "") + f" --out {a.out}"
    command = f"{a.command}; {this}" if a.command else this
    write_json(a.out, {"provenance": provenance(command, threads=runs[0]["threads"], seed_pairs=None),
                       "data": runs[0]["data"], "items": runs[0]["items"], "tables": tables})
    print(json.dumps(table["rows"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
