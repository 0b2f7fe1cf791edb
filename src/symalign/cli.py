"""The ``symalign`` command line.

Each command lives in its own module under :mod:`symalign.commands` and
registers itself on :data:`app` via ``register(app)``. Every user error
(:class:`~symalign.errors.SymalignError`) is printed as one line on stderr with
exit code 2 and no traceback.
"""

from __future__ import annotations

import importlib
import sys

import typer

from symalign.errors import SymalignError

app = typer.Typer(
    name="symalign",
    help="Align Transformers through their exact parameter symmetries and measure linear mode connectivity.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Modules under symalign.commands that define ``register(app)``; missing ones are skipped.
COMMAND_MODULES = ("demo", "probe", "tour", "train", "experiment", "report", "align", "interpolate", "merge",
                   "sweep", "docs")

for _name in COMMAND_MODULES:
    try:
        _mod = importlib.import_module(f"symalign.commands.{_name}")
    except ModuleNotFoundError as exc:  # only skip the command module itself being absent
        if exc.name != f"symalign.commands.{_name}":
            raise
        continue
    _mod.register(app)


def fail(message: str, code: int = 2) -> "typer.Exit":
    """Print ``symalign: error: message`` on stderr and return the Exit to raise."""
    typer.echo(f"symalign: error: {message}", err=True)
    return typer.Exit(code)


def main() -> None:
    """Entry point: run the app, turning user errors into one line and exit code 2."""
    try:
        app(standalone_mode=False)
    except SymalignError as exc:
        typer.echo(f"symalign: error: {exc}", err=True)
        sys.exit(2)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        typer.echo("Aborted.", err=True)
        sys.exit(130)
    except Exception as exc:  # click usage errors
        import click

        errors: tuple = (click.exceptions.ClickException,)
        try:  # typer >= 0.20 vendors click as typer._click
            from typer._click.exceptions import ClickException as _VendoredClickException

            errors += (_VendoredClickException,)
        except ImportError:
            pass
        if isinstance(exc, errors):
            exc.show()
            sys.exit(exc.exit_code)
        raise


if __name__ == "__main__":
    main()
