"""``symalign docs``: write the README's and docs/' result tables from the committed result files."""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    app.command("docs")(docs_command)


def docs_command(
    root: Path = typer.Option(Path("."), "--root", help="The repository root (holding README.md, docs/ and results/)."),
    check: bool = typer.Option(False, "--check", help="Only list tables that differ from their files; exit 1 if any."),
) -> None:
    """Rewrite every `<!-- results: FILE table=NAME -->` block of README.md and docs/*.md from FILE."""
    from symalign.errors import ConfigError
    from symalign.experiments.docs_tables import blocks, doc_files, render_file, stale_blocks

    if not (root / "README.md").is_file():
        raise ConfigError(f"{root} has no README.md; run from the repository root or pass --root")
    if check:
        stale = stale_blocks(root)
        for s in stale:
            typer.echo(f"stale: {s}")
        typer.echo(f"{len(blocks(root)) - len(stale)} of {len(blocks(root))} tables match their result files")
        raise typer.Exit(1 if stale else 0)
    changed = [p for p in doc_files(root) if render_file(p, root)]
    names = ", ".join(str(p.relative_to(root)) for p in changed)
    typer.echo(f"{len(blocks(root))} tables written; changed: {names or 'none'}")
