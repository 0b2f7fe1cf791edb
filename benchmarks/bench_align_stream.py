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
* ``symalign align --stream --scope attention`` and ``--scope model --max-sweeps N``, each in
  its own process: wall time, peak RSS (``ru_maxrss`` of a wrapper's child), bytes read and
  read bandwidth, passes, and the per-layer function checks;
* that OUT loads: ``from_pretrained(OUT, device_map="meta")`` (no weights materialised; needs
  ``accelerate``, else the model is built from OUT's config on the meta device and every
  tensor header is checked against it), and every tensor's name, shape and dtype are B's.

* ``symalign merge A B' --no-align --stream`` (``B'`` = the attention-scope output; the
  alignment is the run above): the streamed average's wall time, peak RSS and read rate;
  the merged checkpoint loads lazily too.

Every command runs with ``SYMALIGN_THREADS=--threads`` (default 2); ``--limit-s STEP=S``
kills a step after ``S`` seconds and keeps its per-layer progress lines (time stamped), so a
run that cannot finish still records measured per-layer figures. The results (with the
provenance: commit, command, threads, versions, load averages) are written to ``--json``
after every step. The temporary folder is deleted at the end, also on failure. Usage::

    python benchmarks/bench_align_stream.py --llama-size 7b [--tmp DIR] [--max-sweeps 2] [--limit-s model=1800]
        [--json OUT.json]
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


def llama_config(size: str, layers: int | None = None):
    """The shape ``size``; ``layers``: that many layers instead (same widths: each layer keeps its size)."""
    import transformers as T

    L, D, H, KV, FF, V = SHAPES[size]
    L = layers or L
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


def _child(spec: str) -> None:
    """The wrapper process of :func:`measured`: runs ``symalign``, timestamps its stderr lines, kills it at the
    time limit, and prints one JSON line (its own ``RUSAGE_CHILDREN`` peak is the command's alone)."""
    import resource
    import threading

    cfg = json.loads(spec)
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "symalign.cli", *cfg["args"]], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    lines: list = []
    out: list = []

    def pump_err():
        for line in proc.stderr:
            lines.append([round(time.perf_counter() - t0, 1), line.rstrip()[:300]])

    def pump_out():
        out.append(proc.stdout.read())

    th = [threading.Thread(target=pump_err, daemon=True), threading.Thread(target=pump_out, daemon=True)]
    for t in th:
        t.start()
    timed_out = False
    try:
        proc.wait(timeout=cfg.get("limit_s"))
    except subprocess.TimeoutExpired:
        timed_out = True
        proc.kill()
        proc.wait()
    for t in th:
        t.join(timeout=10)
    print(json.dumps({"rc": proc.returncode, "wall_s": time.perf_counter() - t0, "timed_out": timed_out,
                      "peak_rss": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
                      "cpu_s": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime
                                     + resource.getrusage(resource.RUSAGE_CHILDREN).ru_stime, 1),
                      "out": "".join(out), "lines": lines,
                      "err": "\n".join(x[1] for x in lines)[-2000:]}))


