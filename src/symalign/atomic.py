"""Atomic file writes: build under a temporary name in the same folder, then ``os.replace``.

A reader (or a run killed mid-write) sees either the old file or the complete new one,
never half of it.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator


@contextmanager
def atomic_path(path: str | Path, suffix: str = ".tmp") -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on success rename it to ``path``, else delete it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix)
    os.close(fd)
    os.chmod(tmp, file_mode())  # mkstemp makes 0600; the final file gets what the umask allows
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """``0o666`` less the process umask: the mode ``open()`` would give a new file."""
    return 0o666 & ~_umask()


def dir_mode() -> int:
    """``0o777`` less the process umask: the mode ``mkdir`` would give a new folder."""
    return 0o777 & ~_umask()


def make_temp_dir(parent: str | Path, prefix: str) -> Path:
    """``tempfile.mkdtemp`` (private while being built) with the umask's mode, as ``mkdir`` would give."""
    tmp = Path(tempfile.mkdtemp(dir=parent, prefix=prefix))
    os.chmod(tmp, dir_mode())
    return tmp


def check_writable(path: str | Path, what: str | None = None) -> Path:
    """Refuse, before any work, a location where nothing can be written: the nearest existing path at or
    above ``path`` must be a folder in which an entry can be created. Tried for real (an empty temporary
    folder made and removed at once), so permissions, a read-only file system and a path under a
    regular file are all caught, for root too. Returns that folder; raises a one-line
    :class:`~symalign.errors.ConfigError` that starts with ``what`` (default: ``path``) and names the fix."""
    from symalign.errors import ConfigError

    path = Path(path)
    what = what or str(path)
    folder = path
    while not os.path.lexists(folder) and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise ConfigError(f"{what}: {folder} is a file, not a folder; pick another location")
    try:
        os.rmdir(tempfile.mkdtemp(dir=folder, prefix=".symalign-write-test-"))
    except OSError as exc:
        reason = os.strerror(exc.errno) if exc.errno else type(exc).__name__
        raise ConfigError(f"{what}: cannot write in {folder} ({reason}); pick a writable location "
                          "or fix its permissions") from None
    return folder


def fix_modes(folder: str | Path) -> None:
    """Give ``folder`` and everything under it the modes the umask allows (some writers, e.g.
    safetensors, create ``0600`` files; ``mkdtemp`` creates ``0700`` folders)."""
    folder = Path(folder)
    os.chmod(folder, dir_mode())
    for p in folder.rglob("*"):
        if p.is_symlink():
            continue
        os.chmod(p, dir_mode() if p.is_dir() else file_mode())


def finite_json(obj: Any) -> Any:
    """``obj`` with every non-finite float (NaN, +-Inf) replaced by ``None`` (JSON ``null``):
    strict JSON has no NaN, and e.g. a barrier ratio over a zero baseline is undefined."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_json(v) for v in obj]
    if hasattr(obj, "item") and getattr(obj, "ndim", 1) == 0:  # numpy / torch scalars
        return finite_json(obj.item())
    return obj


def write_text(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_json(path: str | Path, obj: Any, indent: int | None = 2) -> None:
    """Strict JSON (numpy/torch scalars as numbers; NaN/Inf as ``null``), written atomically."""
    write_text(path, json.dumps(finite_json(obj), indent=indent, default=float, allow_nan=False) + "\n")


def file_digest(path: str | Path, algorithm: str = "sha256") -> str:
    """Hex digest of a file's bytes (read in 1 MiB blocks), e.g. ``"sha256"`` or ``"md5"``."""
    import hashlib

    h = hashlib.new(algorithm)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
