r"""Sweeps: a grid of experiment configs, run in parallel, recorded in one SQLite store.

A grid file is an experiment TOML (``name``, ``data``, ``[model]``, ``[train]``,
``[protocol]``, ...) -- the *base* -- plus::

    [grid]                                   # axes: dotted config paths -> lists of values
    "model.pe" = ["sinusoidal", "rope"]
    "protocol.seeds" = [[1, 2], [3, 4]]

    [[cases]]                                # optional: one more axis of bundled overrides
    label = "vit-digits"
    data = "digits"
    model = { family = "vit", d_model = 32 } # nested tables are merged key by key

    [resources]                              # optional
    cpus_per_run = 1                         # Ray: num_cpus of each task
    gpus_per_run = 0                         # Ray: num_gpus of each task
    threads_per_run = 1                      # torch threads in each task (both backends)

The runs are the Cartesian product ``cases x axis_1 x axis_2 x ...``; each is a
complete :class:`~symalign.experiments.config.ExperimentConfig`, validated
before anything runs, named ``<base name>_<case label>_<key>=<value>_...``
(deterministic; a short hash replaces the parts when the name gets long).

Each run is one task calling :func:`~symalign.experiments.protocol.run_experiment`
in ``OUT/runs/<run name>``; tasks run on a local process pool (spawn context)
or as Ray tasks. Workers return their results to the driver, which alone writes
the ``runs`` table of ``OUT/sweep.sqlite``, one transaction per finished run, so
a killed sweep never leaves a partial row; re-running skips rows marked ``done``
and retries ``failed`` ones.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import os
import re
import socket
import sqlite3
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from symalign.errors import ConfigError, SymalignError
from symalign.experiments.config import ExperimentConfig, parse_config, read_toml


STORE_FILE = "sweep.sqlite"
RUNS_SUBDIR = "runs"
SECTIONS = ("name", "data", "data_options", "model", "train", "protocol")
DICT_SECTIONS = ("data_options", "model", "train", "protocol")
GRID_KEYS = ("grid", "cases", "resources")
MAX_NAME = 120

# ----------------------------------------------------------------------------
# grid
# ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Resources:
    """What each task asks for: Ray's ``num_cpus``/``num_gpus``, and torch threads (``None``: per backend)."""

    cpus_per_run: float = 1
    gpus_per_run: float = 0
    threads_per_run: int | None = None

    def __post_init__(self):
        if not self.cpus_per_run > 0:
            raise ConfigError(f"[resources] cpus_per_run must be > 0, got {self.cpus_per_run}")
        if self.gpus_per_run < 0:
            raise ConfigError(f"[resources] gpus_per_run must be >= 0, got {self.gpus_per_run}")
        if self.threads_per_run is not None and (not isinstance(self.threads_per_run, int)
                                                 or self.threads_per_run < 1):
            raise ConfigError(f"[resources] threads_per_run must be a positive integer, got {self.threads_per_run!r}")


@dataclass(frozen=True)
class Run:
    """One point of the grid: its name, the overrides that made it, and its validated config."""

    name: str
    overrides: dict[str, Any]
    config: ExperimentConfig

    def config_json(self) -> str:
        """The config as canonical JSON (what the store keeps and compares)."""
        return json.dumps(self.config.to_dict(), sort_keys=True)


