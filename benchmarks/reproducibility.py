"""What reproducibility holds: the same experiment run twice, and at another thread count, compared file by file.

Each ``--run LABEL=THREADS=DIR`` is the runs directory of one ``symalign experiment CONFIG --threads
THREADS --out DIR`` (the first one is the reference). For every scope present in all of them it
compares, against the reference: the trained checkpoints (``model.safetensors`` byte for byte:
base, seed A, seed B; and the largest absolute difference of any weight), the loss barriers
(naive and every stage-2 variant: largest absolute difference in nats), the naive and aligned
curves (largest absolute difference of any curve point's loss) and the loss-barrier ratio of
every stage-2 variant (largest absolute difference in percentage points). Writes a result
file (JSON, atomically)::

    symalign experiment configs/vit-digits-rope.toml --threads 1 --scope first-attention --out runs/rep-a
    symalign experiment configs/vit-digits-rope.toml --threads 1 --scope first-attention --out runs/rep-b
    symalign experiment configs/vit-digits-rope.toml --threads 2 --scope first-attention --out runs/rep-t2
    python benchmarks/reproducibility.py vit-digits-rope --run a=1=runs/rep-a --run b=1=runs/rep-b \\
        --run t2=2=runs/rep-t2 --out results/reproducibility.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import sys
from pathlib import Path

from symalign.atomic import write_json
from symalign.experiments.docs_tables import make_table
from symalign.provenance import provenance


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def checkpoints(scope_dir: Path) -> dict[str, str]:
    """``{relative path: sha256}`` of every ``model.safetensors`` under the scope (and the base beside it)."""
    out = {}
    for root in (scope_dir, scope_dir.parent / "base"):
        for p in sorted(root.rglob("model.safetensors")):
            out[str(p.relative_to(scope_dir.parent))] = digest(p)
    return out


def max_weight_diff(ref_scope: Path, other_scope: Path) -> float:
    """Largest ``|w - w'|`` over every tensor of every checkpoint (base, seed A, seed B) of the two scopes."""
    from safetensors.torch import load_file

    worst = 0.0
    ref_files = [*ref_scope.rglob("model.safetensors"), *(ref_scope.parent / "base").rglob("model.safetensors")]
    for p in sorted(ref_files):
        q = other_scope.parent / p.relative_to(ref_scope.parent)
        a, b = load_file(str(p)), load_file(str(q))
        for k in a:
            worst = max(worst, float((a[k].double() - b[k].double()).abs().max()))
    return worst


def barriers(res: dict) -> dict[str, float]:
    out = {"naive": res["naive"]["loss_barrier"]}
    out.update({k: v["curve"]["loss_barrier"] for k, v in res["variants"].items()})
    return out


def curves(res: dict) -> dict[str, list[float]]:
    out = {"naive": res["naive"]["loss"]}
    out.update({k: v["curve"]["loss"] for k, v in res["variants"].items()})
    return out


def compare(ref: Path, other: Path) -> dict:
    ra, rb = json.loads((ref / "results.json").read_text()), json.loads((other / "results.json").read_text())
    ca, cb = checkpoints(ref), checkpoints(other)
    same = sum(1 for k in ca if cb.get(k) == ca[k])
    xa, xb = curves(ra), curves(rb)
    dcurve = max(abs(u - v) for k in xa for u, v in zip(xa[k], xb[k]))
    ratios = {k: (v["loss_barrier_ratio_percent"], rb["variants"][k]["loss_barrier_ratio_percent"])
              for k, v in ra["variants"].items()}
    dratio = max(abs(a - b) for a, b in ratios.values())
    ba, bb = barriers(ra), barriers(rb)
    acc = tuple(f"{r['endpoints']['A']['acc']:.3f} / {r['endpoints']['B']['acc']:.3f}" for r in (ra, rb))
    return {"checkpoints_identical": same, "checkpoints": len(ca), "max_curve_loss_diff": dcurve,
            "max_weight_diff": max_weight_diff(ref, other), "acc": acc,
            "barriers": {k: (ba[k], bb[k]) for k in ba},
            "max_barrier_diff": max(abs(ba[k] - bb[k]) for k in ba),
            "naive_barrier": (ra["naive"]["loss_barrier"], rb["naive"]["loss_barrier"]),
            "ratios": ratios, "max_ratio_diff_points": dratio,
            "bit_for_bit": same == len(ca) and dcurve == 0.0 and dratio == 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("experiment")
    ap.add_argument("--run", action="append", required=True, help="LABEL=THREADS=DIR (the first is the reference)")
    ap.add_argument("--command", default=None, help="the full command to record (default: this one)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    runs = [r.split("=", 2) for r in args.run]
    (ref_label, ref_threads, ref_dir), others = runs[0], runs[1:]
    rows, details = [], []
    for label, threads, d in others:
        base = Path(ref_dir) / args.experiment
        for scope in sorted(p.name for p in base.iterdir() if (p / "results.json").exists()):
            if not (Path(d) / args.experiment / scope / "results.json").exists():
                continue
            c = compare(base / scope, Path(d) / args.experiment / scope)
            details.append({"reference": ref_label, "other": label, "scope": scope, **c})
            full = c["ratios"].get("full", (None, None))
            rows.append({"comparison": f"{ref_label} ({ref_threads} thread) vs {label} ({threads} thread"
                                       f"{'s' if threads != '1' else ''})",
                         "scope": scope, "ckpt": f"{c['checkpoints_identical']} / {c['checkpoints']}",
                         "bit": "yes" if c["bit_for_bit"] else "no", "dweight": c["max_weight_diff"],
                         "dbarrier": c["max_barrier_diff"], "acc_a": c["acc"][0], "acc_b": c["acc"][1],
                         "naive_a": c["naive_barrier"][0], "naive_b": c["naive_barrier"][1],
                         "full_a": full[0], "full_b": full[1], "dcurve": c["max_curve_loss_diff"],
                         "dratio": c["max_ratio_diff_points"]})
    cols = [("comparison", "runs compared"), ("scope", "scope"), ("ckpt", "identical checkpoints"),
            ("bit", "bit-for-bit"), ("dweight", "max weight diff", ".2e"),
            ("acc_a", "test acc A / B (ref)"), ("acc_b", "test acc A / B"),
            ("naive_a", "naive barrier (ref)", ".4f"), ("naive_b", "naive barrier", ".4f"),
            ("full_a", "full % (ref)", ".2f"), ("full_b", "full %", ".2f"),
            ("dbarrier", "max barrier diff (nats)", ".2e"), ("dcurve", "max curve loss diff", ".2e"),
            ("dratio", "max ratio diff (points)", ".2f")]
    command = args.command or shlex.join(["python", "benchmarks/reproducibility.py", *sys.argv[1:]])
    write_json(args.out, {"provenance": provenance(command, int(ref_threads), 1),
                          "tables": {"reproducibility": make_table(rows, cols)}, "comparisons": details})
    for r in rows:
        print(r)


if __name__ == "__main__":
    main()
