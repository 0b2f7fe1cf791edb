"""Peak memory of the streamed paths on a mixture of experts (Mixtral-shaped), as a multiple of one layer.

Writes two random Mixtral-shaped bfloat16 checkpoints with FEW layers and a chosen width
(``--hidden``, ``--ff`` per expert, ``--experts``, ``--heads``, ``--kv-heads``, ``--vocab``,
``--layers``; ``N(0, 0.02)`` weights, unit norm gains, the layout ``save_pretrained`` writes: one
``block_sparse_moe.experts.{e}.w1/w2/w3`` matrix per expert, sharded as Hugging Face does), then runs

* ``symalign align A B -o OUT --stream --scope model --max-sweeps N``,
* ``symalign align A B -o OUT --stream --scope attention``,
* ``symalign merge A B -o OUT --stream --scope model --max-sweeps N``,

each in a fresh process under the sampler of ``profile_stream_memory.py`` (resident set and the
``symalign`` source line running, every few milliseconds). It reports per command the peak RSS
(``ru_maxrss`` of that process: the figure that counts), the resident set after the imports, the
wall time, the source line at the sampled peak and the ten highest lines, and

* ``peak_layers``: the peak RSS divided by ONE layer's size in the working dtype
  (``layer_work_gib``: every tensor of a layer, attention, router, the ``E`` experts and the
  norms, at 4 bytes a value for float32), and ``above_baseline_layers``: the same for the peak
  minus the resident set after the imports (Python, torch, transformers).

``--work float32`` (default) makes the child process compute in float32 as it does for a layer
above ``symalign.stream.attention.FLOAT64_MAX_LAYER_PARAMS`` (150M parameters: Mixtral-8x7B's layer
has 1.41G) by lowering that threshold to 0 in the child, so that a layer small enough to be matched
in minutes on one thread takes the code path of a big one; ``--work auto`` keeps the library's rule.
Mixtral-8x7B's shape is ``--hidden 4096 --ff 14336 --experts 8 --heads 32 --kv-heads 8``.

``--top-k`` defaults to all experts. (Before the per-layer check routed every expert
(``MoEFamily.function_check_config``), the check of a layer as stored -- rounded to bfloat16 -- refused
random top-2 pairs: the rounding flips the top-2 choice of some tokens, a discontinuity of the block,
not an error of the transform; measured ``9.6e-02`` relative on layer 0 with ``--ff 1024 --top-k 2``,
against a bound of ``6.25e-02``. The memory held is the same either way: the experts are all in
memory.)

The provenance (commit, command, threads, versions, load averages) goes with the results to
``--json``. The temporary folder is deleted at the end, also on failure. Usage::

    nice -n 15 python benchmarks/profile_moe_stream.py --hidden 2048 --ff 1536 --experts 8 --layers 2 \\
        --threads 1 --json benchmarks/results/moe_stream_memory.json --label after
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "src"))  # this checkout's symalign (provenance, shapes), as the commands run it

POOL = 1 << 24  # random values per model; each tensor is a slice of it at a random offset
GIB = 2**30


def mixtral_config(a: argparse.Namespace):
    import transformers as T

    return T.MixtralConfig(hidden_size=a.hidden, intermediate_size=a.ff, num_local_experts=a.experts,
                           num_experts_per_tok=a.top_k or a.experts, num_hidden_layers=a.layers,
                           num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, vocab_size=a.vocab,
                           tie_word_embeddings=False, architectures=["MixtralForCausalLM"], dtype="bfloat16")


def write_random(path: Path, config, seed: int, max_shard_size: str) -> int:
    """A random bfloat16 checkpoint under the names and shapes ``save_pretrained`` writes, sharded by
    ``huggingface_hub.split_torch_state_dict_into_shards``, one tensor at a time."""
    import huggingface_hub as hub
    import torch
    from safetensors.torch import save_file

    from symalign.checkpoint.config import expected_shapes
    from symalign.families import get_adapter

    path.mkdir(parents=True)
    config.save_pretrained(path)
    shapes, _ = expected_shapes(get_adapter(config), config)
    meta = {k: torch.empty(s, dtype=torch.bfloat16, device="meta") for k, s in sorted(shapes.items())}
    split = hub.split_torch_state_dict_into_shards(meta, max_shard_size=max_shard_size,
                                                   filename_pattern="model{suffix}.safetensors")
    g = torch.Generator().manual_seed(seed)
    pool = (torch.randn(POOL, generator=g) * 0.02).to(torch.bfloat16)
    total = 0
    for fname, names in split.filename_to_tensors.items():
        part = {}
        for n in sorted(names):
            shape, k = meta[n].shape, meta[n].numel()
            if "norm" in n:
                part[n] = torch.ones(shape, dtype=torch.bfloat16)
            else:  # tensors are at most POOL values here; longer ones repeat the pool
                reps = -(-k // POOL)
                start = int(torch.randint(0, POOL, (1,), generator=g))
                flat = torch.roll(pool, -start).repeat(reps)[:k] if reps > 1 else torch.roll(pool, -start)[:k]
                part[n] = flat.reshape(shape).clone()
        save_file(part, str(path / fname), metadata={"format": "pt"})
        total += (path / fname).stat().st_size
        del part
    if split.is_sharded:
        index = {"metadata": {"total_size": sum(v.numel() * 2 for v in meta.values())},
                 "weight_map": dict(sorted(split.tensor_to_filename.items()))}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return total


def sizes(a: argparse.Namespace, work_bytes: int) -> dict:
    """One layer's parameters and sizes (GiB) from the shape; ``work_bytes``: bytes a value in the working dtype."""
    D, F, E, H, KV = a.hidden, a.ff, a.experts, a.heads, a.kv_heads
    d = D // H
    experts = 3 * E * D * F
    layer = 2 * D * D + 2 * D * KV * d + experts + E * D + 2 * D
    return {"layer_params": layer, "expert_params": experts, "layer_bf16_gib": round(2 * layer / GIB, 4),
            "layer_f32_gib": round(4 * layer / GIB, 4), "layer_f64_gib": round(8 * layer / GIB, 4),
            "layer_work_gib": round(work_bytes * layer / GIB, 4),
            "embedding_and_head_bf16_gib": round(2 * 2 * a.vocab * D / GIB, 4),
            "checkpoint_bf16_gib": round(2 * (a.layers * layer + 2 * a.vocab * D + D) / GIB, 4)}


