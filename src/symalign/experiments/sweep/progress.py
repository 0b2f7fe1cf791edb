"""The sweep's progress bar over runs (rich, on stderr)."""

from __future__ import annotations

class RunsBar:
    """A rich progress bar over runs (elapsed, ETA), or nothing."""

    def __init__(self, enabled: bool, total: int, completed: int, title: str):
        self.progress = None
        if enabled:
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                       TimeRemainingColumn)

            self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("failed {task.fields[failed]}"), TimeElapsedColumn(),
                                     TextColumn("ETA"), TimeRemainingColumn(),
                                     console=Console(stderr=True))
            self.progress.start()
            self.task = self.progress.add_task(title, total=total, completed=completed, failed=0)

    def update(self, failed: int, message: str) -> None:
        if self.progress is not None:
            self.progress.update(self.task, advance=1, failed=failed)
            self.progress.console.print(message)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
