"""``symalign experiment CONFIG.toml``: the paper's re-initialisation protocol."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from symalign.commands import checks


def register(app: typer.Typer) -> None:
    app.command("experiment")(experiment_command)


def experiment_command(
    config: Path = typer.Argument(..., metavar="CONFIG",
                                  help="Experiment config (TOML), e.g. configs/vit-digits-rope.toml."),
    out: Path = typer.Option(Path("runs/experiments"), "-o", "--out", help="Runs directory; the run goes to "
                                                                          "OUT/<name>."),
    threads: Optional[int] = checks.threads_option("torch threads for training and evaluation (default 1, or "
                                                   "$SYMALIGN_THREADS; results depend on it, see README)."),
    fresh: bool = typer.Option(False, "--fresh", "--force",
                               help="Discard OUT/<name> (a previous run of this experiment, recorded with another "
                                    "config) and start over."),
    scope: list[str] = typer.Option([], "--scope", help="Run only these scopes (repeatable); default: the "
                                                       "config's protocol.scopes."),
    seeds: list[int] = typer.Option([], "--seeds", help="The seeds of models A and B, overriding protocol.seeds "
                                                       "(give it twice: --seeds 3 --seeds 4); use another --out "
                                                       "for a second seed pair, since results.json is per scope."),
    variant: list[str] = typer.Option([], "--variant", help="Stage-2 variants, overriding protocol.variants "
                                                         "(repeatable): none | orthogonal | full | learned."),
    learned_steps: Optional[int] = typer.Option(None, "--learned-steps", min=1,
                                                help="Learned-matching steps, overriding protocol.learned_steps."),
    eval_split: Optional[str] = typer.Option(None, "--eval-split",
                                             help="The split the curves are measured on, overriding "
                                                  "protocol.eval_split: test | val | train (use another --out "
                                                  "per split, since results.json is per scope)."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary rows as JSON."),
    quiet: bool = typer.Option(False, help="No progress output."),
    device: Optional[str] = typer.Option(None, "--device", metavar="auto|cpu|cuda", help="Train and evaluate "
                                         "there (recorded as protocol.device). Default: training on CUDA where it "
                                         "exists, the curves on the config's protocol.device."),
) -> None:
    """Train the base, re-initialise each scope with two seeds, train, align, and record LMC curves.

    Re-running skips finished work (checkpoints, per-scope results.json) recorded with the same config;
    results recorded with another config are refused (use another --out, or --fresh to start over).
    """
    from rich.console import Console

    from symalign.experiments import load_experiment_config, run_experiment
    from symalign.experiments.report import markdown_table
    from symalign.experiments.metrics import summary_row

    from symalign.commands import interrupt

    checks.input_file(config, "experiment config (TOML)")
    checks.threads(threads)
    checks.output_dir(out)
    cfg = load_experiment_config(config)  # every key validated before any training
    over = {**({"scopes": list(scope)} if scope else {}), **({"seeds": list(seeds)} if seeds else {}),
            **({"variants": list(variant)} if variant else {}),
            **({"learned_steps": learned_steps} if learned_steps is not None else {}),
            **({"eval_split": eval_split} if eval_split is not None else {})}
    if over:
        from symalign.experiments.config import Protocol

        cfg.protocol = Protocol(**{**vars(cfg.protocol), **over})  # validated again
    checks.use_threads(threads)
    run_device = None if device is None else checks.use_device(device).type
    interrupt.keep_run(out / cfg.name, drop=("--fresh", "--force"))  # re-running resumes; --fresh would discard
    console = Console(stderr=True)
    log = None if quiet else (lambda s: console.print(f"[bold]{cfg.name}[/]: {s}"))
    results = run_experiment(cfg, out, progress=not quiet, log=log, fresh=fresh, device=run_device)
    rows = [summary_row(cfg.name, r) for r in results]
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
    else:
        typer.echo(markdown_table(rows))
        typer.echo(f"results: {out / cfg.name}/<scope>/results.json, summary: {out}/summary.md")
