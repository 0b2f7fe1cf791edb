"""Run ``symalign`` in-process as a user would (``sys.argv`` + ``cli.main``), capturing output."""

from __future__ import annotations

import sys


def run_symalign(monkeypatch, capsys, *argv) -> tuple[int, str, str]:
    """``(exit code, stdout, stderr)`` of ``symalign ARGV...``."""
    from symalign import cli

    capsys.readouterr()  # drop what earlier steps printed
    monkeypatch.setattr(sys, "argv", ["symalign", *map(str, argv)])
    code = 0
    try:
        cli.main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    out, err = capsys.readouterr()
    return code, out, err
