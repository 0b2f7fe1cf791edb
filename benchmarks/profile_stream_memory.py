"""Where the memory of a streamed ``symalign align --scope model`` / ``merge --stream --scope model`` goes.

Writes two random Llama-shaped bfloat16 checkpoints of a chosen width with FEW layers
(:func:`bench_align_stream.write_random`; ``--llama-size 7b --layers 2``: every layer,
the embedding and the head have their 7B sizes), then runs each command in a fresh
process under a sampler thread that reads the process's resident set
(``/proc/self/statm``) every few milliseconds and, with each sample, the innermost
``symalign`` source lines the main thread is executing. It reports

* ``peak_rss_gib``: the kernel's ``ru_maxrss`` of the command's process (the figure that
  counts), the sampled peak, and the resident set after the imports (the baseline:
  Python, torch, transformers);
* ``at_peak``: the ``symalign`` stack (file:line function) running when the sampled peak
  was reached, and ``sites``: the highest resident set seen at each source line (the
  ten highest), so the phases can be ranked;
* ``sizes_gib``: the sizes of the objects the streamed model scope may hold, computed from
  the shape (one layer in the stored dtype / float32 / float64, the ``d_ff x d_ff`` cost
  matrix in float64, the embedding and head) -- the breakdown the measured figures are
  read against.

No tracemalloc (it does not see torch's buffers and slows everything down). Usage::

    nice -n 10 python benchmarks/profile_stream_memory.py --llama-size 7b --layers 2 --threads 2 \
        --commands align,merge --json benchmarks/results/stream_model_memory_7b.json

``--pair DIR`` reuses (and keeps) an existing pair ``DIR/A``, ``DIR/B``; otherwise the pair is
written to a temporary folder that is deleted at the end, also on failure.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "src"))  # this checkout's symalign (provenance: its commit), as the commands run it

from bench_align_stream import SHAPES, llama_config, write_random  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class Sampler(threading.Thread):
    """Samples the resident set and the main thread's ``symalign`` stack every ``every_s`` seconds."""

    def __init__(self, every_s: float = 0.005):
        super().__init__(daemon=True)
        self.every, self.main = every_s, threading.main_thread().ident
        self.peak, self.at_peak, self.sites = 0, [], {}
        self.stop = threading.Event()

    def stack(self) -> list[str]:
        f = sys._current_frames().get(self.main)
        out = []
        while f is not None:
            fn = f.f_code.co_filename
            if "/symalign/" in fn:
                out.append(f"{fn.split('/symalign/', 1)[1]}:{f.f_lineno} {f.f_code.co_name}")
            f = f.f_back
        return out

    def run(self) -> None:
        while not self.stop.is_set():
            r = _rss()
            st = self.stack()
            if st:
                self.sites[st[0]] = max(self.sites.get(st[0], 0), r)
            if r > self.peak:
                self.peak, self.at_peak = r, st[:8]
            time.sleep(self.every)


def _child(spec: str) -> None:
    """Run ``symalign ARGS`` in this process under the sampler; write the profile to ``cfg['profile']``."""
    cfg = json.loads(spec)
    import torch  # noqa: F401  -- the baseline: what the command imports anyway
    import transformers  # noqa: F401

    import symalign.cli as cli

    base = _rss()
    s = Sampler()
    s.start()
    sys.argv = ["symalign", *cfg["args"]]
    t0 = time.perf_counter()
    rc = 0
    try:
        cli.main()
    except SystemExit as e:
        rc = int(e.code or 0)
    wall = time.perf_counter() - t0
    s.stop.set()
    s.join()
    top = sorted(s.sites.items(), key=lambda kv: -kv[1])[:10]
    Path(cfg["profile"]).write_text(json.dumps({
        "rc": rc, "wall_s": round(wall, 1),
        "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30, 3),
        "sampled_peak_gib": round(s.peak / 2**30, 3), "baseline_after_imports_gib": round(base / 2**30, 3),
        "at_peak": s.at_peak, "sites": [[k, round(v / 2**30, 3)] for k, v in top]}))


