"""Streamed ``symalign align`` on Llama-shaped bfloat16 checkpoints that need not fit in memory.

Writes two random checkpoints of the chosen shape (bfloat16, ``N(0, 0.02)`` weights, unit
norm gains; each model draws 64M values once and cuts every row chunk of at most 16M values
from that pool at a random offset -- the two models are independent, the writing is I/O bound;
sharded as Hugging Face does: ``huggingface_hub.split_torch_state_dict_into_shards``
with ``max_shard_size=5GB``, ``model-0000k-of-0000n.safetensors`` + index) tensor by tensor,
in row chunks, so the benchmark itself stays small. Then, in the same run:

* the **floor**: reading both checkpoints once (plain sequential reads), writing one
  (a copy of B), plus the matcher's exact Gram products (the ``stream.time_grams_s`` the run
  reports: stage-1 head-pair products, stage-2 Grams; model scope: also the FF cost
  matrices and the residual cross-Gram);
* ``symalign align --stream --scope attention`` and ``--scope model --max-iter N``, each in
  its own process: wall time, peak RSS (``ru_maxrss`` of a wrapper's child), bytes read and
  read bandwidth, passes, and the per-layer function checks;
* that OUT loads: ``from_pretrained(OUT, device_map="meta")`` (no weights materialised; needs
  ``accelerate``, else the model is built from OUT's config on the meta device and every
  tensor header is checked against it), and every tensor's name, shape and dtype are B's.

``symalign merge`` is run too when the command exists. The temporary folder is deleted at
the end, also on failure. Usage::

    python benchmarks/bench_align_stream.py --llama-size 7b [--tmp DIR] [--max-iter 2] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {
    # layers, D, heads, kv heads, FF, vocab
    "tiny": (4, 256, 8, 4, 688, 1000),
    "small": (8, 1024, 16, 4, 2816, 32000),
    "1b": (16, 2048, 32, 8, 5632, 32000),
    "7b": (32, 4096, 32, 8, 11008, 32000),
}
CHUNK = 1 << 24
POOL = 1 << 26  # random values per model (64M); chunks of at most CHUNK values are cut from it


def llama_config(size: str):
    import transformers as T

    L, D, H, KV, FF, V = SHAPES[size]
    return T.LlamaConfig(hidden_size=D, intermediate_size=FF, num_hidden_layers=L, num_attention_heads=H,
                         num_key_value_heads=KV, vocab_size=V, tie_word_embeddings=False,
                         architectures=["LlamaForCausalLM"], dtype="bfloat16")


def write_random(path: Path, config, seed: int, max_shard_size: str = "5GB") -> int:
    """A random bfloat16 checkpoint in Hugging Face's sharded layout, written in row chunks."""
    import huggingface_hub as hub
    import transformers as T

    path.mkdir(parents=True)
    config.save_pretrained(path)
    with torch.device("meta"):
        model = T.LlamaForCausalLM(config)
    meta = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    split = hub.split_torch_state_dict_into_shards(meta, max_shard_size=max_shard_size,
                                                   filename_pattern="model{suffix}.safetensors")
    g = torch.Generator().manual_seed(seed)
    # a pool of N(0, 0.02) values; each chunk is a slice at a random offset (the writing stays I/O bound)
    pool = (torch.randn(POOL, generator=g) * 0.02).to(torch.bfloat16)
    pool = torch.cat([pool, pool])
    total = 0
    for fname, names in split.filename_to_tensors.items():
        names = sorted(names)
        header, off = {}, 0
        for n in names:
            nb = meta[n].numel() * 2
            header[n] = {"dtype": "BF16", "shape": list(meta[n].shape), "data_offsets": [off, off + nb]}
            off += nb
        header["__metadata__"] = {"format": "pt"}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        with open(path / fname, "wb") as f:
            f.write(len(raw).to_bytes(8, "little") + raw)
            for n in names:
                shape = meta[n].shape
                if "norm" in n:
                    f.write(torch.ones(shape, dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes())
                    continue
                rows = max(1, CHUNK // max(1, meta[n].numel() // shape[0]))
                width = meta[n].numel() // shape[0]
                for s in range(0, shape[0], rows):
                    k = min(rows, shape[0] - s) * width
                    start = int(torch.randint(0, POOL - k + 1 if k < POOL else 1, (1,), generator=g))
                    f.write(pool[start:start + k].view(torch.uint8).numpy().tobytes())
        total += (path / fname).stat().st_size
    if split.is_sharded:
        index = {"metadata": {"total_size": sum(v.numel() * 2 for v in meta.values())},
                 "weight_map": dict(sorted(split.tensor_to_filename.items()))}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return total


def read_floor(*dirs: Path) -> tuple[float, int]:
    """Seconds to read every weight file once (64 MiB sequential reads), bytes read."""
    t0, n = time.perf_counter(), 0
    for d in dirs:
        for f in sorted(d.glob("*.safetensors")):
            with open(f, "rb", buffering=0) as h:
                while True:
                    b = h.read(64 << 20)
                    if not b:
                        break
                    n += len(b)
    return time.perf_counter() - t0, n


def write_floor(src: Path, dest: Path) -> float:
    """Seconds to write a copy of ``src``'s weight files (fsynced), then removed."""
    dest.mkdir()
    t0 = time.perf_counter()
    for f in sorted(src.glob("*.safetensors")):
        with open(f, "rb") as r, open(dest / f.name, "wb") as w:
            shutil.copyfileobj(r, w, 64 << 20)
            w.flush()
            os.fsync(w.fileno())
    t = time.perf_counter() - t0
    shutil.rmtree(dest)
    return t


def measured(args: list[str]) -> dict:
    """``symalign ARGS --json`` in a child of a wrapper: exit code, wall time, the child's peak RSS, output."""
    code = ("import json, resource, subprocess, sys, time; t = time.perf_counter(); "
            "r = subprocess.run([sys.executable, '-m', 'symalign.cli'] + sys.argv[1:], capture_output=True, text=True); "
            "print(json.dumps({'rc': r.returncode, 'wall_s': time.perf_counter() - t, "
            "'peak_rss': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, "
            "'out': r.stdout, 'err': r.stderr[-2000:]}))")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    res = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, check=True)
    return json.loads(res.stdout)


def loads_lazily(out: Path, b: Path) -> dict:
    """OUT through ``from_pretrained(device_map="meta")`` and the lazy reader: names, shapes, dtypes as B."""
    import transformers as T

    from symalign.checkpoint.lazy import open_checkpoint

    T.utils.logging.set_verbosity_error()
    try:  # needs accelerate
        model = T.AutoModelForCausalLM.from_pretrained(out, device_map="meta")
        how = "from_pretrained(device_map='meta')"
    except ValueError:  # without accelerate: the class built on the meta device + every header checked against it
        with torch.device("meta"):
            model = T.AutoModelForCausalLM.from_config(T.AutoConfig.from_pretrained(out))
        how = "meta-device model from config.json; every tensor's name/shape checked against it (no accelerate)"
    n_params = sum(p.numel() for p in model.parameters())
    co, cb = open_checkpoint(out), open_checkpoint(b)  # validates names and shapes against the config
    same = all(co.tensors[k].shape == cb.tensors[k].shape and co.tensors[k].dtype == cb.tensors[k].dtype
               for k in cb.tensors) and set(co.tensors) == set(cb.tensors)
    return {"how": how, "params": n_params, "same_layout_as_b": same,
            "shards": [s.path.name for s in co.shards], "dtype": str(co.dtype).replace("torch.", "")}


def summarise(r: dict, floor_s: float, read_bytes_floor: int) -> dict:
    if r["rc"] != 0:
        return {"error": r["err"].strip().splitlines()[-1:] if r["err"] else "failed", "wall_s": r["wall_s"]}
    info = json.loads(r["out"])
    st = info["stream"]
    grams = st.get("time_grams_s", 0.0)  # stage-1 products (+ its tiny assignment), stage-2 Grams, FF and residual
    v = info["check"]
    return {"wall_s": round(r["wall_s"], 1), "peak_rss_gb": round(r["peak_rss"] / 2**30, 3),
            "passes": st["passes"], "bytes_read_gb": round(st["bytes_read"] / 2**30, 2),
            "read_bandwidth_gb_s": round(st["bytes_read"] / 2**30 / r["wall_s"], 3),
            "grams_s": round(grams, 1), "floor_s": round(floor_s + grams, 1),
            "wall_over_floor": round(r["wall_s"] / (floor_s + grams), 2),
            "distance": {"before": info["distance"]["before"]["total"], "after": info["distance"]["after"]["total"]},
            "check": {"layers": len(v["layers"]) // 2, "exact_max": (v["exact"] or {}).get("rel"),
                      "stored_max": v["rel"], "dtype": v["dtype"],
                      "tolerance": v["tolerance"], "exact_tolerance": (v["exact"] or {}).get("tolerance")},
            "converged": info.get("converged"), "timings": info.get("timings"),
            "self_reported_peak_rss_gb": round(st.get("peak_rss_bytes", 0) / 2**30, 3),
            "matcher_totals": info.get("match", {}).get("totals"),
            "per_layer_time_s": [round(x.get("time_s", 0.0), 2) for x in info.get("match", {}).get("layers", [])
                                 if isinstance(x, dict)][:64]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-size", choices=tuple(SHAPES), default="7b")
    ap.add_argument("--tmp", default=None, help="Parent folder of the temporary checkpoints (default: system temp).")
    ap.add_argument("--max-iter", type=int, default=2, help="--scope model: passes at most.")
    ap.add_argument("--max-shard-size", default=None, help="Shard size limit (default 5GB for 7b, else 200MB, so "
                    "that the smaller shapes are sharded too).")
    ap.add_argument("--scopes", default="attention,model")
    ap.add_argument("--json", default=None, help="Also write the results to this JSON file.")
    args = ap.parse_args()
    cfg = llama_config(args.llama_size)
    res: dict = {"shape": dict(zip(("layers", "D", "heads", "kv_heads", "ff", "vocab"), SHAPES[args.llama_size])),
                 "size": args.llama_size, "dtype": "bfloat16", "cpus": os.cpu_count()}
    tmp = Path(tempfile.mkdtemp(prefix="symalign-stream-bench-", dir=args.tmp))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a terminated run still removes its folder
    try:
        t0 = time.perf_counter()
        shard = args.max_shard_size or ("5GB" if args.llama_size == "7b" else "200MB")
        size = write_random(tmp / "A", cfg, 0, shard) + write_random(tmp / "B", cfg, 1, shard)
        res["max_shard_size"] = shard
        res["write_checkpoints_s"] = round(time.perf_counter() - t0, 1)
        res["checkpoint_gb"] = round(size / 2 / 2**30, 2)
        res["shards"] = sorted(p.name for p in (tmp / "B").glob("*.safetensors"))
        print(json.dumps({"written": res}), flush=True)
        t_read, n = read_floor(tmp / "A", tmp / "B")
        t_write = write_floor(tmp / "B", tmp / "COPY")
        res["floor"] = {"read_both_s": round(t_read, 1), "read_gb_s": round(n / 2**30 / t_read, 3),
                        "write_one_s": round(t_write, 1)}
        print(json.dumps({"floor": res["floor"]}), flush=True)
        for scope in args.scopes.split(","):
            out = tmp / f"OUT-{scope}"
            r = measured(["align", str(tmp / "A"), str(tmp / "B"), "-o", str(out), "--stream", "--scope", scope,
                          "--max-iter", str(args.max_iter), "--json"])
            res[scope] = summarise(r, t_read + t_write, n)
            if r["rc"] == 0:
                res[scope]["loads"] = loads_lazily(out, tmp / "B")
                shutil.rmtree(out, ignore_errors=True)
            print(json.dumps({scope: res[scope]}), flush=True)
        merge = ROOT / "src" / "symalign" / "commands" / "merge.py"
        res["merge"] = "skipped: no merge command in this checkout" if not merge.is_file() else "not run"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(res, indent=2), flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
