"""Training throughput of the built-in GPT and ViT vs Hugging Face GPT-2 / ViT of the same shape.

Each step is forward + cross-entropy + backward + AdamW on the same batches
(Fashion-MNIST / Shakespeare if installed, else random data of the same shape).
Trials alternate between the two implementations (robust to a shared, noisy
machine); the median trial is reported. Ratio = ours / HF (>= 1: ours as fast).

    .venv/bin/python benchmarks/bench_train.py --threads 2 --steps 20 --trials 3

``--out FILE`` writes a result file (JSON, atomically, with its provenance and the load average before and
after) whose ``throughput`` table docs/training.md shows (``symalign docs`` renders it)::

    python benchmarks/bench_train.py --threads 1 --steps 10 --trials 3 --out benchmarks/results/train_throughput.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F


def gpt_pair(d: int, layers: int, heads: int, ctx: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    from symalign.models import ModelConfig, build_model

    ours = build_model(ModelConfig(family="gpt", d_model=d, n_layers=layers, n_heads=heads, pe="learned",
                                   max_len=ctx, vocab_size=256), seed=0)
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=ctx, n_embd=d, n_layer=layers, n_head=heads,
                                    n_inner=4 * d, activation_function="gelu", resid_pdrop=0.0, embd_pdrop=0.0,
                                    attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                                    attn_implementation="sdpa"))
    return ours, lambda x: ours(x), hf, lambda x: hf(input_ids=x).logits


def vit_pair(d: int, layers: int, heads: int, patch: int):
    from transformers import ViTConfig, ViTForImageClassification

    from symalign.models import ModelConfig, build_model

    ours = build_model(ModelConfig(family="vit", d_model=d, n_layers=layers, n_heads=heads, pe="learned",
                                   image_size=28, patch_size=patch, channels=1, n_classes=10), seed=0)
    hf = ViTForImageClassification(ViTConfig(hidden_size=d, num_hidden_layers=layers, num_attention_heads=heads,
                                             intermediate_size=4 * d, image_size=28, patch_size=patch,
                                             num_channels=1, num_labels=10, hidden_dropout_prob=0.0,
                                             attention_probs_dropout_prob=0.0, attn_implementation="sdpa"))
    return ours, lambda x: ours(x), hf, lambda x: hf(pixel_values=x).logits


def batches(kind: str, n: int, batch: int, ctx: int):
    from symalign.data import load_dataset, train_batch
    from symalign.errors import DatasetError

    try:
        ds = load_dataset("shakespeare" if kind == "gpt" else "fashion-mnist")
        source = ds.name
        out = [train_batch(ds, s, batch, 0, ctx) for s in range(n)]
    except DatasetError:
        source = "random"
        g = torch.Generator().manual_seed(0)
        if kind == "gpt":
            out = [(x := torch.randint(0, 256, (batch, ctx), generator=g), torch.roll(x, -1, 1)) for _ in range(n)]
        else:
            out = [(torch.rand(batch, 1, 28, 28, generator=g), torch.randint(0, 10, (batch,), generator=g))
                   for _ in range(n)]
    return out, source


def trial(model, fwd, opt, data, device) -> float:
    """Seconds for one pass over ``data`` (forward, CE, backward, AdamW)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for x, y in data:
        x, y = x.to(device), y.to(device)
        logits = fwd(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t


def bench(kind: str, args, device) -> dict:
    if kind == "gpt":
        ours, f_ours, hf, f_hf = gpt_pair(args.d_model, args.gpt_layers, args.heads, args.context)
        batch, per = args.gpt_batch, args.gpt_batch * args.context
        unit = "tok/s"
    else:
        ours, f_ours, hf, f_hf = vit_pair(args.d_model, args.vit_layers, args.heads, 7)
        batch, per = args.vit_batch, args.vit_batch
        unit = "img/s"
    data, source = batches(kind, args.steps, batch, args.context)
    res = {}
    models = {"symalign": (ours.to(device).train(), f_ours), "hf": (hf.to(device).train(), f_hf)}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, (m, _) in models.items()}
    for k, (m, f) in models.items():  # warm-up
        trial(m, f, opts[k], data[:3], device)
    times = {k: [] for k in models}
    for _ in range(args.trials):
        for k, (m, f) in models.items():
            times[k].append(trial(m, f, opts[k], data, device))
    for k in models:
        t = statistics.median(times[k])
        res[k] = {"seconds": t, "throughput": args.steps * per / t,
                  "params": sum(p.numel() for p in models[k][0].parameters())}
    return {"model": kind, "unit": unit, "data": source, "batch": batch, **res,
            "ratio": res["symalign"]["throughput"] / res["hf"]["throughput"]}


HF_CLASS = {"gpt": "GPT2LMHeadModel", "vit": "ViTForImageClassification"}


def tables(results: list[dict], args) -> dict:
    """The ``throughput`` table: per model, ours and HF's median throughput and their ratio."""
    from symalign.experiments.docs_tables import make_table

    shape = {"gpt": f"GPT (d {args.d_model}, {args.gpt_layers} layers)",
             "vit": f"ViT (d {args.d_model}, {args.vit_layers} layers)"}
    rows = [{"model": shape[r["model"]], "data": r["data"],
             "ours": f"{r['symalign']['throughput']:,.0f} {r['unit']}",
             "hf": f"{r['hf']['throughput']:,.0f} {r['unit']} ({HF_CLASS[r['model']]})", "ratio": r["ratio"]}
            for r in results]
    return {"throughput": make_table(rows, [("model", "model"), ("data", "data"), ("ours", "symalign"),
                                            ("hf", "HF"), ("ratio", "ratio (ours / HF)", ".2f")])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--gpt-layers", type=int, default=2)
    ap.add_argument("--vit-layers", type=int, default=4)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--gpt-batch", type=int, default=32)
    ap.add_argument("--vit-batch", type=int, default=128)
    ap.add_argument("--only", choices=("gpt", "vit"), default=None)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=None, help="write a result file (with docs/training.md's table) here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.out:
        import os
        import sys

        from symalign.provenance import provenance

        prov = provenance(["python", "benchmarks/bench_train.py", *sys.argv[1:]], threads=torch.get_num_threads(),
                          device=device)
        load_start = [round(x, 2) for x in os.getloadavg()]
    results = [bench(k, args, device) for k in ("gpt", "vit") if args.only in (None, k)]
    if args.out:
        from symalign.atomic import write_json

        write_json(args.out, {"provenance": prov, "load_average": {"start": load_start, "end": [
            round(x, 2) for x in os.getloadavg()]}, "steps": args.steps, "trials": args.trials,
            "results": results, "tables": tables(results, args)})
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"threads={torch.get_num_threads()} device={device} steps={args.steps} trials={args.trials} (median)")
    print(f"{'model':6} {'data':14} {'symalign':>14} {'HF':>14} {'ratio':>7}")
    for r in results:
        print(f"{r['model']:6} {r['data']:14} {r['symalign']['throughput']:>10,.0f} {r['unit']:5}"
              f"{r['hf']['throughput']:>10,.0f} {r['unit']:5} {r['ratio']:>6.2f}x")


if __name__ == "__main__":
    main()
