r"""The sweep driver: skip finished runs, run the rest on a backend, record each outcome."""

from __future__ import annotations

import copy
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from symalign.errors import ConfigError
from symalign.experiments.sweep.backends import device_words, make_backend
from symalign.experiments.sweep.grid import Grid
from symalign.experiments.sweep.progress import RunsBar
from symalign.experiments.sweep.store import RUNS_SUBDIR, STORE_FILE, ResultsStore, read_rows


def check_store(grid: Grid, rows: dict[str, dict]) -> None:
    """A ``done`` row whose config differs from the grid's run of that name is stale: refuse to mix them."""
    for run in grid.runs:
        row = rows.get(run.name)
        if row and row["status"] == "done" and json.loads(row["config"]) != json.loads(run.config_json()):
            raise ConfigError(f"run {run.name!r} is recorded as done with a different config in this store; "
                              "use another --out (or delete that row/run directory) to run the changed grid")


def with_device(grid: Grid, device: str | None) -> Grid:
    """``grid`` with every run's ``protocol.device`` set to ``device`` (``None``: unchanged), as
    ``symalign experiment --device`` records it (a CPU run's config is unchanged: ``cpu`` is the default)."""
    if device is None:
        return grid
    from dataclasses import replace

    from symalign.experiments.config import Protocol

    runs = []
    for run in grid.runs:
        cfg = copy.deepcopy(run.config)
        cfg.protocol = Protocol(**{**vars(cfg.protocol), "device": device})  # validated
        runs.append(replace(run, config=cfg))
    return replace(grid, runs=runs)


@dataclass
class SweepSummary:
    """What a sweep invocation did."""

    name: str
    out: str
    backend: str
    runs: int
    skipped: int
    done: int
    failed: int
    seconds: float
    failures: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def run_sweep(grid: Grid, out: str | Path, workers: int | None = None, ray: str | None = None,
              progress: bool = True, log: Callable[[str], None] | None = None,
              device: str | None = None) -> SweepSummary:
    """Run every run of ``grid`` not yet ``done`` in ``out``'s store; returns what happened.

    ``device`` (``"cpu"``, ``"cuda"``, ``"auto"``): every run trains and evaluates there (:func:`with_device`
    records it in each run's config, so the store refuses runs done on another device); ``None``: each
    config's own ``protocol.device``, training on CUDA where a task has one.

    Errors in the grid, a stale store or an unreachable Ray cluster raise before anything runs.
    One driver per ``out``: only it writes the store. With nothing left to run, no backend is started.
    """
    from symalign.experiments.report import write_summary

    out = Path(out)
    say = log or (lambda s: None)
    grid = with_device(grid, device)
    rows = read_rows(out / STORE_FILE)
    check_store(grid, rows)
    pending = [r for r in grid.runs if rows.get(r.name, {}).get("status") != "done"]
    backend = make_backend(grid, workers, ray, device)
    t0 = time.perf_counter()
    n_done, failures = 0, []
    say(f"{grid.name}: {len(grid.runs)} runs, {len(grid.runs) - len(pending)} done, {len(pending)} to run"
        + (f" on {backend.describe()}" if pending else f"; {device_words(device)}"))
    if pending:
        backend.open()  # an unreachable cluster fails here, before anything runs
        try:
            with ResultsStore(out / STORE_FILE) as store:
                bar = RunsBar(progress, len(grid.runs), len(grid.runs) - len(pending), grid.name)
                try:
                    for run, outcome in backend.map(pending, (out / RUNS_SUBDIR).resolve()):
                        store.record(run, outcome, backend.name)
                        if outcome.get("ok"):
                            n_done += 1
                            bar.update(len(failures), f"done   {run.name} ({outcome.get('seconds') or 0:.1f}s)")
                        else:
                            failures.append({"name": run.name, "error": outcome.get("error")})
                            bar.update(len(failures), f"[red]failed[/] {run.name}: {outcome.get('error')}")
                finally:
                    bar.close()
        finally:
            backend.close()
    if (out / RUNS_SUBDIR).exists() or (out / STORE_FILE).exists():
        write_summary(out)
    return SweepSummary(name=grid.name, out=str(out), backend=backend.name, runs=len(grid.runs),
                        skipped=len(grid.runs) - len(pending), done=n_done, failed=len(failures),
                        seconds=time.perf_counter() - t0, failures=failures)
