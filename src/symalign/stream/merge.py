r"""``symalign merge --stream``: align and average checkpoints tensor by tensor, never a whole model in memory.

With checkpoints ``theta_1 .. theta_M`` and weights ``w_k`` (normalised, ``sum w_k = 1``),
the merged model is ``theta = sum_k w_k T_k . theta_k`` (``T_1 = id``), exactly as
:mod:`symalign.merge`. Streamed:

1. each ``theta_k`` (``k >= 2``) is aligned to ``theta_1`` by the streamed
   ``symalign align`` (``--scope attention``: :mod:`symalign.stream.attention`;
   ``--scope model``: :mod:`symalign.stream.model`, the alternating passes; one layer
   of each model in memory, every layer's function checked) into a scratch folder
   next to OUT. With ``--scope model`` the aligned checkpoints are in the exactly
   rewritten (folded) format, so ``theta_1`` is averaged in that format too, folded
   row chunk by row chunk as it is read (:class:`~symalign.stream.fold.FoldedCheckpoint`),
   as the in-memory merge does;
2. the average is formed tensor by tensor in row chunks of at most
   :data:`CHUNK_ELEMENTS` values: each input's rows are read lazily
   (:class:`~symalign.checkpoint.lazy.LazyCheckpoint`), summed in float32 for
   bfloat16/float16 tensors and in float64 otherwise (the rounding argument:
   :mod:`symalign.checkpoint.average`), rounded to the first checkpoint's dtype of that
   tensor, and written at their offsets into OUT's shards by a writer thread while the
   next chunk is read (:class:`~symalign.io.shards.ShardWriter`, the first
   checkpoint's layout: shard names, index, header bytes, non-weight files); integer
   tensors are the first checkpoint's bytes. Each aligned scratch checkpoint is deleted
   once the average is written;
3. OUT is checked to load without materialising weights: every tensor header against
   the config (:func:`~symalign.checkpoint.lazy.open_checkpoint`), and the model class
   built on the meta device has exactly those names and shapes
   (:func:`check_loads_lazily`). Then OUT is committed atomically (nothing is left on
   any failure).

Memory: one layer of two models during each alignment, then ``M`` input row chunks,
the sum and its rounding, and :data:`WRITES_IN_FLIGHT` rounded chunks waiting to be
written while averaging -- independent of the depth. The row chunks are exact (the
average is elementwise) and the sums are :func:`symalign.checkpoint.average.weighted_average`,
as in memory, so the result is bit-identical to the in-memory merge of the same aligned
checkpoints.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

import torch

from symalign.checkpoint import average
from symalign.errors import CheckpointError, ConfigError
from symalign.stream.memory import bound_heap, peak_rss
from symalign.stream.progress import progress_bar
from symalign.checkpoint.lazy import LazyCheckpoint, check_same_architecture, open_checkpoint
from symalign.io.shards import ShardWriter
from symalign.tolerance import all_finite

CHUNK_ELEMENTS = 1 << 24  # values per input read at a time while averaging (32 MiB in bfloat16)
WRITES_IN_FLIGHT = 2  # averaged blocks waiting for the writer thread at most
# `symalign merge` streams by itself above this many checkpoint bytes (together) where streaming keeps the scope
# (symalign.commands.merge.choose_path): the in-memory merge holds several copies of the weights (A, the model
# being aligned, the float32/float64 running sum and its rounding), the streamed one a layer and fixed row chunks;
# below it the chunk buffers would outweigh the checkpoints.
AUTO_STREAM_BYTES = 8 << 20


def row_chunks(shape: tuple[int, ...], limit: int = CHUNK_ELEMENTS) -> list[tuple[int, int]]:
    """``(start, stop)`` row ranges (axis 0) of at most ``limit`` values each (one row at least)."""
    if not shape:
        return [(0, 0)]
    width = 1
    for s in shape[1:]:
        width *= s
    rows = max(1, limit // max(1, width))
    return [(s, min(s + rows, shape[0])) for s in range(0, shape[0], rows)] or [(0, 0)]


def average_into(out_path: Path, inputs: Sequence[Any], weights: Sequence[float],
                 marker: dict[str, Any], progress: bool = True, layout: LazyCheckpoint | None = None,
                 extra: dict[str, Any] | None = None, config_edits: dict[str, Any] | None = None
                 ) -> tuple[Path, int]:
    """Write ``sum_k w_k inputs[k]`` laid out like ``inputs[0]`` (or ``layout``, the checkpoint ``inputs[0]``
    reads through, e.g. :class:`~symalign.stream.fold.FoldedCheckpoint`) into a staged folder; returns it and
    the bytes written. ``extra``: tensors ``inputs[0]`` has beyond ``layout`` (name -> dtype, shape: an untied
    head, :class:`~symalign.io.shards.ShardWriter`); ``config_edits``: merged into OUT's config. Float
    tensors: row blocks of at most :data:`CHUNK_ELEMENTS` values, summed in
    :func:`~symalign.checkpoint.average.accumulate_dtype` (float32 for bfloat16/float16, float64
    otherwise) and rounded to ``inputs[0]``'s dtype; others copied from ``layout``.

    One writer thread writes block ``j`` while block ``j + 1`` is read and summed (``pwrite``
    releases the GIL; at most :data:`WRITES_IN_FLIGHT` blocks wait); every call on the
    :class:`ShardWriter` goes through that thread. An input with NaN/Inf is found from the
    average (a non-finite input makes it non-finite), then named."""
    like = inputs[0]
    writer = ShardWriter(out_path, layout or like, extra=extra)
    total = sum(ck.nbytes for ck in inputs)
    pending: deque[Future] = deque()
    floats = [t for t in like.tensors.values() if t.dtype.is_floating_point and t.numel]
    widest = max((t.dtype.itemsize for t in floats), default=1)
    acc_bytes = max((average.accumulate_dtype(t.dtype).itemsize for t in floats), default=1)
    cap = max([CHUNK_ELEMENTS] + [t.numel // max(1, t.shape[0]) for t in floats if t.shape])  # one row at least
    # reused storage: the inputs' raw rows, the sum, the current term, and a ring of rounded chunks for the writer
    raw = [torch.empty(cap * widest, dtype=torch.uint8) for _ in inputs]
    acc, term = (torch.empty(cap * acc_bytes, dtype=torch.uint8) for _ in range(2))
    ring = [torch.empty(cap * widest, dtype=torch.uint8) for _ in range(WRITES_IN_FLIGHT + 1)]
    j = 0

    def submit(fn, *args) -> None:
        pending.append(pool.submit(fn, *args))
        while len(pending) > WRITES_IN_FLIGHT:
            pending.popleft().result()

    try:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="symalign-write") as pool, \
                progress_bar(total, "merge (streamed average)", progress) as bar:
            order = sorted(like.tensors.values(), key=lambda t: (str(t.file), t.start))  # sequential writes
            for info in order:
                n = info.name
                if not info.dtype.is_floating_point or info.numel == 0:
                    submit(writer.copy, n)
                    continue
                for lo, hi in row_chunks(info.shape):
                    xs = [ck.read_rows_into(n, lo, hi, r) for ck, r in zip(inputs, raw)]
                    dt = average.accumulate_dtype(info.dtype)
                    s = average.weighted_sum(xs, weights, info.dtype, acc.view(dt), term.view(dt))
                    slot = ring[j % len(ring)].view(info.dtype)  # free: at most WRITES_IN_FLIGHT writes wait
                    j += 1
                    avg = slot[:s.numel()].view(s.shape)
                    avg.copy_(s)
                    if not all_finite(avg):
                        _non_finite(n, inputs, xs)
                    if not info.shape:
                        submit(writer.put, n, avg)
                    else:
                        submit(writer.put_rows, n, lo, avg)
                bar.update(sum(ck.bytes_read for ck in inputs), n)
            while pending:
                pending.popleft().result()
            bar.update(total, "done")
        tmp = writer.stage(config_edits, marker=marker)
    except BaseException:
        for f in pending:
            f.cancel()
        writer.abort()
        raise
    return tmp, writer.bytes_written


def _non_finite(name: str, inputs: Sequence[LazyCheckpoint], xs: Sequence[torch.Tensor]) -> None:
    """Raise the error for a non-finite average of tensor ``name``: the input that has NaN/Inf, else overflow."""
    for ck, x in zip(inputs, xs):
        if not all_finite(x):
            raise CheckpointError(f"{ck.path}: tensor {name!r} contains NaN or Inf values")
    raise CheckpointError(f"the weighted average of tensor {name!r} overflows {str(inputs[0].tensors[name].dtype)}; "
                          "use weights between 0 and 1")


def check_loads_lazily(path: Path) -> dict[str, Any]:
    """OUT loads without materialising a weight: every header checked against ``config.json``
    (:func:`open_checkpoint`) and the model class, built on the meta device, has exactly the
    checkpoint's tensor names and shapes (tied weights may be absent)."""
    from symalign.checkpoint.config import expected_shapes

    ck = open_checkpoint(path)
    from transformers.core_model_loading import revert_weight_conversion

    with torch.device("meta"):
        model = ck.adapter.model_class(ck.config)(ck.config)
    # the names and shapes save_pretrained writes (renamed modules; experts one tensor each), by transformers
    shapes = {k: tuple(v.shape) for k, v in revert_weight_conversion(model, dict(model.state_dict())).items()}
    _, tied = expected_shapes(ck.adapter, ck.config)
    for name, info in ck.tensors.items():
        if shapes.get(name) != info.shape:
            raise CheckpointError(f"{path}: tensor {name!r} {info.shape} does not fit "
                                  f"{type(model).__name__} ({shapes.get(name)})")
    missing = sorted(set(shapes) - set(ck.tensors) - set(tied))
    if missing:
        raise CheckpointError(f"{path}: {type(model).__name__} expects {missing[0]!r}, which the checkpoint lacks")
    return {"class": type(model).__name__, "params": sum(p.numel() for p in model.parameters()),
            "tensors": len(ck.tensors), "dtype": str(ck.dtype).replace("torch.", "")}