def _child(spec: str) -> None:
    """Run ``symalign ARGS`` under the sampler (``profile_stream_memory.Sampler``), float32 forced if asked."""
    cfg = json.loads(spec)
    if cfg.get("float32"):
        import symalign.stream.attention as att
        import symalign.stream.layercheck as lc

        att.FLOAT64_MAX_LAYER_PARAMS = lc.FLOAT64_MAX_LAYER_PARAMS = 0
    import profile_stream_memory as psm

    psm._child(json.dumps({"args": cfg["args"], "profile": cfg["profile"]}))


def profiled(args: list[str], threads: int, tmp: Path, float32: bool) -> dict:
    import profile_stream_memory as psm

    out, r = psm.run_child(__file__, {"args": args, "float32": float32}, threads, tmp)
    if out["rc"] == 0:
        try:
            info = json.loads(r.stdout)
            st = info.get("stream") or {}
            out["reported"] = {"work_dtype": st.get("work_dtype"), "passes": st.get("passes"),
                               "check_passed": (info.get("check") or {}).get("passed"),
                               "timings": info.get("timings")}
        except json.JSONDecodeError:
            pass
    return out


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        _child(sys.argv[2])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ff", type=int, default=1536, help="Each expert's FF width.")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--top-k", type=int, default=0,
                    help="Experts per token (default 0: all; module docstring: why not Mixtral's 2 here).")
    ap.add_argument("--vocab", type=int, default=4000)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--shard", default="200MB", help="max_shard_size of the written pair.")
    ap.add_argument("--max-sweeps", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--work", choices=("float32", "auto"), default="float32",
                    help="float32: the working dtype of a big layer whatever the width (module docstring).")
    ap.add_argument("--commands", default="model,attention,merge",
                    help="Any of model (align --scope model), attention (align --scope attention), "
                         "merge (merge --scope model).")
    ap.add_argument("--label", default="run", help="Key of this run in --json (e.g. before / after).")
    ap.add_argument("--tmp", default=None)
    ap.add_argument("--json", default=None, help="Results file; an existing one keeps its other labels.")
    args = ap.parse_args()
    import torch

    from symalign.provenance import provenance
    from symalign.stream.attention import work_dtype

    cfg = mixtral_config(args)
    sz = sizes(args, 4 if args.work == "float32" else torch.finfo(work_dtype(sizes(args, 8)["layer_params"])).bits
               // 8)
    res: dict = {"provenance": provenance(threads=args.threads),
                 "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
                 "load_average_start": [round(x, 2) for x in os.getloadavg()],
                 "shape": {k: getattr(args, k) for k in ("hidden", "ff", "experts", "top_k", "heads", "kv_heads",
                                                         "vocab", "layers")},
                 "work": args.work, "max_sweeps": args.max_sweeps, "sizes": sz}
    layer = sz["layer_work_gib"]
    tmp = Path(tempfile.mkdtemp(prefix="symalign-moeprof-", dir=args.tmp))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        t0 = time.perf_counter()
        write_random(tmp / "A", cfg, 0, args.shard)
        write_random(tmp / "B", cfg, 1, args.shard)
        res["write_s"] = round(time.perf_counter() - t0, 1)
        for c in args.commands.split(","):
            out = tmp / f"OUT-{c}"
            verb, scope = {"model": ("align", "model"), "attention": ("align", "attention"),
                           "merge": ("merge", "model")}[c]
            cmd = [verb, str(tmp / "A"), str(tmp / "B"), "-o", str(out), "--stream", "--scope", scope, "--json"]
            if scope == "model":
                cmd[-1:-1] = ["--max-sweeps", str(args.max_sweeps)]
            r = profiled(cmd, args.threads, tmp, args.work == "float32")
            if r.get("rc") == 0:
                r["peak_layers"] = round(r["peak_rss_gib"] / layer, 2)
                r["above_baseline_layers"] = round((r["peak_rss_gib"] - r["baseline_after_imports_gib"]) / layer, 2)
            res[c] = {"args": " ".join(["symalign", *cmd[:1], "A", "B", "-o", "OUT", *cmd[5:]]), **r}
            print(json.dumps({c: {k: res[c].get(k) for k in ("args", "rc", "wall_s", "peak_rss_gib",
                                                              "baseline_after_imports_gib", "peak_layers",
                                                              "above_baseline_layers", "at_peak", "stderr")}},
                             indent=1), flush=True)
            shutil.rmtree(out, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps({"sizes": sz}), flush=True)
    if args.json:
        p = Path(args.json)
        old = json.loads(p.read_text()) if p.is_file() else {}
        old[args.label] = res
        p.write_text(json.dumps(old, indent=2) + "\n")


if __name__ == "__main__":
    main()
