"""The bfloat16 rounding bound of the streamed attention scope, measured at full Llama width.

Writes two random bfloat16 checkpoints of a :mod:`bench_align_stream` shape (``--layers N``
of them: the width is the point, not the depth), runs the streamed attention scope in this
process (``run_stream_attention(return_transform=True)``), then, layer by layer, applies the
transform found to B's attention tensors in float64 with the in-memory ``symalign.spec.apply``
(``x``, the exact transform) and compares with OUT's stored weights ``w``:

* ``w == round_bf16(x)`` bit for bit, for every tensor;
* ``max |w - x| / |x|`` against the documented bound ``u = 2^-8`` (bfloat16's unit roundoff;
  normal numbers, ``|x| >= 2^-126``).

Prints and (``--json``) writes the per-tensor worst ratios, with the provenance. The
temporary folder is deleted at the end. Usage::

    python benchmarks/bench_stream_rounding.py --llama-size 7b --layers 2 [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_align_stream import SHAPES, llama_config, write_random  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-size", choices=tuple(SHAPES), default="7b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tmp", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from symalign.checkpoint.lazy import open_checkpoint
    from symalign.provenance import provenance
    from symalign.spec import apply
    from symalign.stream.attention import layer_of, n_layers, run_stream_attention

    res: dict = {"provenance": provenance(threads=torch.get_num_threads()),
                 "load_average_start": [round(x, 2) for x in os.getloadavg()],
                 "shape": dict(zip(("layers", "D", "heads", "kv_heads", "ff", "vocab"),
                                   (args.layers, *SHAPES[args.llama_size][1:]))), "dtype": "bfloat16",
                 "bound": 2.0 ** -8}
    tmp = Path(tempfile.mkdtemp(prefix="symalign-rounding-", dir=args.tmp))
    try:
        cfg = llama_config(args.llama_size, args.layers)
        write_random(tmp / "A", cfg, 0)
        write_random(tmp / "B", cfg, 1)
        t0 = time.perf_counter()
        info = run_stream_attention(tmp / "A", tmp / "B", tmp / "OUT", progress=False, return_transform=True)
        res["align_s"] = round(time.perf_counter() - t0, 1)
        b, out = open_checkpoint(tmp / "B"), open_checkpoint(tmp / "OUT")
        spec = b.adapter.spec(b.config, b.keys)
        tiny = torch.finfo(torch.bfloat16).tiny
        rows, worst, identical, n = [], 0.0, True, 0
        for i in range(n_layers(spec)):
            sub = spec.restrict(layer_of(spec, i))
            names = list(sub.tensors)
            xb = b.read(names, torch.float64)
            exact = apply(sub, {k: v for k, v in info.transform.items() if k in sub.spaces}, xb)
            stored = out.read(names)
            for k in names:
                x, w = exact[k], stored[k]
                same = torch.equal(w, x.to(torch.bfloat16))
                normal = x.abs() >= tiny
                ratio = float(((w.double() - x).abs()[normal] / x.abs()[normal]).max())
                identical &= same
                worst = max(worst, ratio)
                n += x.numel()
                rows.append({"tensor": k, "round_bf16_bit_identical": same, "max_rel_error": ratio,
                             "over_bound": ratio / 2.0 ** -8})
            del xb, exact, stored
        res.update({"tensors": rows, "values": n, "all_bit_identical": identical, "worst_rel_error": worst,
                    "worst_over_bound": worst / 2.0 ** -8, "check": info.check.to_dict()["exact"],
                    "stored_check_rel": info.check.rel})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    text = json.dumps(res, indent=2) + "\n"
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text)


if __name__ == "__main__":
    main()
