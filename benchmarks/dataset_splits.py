"""The built-in datasets' split sizes (docs/training.md), as a result file.

Loads each built-in dataset with ``symalign.data.load_dataset(name, split_seed=0)`` (and ``digits`` once more
with ``test_fraction=0.25``, as ``symalign demo`` uses) and records its train / val / test sizes (examples;
language-model corpora: bytes), classes, input length, and for classification the majority class's share of the
training and the test split. A dataset that is not installed on this machine is recorded as such, with the command that
installs it (the loader's own message), not left out. Seconds (the loaders cache under ``$SYMALIGN_CACHE``)::

    python benchmarks/dataset_splits.py --out results/dataset-splits.json
    symalign docs
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

DATASETS = (("digits", {}), ("digits", {"test_fraction": 0.25}), ("fashion-mnist", {}), ("shakespeare", {}),
            ("bible", {}), ("wordnet", {}), ("fortunes", {}))
"""(name, load_dataset options) of each row."""
WHAT = {"digits": "images, scikit-learn", "fashion-mnist": "images (official test set)",
        "shakespeare": "bytes, 38 plays stripped of Markdown (64 KiB chunks assigned by seed)",
        "bible": "bytes, KJV (64 KiB chunks assigned by seed)", "wordnet": "gloss -> lexicographer file",
        "fortunes": "entry -> category (categories with >= 60 entries)"}
"""What each dataset is (words; every number in the table is measured)."""


def _count(n: int, lm: bool) -> str:
    if not lm:
        return f"{n:,}"
    return f"{n / 1e6:.2f} M" if n >= 1e6 else f"{n / 1e3:.0f} k"


def measure(name: str, opts: dict) -> dict:
    from symalign.data import load_dataset
    from symalign.errors import DatasetError

    row: dict = {"name": name, "options": opts}
    try:
        ds = load_dataset(name, split_seed=0, **opts)
    except DatasetError as exc:
        return {**row, "installed": False, "error": str(exc)}
    s = ds.summary()
    row.update(installed=True, task=s["task"], sizes=s["sizes"], classes=s["n_classes"],
               input_shape=s["input_shape"], vocab=s["vocab_size"])
    for split in ("train", "test"):
        y = getattr(ds, f"y_{split}")
        if y is not None:
            counts = y.flatten().bincount()
            row[f"majority_{split}"] = float(counts.max()) / float(counts.sum())
    return row


def shown(r: dict) -> dict:
    opts = ", ".join(f"`{k}={v}`" for k, v in r["options"].items())
    out = {"name": f"`{r['name']}`" + (f" ({opts})" if opts else "")}
    if not r["installed"]:
        how = r["error"].rpartition(" with: ")[2] if " with: " in r["error"] else r["error"]
        return {**out, "task": WHAT[r["name"]], "split": f"not installed when measured (`{how}`)"}
    lm = r["task"] == "lm"
    shape = "x".join(map(str, r["input_shape"][1:] if len(r["input_shape"]) == 3 else r["input_shape"]))
    if lm:
        task = f"{WHAT[r['name']]}; vocab {r['vocab']}"
    elif r["vocab"]:
        task = f"{WHAT[r['name']]}, {r['classes']} classes, {shape} bytes"
    else:
        task = f"{shape} {WHAT[r['name']]}, {r['classes']} classes"
    split = " / ".join(_count(r["sizes"][k], lm) for k in ("train", "val", "test")) + (" bytes" if lm else "")
    if r.get("majority_test") is not None and r["vocab"]:
        split += f" (majority class: {r['majority_test']:.1%} of test, {r['majority_train']:.1%} of train)"
    return {**out, "task": task, "split": split}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "results" / "dataset-splits.json"))
    args = ap.parse_args()
    import torch

    from symalign.atomic import write_json
    from symalign.experiments.docs_tables import make_table
    from symalign.provenance import provenance

    torch.set_num_threads(args.threads)
    prov = provenance(["python", "benchmarks/dataset_splits.py", *sys.argv[1:]], threads=args.threads)
    rows = [measure(name, opts) for name, opts in DATASETS]
    table = make_table([shown(r) for r in rows], [("name", "name"), ("task", "task"),
                                                  ("split", "train / val / test (seeded, `split_seed=0`)")])
    write_json(args.out, {"provenance": prov, "split_seed": 0, "datasets": rows, "tables": {"splits": table}})
    for r in rows:
        print(r["name"], r["options"], r.get("sizes") or "not installed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
