"""What an interrupted command kept: the one line ``symalign`` prints on Ctrl-C, with exit code 130.

A command says what an interrupt would leave as soon as it knows its outputs, before any work:

* :func:`keep_output` -- an output written atomically (a checkpoint folder, a results folder, a
  file). At the interrupt it is compared with what stood there when the command began: still
  absent ("nothing was written"), the same file or folder ("the previous one is intact"), or
  already replaced in full (the interrupt came after the atomic rename);
* :func:`keep_run` -- a resumable run folder (experiment, demo, train, sweep), with the exact
  command that continues it (the command as typed, less the options that would discard the
  finished work, plus those that resume).

:func:`symalign.cli.main` prints ``symalign: interrupted; <what was kept>`` on stderr
(:func:`message`) and exits 130, as shells report a process stopped by SIGINT.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Callable, Iterable, Sequence

_KEPT: Callable[[], str] | None = None


def reset() -> None:
    """Forget what an earlier command registered (:func:`symalign.cli.main` calls it first)."""
    global _KEPT
    _KEPT = None


def message() -> str:
    """What the interrupted command kept, in words (``"nothing was written"`` when it registered nothing)."""
    if _KEPT is None:
        return "nothing was written"
    try:
        return _KEPT()
    except Exception:  # the line must come out whatever state the disk is in
        return "nothing was written by this command's last step"


def _stamp(path: Path) -> tuple[int, int] | None:
    """The identity of what stands at ``path`` (device, inode; ``None``: nothing). An atomic rename puts
    a new inode there, so a changed stamp means the new output was committed."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def keep_output(*paths: Path) -> None:
    """Register outputs written atomically (each is either its old self or complete): at an interrupt,
    say for each whether it was left as it was or had already been written in full."""
    global _KEPT
    before = [(Path(p), _stamp(Path(p))) for p in paths]

    def kept() -> str:
        parts = []
        for p, old in before:
            now = _stamp(p)
            if now == old:
                parts.append(f"nothing was written to {p}" if old is None else f"the previous {p} is intact")
            else:
                parts.append(f"{p} had been written in full before the interrupt")
        return "; ".join(parts)

    _KEPT = kept


def continue_command(argv: Sequence[str] | None = None, drop: Iterable[str] = (), add: Iterable[str] = ()) -> str:
    """The command line that continues this run: ``symalign ARGV`` (default ``sys.argv[1:]``) without the
    flags ``drop`` (e.g. ``--fresh``: it would discard the finished work) and with ``add`` appended
    when absent (e.g. ``--resume``); shell-quoted, ready to paste."""
    args = list(sys.argv[1:] if argv is None else argv)
    drop, add = set(drop), list(add)
    kept = [a for a in args if a not in drop]
    kept += [a for a in add if a not in kept]
    return shlex.join(["symalign", *kept])


def keep_run(folder: Path, drop: Iterable[str] = (), add: Iterable[str] = (),
             resumable: Callable[[], bool] | None = None) -> None:
    """Register a resumable run folder: at an interrupt, name it and the exact command that continues it
    (:func:`continue_command`). ``resumable()``: whether there is anything to continue from yet (default:
    the folder exists); when not, say that nothing was kept and to run the same command again."""
    global _KEPT
    folder = Path(folder)
    command = continue_command(drop=drop, add=add)
    fresh = continue_command(drop=drop)
    has_work = resumable or folder.exists

    def kept() -> str:
        if not has_work():
            return f"nothing was kept in {folder}; start again with: {fresh}"
        return f"the run folder {folder} keeps the finished work; continue with: {command}"

    _KEPT = kept
