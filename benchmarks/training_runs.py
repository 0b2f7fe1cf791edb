"""The training runs of docs/training.md ("Results"), as a result file.

Each run is one ``symalign train ... --json > runs/<name>.json`` of docs/training.md's "Runs"
section. This script reads each run's final metadata (``runs/<name>.json``: the configs, the
step reached, ``metrics``) and its last checkpoint's ``config.json`` (``history``: one record
per evaluation, ``val_*`` at step ``s``), and writes one table row per run:

* the validation metric at the last step, with the earlier evaluations in brackets
  (``@s``): the accuracy in % for classifiers, the loss in nats per byte for the
  character-level LMs (their vocabulary is the 256 bytes, so per token = per byte);
* the same metric on the test split;
* the recorded training wall time (``metrics.train_seconds``, summed over resumed
  sittings) and the mean throughput of the history's records.

Seconds::

    python benchmarks/training_runs.py --runs runs --out results/training-runs.json
    symalign docs
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

RUNS = (("gpt-shakespeare-rope", "GPT Shakespeare", "RoPE"),
        ("gpt-shakespeare-sinusoidal", "GPT Shakespeare", "sinusoidal"),
        ("vit-fashion-rope", "ViT Fashion-MNIST", "RoPE"),
        ("vit-fashion-sinusoidal", "ViT Fashion-MNIST", "sinusoidal"),
        ("encoder-wordnet-rope", "encoder WordNet", "RoPE"),
        ("encoder-wordnet-sinusoidal", "encoder WordNet", "sinusoidal"))
"""(file name under --runs, what is trained, positional encoding) of each row, in the table's order."""

COMMAND = ("for pe in rope sinusoidal; do symalign train ... --seed 0 --threads 1 --out runs/<name> --json > "
           "runs/<name>.json; done (the six commands of docs/training.md, \"Runs\", one after another, "
           "beside other single-threaded work)")
"""How the runs were made (docs/training.md gives them in full)."""


def read_run(runs: Path, name: str) -> dict:
    """One run's final metadata with its checkpoint's evaluation history (``history``)."""
    meta = json.loads((runs / f"{name}.json").read_text())
    ckpt = Path(meta["checkpoint"])
    if not ckpt.is_absolute():
        ckpt = ROOT / ckpt
    meta["history"] = json.loads((ckpt / "config.json").read_text()).get("history", [])
    return meta


def _metric(is_lm: bool) -> tuple[str, str]:
    """(metric key, how it is shown): loss in nats per byte for LMs, accuracy in % otherwise."""
    return ("loss", "{:.3f}") if is_lm else ("accuracy", "{:.1%}")


def row(meta: dict, what: str, pe: str) -> dict:
    """The table row of one run (see the module docstring)."""
    m, hist = meta["metrics"], meta["history"]
    is_lm = "val_accuracy" not in m
    key, fmt = _metric(is_lm)
    shown = fmt.format(m[f"val_{key}"]).replace("%", " %")
    earlier = [f"{fmt.format(h[f'val_{key}']).replace('%', '')} @{h['step']}" for h in hist[:-1]]
    unit = " nats/byte" if is_lm else ""
    val = f"**{shown}**{unit}" + (f" ({', '.join(earlier)})" if earlier else "")
    test = fmt.format(m[f"test_{key}"]).replace("%", " %")
    rate_key = next((k for k in (hist[-1] if hist else {}) if k.endswith("_per_s")), None)
    rate = statistics.mean(h[rate_key] for h in hist) if rate_key else None
    wall = f"{m['train_seconds']:.0f} s" + (f" ({rate:,.0f} {rate_key[:-6]}/s)" if rate else "")
    return {"run": what, "pe": pe, "steps": meta["step"], "val": val, "test": test, "wall": wall,
            "metrics": m, "history": hist, "seed": meta["seed"], "model": meta["model"],
            "train": meta["train"], "data": meta["data"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default="runs", help="The folder holding <name>.json and <name>/ of each run.")
    ap.add_argument("--out", default=str(ROOT / "results" / "training-runs.json"))
    args = ap.parse_args()

    from symalign.atomic import write_json
    from symalign.experiments.docs_tables import make_table
    from symalign.provenance import provenance

    runs = Path(args.runs)
    missing = [n for n, _, _ in RUNS if not (runs / f"{n}.json").is_file()]
    if missing:
        print(f"error: no {runs}/{missing[0]}.json: run docs/training.md's commands first", file=sys.stderr)
        return 2
    rows = [row(read_run(runs, n), what, pe) for n, what, pe in RUNS]
    prov = provenance(f"{COMMAND}; python benchmarks/training_runs.py {' '.join(sys.argv[1:])}".strip(), threads=1)
    table = make_table(rows, [("run", "run"), ("pe", "PE"), ("steps", "steps"), ("val", "val"),
                              ("test", "test"), ("wall", "wall time")])
    write_json(args.out, {"provenance": prov, "runs": [n for n, _, _ in RUNS], "rows": rows,
                          "tables": {"runs": table}})
    for r in rows:
        print(r["run"], r["pe"], r["val"], r["test"], r["wall"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
