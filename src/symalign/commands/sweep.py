"""``symalign sweep GRID.toml``: a grid of experiments on a process pool or a Ray cluster."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Optional

import typer

from symalign.commands import checks, interrupt


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
    out = out or Path("runs/sweeps") / g.name
    checks.output_dir(out)
    interrupt.keep_run(out)  # re-running skips the runs recorded as done
    console = Console(stderr=True)
    log = None if quiet else (lambda s: console.print(s))
    summary = run_sweep(g, out, workers=workers, ray=ray, progress=not quiet, log=log)
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
