"""A rich progress bar on stderr for streamed work: one step per layer, bytes read, rate and time left."""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from typing import Iterator

LINE_EVERY_S = 5.0  # without a terminal: one plain line at most this often


class _Lines:
    """Progress without a terminal, when ``SYMALIGN_PROGRESS=lines`` (logs, ``nohup``, benchmarks): a plain
    stderr line when the step changes, at most every :data:`LINE_EVERY_S` seconds, with the elapsed time
    and bytes read. Off by default, so that a refusal stays one line on stderr."""

    def __init__(self, title: str, total: int):
        self.title, self.total = title, max(1, total)
        self.t0 = self.last = time.perf_counter()
        self.what = None

    def update(self, completed_bytes: int, what: str) -> None:
        now = time.perf_counter()
        if what != self.what and now - self.last >= LINE_EVERY_S:
            print(f"{self.title}: {what}, {completed_bytes / 2**30:.2f}/{self.total / 2**30:.2f} GiB read, "
                  f"{now - self.t0:.0f} s", file=sys.stderr, flush=True)
            self.last = now
        self.what = what


class _Bar:
    def __init__(self, progress, task):
        self.progress, self.task = progress, task

    def update(self, completed_bytes: int, what: str) -> None:
        if self.progress is not None:  # a few small tensors are read twice (the check, the copy): clamp
            total = self.progress.tasks[0].total or completed_bytes
            self.progress.update(self.task, completed=min(completed_bytes, total), description=what)


@contextmanager
def progress_bar(total_bytes: int, title: str, enabled: bool = True) -> Iterator[_Bar]:
    """``bar.update(bytes_read_so_far, "layer 3/32")``; shows bytes read of ``total_bytes``, speed and ETA.

    Disabled (a no-op) when ``enabled`` is false or stderr is not a terminal, unless
    ``SYMALIGN_PROGRESS=lines`` asks for plain lines (:class:`_Lines`).
    """
    if enabled and not sys.stderr.isatty() and os.environ.get("SYMALIGN_PROGRESS", "") == "lines":
        yield _Lines(title, total_bytes)
        return
    if not enabled or not sys.stderr.isatty():
        yield _Bar(None, None)
        return
    from rich.console import Console
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn, TransferSpeedColumn)

    with Progress(TextColumn(f"{title} [bold]{{task.description}}"), BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                  console=Console(stderr=True), transient=False) as p:
        task = p.add_task("", total=max(1, total_bytes))
        yield _Bar(p, task)