def run_stream_merge(dirs: Sequence[Path], out: Path, weights: Sequence[float], scope: str = "attention",
                     stage2: str = "full", align: bool = True, force: bool = False,
                     progress: bool = True, max_sweeps: int = 20, experts: str = "exact",
                     device: Any = None) -> dict[str, Any]:
    """Merge ``dirs`` into ``out`` by streaming (module docstring); ``weights`` already normalised;
    ``max_sweeps``: passes of the streamed model scope at most; ``experts``: how its mixture-of-experts
    blocks are solved (:func:`symalign.match.experts.match_experts`)."""
    from symalign.io.folder import check_output_dir, commit, discard
    from symalign.stream.attention import run_stream_attention
    from symalign.stream.auto import streamable
    from symalign.stream.fold import FoldedCheckpoint
    from symalign.stream.model import run_stream_model

    t0 = time.perf_counter()
    folded = align and scope == "model"
    if scope not in ("attention", "model"):
        raise ConfigError(f"merge --stream aligns with --scope attention or model, not {scope!r}")
    if folded:
        why = streamable(Path(dirs[0]), "model")
        if why is not None:
            raise ConfigError(why)
    bound_heap()
    out_path = check_output_dir(out, list(dirs), force)
    first = open_checkpoint(dirs[0])
    for d in dirs[1:]:
        check_same_architecture(first, open_checkpoint(d))
    reference = FoldedCheckpoint(first) if folded else first  # --scope model: A in the aligned models' format
    scratch = Path(tempfile.mkdtemp(prefix=f".{out_path.name}.align-", dir=out_path.parent))
    aligned_info: list[dict[str, Any]] = []
    t_align = 0.0
    try:
        inputs: list[Any] = [reference]
        for k, d in enumerate(dirs[1:], 1):
            if align:
                ta = time.perf_counter()
                if folded:
                    info = run_stream_model(Path(dirs[0]), Path(d), scratch / str(k), stage2=stage2,
                                            progress=progress, max_sweeps=max_sweeps, experts=experts, device=device)
                else:
                    info = run_stream_attention(Path(dirs[0]), Path(d), scratch / str(k), stage2=stage2,
                                                progress=progress, device=device)
                t_align += time.perf_counter() - ta
                aligned_info.append({"model": str(d), "distance": info.distance, "check": info.check.to_dict(),
                                     "sweeps": info.sweeps, "converged": info.converged})
                inputs.append(open_checkpoint(scratch / str(k)))
            else:
                inputs.append(open_checkpoint(d))
        ta = time.perf_counter()
        tmp, written = average_into(out_path, inputs, weights, marker={
            "command": "merge", "scope": scope if align else "none", "folded": folded, "streamed": True,
            "weights": list(weights), "inputs": [str(Path(d).resolve()) for d in dirs]}, progress=progress,
            layout=first, extra=reference.extra if folded else None,
            config_edits={"tie_word_embeddings": False} if folded and reference.extra else None)
        t_avg = time.perf_counter() - ta
        read = sum(ck.bytes_read for ck in inputs)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    try:
        loads = check_loads_lazily(tmp)
        commit(tmp, out_path)
    except BaseException:
        discard(tmp)
        raise
    return {"models": [str(d) for d in dirs], "weights": list(weights), "out": str(out_path),
            "scope": scope if align else "none", "universe": None, "aligned": aligned_info,
            "dtype": str(first.dtype).replace("torch.", ""), "architecture": first.config.model_type,
            "tensors": len(first.tensors), "new_tensors": [], "loads": loads,
            "stream": {"bytes_read_average": read, "bytes_written": written, "peak_rss_bytes": peak_rss(),
                       "time_align_s": t_align, "time_average_s": t_avg, "time_total_s": time.perf_counter() - t0}}
