"""Peak memory and wall time of ``symalign merge`` against mergekit's linear merge, on one bf16 Llama pair.

The pair: two ``LlamaForCausalLM`` built from one config (``--hidden``/``--layers``/...; default 18 layers,
D=512, 8 heads, d_ff=1536, vocab 32000, untied head: about 94M parameters), random init from seeds 0 and 1
(memory and time do not depend on training), saved in bfloat16 by ``save_pretrained``.

Each merge runs as its own child process; its peak resident memory is the kernel's ``ru_maxrss`` of that
child (``resource.getrusage(RUSAGE_CHILDREN)`` in a fresh Python that runs only it), its wall time measured
around it. Rows:

* ``mergekit linear``: ``mergekit-yaml`` (its own virtual environment, ``--mergekit``; default options but
  ``--no-copy-tokenizer``, as the pair has none), weights 0.5/0.5;
* ``symalign merge`` as a user types it (the default: whole-model scope, its path chosen by itself), with
  ``--no-align``, and both again with ``--no-stream`` (in memory).

The plain averages are compared tensor by tensor with mergekit's output (``torch.equal``): mergekit's
linear merge sums in float32 and rounds to bfloat16, as symalign does, so they must agree bit for bit.
Every child runs with one thread (``OMP_NUM_THREADS=1``, ``--threads 1``); the results file records the
commit, the command, the versions of both environments and the machine.

    nice -n 10 python benchmarks/bench_merge_peers.py --out benchmarks/results/merge_peers.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MERGEKIT = "/work/mk-venv/bin/mergekit-yaml"


def build_pair(where: Path, hidden: int, layers: int, heads: int, d_ff: int, vocab: int) -> tuple[Path, Path, int]:
    """Save two random bf16 Llamas (seeds 0 and 1) under ``where``; returns their folders and the parameter count."""
    import torch
    import transformers as T

    cfg = T.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=d_ff, num_hidden_layers=layers,
                        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=512,
                        tie_word_embeddings=False)
    dirs = []
    n = 0
    for seed in (0, 1):
        torch.manual_seed(seed)
        m = T.LlamaForCausalLM(cfg).to(torch.bfloat16)
        n = sum(p.numel() for p in m.parameters())
        d = where / ("A" if seed == 0 else "B")
        m.save_pretrained(d)
        dirs.append(d)
        del m
    return dirs[0], dirs[1], n


def run_child(cmd: list[str], env: dict[str, str]) -> dict:
    """Run ``cmd`` from a fresh Python: exit code, peak RSS in MB (``ru_maxrss`` of its children: this one
    command), wall seconds, stdout and the end of stderr."""
    code = ("import json, os, resource, subprocess, sys, time\n"
            "t0 = time.perf_counter()\n"
            "r = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
            "w = time.perf_counter() - t0\n"
            "kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss\n"
            "print(json.dumps({'rc': r.returncode, 'peak_rss_mb': kb / 1024, 'wall_s': w, 'stdout': r.stdout,"
            " 'stderr': r.stderr[-2000:]}))\n")
    res = subprocess.run([sys.executable, "-c", code, *cmd], env=env, capture_output=True, text=True, check=True)
    return json.loads(res.stdout)


def states(d: Path) -> dict:
    from safetensors.torch import load_file

    out: dict = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def equal_bitwise(a: Path, b: Path) -> dict:
    """Whether two checkpoints hold the same tensor names with equal dtypes and bits."""
    import torch

    sa, sb = states(a), states(b)
    differ = sorted(k for k in sa if k not in sb or sa[k].dtype != sb[k].dtype or not torch.equal(sa[k], sb[k]))
    return {"equal": not differ and set(sa) == set(sb), "tensors": len(sa), "differ": differ[:5],
            "only_in_second": sorted(set(sb) - set(sa))[:5]}


def mergekit_versions(mergekit: str) -> dict:
    py = str(Path(mergekit).with_name("python"))
    code = ("import json; from importlib import metadata as m; "
            "print(json.dumps({p: m.version(p) for p in ('mergekit', 'torch', 'transformers', 'safetensors')}))")
    try:
        return json.loads(subprocess.run([py, "-c", code], capture_output=True, text=True, check=True).stdout)
    except (OSError, subprocess.CalledProcessError, json.JSONDecodeError):
        return {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "merge_peers.json")
    ap.add_argument("--mergekit", default=MERGEKIT, help="mergekit-yaml in its own virtual environment")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=18)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--d-ff", type=int, default=1536)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    ap.add_argument("--max-sweeps", type=int, default=None, help="passed to the aligning merges (default: "
                    "symalign's); peak memory does not depend on it, the wall time does")
    args = ap.parse_args()

    from symalign.experiments.docs_tables import make_table
    from symalign.provenance import provenance

    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT / "src"), "TOKENIZERS_PARALLELISM": "false"}
    if args.work is not None:
        args.work.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="merge-peers-", dir=args.work))
    try:
        da, db, params = build_pair(work, args.hidden, args.layers, args.heads, args.d_ff, args.vocab)
        size = sum(f.stat().st_size for d in (da, db) for f in d.glob("*.safetensors"))
        print(f"pair: {params / 1e6:.1f}M parameters, {size / 2**20:.0f} MiB of bf16 together", file=sys.stderr)
        sym = [sys.executable, "-m", "symalign.cli", "merge", str(da), str(db), "--json", "--no-progress",
               "--threads", "1", "-o"]
        sweeps = [] if args.max_sweeps is None else ["--max-sweeps", str(args.max_sweeps)]
        runs = [("symalign merge (default)", "sym-default", sweeps),
                ("symalign merge --no-align", "sym-noalign", ["--no-align"]),
                ("symalign merge --no-stream", "sym-mem", ["--no-stream", *sweeps]),
                ("symalign merge --no-align --no-stream", "sym-mem-noalign", ["--no-align", "--no-stream"])]
        rows = []
        if Path(args.mergekit).exists():
            (work / "mk.yml").write_text(
                "merge_method: linear\ndtype: bfloat16\nmodels:\n"
                f"  - model: {da}\n    parameters:\n      weight: 0.5\n"
                f"  - model: {db}\n    parameters:\n      weight: 0.5\n")
            cmd = [args.mergekit, str(work / "mk.yml"), str(work / "mk"), "--no-copy-tokenizer", "--quiet"]
            r = run_child(cmd, env)
            print(f"mergekit: rc {r['rc']}, {r['peak_rss_mb']:.0f} MB, {r['wall_s']:.1f} s", file=sys.stderr)
            if r["rc"] != 0:
                raise SystemExit(f"mergekit failed: {r['stderr']}")
            rows.append({"merge": "mergekit linear", "options": "--no-copy-tokenizer", "path": "mergekit",
                         "scope": "none", "peak_rss_mb": r["peak_rss_mb"], "wall_s": r["wall_s"]})
        else:
            print(f"{args.mergekit} is absent: no mergekit row", file=sys.stderr)
        for name, out, extra in runs:
            r = run_child([*sym, str(work / out), *extra], env)
            if r["rc"] != 0:
                raise SystemExit(f"{name} failed: {r['stderr']}")
            info = json.loads(r["stdout"])
            print(f"{name}: {info['path']}, scope {info['scope']}, {r['peak_rss_mb']:.0f} MB, {r['wall_s']:.1f} s",
                  file=sys.stderr)
            aligned = info.get("aligned") or [{}]
            rows.append({"merge": name, "options": " ".join(extra) or "(none)", "path": info["path"],
                         "path_default": info.get("path_default"), "scope": info["scope"],
                         "sweeps": aligned[0].get("sweeps"), "converged": aligned[0].get("converged"),
                         "peak_rss_mb": r["peak_rss_mb"], "wall_s": r["wall_s"]})
        base = rows[0]["peak_rss_mb"] if rows[0]["merge"] == "mergekit linear" else None
        for row in rows:
            row["rss_vs_mergekit"] = row["peak_rss_mb"] / base if base else None
        checks = {}
        if base:
            checks["mergekit_vs_no_align_streamed"] = equal_bitwise(work / "mk", work / "sym-noalign")
            checks["mergekit_vs_no_align_in_memory"] = equal_bitwise(work / "mk", work / "sym-mem-noalign")
            print(f"bit for bit: {checks}", file=sys.stderr)
        table = make_table(rows, [("merge", "merge"), ("options", "options"), ("path", "path"), ("scope", "aligned"),
                                  ("sweeps", "sweeps"),
                                  ("peak_rss_mb", "peak RSS (MB)", ".0f"), ("rss_vs_mergekit", "x mergekit", ".2f"),
                                  ("wall_s", "wall (s)", ".1f")])
        prov = provenance(threads=1, seed_pairs=1)
        prov["peer_versions"] = mergekit_versions(args.mergekit)
        res = {"provenance": prov,
               "meta": {"model": {"family": "llama", "hidden": args.hidden, "layers": args.layers,
                                  "heads": args.heads, "d_ff": args.d_ff, "vocab": args.vocab,
                                  "tie_word_embeddings": False, "dtype": "bfloat16", "init": "random, seeds 0 and 1",
                                  "params": params, "safetensors_bytes_both": size},
                        "measure": "ru_maxrss of each merge's own child process (os/resource), wall around it; "
                                   "one run each, one thread",
                        "mergekit_config": "linear, weights 0.5/0.5, dtype bfloat16",
                        "max_sweeps": args.max_sweeps},
               "rows": rows, "bit_for_bit": checks, "tables": {"rss": table}}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(res, indent=1) + "\n")
        tmp.replace(args.out)
        print(f"wrote {args.out}", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
