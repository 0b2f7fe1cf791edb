"""``symalign demo`` (what ``make demo`` runs): the symmetry tour, then LMC of small ViTs on digits."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from symalign.commands import checks


def register(app: typer.Typer) -> None:
    app.command("demo")(demo_command)


def demo_command(
    out: Path = typer.Option(Path("runs/demo"), "-o", "--out", help="Output folder: results.json, report.md, "
                                                                     "curves.png."),
    steps: int = typer.Option(300, min=1, help="Training steps per model."),
    learned_steps: int = typer.Option(100, "--learned-steps", min=1, help="Steps of the learned refinement."),
    threads: Optional[int] = checks.threads_option("torch threads (0 or unset: the default, 1 or $SYMALIGN_THREADS; "
                                         "results depend on it, see README)."),
    fresh: bool = typer.Option(False, "--fresh", "--force", help="Discard the runs of a previous demo recorded "
                                                                 "with other settings, and start over."),
    tour: bool = typer.Option(True, "--tour/--no-tour", help="Print the symmetry-probe tour first."),
    as_json: bool = typer.Option(False, "--json", help="Print results.json instead of tables."),
    arithmetic: str = typer.Option(None, "--arithmetic", help="portable (default, or $SYMALIGN_ARITHMETIC): "
                                   "floating-point code meant to be the same on every x86-64 CPU, so that the "
                                   "numbers are the README's (docs/results.md, Reproducibility: what was measured); "
                                   "native: the CPU's fastest kernels, numbers that depend on the CPU."),
    device: Optional[str] = typer.Option(None, "--device", metavar="auto|cpu|cuda", help="Train and evaluate every "
                                         "run there (recorded as protocol.device). Default: training on CUDA where "
                                         "it exists, the curves on the CPU (the README's numbers are the CPU's)."),
) -> None:
    """Linear mode connectivity of ViTs on the embedded digits data, before and after alignment.

    The paper's protocol (first attention layer re-initialised with two seeds, rest frozen) and the
    all-attention scope, for sinusoidal and RoPE encodings: the data-free matcher (stage 2 none /
    orthogonal / full) beside the learned refinement; then a whole-model alignment of two ViTs trained
    from scratch, with the merged model's accuracy beside A's and B's. Resumable: re-running with the
    same settings reuses finished work; other settings are refused (use --fresh or another --out)."""
    import time

    from symalign import arithmetic as arith
    from symalign.commands import interrupt
    from symalign.experiments.demo import run_demo

    # restarts this command in that mode (a library call keeps its own, and the results record it)
    arith.ensure(arithmetic or arith.requested() or "portable")
    checks.output_dir(out)
    checks.use_threads(threads, allow_zero=True)
    run_device = None if device is None else checks.use_device(device).type  # refused before any training
    interrupt.keep_run(out, drop=("--fresh", "--force"))  # re-running with the same settings resumes
    console = checks.console(stderr=as_json)
    t0 = time.perf_counter()
    if not as_json:
        _print_device(console, run_device)
        if tour:
            _print_tour(console)
    log = (lambda s: console.print(f"  {s}")) if not as_json else None
    summary = run_demo(out, steps=steps, progress=not as_json, log=log, fresh=fresh, learned_steps=learned_steps,
                       device=run_device)
    if as_json:
        typer.echo(json.dumps(summary, indent=2))
        return
    console.print(_barrier_table(summary))
    if "whole_model" in summary:
        console.print(_whole_model_table(summary["whole_model"]))
    _print_footer(console, summary, out, time.perf_counter() - t0)


def _print_device(console, run_device: str | None) -> None:
    """Where the demo trains (and, by default, that the curves are computed on the CPU)."""
    from symalign.experiments.demo import training_device

    train_on = training_device(run_device)
    where = train_on["device"] + (f" ({train_on['gpu']})" if "gpu" in train_on else "")
    console.print(f"device: {where}" + ("" if run_device is not None or train_on["device"] == "cpu" else
                                        " for training, the CPU for the curves (--device chooses)"))


def _print_tour(console) -> None:
    """Part 1: the symmetry-probe tour (:func:`symalign.probe.probe_tour`), at the console's width in a log too."""
    import os

    from symalign.commands.tour import render_tour
    from symalign.probe import probe_tour

    console.print("[bold]1. The symmetry group of each attention design, measured[/] "
                  "(Jacobian null space vs theory)")
    rows = probe_tour(seed=0)
    wide = not console.is_terminal and "COLUMNS" not in os.environ
    if wide:  # render_tour makes its own Console: let it keep the table's width in a log too
        os.environ["COLUMNS"] = str(console.width)
    try:
        render_tour(rows)
    finally:
        if wide:
            del os.environ["COLUMNS"]
    console.print("[bold]2. Linear mode connectivity after alignment[/] (ViT on digits)")


