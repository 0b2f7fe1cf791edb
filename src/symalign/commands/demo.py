"""``symalign demo`` (what ``make demo`` runs): the symmetry tour, then LMC of small ViTs on digits."""

from __future__ import annotations

import json
from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    app.command("demo")(demo_command)


def demo_command(
    out: Path = typer.Option(Path("runs/demo"), "-o", "--out", help="Output folder: results.json, report.md, "
                                                                     "curves.png."),
    steps: int = typer.Option(400, min=1, help="Training steps per model (base, A, B)."),
    threads: int = typer.Option(0, help="torch threads (0: the default, 1 or $SYMALIGN_THREADS; results depend "
                                        "on it, see README)."),
    fresh: bool = typer.Option(False, "--fresh", "--force", help="Discard the runs of a previous demo recorded "
                                                                 "with other settings, and start over."),
    tour: bool = typer.Option(True, "--tour/--no-tour", help="Print the symmetry-probe tour first."),
    as_json: bool = typer.Option(False, "--json", help="Print results.json instead of tables."),
) -> None:
    """Train small ViTs on the embedded digits data with sinusoidal and RoPE encodings, re-initialise
    their attention with two seeds, align B to A with the two-stage matcher, and compare naive and
    aligned interpolation barriers. Resumable: re-running reuses finished checkpoints."""
    import torch
    from rich.console import Console
    from rich.table import Table

    from symalign.experiments.demo import run_demo

    from symalign.commands import checks

    checks.threads(threads, allow_zero=True)
    checks.output_dir(out)
    torch.set_num_threads(threads or checks.default_threads())
    console = checks.console(stderr=as_json)
    if tour and not as_json:
        from symalign.commands.tour import render_tour
        from symalign.probe import probe_tour

        console.print("[bold]1. The symmetry group of each attention design, measured[/] "
                      "(Jacobian null space vs theory)")
        render_tour(probe_tour(seed=0))
        console.print("[bold]2. Linear mode connectivity after alignment[/] (ViT on digits, "
                      "attention re-initialised with two seeds)")
    log = (lambda s: console.print(f"  {s}")) if not as_json else None
    summary = run_demo(out, steps=steps, progress=not as_json, log=log, fresh=fresh)
    if as_json:
        typer.echo(json.dumps(summary, indent=2))
        return
    table = Table(title="LMC barriers, B aligned to A (held-out digits)")
    for col in ("encoding", "acc A", "acc B", "naive loss barrier", "aligned loss barrier", "ratio %",
                "naive acc barrier", "aligned acc barrier"):
        table.add_column(col, justify="right")
    for pe, d in summary["encodings"].items():
        table.add_row(pe, f"{d['acc_A']:.3f}", f"{d['acc_B']:.3f}", f"{d['naive_loss_barrier']:.4f}",
                      f"{d['aligned_loss_barrier']:.4f}", f"{d['barrier_ratio_percent']:.1f}",
                      f"{d['naive_acc_barrier']:.4f}", f"{d['aligned_acc_barrier']:.4f}")
    console.print(table)
    abl = Table(title="Stage-2 ablation: loss barrier ratio aligned / naive (%)")
    for col in ("encoding", "none", "orthogonal", "full"):
        abl.add_column(col, justify="right")
    for pe, d in summary["encodings"].items():
        r = d["stage2_ablation_ratio_percent"]
        abl.add_row(pe, *(f"{r[k]:.1f}" for k in ("none", "orthogonal", "full")))
    console.print(abl)
    console.print(f"wrote {out / 'results.json'}, {out / 'report.md'}, {out / 'curves.png'}")
