r"""The one merge: every model's aligned tensors averaged with the first model's as they are produced.

With checkpoints ``theta_1 .. theta_M`` and weights ``w_k`` (normalised, ``sum w_k = 1``), the merged model is
``theta = sum_k w_k T_k . theta_k`` (``T_1 = id``). :func:`merge_into` forms it tensor by tensor, in memory and
streamed alike; what differs is only where the tensors come from and what stays resident:

* **the reference** ``theta_1``: a source read row chunk by row chunk -- the checkpoint opened lazily
  (:class:`~symalign.checkpoint.lazy.LazyCheckpoint`), or held (:class:`~symalign.checkpoint.lazy.
  ResidentCheckpoint`); with ``--scope model`` in the exactly rewritten (folded) format the aligned models are
  in (:class:`~symalign.stream.fold.FoldedCheckpoint` streamed; the folded state in memory);
* **each other model** ``T_k . theta_k``: a stream of items ``(name, first row or None, tensor or None)`` in the
  order its alignment engine puts them into its sink (``None`` tensor: the model's own stored tensor, a copy).
  Streamed, the engine (:func:`~symalign.stream.attention.align_attention` or
  :func:`~symalign.stream.model.align_model_into`, one layer of two models in memory, every layer's function
  checked) runs on a producer thread writing into a :class:`ChannelSink`, a bounded queue the merge reads:
  the aligned models are never written to disk nor read back. In memory, each model is aligned whole and
  checked whole (:func:`symalign.pipeline.align_loaded`) and its state handed over;
* **the output**: a :class:`~symalign.stream.sink.TensorSink` -- OUT's shards laid out like the first checkpoint
  (:class:`~symalign.io.shards.ShardWriter`, then committed atomically) or a state dict
  (:class:`~symalign.stream.sink.StateSink`, then staged).

Per item, each input's rows are taken in row chunks of at most :data:`CHUNK_ELEMENTS` values, each rounded to
its model's stored dtype (as writing the aligned model would), summed in float32 for bfloat16/float16 tensors
and in float64 otherwise (:func:`symalign.checkpoint.average.weighted_sum`: the rounding argument is there) and
rounded to the first checkpoint's dtype of that tensor; integer tensors are the first checkpoint's. The average
is elementwise, so the chunking changes no bit: the streamed and in-memory merges of the same aligned models
agree bit for bit. An input with NaN/Inf is found from the average (a non-finite input makes it non-finite),
then named.

Memory, streamed: per producer one layer of two models and the items waiting in its queue (at most
:data:`QUEUE_ITEMS`), plus the row chunks being averaged -- independent of the depth. The models are aligned
concurrently (one thread each) and their items consumed in lockstep: the engines put the same names in the same
order. Streamed OUT is checked to load without materialising weights (:func:`check_loads_lazily`).
"""

from __future__ import annotations

import math
import queue
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from torch import Tensor

from symalign.checkpoint import average
from symalign.errors import CheckpointError, ConfigError, SymalignError
from symalign.stream.memory import bound_heap, peak_rss
from symalign.stream.progress import progress_bar
from symalign.checkpoint.lazy import LazyCheckpoint, check_same_architecture, open_checkpoint
from symalign.io.shards import ShardWriter
from symalign.stream.sink import TensorSink
from symalign.tolerance import all_finite

Item = tuple[str, "int | None", "Tensor | None"]  # (name, first row or None: the whole tensor, tensor or None: a copy)

# values of each input averaged at a time (2 MiB of float64 sum): the inputs' rows, the sum, the term and the rounded
# chunk are reused storage, held beside the engines aligning the next layers (measured: 1 << 20 adds 20 MiB to the
# peak of a streamed merge of D=512 layers, 1 << 18 nothing measurable; tests/test_stream_merge.py)
CHUNK_ELEMENTS = 1 << 18
# `symalign merge` streams by itself above this many checkpoint bytes (together) where streaming keeps the scope
# (symalign.commands.merge.choose_path): the in-memory merge holds several copies of the weights (A, each model,
# its aligned copy and the merged state), the streamed one a layer of each model and fixed row chunks;
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


QUEUE_ITEMS = 1  # items a producer may put ahead of the merge (each can be a whole tensor of a layer)


