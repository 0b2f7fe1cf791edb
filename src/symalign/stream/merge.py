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
   row chunk by row chunk as it is read (:class:`~symalign.stream.model.FoldedCheckpoint`),
   as the in-memory merge does;
2. the average is formed tensor by tensor in row chunks of at most
   :data:`CHUNK_ELEMENTS` values: each input's rows are read lazily
   (:class:`~symalign.stream.reader.LazyCheckpoint`), summed in float64, rounded to
   the first checkpoint's dtype of that tensor, and written at their offsets into
   OUT's shards (:class:`~symalign.stream.writer.ShardWriter`, the first checkpoint's
   layout: shard names, index, header bytes, non-weight files); integer tensors are
   the first checkpoint's bytes. Each aligned scratch checkpoint is deleted once the
   average is written;
3. OUT is checked to load without materialising weights: every tensor header against
   the config (:func:`~symalign.stream.reader.open_checkpoint`), and the model class
   built on the meta device has exactly those names and shapes
   (:func:`check_loads_lazily`). Then OUT is committed atomically (nothing is left on
   any failure).

Memory: one layer of two models during each alignment, then ``M + 1`` row chunks
(``(M + 1) x 8 x CHUNK_ELEMENTS`` bytes at most) while averaging -- independent of the
depth. The row chunks are exact (the average is elementwise), so the result is
bit-identical to the in-memory merge of the same aligned checkpoints.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from symalign.errors import CheckpointError, ConfigError
from symalign.stream.memory import bound_heap, peak_rss, release
from symalign.stream.progress import progress_bar
from symalign.stream.reader import LazyCheckpoint, check_same_architecture, open_checkpoint
from symalign.stream.writer import ShardWriter

CHUNK_ELEMENTS = 1 << 22  # values per input read at a time while averaging (32 MiB in float64)


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
                 marker: dict[str, Any], progress: bool = True, layout: LazyCheckpoint | None = None
                 ) -> tuple[Path, int]:
    """Write ``sum_k w_k inputs[k]`` laid out like ``inputs[0]`` (or ``layout``, the checkpoint ``inputs[0]``
    reads through, e.g. :class:`~symalign.stream.model.FoldedCheckpoint`) into a staged folder; returns it and
    the bytes written. Float tensors: float64 sums in row chunks, rounded to ``inputs[0]``'s dtype; others
    copied from ``layout``."""
    like = inputs[0]
    writer = ShardWriter(out_path, layout or like)
    total = sum(ck.nbytes for ck in inputs)
    try:
        with progress_bar(total, "merge (streamed average)", progress) as bar:
            order = sorted(like.tensors.values(), key=lambda t: (str(t.file), t.start))  # sequential writes
            for info in order:
                n = info.name
                if not info.dtype.is_floating_point or info.numel == 0:
                    writer.copy(n)
                    continue
                for lo, hi in row_chunks(info.shape):
                    if not info.shape:  # a scalar tensor
                        acc = sum(w * ck.read([n], torch.float64)[n] for w, ck in zip(weights, inputs))
                        writer.put(n, acc)
                        continue
                    acc = torch.zeros((hi - lo, *info.shape[1:]), dtype=torch.float64)
                    for w, ck in zip(weights, inputs):
                        acc += w * ck.read_rows(n, lo, hi, torch.float64)  # as merge.weighted_average
                    writer.put_rows(n, lo, acc)
                    del acc
                bar.update(sum(ck.bytes_read for ck in inputs), n)
                release()
            bar.update(total, "done")
        tmp = writer.stage(marker=marker)
    except BaseException:
        writer.abort()
        raise
    return tmp, writer.bytes_written


def check_loads_lazily(path: Path) -> dict[str, Any]:
    """OUT loads without materialising a weight: every header checked against ``config.json``
    (:func:`open_checkpoint`) and the model class, built on the meta device, has exactly the
    checkpoint's tensor names and shapes (tied weights may be absent)."""
    from symalign.hf_io import expected_shapes

    ck = open_checkpoint(path)
    with torch.device("meta"):
        model = ck.adapter.model_class(ck.config)(ck.config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
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
                     progress: bool = True, max_sweeps: int = 20) -> dict[str, Any]:
    """Merge ``dirs`` into ``out`` by streaming (module docstring); ``weights`` already normalised;
    ``max_sweeps``: passes of the streamed model scope at most."""
    from symalign import hf_io
    from symalign.stream.attention import run_stream_attention
    from symalign.stream.auto import streamable
    from symalign.stream.model import FoldedCheckpoint, run_stream_model

    t0 = time.perf_counter()
    folded = align and scope == "model"
    if scope not in ("attention", "model"):
        raise ConfigError(f"merge --stream aligns with --scope attention or model, not {scope!r}")
    if folded:
        why = streamable(Path(dirs[0]), "model")
        if why is not None:
            raise ConfigError(why)
    bound_heap()
    out_path = hf_io.check_output_dir(out, list(dirs), force)
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
                                            progress=progress, max_iter=max_sweeps)
                else:
                    info = run_stream_attention(Path(dirs[0]), Path(d), scratch / str(k), stage2=stage2,
                                                progress=progress)
                t_align += time.perf_counter() - ta
                aligned_info.append({"model": str(d), "distance": info.distance, "check": info.check.to_dict()})
                inputs.append(open_checkpoint(scratch / str(k)))
            else:
                inputs.append(open_checkpoint(d))
        ta = time.perf_counter()
        tmp, written = average_into(out_path, inputs, weights, marker={
            "command": "merge", "scope": scope if align else "none", "folded": folded, "streamed": True,
            "weights": list(weights), "inputs": [str(Path(d).resolve()) for d in dirs]}, progress=progress,
            layout=first)
        t_avg = time.perf_counter() - ta
        read = sum(ck.bytes_read for ck in inputs)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    try:
        loads = check_loads_lazily(tmp)
        hf_io.commit(tmp, out_path)
    except BaseException:
        hf_io.discard(tmp)
        raise
    return {"models": [str(d) for d in dirs], "weights": list(weights), "out": str(out_path),
            "scope": scope if align else "none", "universe": None, "aligned": aligned_info,
            "dtype": str(first.dtype).replace("torch.", ""), "architecture": first.config.model_type,
            "tensors": len(first.tensors), "new_tensors": [], "loads": loads,
            "stream": {"bytes_read_average": read, "bytes_written": written, "peak_rss_bytes": peak_rss(),
                       "time_align_s": t_align, "time_average_s": t_avg, "time_total_s": time.perf_counter() - t0}}