@dataclass
class Grid:
    """A parsed grid: the sweep name, its runs (in expansion order) and the task resources."""

    name: str
    runs: list[Run]
    resources: Resources = field(default_factory=Resources)
    source: str = "grid"


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """Nested tables -> ``{"a.b": leaf}`` (a leaf is anything that is not a table)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        path = f"{prefix}{k}"
        if isinstance(v, dict) and (path not in SECTIONS or path in DICT_SECTIONS):
            out.update(_flatten(v, path + "."))
        else:
            out[path] = v
    return out


def _axes(grid: dict, source: str) -> list[tuple[str, list]]:
    """The ``[grid]`` table as ``(dotted key, values)`` axes; tables nest (``model.pe`` == ``"model.pe"``)."""
    axes = []
    for key, values in _flatten_axes(grid).items():
        if not isinstance(values, list):
            raise ConfigError(f"{source}: [grid] {key!r} must be a list of values, got {values!r}")
        if not values:
            raise ConfigError(f"{source}: [grid] axis {key!r} is empty; give at least one value")
        _check_path(key, source)
        axes.append((key, values))
    return axes


def _flatten_axes(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten_axes(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _check_path(key: str, source: str) -> None:
    """A dotted key is ``section`` or ``section.field`` with a known section (not ``name``)."""
    parts = key.split(".")
    if key == "name":
        raise ConfigError(f"{source}: 'name' cannot vary: run names are derived from the grid (set the base name)")
    if parts[0] not in SECTIONS:
        raise ConfigError(f"{source}: unknown grid key {key!r} (section {parts[0]!r}); "
                          f"use one of {', '.join(SECTIONS)} or a dotted path like 'model.pe'")
    if len(parts) > 2 or (len(parts) == 2 and parts[0] not in DICT_SECTIONS):
        raise ConfigError(f"{source}: unknown grid key {key!r}; a key is a section or section.field, "
                          "e.g. 'data' or 'model.pe'")


def _set(d: dict, key: str, value: Any) -> None:
    """``d[section][field] = value`` for ``"section.field"`` (``d[section] = value`` for a bare section)."""
    parts = key.split(".")
    if len(parts) == 1:
        d[key] = copy.deepcopy(value)
    else:
        d.setdefault(parts[0], {})[parts[1]] = copy.deepcopy(value)


def _cases(raw: Any, source: str) -> list[tuple[str, dict[str, Any]]]:
    """``[[cases]]`` as ``(label, {dotted key: value})``; no cases -> one empty case."""
    if raw is None:
        return [("", {})]
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"{source}: [[cases]] must be a non-empty array of tables")
    out = []
    for i, case in enumerate(raw):
        if not isinstance(case, dict):
            raise ConfigError(f"{source}: case {i} must be a table")
        case = dict(case)
        label = str(case.pop("label", f"case{i}"))
        flat = _flatten(case)
        for key in flat:
            _check_path(key, f"{source}: case {label!r}")
        out.append((label, flat))
    return out


def _slug(v: Any) -> str:
    """A short, path-safe rendering of one value."""
    if isinstance(v, bool):
        s = str(v).lower()
    elif isinstance(v, (list, tuple)):
        s = "+".join(_slug(x) for x in v)
    elif isinstance(v, dict):
        s = _digest(v, 8)
    else:
        s = str(v)
    return re.sub(r"[^A-Za-z0-9.+=-]", "-", s)


def _digest(obj: Any, n: int) -> str:
    return hashlib.sha1(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:n]


def _short_keys(keys: list[str]) -> dict[str, str]:
    """The last path component of each key, or the full key where two keys share it."""
    last = [k.split(".")[-1] for k in keys]
    return {k: (s if last.count(s) == 1 else k) for k, s in zip(keys, last)}


def run_name(base: str, label: str, point: list[tuple[str, Any]], short: dict[str, str]) -> str:
    """``base[_label]_key=value_...``; a hash of the overrides when that exceeds :data:`MAX_NAME` chars."""
    parts = [base] + ([_slug(label)] if label else []) + [f"{short[k]}={_slug(v)}" for k, v in point]
    name = "_".join(parts)
    if len(name) > MAX_NAME:
        name = f"{base}_{_digest([label, point], 10)}"
    return name


def expand(base: dict, axes: list[tuple[str, list]], cases: list[tuple[str, dict]], source: str = "grid"
           ) -> list[Run]:
    """The Cartesian product ``cases x axes`` as validated runs; duplicate names raise :class:`ConfigError`."""
    base_name = str(base.get("name", "sweep"))
    short = _short_keys([k for k, _ in axes])
    runs: list[Run] = []
    seen: dict[str, dict] = {}
    for (label, case), values in itertools.product(cases, itertools.product(*(v for _, v in axes))):
        point = list(zip((k for k, _ in axes), values))
        d = copy.deepcopy(base)
        for key, value in [*case.items(), *point]:
            _set(d, key, value)
        name = run_name(base_name, label, point, short)
        overrides = {**({"case": label} if label else {}), **dict(point)}
        if name in seen:
            raise ConfigError(f"{source}: two grid points get the same run name {name!r} "
                              f"({seen[name]} and {overrides}); remove the duplicate value or relabel the case")
        seen[name] = overrides
        d["name"] = name
        try:
            cfg = parse_config(d, f"{source}: run {name!r}")
        except SymalignError as exc:  # an unknown key or value, an unknown dataset...
            raise ConfigError(f"{source}: run {name!r} (overrides {overrides}): {exc}") from exc
        runs.append(Run(name, overrides, cfg))
    return runs


def parse_grid(d: dict, source: str = "grid", default_name: str = "sweep") -> Grid:
    """Validate a grid dict (base config + ``[grid]`` + ``[[cases]]`` + ``[resources]``) and expand it."""
    for k in d:
        if k not in SECTIONS and k not in GRID_KEYS:
            raise ConfigError(f"{source}: unknown key {k!r}; allowed: {', '.join(SECTIONS + GRID_KEYS)}")
    base = {k: copy.deepcopy(v) for k, v in d.items() if k in SECTIONS}
    base.setdefault("name", default_name)
    grid = d.get("grid", {})
    if not isinstance(grid, dict):
        raise ConfigError(f"{source}: [grid] must be a table of dotted keys -> lists")
    res = d.get("resources", {})
    allowed = ("cpus_per_run", "gpus_per_run", "threads_per_run")
    for k in res:
        if k not in allowed:
            raise ConfigError(f"{source}: unknown key [resources] {k!r}; allowed: {', '.join(allowed)}")
    runs = expand(base, _axes(grid, source), _cases(d.get("cases"), source), source)
    return Grid(name=str(base["name"]), runs=runs, resources=Resources(**res), source=source)


def load_grid(path: str | Path) -> Grid:
    """Read, validate and expand a TOML grid file (nothing runs)."""
    path = Path(path)
    return parse_grid(read_toml(path, "grid"), str(path), default_name=path.stem)


# ----------------------------------------------------------------------------
# results store
# ----------------------------------------------------------------------------

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    name        TEXT PRIMARY KEY,
    config      TEXT NOT NULL,               -- ExperimentConfig as JSON
    overrides   TEXT NOT NULL,               -- the grid point as JSON
    status      TEXT NOT NULL CHECK (status IN ('done', 'failed')),
    error       TEXT,
    traceback   TEXT,
    started_at  REAL,                        -- unix time, in the worker
    finished_at REAL,
    seconds     REAL,
    backend     TEXT,                        -- 'local' or 'ray'
    host        TEXT,
    threads     INTEGER,
    attempts    INTEGER NOT NULL DEFAULT 1,
    run_dir     TEXT NOT NULL,               -- relative to the store's directory
    results     TEXT                         -- {scope: results.json contents} as JSON
)
"""

