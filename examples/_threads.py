"""The thread setting of the example scripts: ``--threads N``, else ``$SYMALIGN_THREADS``, else 1 -- read
through symalign's one place for it (:func:`symalign.commands.checks.default_threads`), as every
``symalign`` command does. Training and matching results depend on the thread count (float
reductions), so each script records the count torch really ran with."""

from __future__ import annotations

import argparse

import torch


def add_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: $SYMALIGN_THREADS, else 1); results depend on it, it is recorded")


def use(p: argparse.ArgumentParser, threads: int | None) -> int:
    """Set torch's threads from ``--threads`` / ``$SYMALIGN_THREADS``; returns the count torch now uses
    (a bad value: one line from ``p``, exit 2)."""
    from symalign.commands.checks import default_threads
    from symalign.commands.checks import threads as check_threads
    from symalign.errors import SymalignError

    try:
        check_threads(threads)
        torch.set_num_threads(threads or default_threads())
    except SymalignError as exc:
        p.error(str(exc))
    return torch.get_num_threads()


def record(path, script: str, args: argparse.Namespace, threads: int, **extra) -> None:
    """Write ``path`` (JSON, atomically): the script, its arguments, the threads it ran with, provenance."""
    import sys

    from symalign.atomic import write_json
    from symalign.provenance import provenance

    write_json(path, {"script": script, "args": {k: (str(v) if not isinstance(v, (int, float, list, type(None)))
                                                     else v) for k, v in vars(args).items()},
                      "threads": threads, **extra,
                      "provenance": provenance(["python", *sys.argv], threads=threads)})
