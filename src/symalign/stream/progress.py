"""A rich progress bar on stderr for streamed work: one step per layer, bytes read, rate and time left."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Iterator


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

    Disabled (a no-op) when ``enabled`` is false or stderr is not a terminal.
    """
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
