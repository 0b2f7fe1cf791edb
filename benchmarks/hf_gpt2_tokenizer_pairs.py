"""The README-style user path on Hugging Face GPT-2 pairs with a trained tokenizer, over several seed pairs.

For each seed pair ``(2p, 2p + 1)``, ``p < --pairs``, exactly the commands of docs/results.md ("Hugging Face
GPT-2 with a trained tokenizer"), run in this process through the CLI:

1. ``python examples/hf_gpt2_pair.py PAIR --steps 600 --seeds a b`` -- two tiny ``GPT2LMHeadModel`` checkpoints
   (2 layers, width 64, 4 heads, 64 positions) trained from the two seeds with a byte-level BPE tokenizer
   (vocabulary 1024, trained by ``tokenizers`` on the training split of the Shakespeare plays);
2. ``symalign align A B -o B-model --scope model`` and ``symalign align A B -o B-attn`` (the attention scope);
3. ``symalign interpolate A B-model --baseline B --scope model`` and ``symalign interpolate A B-attn
   --baseline B`` on the test split read with the checkpoints' own tokenizer (``--context 64 --eval-tokens
   64000``, 25 points): the naive (A -> B) and aligned (A -> B') loss and accuracy barriers, in nats per token;
4. ``symalign merge A B`` four ways, uniform weights, each evaluated on the same windows (``--eval shakespeare
   --context 64 --eval-items 1000``): ``--no-align`` (the plain average), ``--scope attention``,
   ``--scope model`` and ``--scope model --universe`` (3 rounds).

The loss barrier of a curve ``L(t)`` is ``max_t [L(t) - ((1 - t) L(0) + t L(1))]`` (:class:`symalign.lmc.Curve`);
the ratio is ``100 * aligned / naive``. With ``--scope model`` the naive curve joins the rewritten (folded) endpoints,
so only the alignment differs between the two curves. Mean and sample standard deviation over pairs in the
summary table. About 6 minutes per pair at one thread on an idle core::

    python benchmarks/hf_gpt2_tokenizer_pairs.py --pairs 3 --out results/hf-gpt2-tokenizer.json
    symalign docs
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

EVAL = ["--data", "shakespeare", "--context", "64", "--eval-tokens", "64000"]
"""The evaluation options of ``interpolate`` (the test split, 64-token windows, about 63,000 predicted tokens)."""
MERGE_EVAL = ["--eval", "shakespeare", "--context", "64", "--eval-items", "1000"]
"""The same windows for ``merge --eval``."""
MERGES = (("plain", ["--no-align"]), ("attention", ["--scope", "attention"]), ("model", ["--scope", "model"]),
          ("universe", ["--scope", "model", "--universe"]))
"""(label, options) of the four merges."""


def cli(args: list[str], threads: int) -> dict:
    """``symalign ARGS --json --threads N`` in this process; its JSON (a failure stops the run)."""
    from typer.testing import CliRunner

    from symalign.cli import app

    quiet = [] if args[0] == "align" else ["--no-progress"]  # align --json shows no progress
    r = CliRunner().invoke(app, [*args, "--json", "--threads", str(threads), *quiet])
    if r.exit_code != 0:
        raise SystemExit(f"symalign {' '.join(args)} failed (exit {r.exit_code}): {r.output.strip()[-800:]}")
    return json.loads(r.stdout)


def curve_row(res: dict) -> dict:
    """The barriers of ``interpolate --baseline`` (naive = A -> B, aligned = A -> B')."""
    naive, aligned = res["naive"], res["curve"]
    return {"naive_loss": naive["loss_barrier"], "aligned_loss": aligned["loss_barrier"],
            "ratio_percent": res["barrier_ratio_percent"], "naive_acc": naive["acc_barrier"],
            "aligned_acc": aligned["acc_barrier"], "loss_A": aligned["loss"][0], "loss_B": naive["loss"][-1]}


def measure_pair(p: int, work: Path, steps: int, threads: int) -> dict:
    """Train pair ``p`` (seeds ``2p``, ``2p + 1``), align, interpolate and merge it (the module docstring)."""
    seeds = (2 * p, 2 * p + 1)
    pair = work / f"pair{p}"
    subprocess.run([sys.executable, str(ROOT / "examples" / "hf_gpt2_pair.py"), str(pair), "--steps", str(steps),
                    "--seeds", *map(str, seeds), "--threads", str(threads)], check=True)
    a, b = pair / f"gpt2-s{seeds[0]}", pair / f"gpt2-s{seeds[1]}"
    row: dict = {"pair": p, "seeds": list(seeds), "curves": {}, "merges": {}}
    for scope, extra in (("model", ["--scope", "model"]), ("attention", [])):
        out = pair / f"aligned-{scope}"
        row[f"align_{scope}"] = cli(["align", str(a), str(b), "-o", str(out), *extra], threads)["distance"]
        res = cli(["interpolate", str(a), str(out), "--baseline", str(b), *extra, *EVAL,
                   "--out", str(pair / f"lmc-{scope}")], threads)
        row["curves"][scope] = curve_row(res)
        row["evaluation"] = res["evaluation"]
    for label, opts in MERGES:
        res = cli(["merge", str(a), str(b), "-o", str(pair / f"merged-{label}"), *opts, *MERGE_EVAL], threads)
        models = res["eval"]["models"]
        row["merges"][label] = {"merged": res["eval"]["merged"], "scope": res.get("scope")}
        row["inputs"] = [models[str(a)], models[str(b)]]
        shutil.rmtree(pair / f"merged-{label}")
    return row


def mean_std(xs: list[float], fmt: str = ".4f") -> str:
    """``mean +- sample std`` of ``xs`` (the value alone for one pair)."""
    return f"{statistics.mean(xs):{fmt}} +- {statistics.stdev(xs):{fmt}}" if len(xs) > 1 else f"{xs[0]:{fmt}}"


def tables(rows: list[dict]) -> dict:
    """``curves`` (one row per pair and scope), ``merges`` (one row per pair and merge) and ``summary`` (mean and
    sample standard deviation over pairs)."""
    from symalign.experiments.docs_tables import make_table

    names = {"model": "whole model (`--scope model`)", "attention": "attention only"}
    curves = [{"pair": f"seeds {r['seeds'][0]}, {r['seeds'][1]}", "alignment": names[s], **r["curves"][s]}
              for r in rows for s in ("model", "attention")]
    merge_names = {"plain": "naive (`--no-align`)", "attention": "attention aligned",
                   "model": "whole model aligned (`--scope model`)", "universe": "universe (`--universe`, 3 rounds)"}
    merges = []
    for r in rows:
        ia, ib = r["inputs"]
        merges.append({"pair": f"seeds {r['seeds'][0]}, {r['seeds'][1]}", "merge": "input A / input B",
                       "loss": f"{ia['loss']:.4f} / {ib['loss']:.4f}",
                       "byte": f"{ia['loss_per_byte']:.4f} / {ib['loss_per_byte']:.4f}",
                       "acc": f"{ia['accuracy']:.4f} / {ib['accuracy']:.4f}"})
        for label, m in r["merges"].items():
            mm = m["merged"]
            merges.append({"pair": merges[-1]["pair"], "merge": merge_names[label], "loss": f"{mm['loss']:.4f}",
                           "byte": f"{mm['loss_per_byte']:.4f}", "acc": f"{mm['accuracy']:.4f}"})
    summary = [{"what": f"ratio, {names[s]}", "value": mean_std([r["curves"][s]["ratio_percent"] for r in rows], ".1f")
                + " %"} for s in ("model", "attention")]
    summary += [{"what": f"merged loss, {merge_names[k]}",
                 "value": mean_std([r["merges"][k]["merged"]["loss"] for r in rows])} for k, _ in MERGES]
    summary.append({"what": "input loss (mean of A and B)",
                    "value": mean_std([(r["inputs"][0]["loss"] + r["inputs"][1]["loss"]) / 2 for r in rows])})
    for s in summary:
        s["pairs"] = len(rows)
    return {
        "curves": make_table(curves, [("pair", "pair"), ("alignment", "alignment"),
                                      ("naive_loss", "naive loss barrier", ".4f"),
                                      ("aligned_loss", "aligned loss barrier", ".4f"),
                                      ("ratio_percent", "ratio %", ".1f"),
                                      ("naive_acc", "naive acc. barrier", ".4f"),
                                      ("aligned_acc", "aligned acc. barrier", ".4f")]),
        "merges": make_table(merges, [("pair", "pair"), ("merge", "merge"), ("loss", "loss (nats/token)"),
                                      ("byte", "nats/byte"), ("acc", "accuracy")]),
        "summary": make_table(summary, [("what", "quantity"), ("value", "mean +- std over pairs"),
                                        ("pairs", "pairs")]),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "results" / "hf-gpt2-tokenizer.json"))
    args = ap.parse_args()
    import torch

    from symalign.atomic import write_json
    from symalign.provenance import provenance

    torch.set_num_threads(args.threads)
    prov = provenance(["python", "benchmarks/hf_gpt2_tokenizer_pairs.py", *sys.argv[1:]], threads=args.threads,
                      seed_pairs=args.pairs)
    rows = []
    with tempfile.TemporaryDirectory(prefix="symalign-gpt2-tok-") as d:
        for p in range(args.pairs):
            rows.append(measure_pair(p, Path(d), args.steps, args.threads))
            c = rows[-1]["curves"]
            print(f"pair {p}: ratio model {c['model']['ratio_percent']:.1f} %, attention "
                  f"{c['attention']['ratio_percent']:.1f} %; merged loss "
                  + ", ".join(f"{k} {v['merged']['loss']:.4f}" for k, v in rows[-1]["merges"].items()), flush=True)
            shutil.rmtree(Path(d) / f"pair{p}")
    write_json(args.out, {"provenance": prov, "steps": args.steps, "pairs": len(rows), "rows": rows,
                          "tables": tables(rows)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