UPSERT = """
INSERT INTO runs (name, config, overrides, status, error, traceback, started_at, finished_at, seconds,
                  backend, host, threads, attempts, run_dir, results)
VALUES (:name, :config, :overrides, :status, :error, :traceback, :started_at, :finished_at, :seconds,
        :backend, :host, :threads, 1, :run_dir, :results)
ON CONFLICT(name) DO UPDATE SET
    config = excluded.config, overrides = excluded.overrides, status = excluded.status,
    error = excluded.error, traceback = excluded.traceback, started_at = excluded.started_at,
    finished_at = excluded.finished_at, seconds = excluded.seconds, backend = excluded.backend,
    host = excluded.host, threads = excluded.threads, attempts = runs.attempts + 1,
    run_dir = excluded.run_dir, results = excluded.results
"""


class ResultsStore:
    """The sweep's SQLite store; only the driver process writes it, one transaction per run."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.conn = sqlite3.connect(str(self.path), timeout=60)
        self.conn.row_factory = sqlite3.Row
        with self.conn:
            self.conn.execute(SCHEMA)

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> "ResultsStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def rows(self) -> dict[str, dict]:
        """Every row, by run name."""
        return {r["name"]: dict(r) for r in self.conn.execute("SELECT * FROM runs ORDER BY name")}

    def record(self, run: Run, outcome: dict, backend: str) -> None:
        """Insert or replace ``run``'s row from a task outcome (atomically)."""
        row = {
            "name": run.name, "config": run.config_json(), "overrides": json.dumps(run.overrides, sort_keys=True),
            "status": "done" if outcome.get("ok") else "failed", "error": outcome.get("error"),
            "traceback": outcome.get("traceback"), "started_at": outcome.get("started"),
            "finished_at": outcome.get("finished"), "seconds": outcome.get("seconds"), "backend": backend,
            "host": outcome.get("host"), "threads": outcome.get("threads"),
            "run_dir": f"{RUNS_SUBDIR}/{run.name}", "results": outcome.get("results_json"),
        }
        with self.conn:
            self.conn.execute(UPSERT, row)


def read_rows(path: str | Path) -> dict[str, dict]:
    """The rows of an existing store, opened read-only (empty when there is no store)."""
    path = Path(path)
    if not path.exists():
        return {}
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=60)
    conn.row_factory = sqlite3.Row
    try:
        return {r["name"]: dict(r) for r in conn.execute("SELECT * FROM runs ORDER BY name")}
    except sqlite3.OperationalError:  # no runs table yet
        return {}
    finally:
        conn.close()