def measured(args: list[str], limit_s: float | None = None, threads: int = 2) -> dict:
    """``symalign ARGS --json`` in a child of a wrapper: exit code, wall time, the child's peak RSS, output,
    its progress lines with their times; killed after ``limit_s`` seconds (``timed_out``)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "SYMALIGN_THREADS": str(threads),
           "SYMALIGN_PROGRESS": "lines"}
    res = subprocess.run([sys.executable, __file__, "--child", json.dumps({"args": args, "limit_s": limit_s})],
                         capture_output=True, text=True, env=env, check=True)
    r = json.loads(res.stdout)
    r["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    return r


def layer_times(lines: list) -> list[list]:
    """``[seconds, line]`` of the progress lines that name a layer (the per-layer record of a run)."""
    return [x for x in lines if " layer " in x[1]]


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
        return {"error": "killed at the time limit" if r.get("timed_out") else
                (r["err"].strip().splitlines()[-1:] if r["err"] else "failed"),
                "wall_s": round(r["wall_s"], 1), "cpu_s": r.get("cpu_s"),
                "peak_rss_gib_so_far": round(r["peak_rss"] / 2**30, 3),
                "progress_lines": layer_times(r.get("lines", [])), "load_average_after": r.get("load_average_after")}
    info = json.loads(r["out"])
    st = info["stream"]
    grams = st.get("time_grams_s", 0.0)  # stage-1 products (+ its tiny assignment), stage-2 Grams, FF and residual
    v = info["check"]
    return {"wall_s": round(r["wall_s"], 1), "cpu_s": r.get("cpu_s"), "peak_rss_gib": round(r["peak_rss"] / 2**30, 3),
            "passes": st["passes"], "bytes_read_gb": round(st["bytes_read"] / 2**30, 2),
            "read_bandwidth_gb_s": round(st["bytes_read"] / 2**30 / r["wall_s"], 3),
            "grams_s": round(grams, 1), "floor_s": round(floor_s + grams, 1),
            "wall_over_floor": round(r["wall_s"] / (floor_s + grams), 2),
            "io_floor_s": round(floor_s, 1), "wall_over_io_floor": round(r["wall_s"] / floor_s, 2),
            "distance": {"before": info["distance"]["before"]["total"], "after": info["distance"]["after"]["total"]},
            "check": {"layers": len(v["layers"]) // 2, "exact_max": (v["exact"] or {}).get("rel"),
                      "stored_max": v["rel"], "dtype": v["dtype"],
                      "tolerance": v["tolerance"], "exact_tolerance": (v["exact"] or {}).get("tolerance")},
            "converged": info.get("converged"), "timings": info.get("timings"),
            "self_reported_peak_rss_gib": round(st.get("peak_rss_bytes", 0) / 2**30, 3),
            "matcher_totals": info.get("match", {}).get("totals"),
            "per_layer_time_s": [round(x.get("time_s", 0.0), 2) for x in info.get("match", {}).get("layers", [])
                                 if isinstance(x, dict)][:64],
            "progress_lines": layer_times(r.get("lines", [])), "load_average_after": r.get("load_average_after")}


def expected_size(size: str, layers: int | None = None) -> dict:
    """Parameters and bfloat16 bytes of the shape, counted from the config (meta device)."""
    import transformers as T

    with torch.device("meta"):
        model = T.LlamaForCausalLM(llama_config(size, layers))
    n = sum(p.numel() for p in model.parameters())
    L, D, H, KV, FF, V = SHAPES[size]
    L = layers or L
    d = D // H
    per_layer = 2 * D * D + 2 * D * KV * d + 3 * D * FF + 2 * D
    return {"params": n, "bf16_gib": round(2 * n / 2**30, 3), "per_layer_params": per_layer,
            "by_hand": L * per_layer + 2 * V * D + D, "kv_width": KV * d}


def _save_json(res: dict, path: str | None) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(res, indent=2) + "\n")


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        _child(sys.argv[2])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-size", choices=tuple(SHAPES), default="7b")
    ap.add_argument("--layers", type=int, default=None, help="Fewer layers than the shape has (same width): a "
                    "cheap profile of the per-layer cost.")
    ap.add_argument("--tmp", default=None, help="Parent folder of the temporary checkpoints (default: system temp).")
    ap.add_argument("--max-sweeps", type=int, default=2, help="--scope model: passes at most.")
    ap.add_argument("--max-shard-size", default=None, help="Shard size limit (default 5GB for 7b, else 200MB, so "
                    "that the smaller shapes are sharded too).")
    ap.add_argument("--scopes", default="attention,model")
    ap.add_argument("--threads", type=int, default=2, help="SYMALIGN_THREADS of the measured commands.")
    ap.add_argument("--limit-s", action="append", default=[], metavar="STEP=SECONDS",
                    help="Kill a step (attention, merge, model) after this long and record its per-layer progress "
                         "lines instead (repeatable).")
    ap.add_argument("--deadline-utc", default=None, metavar="HH:MM", help="End every step by this time (UTC; "
                    "the next time it comes: today, or tomorrow when already past): a step's limit is also the "
                    "time left, less a 3-minute margin for the clean-up.")
    ap.add_argument("--json", default=None, help="Also write the results to this JSON file (after every step).")
    args = ap.parse_args()
    limits = {k: float(v) for k, v in (x.split("=") for x in args.limit_s)}
    deadline = None
    if args.deadline_utc:
        import datetime as dt

        now = dt.datetime.now(dt.timezone.utc)
        hh, mm = (int(x) for x in args.deadline_utc.split(":"))
        end = now.replace(hour=hh, minute=mm, second=0, microsecond=0)
        if end <= now:  # a time already past today is tomorrow's (a run across midnight)
            end += dt.timedelta(days=1)
        deadline = time.time() + (end - now).total_seconds() - 180

    def limit(step: str) -> float | None:
        left = None if deadline is None else max(1.0, deadline - time.time())
        given = limits.get(step)
        return left if given is None else given if left is None else min(given, left)
    from symalign.provenance import provenance

    cfg = llama_config(args.llama_size, args.layers)
    res: dict = {"provenance": provenance(threads=args.threads),
                 "load_average_start": [round(x, 2) for x in os.getloadavg()],
                 "shape": dict(zip(("layers", "D", "heads", "kv_heads", "ff", "vocab"),
                                   (cfg.num_hidden_layers, *SHAPES[args.llama_size][1:]))),
                 "size": args.llama_size, "dtype": "bfloat16", "cpus": os.cpu_count(), "threads": args.threads,
                 "expected": expected_size(args.llama_size, args.layers), "limits_s": limits,
                 "deadline_utc": args.deadline_utc}
    tmp = Path(tempfile.mkdtemp(prefix="symalign-stream-bench-", dir=args.tmp))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a terminated run still removes its folder
    try:
        t0 = time.perf_counter()
        shard = args.max_shard_size or ("5GB" if args.llama_size == "7b" else "200MB")
        size = write_random(tmp / "A", cfg, 0, shard) + write_random(tmp / "B", cfg, 1, shard)
        res["max_shard_size"] = shard
        res["write_checkpoints_s"] = round(time.perf_counter() - t0, 1)
        res["checkpoint_gib"] = round(size / 2 / 2**30, 3)
        res["shards"] = sorted(p.name for p in (tmp / "B").glob("*.safetensors"))
        print(json.dumps({"written": res}), flush=True)
        t_read, n = read_floor(tmp / "A", tmp / "B")
        t_write = write_floor(tmp / "B", tmp / "COPY")
        res["floor"] = {"read_both_s": round(t_read, 1), "read_gib_s": round(n / 2**30 / t_read, 3),
                        "write_one_s": round(t_write, 1)}
        print(json.dumps({"floor": res["floor"]}), flush=True)
        _save_json(res, args.json)
        for scope in args.scopes.split(","):
            out = tmp / f"OUT-{scope}"
            r = measured(["align", str(tmp / "A"), str(tmp / "B"), "-o", str(out), "--stream", "--scope", scope,
                          "--max-sweeps", str(args.max_sweeps), "--json"], limit(scope), args.threads)
            res[scope] = summarise(r, t_read + t_write, n)
            if r["rc"] == 0:
                res[scope]["loads"] = loads_lazily(out, tmp / "B")
            print(json.dumps({scope: res[scope]}), flush=True)
            _save_json(res, args.json)
            if scope == "attention" and r["rc"] == 0:
                # the merge of A and the aligned B' (the alignment is the run above): streamed average + lazy load
                mo = tmp / "MERGED"
                m = measured(["merge", str(tmp / "A"), str(out), "--no-align", "--stream", "-o", str(mo), "--json"],
                             limit("merge"), args.threads)
                if m["rc"] == 0:
                    info = json.loads(m["out"])
                    res["merge"] = {"what": "merge A B' --no-align --stream (B' = the attention-scope output)",
                                    "wall_s": round(m["wall_s"], 1), "cpu_s": m.get("cpu_s"),
                                    "peak_rss_gib": round(m["peak_rss"] / 2**30, 3),
                                    "floor_s": round(t_read + t_write, 1),
                                    "wall_over_floor": round(m["wall_s"] / (t_read + t_write), 2),
                                    "read_gib_s": round(info["stream"]["bytes_read"] / 2**30 / m["wall_s"], 3),
                                    "loads": info["loads"], "lazy_check": loads_lazily(mo, tmp / "A")}
                else:
                    res["merge"] = summarise(m, t_read + t_write, n)
                shutil.rmtree(mo, ignore_errors=True)
                print(json.dumps({"merge": res["merge"]}), flush=True)
                _save_json(res, args.json)
            shutil.rmtree(out, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(res, indent=2), flush=True)
    _save_json(res, args.json)


if __name__ == "__main__":
    main()
