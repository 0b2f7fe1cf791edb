"""Align and interpolate the BERT and ViT pairs of ``hf_bert_vit_pairs.py``; write the barriers as a result file.

    python examples/hf_bert_vit_results.py PAIR_DIR [-o OUT.json] [--seeds 0 1] [--threads N]

For each model (``bert``, ``vit``) and each alignment scope (``attention``,
``model``) this runs::

    symalign align PAIR/M-s0 PAIR/M-s1 -o PAIR/M-s1-aligned-SCOPE --scope SCOPE --force --json
    symalign interpolate PAIR/M-s0 PAIR/M-s1-aligned-SCOPE --baseline PAIR/M-s1 --scope SCOPE --json ...

with ``--threads`` threads (else ``$SYMALIGN_THREADS``, else 1: passed to each command as
``SYMALIGN_THREADS``); the count the commands report having used is recorded (one count for all,
else the script stops), beside the count each pair was trained with (``PAIR/M-pair.json`` of
``hf_bert_vit_pairs.py``, when present). The result goes to ``PAIR/hf-bert-vit.json`` unless
``-o`` says otherwise: the committed ``results/hf-bert-vit.json`` is replaced only when asked for
(``-o results/hf-bert-vit.json``).

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


def cli(threads: int, *args: str) -> dict:
    """``symalign ARGS... --json`` in a subprocess with ``threads`` threads; its JSON output."""
    n = str(threads)
    env = dict(os.environ, SYMALIGN_THREADS=n, OMP_NUM_THREADS=n, MKL_NUM_THREADS=n)
    out = subprocess.run([sys.executable, "-m", "symalign.cli", *args], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"symalign {' '.join(args)} failed (exit {out.returncode}): {out.stderr.strip()}")
    return json.loads(out.stdout[out.stdout.index("{"):])


def pair_threads(pair: Path, model: str) -> int | None:
    """The threads the pair was trained with (``PAIR/M-pair.json`` of ``hf_bert_vit_pairs.py``)."""
    try:
        return int(json.loads((pair / f"{model}-pair.json").read_text())["threads"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def run_pair(pair: Path, model: str, scope: str, seeds: tuple[int, int], runs: Path, threads: int) -> dict:
    a, b = pair / f"{model}-s{seeds[0]}", pair / f"{model}-s{seeds[1]}"
    aligned = pair / f"{model}-s{seeds[1]}-aligned-{scope}"
    info = cli(threads, "align", str(a), str(b), "-o", str(aligned), "--scope", scope, "--force", "--json")
    res = cli(threads, "interpolate", str(a), str(aligned), "--baseline", str(b), "--scope", scope, *EVAL[model],
              "--no-progress", "--json", "-o", str(runs / f"{model}-{scope}"))
    used = {int(info["threads"]), int(res["threads"])}
    if used != {threads}:
        sys.exit(f"asked for {threads} threads, but the commands ran with {sorted(used)}")
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
        "threads": threads, "pair_threads": pair_threads(pair, model),
    }


def main(argv: list[str] | None = None) -> None:
    import _threads

    from symalign.atomic import write_json
    from symalign.experiments.docs_tables import make_table
    from symalign.provenance import provenance

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("pair", type=Path)
    p.add_argument("-o", "--out", type=Path, default=None,
                   help="result file (default PAIR/hf-bert-vit.json; the committed one: results/hf-bert-vit.json)")
    p.add_argument("--seeds", type=int, nargs=2, default=[0, 1])
    p.add_argument("--models", nargs="+", default=["bert", "vit"])
    _threads.add_option(p)
    args = p.parse_args(argv)
    args.out = args.out if args.out is not None else args.pair / "hf-bert-vit.json"
    threads = _threads.use(p, args.threads)
    rows = []
    for model in args.models:
        for scope in ("attention", "model"):
            row = run_pair(args.pair, model, scope, tuple(args.seeds), args.pair / "runs", threads)
            print(json.dumps(row), flush=True)
            rows.append(row)
    columns = [("model", "model / data"), ("seeds", "seeds"), ("scope", "alignment"),
               ("loss_ab", "loss A / B"), ("acc_ab", "acc. A / B"),
               ("naive", "naive loss barrier", ".4f"), ("aligned", "aligned loss barrier", ".4f"),
               ("ratio", "ratio %", ".1f"), ("naive_acc", "naive acc. barrier", ".4f"),
               ("aligned_acc", "aligned acc. barrier", ".4f")]
    t = f" --threads {threads}"
    command = ["python", "examples/hf_bert_vit_pairs.py", str(args.pair) + t, "&&", "python",
               "examples/hf_bert_vit_results.py", str(args.pair), "-o", str(args.out) + t]
    result = {"provenance": provenance(" ".join(command), threads=threads, seed_pairs=1),
              "tables": {"barriers": make_table(rows, columns)}, "rows": rows}
    write_json(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