class _Cancelled(Exception):
    """Raised in a producer thread when the merge stopped (an error or an interrupt elsewhere)."""


class _End:
    """The last item of a producer's queue: its engine's result, or the error that stopped it."""

    def __init__(self, result: Any = None, error: BaseException | None = None):
        self.result, self.error = result, error


class ChannelSink:
    """A :class:`~symalign.stream.sink.TensorSink` that hands each tensor to the merge through a bounded queue:
    the sink of an alignment running on a :class:`Producer` thread. ``put``: the tensor itself (an engine never
    changes a tensor once put, which :class:`~symalign.stream.sink.StateSink` relies on too); ``put_rows``: a copy
    (a chunk may live in a buffer the engine reuses); ``copy``: ``None``, the model's own stored tensor."""

    def __init__(self, maxsize: int = QUEUE_ITEMS):
        self.queue: queue.Queue = queue.Queue(maxsize)
        self.cancelled = threading.Event()
        self.bytes_written = 0

    def send(self, item: Any) -> None:
        """Put ``item`` on the queue, waiting for room; raises :class:`_Cancelled` once the merge stopped."""
        while not self.cancelled.is_set():
            try:
                self.queue.put(item, timeout=0.05)
                return
            except queue.Full:
                continue
        raise _Cancelled()

    def put(self, name: str, t: Tensor) -> None:
        self.bytes_written += t.numel() * t.element_size()
        self.send((name, None, t))

    def put_rows(self, name: str, start: int, t: Tensor) -> None:
        self.bytes_written += t.numel() * t.element_size()
        self.send((name, start, t.clone()))

    def copy(self, name: str, check_finite: bool = True) -> None:
        self.send((name, None, None))

    def abort(self) -> None:
        self.cancelled.set()


class Producer:
    """One model's alignment on its own thread: ``align(sink)`` (an engine writing every tensor of the aligned
    model into ``sink``, returning its result) runs into a :class:`ChannelSink`; iterating yields its items in
    order and re-raises the engine's error; :attr:`result` is the engine's result once iterated to the end."""

    def __init__(self, align: Callable[[TensorSink], Any], label: str):
        self.align, self.sink, self.result = align, ChannelSink(), None
        self.thread = threading.Thread(target=self._run, name=f"symalign-merge-{label}", daemon=True)

    def _run(self) -> None:
        try:
            end = _End(result=self.align(self.sink))
        except _Cancelled:
            return
        except BaseException as e:  # handed to the merge, which raises it
            end = _End(error=e)
        try:
            self.sink.send(end)
        except _Cancelled:
            pass

    def start(self) -> "Producer":
        self.thread.start()
        return self

    def __iter__(self) -> Iterator[Item]:
        while True:
            item = self.sink.queue.get()
            if isinstance(item, _End):
                if item.error is not None:
                    raise item.error
                self.result = item.result
                return
            yield item

    def cancel(self) -> None:
        """Stop the engine at its next put and wait for its thread to end (an interrupt still stops the wait), so
        that no alignment keeps running -- and building models -- after the merge has returned."""
        self.sink.cancelled.set()
        self.thread.join()


def copies(source: Any) -> Iterator[Item]:
    """The items of a model taken as stored (``--no-align``): every tensor a copy."""
    for name in source.tensors:
        yield name, None, None


def state_items(state: dict[str, Tensor]) -> Iterator[Item]:
    """The items of an aligned state held in memory, whole tensors in the state's order."""
    for name, t in state.items():
        yield name, None, t


def merge_into(sink: TensorSink, ref: Any, models: Sequence[Any], items: Sequence[Iterable[Item]],
               weights: Sequence[float], bar: Any = None) -> None:
    """``sum_k w_k theta_k`` into ``sink``, tensor by tensor (module docstring).

    ``ref``: the first model (a source: ``tensors``, ``read``, ``read_rows``, ``path``); ``models[j]``: model
    ``j + 2`` as stored (for its copies and dtypes); ``items[j]``: its aligned tensors (:data:`Item`), in
    any order, each name (and row range) once -- the streams are consumed in lockstep, the first stream leading,
    so when all put the same keys in the same order one item of each is held at a time. ``weights``: one per
    model, the first's first. ``bar``: a progress bar told the bytes read."""
    streams = [iter(x) for x in items]
    scratch = _Scratch()
    held: list[dict[tuple[str, int | None], Tensor | None]] = [{} for _ in streams[1:]]  # read ahead, per follower
    for name, start, t in streams[0]:
        parts = [t] + [_take(s, h, (name, start), j + 1) for j, (s, h) in enumerate(zip(streams[1:], held))]
        _average(sink, ref, models, weights, name, start, parts, scratch)
        if bar is not None:
            bar.update(ref.bytes_read + sum(m.bytes_read for m in models), name)
    for j, (s, h) in enumerate(zip(streams[1:], held), 1):
        rest = list(h) + [(n, st) for n, st, _ in s]
        if rest:
            raise SymalignError(f"internal error: model {j + 2} put {rest[0][0]!r}, which model 2 did not")