def stored_results(path: str | Path) -> list[dict]:
    """Every scope's results of the ``done`` runs of a store, with ``_path`` = the scope's run directory."""
    path = Path(path)
    out = []
    for row in read_rows(path).values():
        if row["status"] != "done" or not row["results"]:
            continue
        for scope, res in json.loads(row["results"]).items():
            res.setdefault("experiment", row["name"])
            res["_path"] = str(path.parent / row["run_dir"] / scope)
            out.append(res)
    return out


# ----------------------------------------------------------------------------
# tasks and backends
# ----------------------------------------------------------------------------


def cpu_count() -> int:
    """CPUs this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS, Windows
        return os.cpu_count() or 1


def execute_run(config: dict, runs_dir: str, threads: int) -> dict:
    """One task: run (or resume) an experiment with ``threads`` torch threads; never raises.

    Returns ``{"ok", "results_json" | "error", "traceback", "started", "finished", "seconds", "host", "threads"}``.
    """
    from threadpoolctl import threadpool_limits

    from symalign.experiments.protocol import run_experiment

    set_threads(threads)
    started = time.time()
    out: dict[str, Any] = {"started": started, "host": socket.gethostname(), "threads": int(threads)}
    try:
        with threadpool_limits(limits=int(threads)):  # numpy/scipy BLAS and OpenMP pools too
            results = run_experiment(parse_config(config), runs_dir, progress=False)
        out.update(ok=True, results_json=json.dumps({r["scope"]: r for r in results}, default=float))
    except Exception as exc:  # recorded as a failed run; the sweep goes on
        out.update(ok=False, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
    out["finished"] = time.time()
    out["seconds"] = out["finished"] - started
    return out


def _failure(exc: BaseException) -> dict:
    """The outcome of a task that died before it could report (worker crash, lost node)."""
    now = time.time()
    return {"ok": False, "error": f"{type(exc).__name__}: {exc}",
            "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
            "started": None, "finished": now, "seconds": None}


def set_threads(threads: int) -> None:
    """Pin torch's intra-op threads; the OpenMP/BLAS env vars first, for the libraries not loaded yet."""
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(int(threads))
    import torch

    torch.set_num_threads(int(threads))


class LocalBackend:
    """A process pool on this machine (``spawn`` context: no forked torch state)."""

    name = "local"

    def __init__(self, workers: int, threads: int):
        self.workers, self.threads = workers, threads

    def open(self) -> None:
        """Nothing to connect to."""

    def close(self) -> None:
        """The pool is closed by :meth:`map`."""

    def describe(self) -> str:
        return f"local pool, {self.workers} worker(s) x {self.threads} thread(s)"

    def map(self, runs: list[Run], runs_dir: Path) -> Iterator[tuple[Run, dict]]:
        """Yield ``(run, outcome)`` as runs finish."""
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor, as_completed

        if not runs:
            return
        pool = ProcessPoolExecutor(max_workers=min(self.workers, len(runs)), mp_context=mp.get_context("spawn"),
                                   initializer=set_threads, initargs=(self.threads,))
        try:
            futures = {pool.submit(execute_run, r.config.to_dict(), str(runs_dir), self.threads): r for r in runs}
            for fut in as_completed(futures):
                try:
                    outcome = fut.result()
                except Exception as exc:  # BrokenProcessPool: a worker died
                    outcome = _failure(exc)
                outcome.setdefault("threads", self.threads)
                yield futures[fut], outcome
        finally:
            pool.shutdown(wait=True, cancel_futures=True)


def check_reachable(address: str, timeout: float = 5.0) -> None:
    """Raise :class:`SymalignError` naming ``address`` unless something listens there (``host:port``)."""
    hostport = address.split("://", 1)[-1]
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        raise SymalignError(f"--ray {address!r}: expected HOST:PORT (e.g. 10.0.0.1:6379), 'local' or 'auto'")
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout).close()
    except OSError as exc:
        raise SymalignError(f"cannot reach the Ray cluster at {address} ({exc}); start it with "
                            f"`ray start --head` on that machine, or use --ray local") from exc


