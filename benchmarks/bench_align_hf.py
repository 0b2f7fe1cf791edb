"""Wall time and peak memory of ``symalign align`` on realistic Hugging Face shapes.

Pairs (random init, built from configs, saved with ``save_pretrained`` to a temp dir):

* GPT-2 small (124M parameters, float32);
* a Llama-shaped model (``--llama-size``: ``1b`` = 16 layers, D 2048, 32/8 heads, tied embeddings,
  0.79B parameters; ``small`` = 8 layers, D 1024, 16/4 heads, 0.16B; ``small+1b`` both).

Each ``symalign align`` runs as a subprocess of a wrapper process; peak memory is its ``ru_maxrss``
(the wrapper's children: that command alone). Goals: GPT-2 small under 60 s and under 3x the size of the two
checkpoints. Usage: ``python benchmarks/bench_align_hf.py [--llama-size none|small|1b]``.

``--out FILE`` writes a result file (JSON, atomically, with its provenance) with docs/adapters.md's tables:
``fullsize`` (wall, match, peak RSS and output change of each pair above) and ``independent`` (the relative
attention distance ``||A - B'|| / ||A||`` before and after, on these pairs and on the tests' tiny float32 GPT-2 and
GQA Llama: ``tests/hf_tiny.make_model`` seeds 0 and 1, ``--stage2 full`` and ``orthogonal``, in-process)::

    python benchmarks/bench_align_hf.py --llama-size small --threads 1 --out benchmarks/results/align_hf.json

``--threads`` is passed to each ``symalign align`` (``--threads``); the wall times are those of this machine at
the time (a shared machine's load is recorded, not removed).

``--llama-size 7b`` (or ``--stream``) runs the streamed benchmark instead
(``benchmarks/bench_align_stream.py``: two random bfloat16 checkpoints written to a
temporary folder, ``symalign align --stream`` with both scopes, wall time, peak RSS,
read bandwidth and the floor measured in the same run).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _save(model, path: Path) -> int:
    model.save_pretrained(path)
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def make_pair(kind: str, tmp: Path) -> tuple[Path, Path, int, int]:
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
    size = n_params = 0
    for seed, name in ((0, "A"), (1, "B")):
        torch.manual_seed(seed)
        model = cls(cfg)
        n_params = sum(p.numel() for p in model.parameters())  # tied embeddings counted once
        size += _save(model, tmp / name)
        del model
    return tmp / "A", tmp / "B", size, n_params


def run(kind: str, threads: int | None = None) -> dict:
    """Build the pair, run ``symalign align A B -o OUT --json`` in a child of a wrapper
    (``bench_align_stream.measured``: the peak RSS is that command's alone, not the largest of earlier children)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_align_stream import measured

    with tempfile.TemporaryDirectory(prefix="symalign-bench-") as d:
        tmp = Path(d)
        a, b, size, n_params = make_pair(kind, tmp)
        args = ["align", str(a), str(b), "-o", str(tmp / "OUT"), "--json"]
        r = measured(args + ([] if threads is None else ["--threads", str(threads)]),
                     threads=threads if threads is not None else 2)
        if r["rc"] != 0:
            return {"pair": kind, "error": r["err"][-500:]}
        info = json.loads(r["out"])
        peak = r["peak_rss"]
        return {"pair": kind, "params": n_params, "wall_s": round(r["wall_s"], 1), "cpu_s": r["cpu_s"],
                "timings": {k: round(v, 2) for k, v in info["timings"].items()},
                "peak_rss_gib": round(peak / 2**30, 2), "peak_rss_gb": round(peak / 1e9, 2),
                "checkpoints_gib": round(size / 2**30, 2), "checkpoints_gb": round(size / 1e9, 2),
                "peak_over_checkpoints": round(peak / size, 2), "load_average_after": r["load_average_after"],
                "distance": {k: round(v["total"], 4) for k, v in info["distance"].items()},
                "check": {k: v for k, v in info["check"].items() if k != "layers"}}


LABELS = {"gpt2": "GPT-2 small", "llama-small": "Llama, 8 layers, D 1024, GQA 16/4",
          "llama-1b": "Llama, 16 layers, D 2048, GQA 32/8, tied embeddings",
          "tiny-gpt2": "tiny GPT-2 (tests)", "tiny-llama": "tiny Llama, GQA (tests)"}


def _params(n: int) -> str:
    return f"{n / 1e6:.0f}M" if n < 1e9 else f"{n / 1e9:.2f}B"


def tiny_pairs(threads: int | None) -> list[dict]:
    """The tests' tiny float32 GPT-2 and GQA Llama, seeds 0 and 1, aligned in-process (``--stage2`` each)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from hf_tiny import make_model
    from typer.testing import CliRunner

    from symalign.cli import app

    rows = []
    with tempfile.TemporaryDirectory(prefix="symalign-bench-tiny-") as d:
        for family, stage2 in (("gpt2", "full"), ("llama", "full"), ("llama", "orthogonal")):
            a, b, out = Path(d) / f"{family}-A", Path(d) / f"{family}-B", Path(d) / f"{family}-{stage2}"
            if not a.exists():
                make_model(family, dtype=torch.float32, seed=0).save_pretrained(a)
                make_model(family, dtype=torch.float32, seed=1).save_pretrained(b)
            args = ["align", str(a), str(b), "-o", str(out), "--json", "--stage2", stage2]
            r = CliRunner().invoke(app, args + ([] if threads is None else ["--threads", str(threads)]))
            if r.exit_code != 0:
                raise SystemExit(f"tiny {family} --stage2 {stage2} failed: {r.output.strip()[-500:]}")
            info = json.loads(r.stdout)
            rows.append({"pair": f"tiny-{family}", "stage2": stage2,
                         "distance": {k: v["total"] for k, v in info["distance"].items()}})
    return rows


def tables(full: list[dict], tiny: list[dict]) -> dict:
    """docs/adapters.md's ``fullsize`` and ``independent`` tables, from the measured runs."""
    from symalign.experiments.docs_tables import make_table

    shown = [{"pair": LABELS[r["pair"]], "params": _params(r["params"]), "wall": r["wall_s"],
              "match": r["timings"].get("match_s"), "rss": r["peak_rss_gb"], "ckpt": r["checkpoints_gb"],
              "ratio": r["peak_over_checkpoints"], "change": f"{r['check']['rel']:.1e} ({r['check']['dtype']} check)"}
             for r in full]
    fullsize = make_table(shown, [
        ("pair", "pair"), ("params", "parameters"), ("wall", "wall s", ".1f"), ("match", "match s", ".1f"),
        ("rss", "peak RSS GB", ".2f"), ("ckpt", "checkpoints (both) GB", ".2f"),
        ("ratio", "peak / checkpoints", ".2f"), ("change", "output change")])
    dist = [{"pair": LABELS[r["pair"]], "stage2": r["stage2"], **r["distance"]} for r in tiny]
    dist += [{"pair": f"{LABELS[r['pair']]}, {_params(r['params'])} (benchmark)", "stage2": "full", **r["distance"]}
             for r in full]
    for r in dist:
        r["reduction"] = 1 - r["after"] / r["before"]
    independent = make_table(dist, [("pair", "pair"), ("stage2", "stage 2"), ("before", "before", ".3f"),
                                    ("after", "after", ".3f"), ("reduction", "reduction", ".1%")])
    return {"fullsize": fullsize, "independent": independent}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-size", choices=("none", "small", "1b", "small+1b", "7b"), default="small")
    ap.add_argument("--stream", action="store_true", help="Run the streamed benchmark (bench_align_stream.py) at "
                    "this size; 7b always does. Other options are passed on to it.")
    ap.add_argument("--threads", type=int, default=None, help="--threads of each symalign align (default: its own)")
    ap.add_argument("--out", default=None, help="write a result file (with docs/adapters.md's tables) here")
    args, rest = ap.parse_known_args()
    if args.llama_size == "7b" or args.stream:
        from bench_align_stream import main as stream_main

        sys.argv = [sys.argv[0], "--llama-size", "tiny" if args.llama_size == "none" else args.llama_size, *rest]
        stream_main()
        return
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    prov = None
    if args.out:
        from symalign.provenance import provenance

        prov = provenance(["python", "benchmarks/bench_align_hf.py", *sys.argv[1:]], threads=args.threads,
                          seed_pairs=1)  # one independent pair (seeds 0, 1) per row
        load_start = [round(x, 2) for x in os.getloadavg()]
    kinds = ["gpt2"] + {"small": ["llama-small"], "1b": ["llama-1b"], "small+1b": ["llama-small", "llama-1b"]}.get(
        args.llama_size, [])
    full = []
    for kind in kinds:
        full.append(run(kind, args.threads))
        print(json.dumps(full[-1]), flush=True)
    if args.out:
        from symalign.atomic import write_json

        if any("error" in r for r in full):
            raise SystemExit(f"a pair failed; {args.out} not written")
        tiny = tiny_pairs(args.threads)
        write_json(args.out, {"provenance": prov, "load_average": {"start": load_start, "end": [
            round(x, 2) for x in os.getloadavg()]}, "pairs": full, "tiny": tiny, "tables": tables(full, tiny)})


if __name__ == "__main__":
    main()
