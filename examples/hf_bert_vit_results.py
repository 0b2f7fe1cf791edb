"""Align and interpolate the BERT and ViT pairs of ``hf_bert_vit_pairs.py``; write the barriers as a result file.

    python examples/hf_bert_vit_results.py PAIR_DIR [-o results/hf-bert-vit.json] [--seeds 0 1]

For each model (``bert``, ``vit``) and each alignment scope (``attention``,
``model``) this runs, with one thread::

    symalign align PAIR/M-s0 PAIR/M-s1 -o PAIR/M-s1-aligned-SCOPE --scope SCOPE
    symalign interpolate PAIR/M-s0 PAIR/M-s1-aligned-SCOPE --baseline PAIR/M-s1 --scope SCOPE --json ...

BERT is evaluated on the Shakespeare test split's raw text read with the
checkpoints' WordPiece tokenizer, masked LM with the fixed seeded 15 % masks
(``--context 64 --eval-items 500``); the ViT on the ``digits`` test split
through its saved image processor. The naive barrier is that of A -> B (in the
whole-model format for ``--scope model``), the aligned one that of A -> aligned B;
ratio = aligned / naive. The result file holds a provenance record and the
table ``barriers`` (rendered into docs/results.md by ``symalign docs``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

EVAL = {
    "bert": ["--data", "shakespeare", "--context", "64", "--eval-items", "500"],
    "vit": ["--data", "digits"],
}
WHAT = {"bert": "BERT masked LM / Shakespeare (WordPiece)", "vit": "ViT / digits"}


def cli(*args: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-m", "symalign.cli", *args], env=env, check=True, capture_output=True,
                         text=True)
    return out.stdout


def run_pair(pair: Path, model: str, scope: str, seeds: tuple[int, int], runs: Path) -> dict:
    a, b = pair / f"{model}-s{seeds[0]}", pair / f"{model}-s{seeds[1]}"
    aligned = pair / f"{model}-s{seeds[1]}-aligned-{scope}"
    cli("align", str(a), str(b), "-o", str(aligned), "--scope", scope)
    text = cli("interpolate", str(a), str(aligned), "--baseline", str(b), "--scope", scope, *EVAL[model],
               "--no-progress", "--json", "-o", str(runs / f"{model}-{scope}"))
    res = json.loads(text[text.index("{"):])
    naive, curve = res["naive"], res["curve"]
    return {
        "model": WHAT[model], "scope": "whole model" if scope == "model" else "attention only",
        "seeds": f"{seeds[0]}, {seeds[1]}",
        "loss_ab": f"{curve['loss'][0]:.4f} / {curve['loss'][-1]:.4f}",
        "acc_ab": f"{curve['acc'][0]:.3f} / {curve['acc'][-1]:.3f}",
        "naive": naive["loss_barrier"], "aligned": curve["loss_barrier"],
        "ratio": 100.0 * curve["loss_barrier"] / naive["loss_barrier"] if naive["loss_barrier"] > 0 else None,
        "naive_acc": naive["acc_barrier"], "aligned_acc": curve["acc_barrier"],
        "items": res["evaluation"].get("items"), "tokens": res["evaluation"].get("tokens"),
    }


def main() -> None:
    from symalign.atomic import write_json
    from symalign.experiments.docs_tables import make_table
    from symalign.provenance import provenance

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("pair", type=Path)
    p.add_argument("-o", "--out", type=Path, default=Path("results/hf-bert-vit.json"))
    p.add_argument("--seeds", type=int, nargs=2, default=[0, 1])
    p.add_argument("--models", nargs="+", default=["bert", "vit"])
    args = p.parse_args()
    rows = []
    for model in args.models:
        for scope in ("attention", "model"):
            row = run_pair(args.pair, model, scope, tuple(args.seeds), args.pair / "runs")
            print(json.dumps(row), flush=True)
            rows.append(row)
    columns = [("model", "model / data"), ("seeds", "seeds"), ("scope", "alignment"),
               ("loss_ab", "loss A / B"), ("acc_ab", "acc. A / B"),
               ("naive", "naive loss barrier", ".4f"), ("aligned", "aligned loss barrier", ".4f"),
               ("ratio", "ratio %", ".1f"), ("naive_acc", "naive acc. barrier", ".4f"),
               ("aligned_acc", "aligned acc. barrier", ".4f")]
    command = ["python", "examples/hf_bert_vit_pairs.py", str(args.pair), "&&", "python",
               "examples/hf_bert_vit_results.py", str(args.pair), "-o", str(args.out)]
    result = {"provenance": provenance(" ".join(command), threads=1, seed_pairs=1),
              "tables": {"barriers": make_table(rows, columns)}, "rows": rows}
    write_json(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
