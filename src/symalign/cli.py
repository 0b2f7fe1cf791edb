"""The ``symalign`` command line.

Each command lives in its own module under :mod:`symalign.commands` and
registers itself on :data:`app` via ``register(app)``. Every user error
(:class:`~symalign.errors.SymalignError`) is printed as one line on stderr with
exit code 2 and no traceback.
"""

from __future__ import annotations

import importlib
import os
import sys

import typer
import typer.core

from symalign.errors import SymalignError

# Hugging Face's load reports would mix into symalign's own output (its "Loading weights" bars are
# switched off where symalign loads a model: symalign.jobs.interpolate.load_hf_model, symalign.arch.check).
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

app = typer.Typer(
    name="symalign",
    help="Align Transformers through their exact parameter symmetries and measure linear mode connectivity.",
    epilog="Environment: SYMALIGN_THREADS=N sets torch's threads for every command (default 1; results depend on "
           "it). SYMALIGN_ARITHMETIC=portable runs any command on floating-point code meant to be the same on every "
           "x86-64 CPU (torch's baseline kernels, MKL's strict reproducible mode, oneDNN off; about 2x slower), "
           "native on the "
           "CPU's fastest; symalign demo is portable unless told otherwise.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _hide_flag_types() -> None:
    """On ``--help``, show no ``<bool>`` type for on/off flags (typer >= 0.20 shows one)."""
    cls = typer.core.TyperOption
    show = getattr(cls, "display_type_rich", None)
    if show is None or getattr(show, "_symalign", False):
        return

    def display_type_rich(self, ctx):  # type: ignore[no-untyped-def]
        if getattr(self, "is_flag", False) or getattr(self, "is_bool_flag", False):
            return None
        return show(self, ctx)

    display_type_rich._symalign = True  # type: ignore[attr-defined]
    cls.display_type_rich = display_type_rich


_hide_flag_types()


def _version(value: bool) -> None:
    if value:
        from symalign import __version__

        typer.echo(f"symalign {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    """Align Transformers through their exact parameter symmetries and measure linear mode connectivity."""

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


def main() -> None:
    """Entry point: run the app, turning user errors into one line and exit code 2.

    torch runs single-threaded unless ``$SYMALIGN_THREADS`` or a command's ``--threads`` says
    otherwise (:func:`symalign.commands.checks.use_threads`: faster on shared machines, and
    the thread count changes results, so it is fixed and recorded). ``$SYMALIGN_ARITHMETIC=portable``
    restarts the command with floating-point code meant to be the same on every x86-64 CPU
    (:mod:`symalign.arithmetic`). Ctrl-C exits 130 with one line saying what the command kept
    (:mod:`symalign.commands.interrupt`); a command's ``typer.Exit(code)`` is its exit status. A device (or
    the host) out of memory is one line naming the remedies (:func:`symalign.device.out_of_memory`), exit 2."""
    from symalign import arithmetic
    from symalign.commands import interrupt

    interrupt.reset()
    try:
        # the requested mode (the console script restarts in it; in-process callers keep theirs), else the one the
        # environment already sets: either way its in-process settings are applied (arithmetic.apply)
        arithmetic.ensure(arithmetic.requested() or arithmetic.active())
        from symalign.commands.checks import use_threads

        use_threads(None)
        # standalone_mode=False: typer returns the code of a typer.Exit, and 130 for a KeyboardInterrupt
        code = app(standalone_mode=False, prog_name="symalign")
    except KeyboardInterrupt:  # before typer took over (imports, the arithmetic restart)
        code = INTERRUPTED
    except SymalignError as exc:
        typer.echo(f"symalign: error: {exc}", err=True)
        sys.exit(2)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        typer.echo("Aborted.", err=True)
        sys.exit(INTERRUPTED)
    except Exception as exc:  # a device out of memory; click usage errors
        from symalign.device import is_out_of_memory, oom_device, out_of_memory

        if is_out_of_memory(exc):  # every command writes OUT through a temporary path: nothing was replaced
            typer.echo(f"symalign: error: {out_of_memory(oom_device(exc))}", err=True)
            sys.exit(2)
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
    if code == INTERRUPTED:
        typer.echo(f"symalign: interrupted; {interrupt.message()}", err=True)
    if isinstance(code, int) and code != 0:
        sys.exit(code)


INTERRUPTED = 130
"""The exit status of an interrupted command (128 + SIGINT, as a shell reports it)."""


def entry() -> None:
    """The ``symalign`` console script (and ``python -m symalign.cli``): :func:`main` in a process of its own,
    which may restart itself in another arithmetic (:func:`symalign.arithmetic.ensure`)."""
    from symalign import arithmetic

    arithmetic.ENTRY_ARGV = list(sys.argv[1:])
    main()


if __name__ == "__main__":
    entry()
