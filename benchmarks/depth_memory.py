r"""Peak RSS of the streamed commands against model depth: memory must not grow with the number of layers.

For each command (``align --stream`` and ``merge --stream``, both scopes) and each depth in ``--layers``, two
random float32 Llama-shaped checkpoints (D 512, FF 2048, 8/4 heads, vocab 256, untied head; one layer is
``4 (2 D^2 + 2 D D_kv + 3 D FF + 2 D)`` bytes = 15.0 MiB) are written sharded in 6 MB files, and the command runs in
a fresh Python process whose peak RSS (``ru_maxrss`` of the child) is recorded. The table gives the peak per depth
and the growth from the shallowest to the deepest run, in MiB and in layers: a bounded engine grows by less than one
layer whatever the depth (the same measurement as ``tests/test_stream.py::test_peak_memory_independent_of_depth``,
here for the merge too and at more depths). Writes a result file (atomically) that ``symalign docs`` renders::

    python benchmarks/depth_memory.py --layers 2 8 16 32 --out benchmarks/results/depth_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import transformers as T  # noqa: E402

from symalign.atomic import write_json  # noqa: E402
from symalign.experiments.docs_tables import make_table  # noqa: E402
from symalign.provenance import provenance  # noqa: E402

WIDTH = 512
LAYER_BYTES = 4 * (2 * WIDTH * WIDTH + 2 * WIDTH * WIDTH // 2 + 3 * WIDTH * 4 * WIDTH + 2 * WIDTH)
RUNS = (("align", "attention"), ("align", "model"), ("merge", "attention"), ("merge", "model"))


def write_llama(path: Path, layers: int, seed: int) -> None:
    """A random float32 Llama (the shape above), saved sharded in 6 MB files."""
    torch.manual_seed(seed)
    cfg = T.LlamaConfig(hidden_size=WIDTH, intermediate_size=4 * WIDTH, num_hidden_layers=layers,
                        num_attention_heads=8, num_key_value_heads=4, vocab_size=256, max_position_embeddings=64,
                        tie_word_embeddings=False)
    T.LlamaForCausalLM(cfg).save_pretrained(path, max_shard_size="6MB")


def peak_rss(args: list[str]) -> tuple[int, float]:
    """Run ``symalign ARGS`` in a fresh Python (one thread); returns (its peak RSS in bytes, wall seconds)."""
    code = ("import resource, subprocess, sys, json; "
            "r = subprocess.run([sys.executable, '-m', 'symalign.cli'] + sys.argv[1:], capture_output=True, "
            "text=True); "
            "print(json.dumps([r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, r.stderr]))")
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "SYMALIGN_THREADS": "1"})
    rc, kb, err = json.loads(res.stdout)
    if rc != 0:
        raise SystemExit(f"symalign {' '.join(args)} failed:\n{err}")
    return kb * 1024, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 8, 16])
    ap.add_argument("--max-sweeps", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True, help="result file (JSON, written atomically)")
    args = ap.parse_args()
    depths = sorted(args.layers)
    rows = []
    with tempfile.TemporaryDirectory(prefix="symalign-depth-") as tmp:
        for layers in depths:
            d = Path(tmp) / f"L{layers}"
            write_llama(d / "A", layers, 0)
            write_llama(d / "B", layers, 1)
            for command, scope in RUNS:
                out = d / f"OUT-{command}-{scope}"
                peak, wall = peak_rss([command, str(d / "A"), str(d / "B"), "-o", str(out), "--stream",
                                       "--scope", scope, "--max-sweeps", str(args.max_sweeps)])
                rows.append({"command": command, "scope": scope, "layers": layers, "peak_rss_mib": peak / 2**20,
                             "wall_s": wall})
                print(json.dumps(rows[-1]), flush=True)
    summary = []
    for command, scope in RUNS:
        sel = {r["layers"]: r["peak_rss_mib"] for r in rows if (r["command"], r["scope"]) == (command, scope)}
        grow = sel[depths[-1]] - sel[depths[0]]
        s = {"run": f"{command} --stream --scope {scope}", "growth_mib": grow,
             "growth_layers": grow / (LAYER_BYTES / 2**20), "bounded": "yes" if grow < LAYER_BYTES / 2**20 else "no"}
        s.update({f"L{n}": sel[n] for n in depths})
        summary.append(s)
    columns = [("run", "command")] + [(f"L{n}", f"{n} layers (MiB)", ".1f") for n in depths] + [
        ("growth_mib", f"{depths[-1]} - {depths[0]} layers (MiB)", ".1f"),
        ("growth_layers", "growth in layers", ".2f"), ("bounded", "under one layer")]
    res = {"provenance": provenance("python benchmarks/depth_memory.py " + shlex.join(sys.argv[1:]), threads=1),
           "layer_mib": LAYER_BYTES / 2**20, "width": WIDTH, "dtype": "float32", "max_sweeps": args.max_sweeps,
           "rows": rows, "summary": summary, "tables": {"summary": make_table(summary, columns)}}
    write_json(args.out, res)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