def _barrier_table(summary: dict):
    """The LMC barrier rows (naive vs aligned) of every encoding, scope and stage 2; the main row starred."""
    from rich.table import Table

    table = Table(title="LMC barriers on held-out digits: naive (A -> B) vs aligned (A -> B')")
    for col in ("encoding", "scope", "stage 2", "naive loss barrier", "aligned loss barrier", "ratio %",
                "naive acc barrier", "aligned acc barrier"):
        table.add_column(col, justify="right")
    main = summary["main_row"]
    for r in summary["rows"]:
        if r["scope"] == "full":
            continue
        star = " *" if (r["scope"], r["stage2"]) == (main["scope"], main["stage2"]) else ""
        table.add_row(r["encoding"], r["scope"], r["stage2"] + star, f"{r['naive_loss_barrier']:.4f}",
                      f"{r['aligned_loss_barrier']:.4f}", _pct(r["barrier_ratio_percent"]),
                      f"{r['naive_acc_barrier']:.4f}", f"{r['aligned_acc_barrier']:.4f}")
    return table


def _whole_model_table(w: dict):
    """The whole-model alignment row: A's and B's accuracy, the merged model's (naive, aligned, learned), barriers."""
    from rich.table import Table

    wt = Table(title=f"Whole-model alignment ({w['encoding']}, trained from scratch): the merged model t = 1/2")
    for col in ("acc A", "acc B", "merged: naive", "aligned (full)", "aligned (learned)", "naive loss barrier",
                "full", "learned", "ratio % full / learned"):
        wt.add_column(col, justify="right")
    wt.add_row(f"{w['acc_A']:.3f}", f"{w['acc_B']:.3f}", f"{w['merged_naive_acc']:.3f}",
               f"{w['merged_aligned_acc']:.3f}", f"{w['merged_learned_acc']:.3f}",
               f"{w['naive_loss_barrier']:.4f}", f"{w['aligned_loss_barrier']:.4f}",
               f"{w['learned_loss_barrier']:.4f}",
               f"{_pct(w['barrier_ratio_percent'])} / {_pct(w['learned_ratio_percent'])}")
    return wt


def _print_footer(console, summary: dict, out: Path, elapsed: float) -> None:
    """The accuracies behind the main row, how many seed pairs and test images stand behind the numbers, the
    arithmetic mode, and the files written."""
    accs = ", ".join(f"{pe} A {d['acc_A']:.3f} / B {d['acc_B']:.3f}" for pe, d in summary["encodings"].items())
    console.print(f"* main row (the paper's protocol). Test accuracy of the re-initialised pairs: {accs}.")
    console.print(f"These numbers rest on {summary['seed_pairs']} seed pair (A: seed {summary['seeds'][0]}, B: seed "
                  f"{summary['seeds'][1]}) and {summary['test_items']} held-out test images; ratios vary across seed "
                  f"pairs and with the thread count ({summary['threads']} here); "
                  + ("portable arithmetic: meant to be the same on every x86-64 CPU (docs/results.md, "
                     "Reproducibility)." if summary["arithmetic"]["mode"] == "portable"
                     else "native arithmetic: they also vary with the CPU (--arithmetic portable is meant not to)."))
    console.print(f"wrote {out / 'results.json'}, {out / 'report.md'}, {out / 'curves.png'} "
                  f"({elapsed:.0f} s)")


def _pct(x) -> str:
    return "n/a" if x is None or x != x else f"{x:.1f}"