class RayBackend:
    """Ray tasks, on a local Ray instance (``address='local'``) or an existing cluster."""

    name = "ray"

    def __init__(self, address: str, workers: int, threads: int, resources: Resources):
        self.address, self.workers, self.threads, self.resources = address, workers, threads, resources
        self._started = False

    def describe(self) -> str:
        where = "local Ray instance" if self.address == "local" else f"Ray cluster {self.address}"
        r = self.resources
        return f"{where}, tasks of {r.cpus_per_run:g} CPU / {r.gpus_per_run:g} GPU x {self.threads} thread(s)"

    def open(self) -> None:
        """Start or join Ray; a cluster that cannot be reached raises :class:`SymalignError` before anything runs."""
        try:
            import ray
        except ImportError as exc:
            raise SymalignError("--ray needs Ray: pip install 'symalign[ray]' (or pip install ray)") from exc
        kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False,
                                  "logging_level": "ERROR", "configure_logging": True}
        if self.address == "local":
            kwargs["num_cpus"] = max(1, int(round(self.workers * self.resources.cpus_per_run)))
        else:
            if self.address != "auto":
                check_reachable(self.address)
            kwargs["address"] = self.address
        if ray.is_initialized():  # the caller's Ray session: use it, leave it running
            return
        try:
            ray.init(**kwargs)
        except (ConnectionError, TimeoutError) as exc:
            raise SymalignError(f"cannot connect to the Ray cluster at {self.address}: {exc}") from exc
        self._started = True

    def close(self) -> None:
        """Shut Ray down (a local instance stops; a cluster stays up)."""
        if self._started:
            import ray

            ray.shutdown()
            self._started = False

    def map(self, runs: list[Run], runs_dir: Path) -> Iterator[tuple[Run, dict]]:
        """Yield ``(run, outcome)`` as tasks finish."""
        import ray

        task = ray.remote(num_cpus=self.resources.cpus_per_run, num_gpus=self.resources.gpus_per_run,
                          max_retries=1)(execute_run)
        pending = {task.remote(r.config.to_dict(), str(runs_dir), self.threads): r for r in runs}
        try:
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=1)
                for ref in ready:
                    run = pending.pop(ref)
                    try:
                        outcome = ray.get(ref)
                    except Exception as exc:  # worker or node died
                        outcome = _failure(exc)
                    outcome.setdefault("threads", self.threads)
                    yield run, outcome
        finally:
            for ref in pending:
                ray.cancel(ref, force=True)


def threads_per_task(backend: str, workers: int, resources: Resources) -> int:
    """Torch threads in each task: ``threads_per_run``, else local ``cores // workers``, Ray ``cpus_per_run``."""
    if resources.threads_per_run is not None:
        return resources.threads_per_run
    if backend == "local":
        return max(1, cpu_count() // workers)
    return max(1, int(resources.cpus_per_run))


def make_backend(grid: Grid, workers: int | None = None, ray: str | None = None) -> LocalBackend | RayBackend:
    """The backend for ``--workers`` / ``--ray`` (``workers=None``: as many as the CPUs allow)."""
    if workers is not None and workers < 1:
        raise SymalignError(f"--workers must be >= 1, got {workers}")
    if workers is None:
        workers = max(1, int(cpu_count() // grid.resources.cpus_per_run))
    if ray is None:
        return LocalBackend(workers, threads_per_task("local", workers, grid.resources))
    return RayBackend(ray, workers, threads_per_task("ray", workers, grid.resources), grid.resources)


# ----------------------------------------------------------------------------
# the driver
# ----------------------------------------------------------------------------


def check_store(grid: Grid, rows: dict[str, dict]) -> None:
    """A ``done`` row whose config differs from the grid's run of that name is stale: refuse to mix them."""
    for run in grid.runs:
        row = rows.get(run.name)
        if row and row["status"] == "done" and json.loads(row["config"]) != json.loads(run.config_json()):
            raise ConfigError(f"run {run.name!r} is recorded as done with a different config in this store; "
                              "use another --out (or delete that row/run directory) to run the changed grid")


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


class _Bar:
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


def run_sweep(grid: Grid, out: str | Path, workers: int | None = None, ray: str | None = None,
              progress: bool = True, log: Callable[[str], None] | None = None) -> SweepSummary:
    """Run every run of ``grid`` not yet ``done`` in ``out``'s store; returns what happened.

    Errors in the grid, a stale store or an unreachable Ray cluster raise before anything runs.
    One driver per ``out``: only it writes the store. With nothing left to run, no backend is started.
    """
    from symalign.experiments.report import write_summary

    out = Path(out)
    say = log or (lambda s: None)
    rows = read_rows(out / STORE_FILE)
    check_store(grid, rows)
    pending = [r for r in grid.runs if rows.get(r.name, {}).get("status") != "done"]
    backend = make_backend(grid, workers, ray)
    t0 = time.perf_counter()
    n_done, failures = 0, []
    say(f"{grid.name}: {len(grid.runs)} runs, {len(grid.runs) - len(pending)} done, {len(pending)} to run"
        + (f" on {backend.describe()}" if pending else ""))
    if pending:
        backend.open()  # an unreachable cluster fails here, before anything runs
        try:
            with ResultsStore(out / STORE_FILE) as store:
                bar = _Bar(progress, len(grid.runs), len(grid.runs) - len(pending), grid.name)
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
