"""Wall time and peak memory of ``symalign align`` on realistic Hugging Face shapes.

Pairs (random init, built from configs, saved with ``save_pretrained`` to a temp dir):

* GPT-2 small (124M parameters, float32);
* a Llama-shaped model (``--llama-size``: ``1b`` = 16 layers, D 2048, 32/8 heads,
  ~1.1B parameters; ``small`` = 8 layers, D 1024, 16/4 heads, ~0.2B).

Each ``symalign align`` runs as a subprocess; peak memory is its ``ru_maxrss``
(children). Goals: GPT-2 small under 60 s and under 3x the size of the two
checkpoints. Usage: ``python benchmarks/bench_align_hf.py [--llama-size none|small|1b]``.

``--llama-size 7b`` (or ``--stream``) runs the streamed benchmark instead
(``benchmarks/bench_align_stream.py``: two random bfloat16 checkpoints written to a
temporary folder, ``symalign align --stream`` with both scopes, wall time, peak RSS,
read bandwidth and the floor measured in the same run).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _save(model, path: Path) -> int:
    model.save_pretrained(path)
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def make_pair(kind: str, tmp: Path) -> tuple[Path, Path, int]:
    import transformers as T

    T.utils.logging.disable_progress_bar()
    if kind == "gpt2":
        cfg, cls = T.GPT2Config(), T.GPT2LMHeadModel
    elif kind == "llama-1b":
        cfg = T.LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=32,
                            num_key_value_heads=8, vocab_size=32000, tie_word_embeddings=True)
        cls = T.LlamaForCausalLM
    else:
        cfg = T.LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                            num_key_value_heads=4, vocab_size=32000)
        cls = T.LlamaForCausalLM
    size = 0
    for seed, name in ((0, "A"), (1, "B")):
        torch.manual_seed(seed)
        model = cls(cfg)
        size += _save(model, tmp / name)
        del model
    return tmp / "A", tmp / "B", size


def run(kind: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="symalign-bench-") as d:
        tmp = Path(d)
        a, b, size = make_pair(kind, tmp)
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        t0 = time.perf_counter()
        res = subprocess.run([sys.executable, "-m", "symalign.cli", "align", str(a), str(b), "-o", str(tmp / "OUT"),
                              "--json"], capture_output=True, text=True, env=env)
        wall = time.perf_counter() - t0
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
        if res.returncode != 0:
            return {"pair": kind, "error": res.stderr.strip()[-500:]}
        info = json.loads(res.stdout)
        return {"pair": kind, "wall_s": round(wall, 1), "timings": {k: round(v, 2) for k, v in info["timings"].items()},
                "peak_rss_gib": round(peak / 2**30, 2), "peak_rss_gb": round(peak / 1e9, 2),
                "checkpoints_gib": round(size / 2**30, 2),
                "peak_over_checkpoints": round(peak / size, 2), "peak_is_max_over_children": before > 0,
                "distance": {k: round(v["total"], 4) for k, v in info["distance"].items()},
                "check": {k: v for k, v in info["check"].items() if k != "layers"}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-size", choices=("none", "small", "1b", "7b"), default="small")
    ap.add_argument("--stream", action="store_true", help="Run the streamed benchmark (bench_align_stream.py) at "
                    "this size; 7b always does. Other options are passed on to it.")
    args, rest = ap.parse_known_args()
    if args.llama_size == "7b" or args.stream:
        from bench_align_stream import main as stream_main

        sys.argv = [sys.argv[0], "--llama-size", "tiny" if args.llama_size == "none" else args.llama_size, *rest]
        stream_main()
        return
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    kinds = ["gpt2"] + ({"small": ["llama-small"], "1b": ["llama-1b"]}.get(args.llama_size, []))
    for kind in kinds:
        print(json.dumps(run(kind)), flush=True)


if __name__ == "__main__":
    main()
