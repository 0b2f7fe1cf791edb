r"""Read the next layer while the current one computes: one reader thread ahead of a streamed engine.

:func:`read_ahead` is ``map(read, items)`` with the reading moved to a thread: while the caller works on item
``k``, the thread reads item ``k + 1`` -- never further (a one-slot semaphore), so the memory it adds is one
item (one layer's tensors as read), whatever the number of layers. Values, order and bytes are those of
``map(read, items)``: a job's results are bit-identical with and without it.

On a CUDA device the tensors read are copied into pinned (page-locked) host memory on the thread, so a later
``.to(device, non_blocking=True)`` is a DMA transfer that overlaps compute; with ``to_device=True`` the thread
also issues that transfer on a CUDA stream of its own and the caller's stream waits on it (an event) before
the item is handed over. On the CPU it is plain read-ahead.

**No reference is kept.** An item handed over is referenced by the caller only: once the caller drops it (``del``),
it is freed, while the caller still works on that step. (A generator that did ``value = read(item); yield value``
would keep ``value`` alive in its suspended frame until the next item is asked for: one more layer as read at
every step's peak, 0.66 GiB at 7B with both checkpoints' layers.)

Errors: an exception raised by ``read`` on the thread is raised in the caller, at the item that failed (the
items before it are delivered). The thread never outlives the iteration: the generator's ``finally`` (run
when it is exhausted, closed, or dropped by a loop that raised) stops and joins it.

**When it is on.** By default only when the reads feed a CUDA device: on the CPU, ``benchmarks/bench_prefetch.py``
measured no gain (docs/scaling.md, "Reading ahead"), so the CPU path reads in turn, as before read-ahead existed.
``SYMALIGN_PREFETCH=1`` (or ``on``, ``true``, ``yes``) turns it on everywhere, ``0`` (``off``, ``false``, ``no``)
off everywhere: the same reads, on the calling thread, when each item is asked for.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from typing import Any, Callable, ContextManager, Iterable, Iterator, TypeVar

import torch

from symalign.errors import ConfigError

__all__ = ["ENV", "Gate", "enabled", "read_ahead"]

ENV = "SYMALIGN_PREFETCH"
_OFF = ("0", "off", "false", "no")
_ON = ("1", "on", "true", "yes")
_POLL_S = 0.05  # how often a waiting thread looks at the stop flag

K = TypeVar("K")
V = TypeVar("V")


def enabled(device: torch.device | str | None = None) -> bool:
    """Whether read-ahead is on for reads that feed ``device``: ``$SYMALIGN_PREFETCH`` when set (``1``/``on``/
    ``true``/``yes`` or ``0``/``off``/``false``/``no``), else only for a CUDA device (module docstring)."""
    value = os.environ.get(ENV, "").strip().lower()
    if value and value not in _OFF + _ON:
        raise ConfigError(f"{ENV}={value!r}: use 1 (read the next layer ahead) or 0 (off); unset: on for CUDA only")
    if value:
        return value in _ON
    return device is not None and torch.device(device).type == "cuda"


def _map(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` (tensors in dicts, lists and tuples) with ``fn`` applied to every tensor."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map(v, fn) for v in obj)
    return obj


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


class Gate:
    """When the reader may start on the next item: by default as soon as an item is handed over; with a gate,
    when the caller calls :meth:`open` (or asks for the next item). A caller whose memory peaks early in an item
    (the attention engine: the stage-1 products) opens it after that peak, so the read-ahead layer never
    adds to it."""

    def __init__(self) -> None:
        self._open: Callable[[], None] | None = None

    def open(self) -> None:
        """Let the reader read the next item now."""
        if self._open is not None:
            self._open()


def _read_timed(read: Callable[[K], V], item: K, wait: Callable[[], ContextManager[Any]]) -> V:
    with wait():
        return read(item)


def read_ahead(read: Callable[[K], V], items: Iterable[K], device: torch.device | str | None = None,
               timer: Callable[[], ContextManager[Any]] | None = None, to_device: bool = False,
               gate: Gate | None = None) -> Iterator[V]:
    """``read(item)`` for each item in order, the next one read on a thread while the caller works (module
    docstring). ``device``: a CUDA device pins what is read (and ``to_device`` moves it there on a side stream);
    ``None`` or the CPU: plain read-ahead. ``timer``: a context manager factory around each wait for an item
    (e.g. ``lambda: clock("read")``), so the time spent waiting for the reader counts as reading. ``gate``: the
    reader waits for :meth:`Gate.open` before reading the next item (:class:`Gate`)."""
    items = list(items)
    wait = timer or contextlib.nullcontext
    if not enabled(device) or len(items) < 2:
        for item in items:
            yield _read_timed(read, item, wait)  # no name in this frame holds the item once the caller drops it
        return
    dev = None if device is None else torch.device(device)
    cuda = dev is not None and dev.type == "cuda"
    side = torch.cuda.Stream(dev) if cuda and to_device else None
    results: queue.Queue = queue.Queue()
    slot = threading.Semaphore(1)  # the reader is at most one item ahead of the caller
    stop = threading.Event()

    def reader() -> None:
        for item in items:
            while not slot.acquire(timeout=_POLL_S):
                if stop.is_set():
                    return
            if stop.is_set():
                return
            try:
                value = read(item)
                event = None
                if cuda:
                    value = _map(value, lambda t: t.pin_memory() if t.device.type == "cpu" else t)
                    if side is not None:
                        with torch.cuda.stream(side):
                            value = _map(value, lambda t: t.to(dev, non_blocking=True))
                            event = torch.cuda.Event()
                            event.record(side)
                results.put((True, value, event))
                del value, event  # the thread keeps no reference while it waits for the next slot
            except BaseException as exc:  # handed to the caller, raised there
                results.put((False, exc, None))
                return

    released = [True]  # the slot for the next item was given to the reader
    lock = threading.Lock()

    def release_once() -> None:
        with lock:
            if not released[0]:
                released[0] = True
                slot.release()

    if gate is not None:
        gate._open = release_once
    thread = threading.Thread(target=reader, name="symalign-prefetch", daemon=True)
    thread.start()
    try:
        for _ in items:
            release_once()  # asked for: read it now, gate or not
            with wait():
                while True:
                    try:
                        ok, value, event = results.get(timeout=_POLL_S)
                        break
                    except queue.Empty:
                        if not thread.is_alive() and results.empty():  # pragma: no cover - the reader always reports
                            raise RuntimeError("the prefetch thread stopped without a result") from None
            if not ok:
                raise value
            if event is not None:
                current = torch.cuda.current_stream(dev)
                current.wait_event(event)
                for t in _tensors(value):
                    if t.device.type == "cuda":
                        t.record_stream(current)  # freed on the caller's stream, not the reader's
            released[0] = False
            if gate is None:
                release_once()  # the reader may read the next item while the caller works on this one
            box = [value]
            del value
            yield box.pop()  # the frame keeps no reference: the caller's ``del`` frees the item
    finally:
        if gate is not None:
            gate._open = None
        stop.set()
        slot.release()
        thread.join()
        while not results.empty():  # drop what was read ahead and not used
            results.get_nowait()
