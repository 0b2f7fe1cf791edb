"""Up-front argument checks shared by the commands: each raises a one-line
:class:`~symalign.errors.ConfigError` (exit code 2) naming the option and the fix,
before any data is loaded or any model is trained."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Any, Iterable, Optional

from symalign.errors import ConfigError


def threads(n: Optional[int], option: str = "--threads", allow_zero: bool = False) -> None:
    """``--threads`` must be a positive integer (``0`` meaning "automatic" where ``allow_zero``)."""
    if n is None or n > 0 or (allow_zero and n == 0):
        return
    low = "0 (automatic) or more" if allow_zero else "at least 1"
    raise ConfigError(f"{option} must be {low}, got {n}")


def output_dir(path: Path, option: str = "--out") -> None:
    """An output folder may exist as a folder, never as a file, and must be writable (it, or the nearest
    folder above it that exists: :func:`symalign.atomic.check_writable`)."""
    from symalign.atomic import check_writable

    if path.exists() and not path.is_dir():
        raise ConfigError(f"{option} {path} is an existing file, not a folder; pass a folder path")
    check_writable(path, f"{option} {path}")


def output_file(path: Path, option: str = "--out") -> None:
    """An output file may exist as a file (it is replaced), never as a folder."""
    if path.is_dir():
        raise ConfigError(f"{option} {path} is an existing folder; pass a file path (e.g. {path / 'report.md'})")
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if parent.exists() and not parent.is_dir():
        raise ConfigError(f"{option} {path}: {parent} is a file, not a folder")
    from symalign.atomic import check_writable

    check_writable(path.parent, f"{option} {path}")


def input_file(path: Path, what: str) -> None:
    """An input that must be an existing file (e.g. a TOML config)."""
    if path.is_dir():
        raise ConfigError(f"{path} is a folder; pass the {what} file itself (e.g. configs/vit-digits-rope.toml)")
    if not path.is_file():
        raise ConfigError(f"{path}: no such {what} file")


def not_inside(out: Path, inputs: Iterable[Path], option: str = "--out") -> None:
    """Refuse an output folder that is, contains or lies inside one of the input folders."""
    out_r = Path(out).resolve()
    for src in inputs:
        src_r = Path(src).resolve()
        if out_r == src_r or src_r in out_r.parents:
            raise ConfigError(f"{option} {out} would write into the input checkpoint {src}; pick another folder")
        if out_r in src_r.parents:
            raise ConfigError(f"{option} {out} contains the input checkpoint {src}; pick another folder")


def positive(value: int, option: str) -> None:
    if value <= 0:
        raise ConfigError(f"{option} must be a positive integer, got {value}")


def default_threads() -> int:
    """The default torch thread count of every command: 1 (see README, "Threads and results").

    Measured on a shared 2-core machine: ``symalign demo`` with one thread is faster than with
    two (intra-op threads of small models spin and contend with other processes), and a
    fixed count keeps results reproducible across machines (float reductions depend on it).
    ``SYMALIGN_THREADS`` overrides it.
    """
    env = os.environ.get("SYMALIGN_THREADS", "").strip()
    if env:
        if not env.isdigit() or int(env) < 1:
            raise ConfigError(f"SYMALIGN_THREADS must be a positive integer, got {env!r}")
        return int(env)
    return 1


THREADS_HELP = "torch threads (default 1, or $SYMALIGN_THREADS; results depend on it, see README)."


def threads_option(help: str = THREADS_HELP) -> Any:
    """The ``--threads N`` option every command that runs torch declares (read by :func:`use_threads`)."""
    import typer

    return typer.Option(None, "--threads", metavar="N", help=help)


def use_threads(n: Optional[int], option: str = "--threads", allow_zero: bool = False) -> int:
    """The one place torch's thread count is set: ``n`` (checked by :func:`threads`; ``None``, or ``0``
    where ``allow_zero``, means :func:`default_threads`). Returns the count now in use."""
    import torch

    threads(n, option, allow_zero)
    count = n or default_threads()
    torch.set_num_threads(count)
    return count


DEVICE_HELP = ("Where to compute: auto (CUDA when present, else the CPU), cpu, cuda, cuda:N or mps. Matching keeps "
               "the CPU path's dtypes with TF32 off; see docs/scaling.md, 'Devices'.")


def device_option(help: str = DEVICE_HELP) -> Any:
    """The ``--device`` option every command that computes declares (read by :func:`use_device`)."""
    import typer

    return typer.Option("auto", "--device", metavar="auto|cpu|cuda|cuda:N|mps", help=help)


def use_device(spec: Optional[str], say: Optional[Callable[[str], None]] = None) -> Any:
    """The one place ``--device`` is read: the :class:`torch.device` it names (:func:`symalign.device.resolve`,
    which refuses an unknown string or an absent device in one line, before any weight is loaded); ``say``
    receives the first progress line, which names an accelerator (and the GPU): on the CPU nothing is added to
    the output (``--json`` and every provenance record the device either way)."""
    from symalign.device import describe, resolve

    dev = resolve(spec)
    if say is not None and dev.type != "cpu":
        info = describe(dev)
        say(f"device: {info['device']}" + (f" ({info['gpu']})" if "gpu" in info else ""))
    return dev


MAX_DEVICE_MEMORY_HELP = ("Cap the memory torch may hold on the device (CUDA: a per-process fraction; an allocation "
                          "past it stops the command in one line): 8GiB, 512MiB, 20GB or bytes. Accepted and "
                          "recorded on the CPU, where it bounds nothing (--stream bounds the host).")


def max_device_memory_option() -> Any:
    """The ``--max-device-memory SIZE`` option (read by :func:`use_max_device_memory`)."""
    import typer

    return typer.Option(None, "--max-device-memory", metavar="SIZE", help=MAX_DEVICE_MEMORY_HELP)


def use_max_device_memory(size: Optional[str], device: Any) -> dict:
    """The one place ``--max-device-memory`` is read: parsed (:func:`symalign.device.parse_size`; a bad size is
    refused in one line before any weight is loaded) and applied to ``device`` (:func:`symalign.device.cap_memory`).
    Returns what ``--json`` records under ``memory``."""
    from symalign.device import cap_memory, parse_size

    return cap_memory(device, None if size is None else parse_size(size))


_INT_OPTIONS = ("split_seed", "subset", "seq_len", "n", "image_size", "per_class")
_BOOL_OPTIONS = ("use_cache", "download")
_FLOAT_OPTIONS = ("test_fraction",)


def data_options(opts: dict, option: str = "--data-option") -> dict:
    """Check ``KEY=VALUE`` dataset options against :func:`symalign.data.load_dataset`'s keywords:
    unknown keys and non-integer values of integer keys are refused; ``true``/``false`` become
    booleans for the on/off keys. Returns the checked options."""
    import inspect

    from symalign.data import load_dataset

    known = [p for p in inspect.signature(load_dataset).parameters if p != "name"]
    out = {}
    for key, value in opts.items():
        if key not in known:
            raise ConfigError(f"unknown {option} {key!r}; known keys: {', '.join(known)}")
        if key in _INT_OPTIONS:
            if not isinstance(value, int) or value < 0 or (value == 0 and key != "split_seed"):
                raise ConfigError(f"{option} {key}={value!r}: expected a positive integer")
        if key in _FLOAT_OPTIONS:
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(f"{option} {key}={value!r}: expected a number") from None
        if key in _BOOL_OPTIONS and not isinstance(value, bool):
            low = str(value).lower()
            if low not in ("true", "false", "1", "0", "yes", "no"):
                raise ConfigError(f"{option} {key}={value!r}: expected true or false")
            value = low in ("true", "1", "yes")
        out[key] = value
    return out


def console(stderr: bool = False):
    """A rich Console for tables: when the output is not a terminal (a log file, a pipe), tables
    keep their natural width instead of being cut to rich's default of 80 columns."""
    from rich.console import Console

    c = Console(stderr=stderr)
    if not c.is_terminal and "COLUMNS" not in os.environ:
        c = Console(stderr=stderr, width=1000)
    return c
