"""Read-ahead on the CPU: streamed ``symalign align`` with ``SYMALIGN_PREFETCH=1`` against ``0`` (unset: CUDA only).

Writes two random Llama-shaped bfloat16 checkpoints (``bench_align_stream.write_random``: ``N(0, 0.02)`` weights,
sharded) of a small shape (``--layers``, ``--d-model``, ``--ff``, ``--heads``/``--kv-heads``, ``--vocab``) to a
temporary folder, then runs ``align --stream --scope attention`` and ``align --stream --scope model
--max-sweeps 1``, each in its own process (``bench_align_stream.measured``: wall time, the child's peak RSS),
alternating prefetch on and off ``--repeats`` times. Each run's OUT weights are hashed: on and off must give the
same bytes (the benchmark fails otherwise). Recorded per scope: every wall time, the medians and the fastest runs,
``on / off`` of each (a ratio below 1 is read-ahead saving time; the fastest run is the one least disturbed on a
shared machine), the runs' own ``timings`` (read, match, verify, write) and peak RSS.

The checkpoints were just written, so they are read from the page cache: this measures the overlap of the
reads' copying and NaN checks with compute on the CPU, not a disk. A GPU, where reading is the floor, is
another matter (``benchmarks/gpu_check.sh``); no GPU figure comes from this script.

    nice -n 10 python benchmarks/bench_prefetch.py [--json benchmarks/results/prefetch_cpu.json]
    python benchmarks/bench_prefetch.py --tables benchmarks/results/prefetch_cpu.json   # its table, from its runs
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_align_stream import measured, write_random  # noqa: E402


def weights_digest(folder: Path) -> str:
    """SHA-256 over OUT's weight files (names and bytes, in name order)."""
    h = hashlib.sha256()
    for f in sorted(folder.glob("*.safetensors")):
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def tables(res: dict) -> dict:
    """The ``prefetch`` table of docs/scaling.md ("Devices"), a pure function of the measured runs."""
    from symalign.experiments.docs_tables import make_table

    rows = []
    for scope, r in res["scopes"].items():
        on, off = r["runs"]["on"], r["runs"]["off"]
        rows.append({"scope": scope, "runs": f"{len(on)} + {len(off)}", "on": r["median_wall_s"]["on"],
                     "off": r["median_wall_s"]["off"], "ratio": r["on_over_off"],
                     "min_on": min(x["wall_s"] for x in on), "min_off": min(x["wall_s"] for x in off),
                     "ratio_min": min(x["wall_s"] for x in on) / min(x["wall_s"] for x in off),
                     "read_on": statistics.median(x["timings"]["read_s"] for x in on),
                     "read_off": statistics.median(x["timings"]["read_s"] for x in off),
                     "rss_on": max(x["peak_rss_bytes"] for x in on) / 2 ** 20,
                     "rss_off": max(x["peak_rss_bytes"] for x in off) / 2 ** 20,
                     "same": "yes" if r["identical_bytes"] else "NO"})
    return {"prefetch": make_table(rows, [
        ("scope", "streamed align"), ("runs", "runs on + off"), ("on", "median wall s, prefetch on", ".1f"),
        ("off", "median wall s, off", ".1f"), ("ratio", "on / off (medians)", ".3f"),
        ("min_on", "fastest s, on", ".1f"), ("min_off", "fastest s, off", ".1f"),
        ("ratio_min", "on / off (fastest)", ".3f"), ("read_on", "read phase s, on (median)", ".2f"),
        ("read_off", "read phase s, off", ".2f"), ("rss_on", "peak RSS MiB, on", ".0f"),
        ("rss_off", "peak RSS MiB, off", ".0f"), ("same", "same bytes")])}


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--tables":  # rewrite a result file's tables from its runs
        path = Path(sys.argv[2])
        res = json.loads(path.read_text())
        res["tables"] = tables(res)
        path.write_text(json.dumps(res, indent=2) + "\n")
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--ff", type=int, default=1376)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4000)
    ap.add_argument("--shard", default="8MB", help="max_shard_size of the written checkpoints.")
    ap.add_argument("--repeats", type=int, default=3, help="Runs per scope and setting (alternating on, off).")
    ap.add_argument("--scopes", default="attention,model")
    ap.add_argument("--max-sweeps", type=int, default=1, help="--scope model: passes.")
    ap.add_argument("--threads", type=int, default=1, help="SYMALIGN_THREADS of the measured commands.")
    ap.add_argument("--tmp", default=None, help="Parent of the temporary checkpoints (default: system temp).")
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "prefetch_cpu.json"))
    args = ap.parse_args()
    import transformers as T

    from symalign.provenance import provenance

    cfg = T.LlamaConfig(hidden_size=args.d_model, intermediate_size=args.ff, num_hidden_layers=args.layers,
                        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
                        tie_word_embeddings=False, architectures=["LlamaForCausalLM"], dtype="bfloat16")
    res: dict = {"provenance": provenance(command=["python", "benchmarks/bench_prefetch.py", *sys.argv[1:]],
                                          threads=args.threads),
                 "shape": {"layers": args.layers, "D": args.d_model, "ff": args.ff, "heads": args.heads,
                           "kv_heads": args.kv_heads, "vocab": args.vocab, "dtype": "bfloat16", "shard": args.shard},
                 "repeats": args.repeats, "load_average_start": [round(x, 2) for x in os.getloadavg()],
                 "source": "page cache (the checkpoints were just written)", "scopes": {}}
    tmp = Path(tempfile.mkdtemp(prefix="symalign-prefetch-bench-", dir=args.tmp))
    ok = True
    try:
        for name, seed in (("A", 1), ("B", 2)):
            res.setdefault("checkpoint_bytes", 0)
            res["checkpoint_bytes"] += write_random(tmp / name, cfg, seed, max_shard_size=args.shard)
        for scope in args.scopes.split(","):
            runs: dict[str, list] = {"on": [], "off": []}
            digests: set[str] = set()
            for r in range(args.repeats):
                for setting in (("on", "off") if r % 2 == 0 else ("off", "on")):
                    out = tmp / f"O-{scope}-{setting}"
                    os.environ["SYMALIGN_PREFETCH"] = "1" if setting == "on" else "0"
                    cmd = ["align", str(tmp / "A"), str(tmp / "B"), "-o", str(out), "--stream", "--scope", scope,
                           "--json", "--force"] + (["--max-sweeps", str(args.max_sweeps)] if scope == "model" else [])
                    m = measured(cmd, threads=args.threads)
                    if m["rc"] != 0:
                        raise SystemExit(f"{scope} prefetch {setting}: exit {m['rc']}: {m['err'][-800:]}")
                    info = json.loads(m["out"])
                    digests.add(weights_digest(out))
                    runs[setting].append({"wall_s": round(m["wall_s"], 2), "peak_rss_bytes": m["peak_rss"],
                                          "timings": {k: round(v, 3) for k, v in info["timings"].items()},
                                          "load_average_after": m["load_average_after"]})
                    print(json.dumps({scope: setting, **runs[setting][-1]}), flush=True)
            os.environ.pop("SYMALIGN_PREFETCH", None)
            med = {k: statistics.median(x["wall_s"] for x in v) for k, v in runs.items()}
            low = {k: min(x["wall_s"] for x in v) for k, v in runs.items()}
            res["scopes"][scope] = {"command": ["symalign", "align", "A", "B", "-o", "OUT", "--stream", "--scope",
                                                scope] + (["--max-sweeps", str(args.max_sweeps)] if scope == "model"
                                                          else []),
                                    "runs": runs, "median_wall_s": med, "min_wall_s": low,
                                    "on_over_off": round(med["on"] / med["off"], 3),
                                    "on_over_off_min": round(low["on"] / low["off"], 3),
                                    "identical_bytes": len(digests) == 1}
            ok &= len(digests) == 1
            print(json.dumps({scope: {"median_wall_s": med, "on_over_off": res["scopes"][scope]["on_over_off"],
                                      "on_over_off_min": res["scopes"][scope]["on_over_off_min"],
                                      "identical_bytes": len(digests) == 1}}), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    res["passed"] = bool(ok)
    res["tables"] = tables(res)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps({"passed": ok, "json": args.json}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    t0 = time.perf_counter()
    code = main()
    print(f"{time.perf_counter() - t0:.0f} s", flush=True)
    sys.exit(code)
