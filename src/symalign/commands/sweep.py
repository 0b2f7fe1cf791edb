"""``symalign sweep GRID.toml``: a grid of experiments on a process pool or a Ray cluster."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from symalign.commands import checks, interrupt

if TYPE_CHECKING:
    from symalign.experiments.sweep.grid import Resources


def register(app: typer.Typer) -> None:
    app.command("sweep")(sweep_command)


def sweep_command(
    grid: Path = typer.Argument(..., help="Grid file (TOML): a base experiment config plus a \\[grid] table "
                                          "(docs/scaling.md)."),
    workers: Optional[int] = typer.Option(None, "--workers", "-w",
                                          help="Parallel runs (local pool; with --ray local: the CPUs Ray gets). "
                                               "Default: CPUs / cpus_per_run."),
    ray: Optional[str] = typer.Option(None, "--ray", metavar="ADDRESS|local",
                                      help="Run on Ray: 'local' starts a local instance, HOST:PORT joins a cluster."),
    out: Optional[Path] = typer.Option(None, "--out", "-o",
                                       help="Sweep directory (store + runs). Default: runs/sweeps/<grid name>."),
    as_json: bool = typer.Option(False, "--json", help="Print the final summary as JSON."),
    quiet: bool = typer.Option(False, help="No progress output."),
    threads: Optional[int] = checks.threads_option("torch threads in each run, overriding the grid's [resources] "
                                                   "threads_per_run (default: that, else CPUs / workers locally, "
                                                   "cpus_per_run on Ray; results depend on it, see README)."),
    device: Optional[str] = typer.Option(None, "--device", metavar="auto|cpu|cuda", help="Train and evaluate "
                                         "every run there (recorded as protocol.device, as `symalign experiment "
                                         "--device`). Default: each config's protocol.device, training on CUDA "
                                         "where a run has one."),
    gpus_per_run: Optional[float] = typer.Option(None, "--gpus-per-run", metavar="N", help="--ray: the GPUs each "
                                                 "run reserves (Ray's num_gpus; fractions share a GPU), overriding "
                                                 "the grid's [resources] gpus_per_run. Default with --device cuda: "
                                                 "1."),
) -> None:
    """Expand GRID into runs, run those not yet done, and record every result in OUT/sweep.sqlite.

    Re-running skips runs recorded as done and retries failed ones. Exit code 1 if a run failed.
    """
    from rich.console import Console

    from symalign.experiments.sweep import STORE_FILE, load_grid, run_sweep

    checks.threads(threads)
    g = load_grid(grid)  # every run validated before anything runs
    if threads is not None:
        g = replace(g, resources=replace(g.resources, threads_per_run=threads))
    run_device = run_device_of(device, ray)
    g = replace(g, resources=gpu_resources(g.resources, gpus_per_run, run_device, ray))
    out = out or Path("runs/sweeps") / g.name
    checks.output_dir(out)
    interrupt.keep_run(out)  # re-running skips the runs recorded as done
    console = Console(stderr=True)
    log = None if quiet else (lambda s: console.print(s))
    summary = run_sweep(g, out, workers=workers, ray=ray, progress=not quiet, log=log, device=run_device)
    if as_json:
        typer.echo(json.dumps(summary.to_dict(), indent=2))
    else:
        typer.echo(f"{summary.name}: {summary.runs} runs, {summary.skipped} already done, {summary.done} done now, "
                   f"{summary.failed} failed ({summary.seconds:.1f}s); store: {out / STORE_FILE}; "
                   f"report: symalign report {out}")
        for f in summary.failures:
            typer.echo(f"failed: {f['name']}: {f['error']}", err=True)
    if summary.failed:
        raise typer.Exit(1)


def run_device_of(device: str | None, ray: str | None) -> str | None:
    """The device every run computes on (``"cpu"``, ``"cuda"``, ``"auto"``; ``None``: each config's). On this
    machine (the local pool, ``--ray local``) it must exist (:func:`symalign.device.resolve`, one line, exit 2);
    on a Ray cluster the tasks run elsewhere, so only the form is checked and ``auto`` is left to each task."""
    if device is None:
        return None
    from symalign.device import kind

    if ray is not None and ray != "local":
        return kind(device)
    return checks.use_device(device).type


def gpu_resources(resources: Resources, gpus_per_run: float | None, device: str | None,
                  ray: str | None) -> Resources:
    """``[resources]`` with ``--gpus-per-run`` applied: Ray's ``num_gpus`` per run. ``--device cuda`` on Ray
    reserves one GPU per run unless told otherwise (a task granted none sees no GPU). Refused without ``--ray``
    (a local pool uses this machine's devices) and below 0."""
    from symalign.errors import ConfigError

    if gpus_per_run is not None:
        if ray is None:
            raise ConfigError("--gpus-per-run reserves GPUs for Ray tasks; use it with --ray (a local pool runs on "
                              "this machine's devices: --device chooses)")
        if gpus_per_run < 0:
            raise ConfigError(f"--gpus-per-run must be 0 or more, got {gpus_per_run:g}")
        return replace(resources, gpus_per_run=gpus_per_run)
    if ray is not None and device == "cuda" and resources.gpus_per_run == 0:
        return replace(resources, gpus_per_run=1)
    return resources
