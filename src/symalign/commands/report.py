"""``symalign report RUNS_DIR``: one Markdown report across runs."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


def register(app: typer.Typer) -> None:
    app.command("report")(report_command)


def report_command(
    runs_dir: Path = typer.Argument(..., metavar="RUNS_DIR", help="A directory holding experiment runs (any depth)."),
    out: Optional[Path] = typer.Option(None, "-o", "--out", help="Report path (default RUNS_DIR/report.md)."),
) -> None:
    """Collect every results.json under RUNS_DIR into one Markdown report with tables and plots."""
    from symalign.commands import checks, interrupt
    from symalign.experiments.report import write_report, write_summary

    if out is not None:
        checks.output_file(out, "--out")
    interrupt.keep_output(*(p for p in (runs_dir / "summary.md", out or runs_dir / "report.md")))
    write_summary(runs_dir)
    path = write_report(runs_dir, out)
    typer.echo(str(path))