def run_child(script: str, payload: dict, threads: int, tmp: Path) -> tuple[dict, subprocess.CompletedProcess]:
    """Run ``script --child PAYLOAD`` (a ``_child`` that writes its profile to ``payload['profile']``)
    with ``threads`` threads everywhere (symalign, OpenMP, MKL) and line progress; its profile (``rc``
    and, on failure, the last of stderr) and the finished process, whose stdout is the command's JSON."""
    prof = tmp / "profile.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "SYMALIGN_THREADS": str(threads),
           "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "SYMALIGN_PROGRESS": "lines"}
    r = subprocess.run([sys.executable, script, "--child", json.dumps({**payload, "profile": str(prof)})],
                       capture_output=True, text=True, env=env)
    out = json.loads(prof.read_text()) if prof.is_file() else {"rc": r.returncode}
    prof.unlink(missing_ok=True)
    if out["rc"] != 0:
        out["stderr"] = r.stderr[-2000:]
    out["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    return out, r


def profiled(args: list[str], threads: int, tmp: Path) -> dict:
    out, r = run_child(__file__, {"args": args}, threads, tmp)
    if out["rc"] == 0:
        try:
            info = json.loads(r.stdout)
            out["reported"] = {"check": info.get("check", {}).get("rel"), "stream": info.get("stream"),
                               "timings": info.get("timings"), "passes": info.get("sweeps")}
        except json.JSONDecodeError:
            pass
    out["layer_lines"] = [line for line in r.stderr.splitlines() if " layer " in line][-64:]
    return out


def sizes(size: str, layers: int) -> dict:
    """Sizes (GiB) of what the streamed model scope may hold, from the shape."""
    _, D, H, KV, FF, V = SHAPES[size]
    d = D // H
    layer = 2 * D * D + 2 * D * KV * d + 3 * D * FF + 2 * D
    g = 2**30
    return {"layer_params": layer, "layer_bf16": round(2 * layer / g, 3), "layer_f32": round(4 * layer / g, 3),
            "layer_f64": round(8 * layer / g, 3), "ff_tensor_f64": round(8 * D * FF / g, 3),
            "ff_cost_f64": round(8 * FF * FF / g, 3), "embedding_f32": round(4 * V * D / g, 3),
            "embedding_f64": round(8 * V * D / g, 3), "d_by_d_f64": round(8 * D * D / g, 3),
            "checkpoint_bf16": round(2 * (layers * layer + 2 * V * D + D) / g, 3)}


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        _child(sys.argv[2])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-size", choices=tuple(SHAPES), default="7b")
    ap.add_argument("--layers", type=int, default=2, help="Layers of the pair (the width is the size's).")
    ap.add_argument("--max-sweeps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--commands", default="align,merge", help="align (--scope model) and/or merge (--scope model).")
    ap.add_argument("--pair", default=None, help="Reuse (and keep) DIR/A and DIR/B; written there if absent.")
    ap.add_argument("--tmp", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from symalign.provenance import provenance

    res: dict = {"provenance": provenance(threads=args.threads),
                 "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
                 "load_average_start": [round(x, 2) for x in os.getloadavg()], "size": args.llama_size,
                 "layers": args.layers, "shape": dict(zip(("layers", "D", "heads", "kv_heads", "ff", "vocab"),
                                                          (args.layers, *SHAPES[args.llama_size][1:]))),
                 "sizes_gib": sizes(args.llama_size, args.layers), "max_sweeps": args.max_sweeps}
    tmp = Path(tempfile.mkdtemp(prefix="symalign-memprof-", dir=args.tmp))
    pair = Path(args.pair) if args.pair else tmp
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        if not (pair / "B").is_dir():
            cfg = llama_config(args.llama_size, layers=args.layers)
            t0 = time.perf_counter()
            write_random(pair / "A", cfg, 0, "2GB")
            write_random(pair / "B", cfg, 1, "2GB")
            res["write_s"] = round(time.perf_counter() - t0, 1)
        for c in args.commands.split(","):
            out = tmp / f"OUT-{c}"
            if c == "align":
                cmd = ["align", str(pair / "A"), str(pair / "B"), "-o", str(out), "--stream", "--scope", "model",
                       "--max-sweeps", str(args.max_sweeps), "--json"]
            else:
                cmd = ["merge", str(pair / "A"), str(pair / "B"), "-o", str(out), "--stream", "--scope", "model",
                       "--max-sweeps", str(args.max_sweeps), "--json"]
            res[c] = {"args": cmd[:1] + ["A", "B", "-o", "OUT"] + cmd[5:], **profiled(cmd, args.threads, tmp)}
            print(json.dumps({c: res[c]}, indent=1), flush=True)
            shutil.rmtree(out, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
