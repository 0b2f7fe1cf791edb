r"""Where a sweep's runs execute: a local process pool or Ray tasks.

A backend has ``open()``, ``close()``, ``describe()`` and ``map(runs, runs_dir)``, which
yields ``(run, outcome)`` as runs finish; each task is :func:`execute_run` (one
experiment, never raises: a failure is an outcome).
"""

from __future__ import annotations

import json
import os
import socket
import time
import traceback
from pathlib import Path
from typing import Any, Iterator

from symalign.errors import SymalignError
from symalign.experiments.config import parse_config
from symalign.experiments.sweep.grid import Grid, Resources, Run


def cpu_count() -> int:
    """CPUs this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS, Windows
        return os.cpu_count() or 1


def execute_run(config: dict, runs_dir: str, threads: int, device: str | None = None) -> dict:
    """One task: run (or resume) an experiment with ``threads`` torch threads on ``device`` (``None``: the
    config's own, training on CUDA where the task has one); never raises.

    Returns ``{"ok", "results_json" | "error", "traceback", "started", "finished", "seconds", "host", "threads"}``.
    """
    from threadpoolctl import threadpool_limits

    from symalign.experiments.protocol import run_experiment

    set_threads(threads)
    started = time.time()
    out: dict[str, Any] = {"started": started, "host": socket.gethostname(), "threads": int(threads)}
    try:
        with threadpool_limits(limits=int(threads)):  # numpy/scipy BLAS and OpenMP pools too
            results = run_experiment(parse_config(config), runs_dir, progress=False, device=device)
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

    def __init__(self, workers: int, threads: int, device: str | None = None):
        self.workers, self.threads, self.device = workers, threads, device

    def open(self) -> None:
        """Nothing to connect to."""

    def close(self) -> None:
        """The pool is closed by :meth:`map`."""

    def describe(self) -> str:
        return f"local pool, {self.workers} worker(s) x {self.threads} thread(s), {device_words(self.device)}"

    def map(self, runs: list[Run], runs_dir: Path) -> Iterator[tuple[Run, dict]]:
        """Yield ``(run, outcome)`` as runs finish."""
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor, as_completed

        if not runs:
            return
        pool = ProcessPoolExecutor(max_workers=min(self.workers, len(runs)), mp_context=mp.get_context("spawn"),
                                   initializer=set_threads, initargs=(self.threads,))
        try:
            futures = {pool.submit(execute_run, r.config.to_dict(), str(runs_dir), self.threads, self.device): r
                       for r in runs}
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

    def __init__(self, address: str, workers: int, threads: int, resources: Resources, device: str | None = None):
        self.address, self.workers, self.threads, self.resources = address, workers, threads, resources
        self.device = device
        self._started = False

    def describe(self) -> str:
        where = "local Ray instance" if self.address == "local" else f"Ray cluster {self.address}"
        r = self.resources
        return (f"{where}, tasks of {r.cpus_per_run:g} CPU / {r.gpus_per_run:g} GPU x {self.threads} thread(s), "
                f"{device_words(self.device)}")

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
        pending = {task.remote(r.config.to_dict(), str(runs_dir), self.threads, self.device): r for r in runs}
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


def device_words(device: str | None) -> str:
    """How the first progress line names where the runs compute."""
    if device is None:
        return "device: the grid's protocol.device (training on CUDA where a task has one)"
    return f"device: {device}"


def threads_per_task(backend: str, workers: int, resources: Resources) -> int:
    """Torch threads in each task: ``threads_per_run``, else local ``cores // workers``, Ray ``cpus_per_run``."""
    if resources.threads_per_run is not None:
        return resources.threads_per_run
    if backend == "local":
        return max(1, cpu_count() // workers)
    return max(1, int(resources.cpus_per_run))


def make_backend(grid: Grid, workers: int | None = None, ray: str | None = None,
                 device: str | None = None) -> LocalBackend | RayBackend:
    """The backend for ``--workers`` / ``--ray`` (``workers=None``: as many as the CPUs allow); every run computes
    on ``device`` (:func:`execute_run`)."""
    if workers is not None and workers < 1:
        raise SymalignError(f"--workers must be >= 1, got {workers}")
    if workers is None:
        workers = max(1, int(cpu_count() // grid.resources.cpus_per_run))
    if ray is None:
        return LocalBackend(workers, threads_per_task("local", workers, grid.resources), device)
    return RayBackend(ray, workers, threads_per_task("ray", workers, grid.resources), grid.resources, device)


# ----------------------------------------------------------------------------