def _take(stream: Iterator[Item], held: dict, key: tuple[str, int | None], j: int) -> Tensor | None:
    """The item ``key`` of ``stream`` (from what was held back, else read on, holding back the others)."""
    if key in held:
        return held.pop(key)
    for n, st, t in stream:
        if (n, st) == key:
            return t
        held[(n, st)] = t
    raise SymalignError(f"internal error: model {j + 2} never put {key[0]!r}, which model 2 did")


class _Scratch:
    """Storage reused across chunks (each input's rows, the sum, the current term, the rounded chunk), grown to
    the largest chunk seen: the averaging allocates nothing per chunk, so the allocator's pages do not grow with
    the number of tensors (the depth)."""

    def __init__(self) -> None:
        self.bufs: dict[Any, Tensor] = {}

    def raw(self, key: Any, n_bytes: int) -> Tensor:
        b = self.bufs.get(key)
        if b is None or b.numel() < n_bytes:
            b = self.bufs[key] = torch.empty(max(n_bytes, 1), dtype=torch.uint8)
        return b

    def view(self, key: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> Tensor:
        n = math.prod(shape) * dtype.itemsize
        return self.raw(key, n)[:n].view(dtype).view(shape)


def _rows(src: Any, name: str, lo: int, hi: int, scratch: _Scratch, key: Any) -> Tensor:
    """Rows ``lo:hi`` of ``src``'s stored tensor ``name``, read into reused storage where the source can."""
    into = getattr(src, "read_rows_into", None)
    if into is None:
        return src.read_rows(name, lo, hi)
    info = src.tensors[name]
    return into(name, lo, hi, scratch.raw(key, (hi - lo) * (info.nbytes // max(1, info.shape[0]))))


def _average(sink: TensorSink, ref: Any, models: Sequence[Any], weights: Sequence[float], name: str,
             start: int | None, parts: list[Tensor | None], scratch: _Scratch) -> None:
    """One item: ``round(w_1 ref + sum_k w_k parts[k])`` for the rows the item covers, into ``sink``."""
    info = ref.tensors[name]
    if not info.dtype.is_floating_point or info.numel == 0:
        sink.copy(name)  # the first checkpoint's tensor
        return
    stored = [info.dtype] + [m.tensors[name].dtype if name in m.tensors else info.dtype for m in models]
    inputs = [ref, *models]
    if not info.shape:  # a scalar
        xs = [ref.read([name])[name]] + [p if p is not None else m.read([name])[name] for p, m in zip(parts, models)]
        sink.put(name, _rounded(name, inputs, [x.to(d) for x, d in zip(xs, stored)], weights, info.dtype))
        return
    if start is None:
        lo, rows = 0, info.shape[0]
    else:  # the rows the engines put (every model puts the same range)
        lo, rows = start, next(p.shape[0] for p in parts if p is not None)
    acc_dt = average.accumulate_dtype(info.dtype)
    for a, b in row_chunks((rows, *info.shape[1:])):
        shape = (b - a, *info.shape[1:])
        xs = [_rows(ref, name, lo + a, lo + b, scratch, 0)]
        for k, (p, m) in enumerate(zip(parts, models), 1):
            if p is None:
                xs.append(_rows(m, name, lo + a, lo + b, scratch, k))
            elif p.dtype != stored[k]:  # rounded as the aligned model would be stored
                xs.append(scratch.view(k, stored[k], shape).copy_(p[a:b]))
            else:
                xs.append(p[a:b])
        acc = average.weighted_sum(xs, weights, info.dtype, scratch.view("sum", acc_dt, shape),
                                   scratch.view("term", acc_dt, shape))
        avg = scratch.view("out", info.dtype, shape).copy_(acc)
        if not all_finite(avg):
            _non_finite(name, inputs, xs)
        sink.put_rows(name, lo + a, avg)


def _rounded(name: str, inputs: Sequence[Any], xs: Sequence[Tensor], weights: Sequence[float],
             dtype: torch.dtype) -> Tensor:
    """:func:`~symalign.checkpoint.average.weighted_average` of ``xs``, an input with NaN/Inf named."""
    avg = average.weighted_average(xs, weights, dtype)
    if not all_finite(avg):
        _non_finite(name, inputs, xs)
    return avg


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
    blocks are solved (:func:`symalign.match.experts.match_experts`). Each model ``k >= 2`` is aligned on its own
    thread into a :class:`ChannelSink` (the first one's progress shown) and averaged as its tensors arrive."""
    from symalign.io.folder import check_output_dir, commit, discard
    from symalign.stream.auto import streamable
    from symalign.stream.fold import FoldedCheckpoint

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
    models = [open_checkpoint(d) for d in dirs[1:]]
    for m in models:
        check_same_architecture(first, m)
    reference = FoldedCheckpoint(first) if folded else first  # --scope model: A in the aligned models' format
    writer = ShardWriter(out_path, first, extra=reference.extra if folded else None)
    producers = [Producer(_engine(Path(dirs[0]), Path(d), scope, stage2, progress and k == 1, max_sweeps, experts,
                                  device, str(out_path)), str(k)) for k, d in enumerate(dirs[1:], 1)] if align else []
    try:
        with progress_bar(sum(ck.nbytes for ck in [first, *models]), "merge (streamed average)",
                          progress and not align) as bar:
            merge_into(writer, reference, models, [p.start() for p in producers] or [copies(m) for m in models],
                       weights, bar if not align else None)
        tmp = writer.stage({"tie_word_embeddings": False} if folded and reference.extra else None, marker={
            "command": "merge", "scope": scope if align else "none", "folded": folded, "streamed": True,
            "weights": list(weights), "inputs": [str(Path(d).resolve()) for d in dirs]})
    except BaseException:
        for p in producers:
            p.cancel()
        writer.abort()
        raise
    try:
        loads = check_loads_lazily(tmp)
        commit(tmp, out_path)
    except BaseException:
        discard(tmp)
        raise
    aligned_info = [{"model": str(d), "distance": p.result.distance, "check": p.result.check.to_dict(),
                     "sweeps": p.result.sweeps, "converged": p.result.converged} for d, p in zip(dirs[1:], producers)]
    return {"models": [str(d) for d in dirs], "weights": list(weights), "out": str(out_path),
            "scope": scope if align else "none", "universe": None, "aligned": aligned_info,
            "dtype": str(first.dtype).replace("torch.", ""), "architecture": first.config.model_type,
            "tensors": len(first.tensors), "new_tensors": [], "loads": loads,
            "stream": {"bytes_read": first.bytes_read + sum(m.bytes_read for m in models),
                       "bytes_written": writer.bytes_written, "peak_rss_bytes": peak_rss(),
                       "aligned_in_lockstep": len(producers), "time_total_s": time.perf_counter() - t0}}


def _engine(a_dir: Path, b_dir: Path, scope: str, stage2: str, progress: bool, max_sweeps: int, experts: str,
            device: Any, out_name: str) -> Callable[[TensorSink], Any]:
    """``align(sink)`` for a :class:`Producer`: B aligned to A by the streamed engine of ``scope``, over its own
    lazy readers of both checkpoints (opened here, so that a refusal comes before any thread starts)."""
    from symalign.stream.attention import align_attention, attention_result, open_pair
    from symalign.stream.model import align_model_into

    a, b = open_pair(a_dir, b_dir)

    def align(sink: TensorSink) -> Any:
        if scope == "model":
            return align_model_into(a, b, lambda w: sink, stage2=stage2, progress=progress, max_sweeps=max_sweeps,
                                    experts=experts, device=device, out_name=out_name)
        run = align_attention(a, b, sink, stage2=stage2, progress=progress, device=device, out_name=out_name)
        return attention_result(run, a, b, sink)

    return align
