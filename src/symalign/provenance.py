r"""Where a result came from: the commit, the command, the thread count, the versions and the machine.

Every result file that a number in the README or ``docs/`` is taken from carries one
``provenance`` object (:func:`provenance`), so that a reader can rerun the exact command
at the exact commit with the same thread count. Training and matching on CPU are
bit-for-bit reproducible at a fixed commit, thread count and library versions on one
machine; the thread count changes the floating-point summation order and hence results,
so it is always recorded.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Sequence

import torch

from symalign.arithmetic import describe

PACKAGES: tuple[str, ...] = ("symalign", "torch", "numpy", "scipy", "transformers", "tokenizers", "safetensors")


def git_commit(where: str | Path | None = None) -> str | None:
    """``HEAD``'s hash of the git checkout holding ``where`` (default: this package), ``+dirty``
    when tracked files differ from it; ``None`` outside a checkout or without git."""
    where = Path(where) if where is not None else Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=where,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def versions(packages: Sequence[str] = PACKAGES) -> dict[str, str]:
    """Installed versions of ``packages`` (absent ones left out) and Python's."""
    out = {"python": platform.python_version()}
    for name in packages:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def cpu_model() -> str | None:
    """The CPU's model name (Linux: ``/proc/cpuinfo``; elsewhere :func:`platform.processor`), or ``None``.

    In native arithmetic two CPUs of one instruction-set class (say an Intel and an AMD AVX-512 part) may
    still pick different library code paths, so trained models, and every ratio after them, are another draw;
    the model name says which CPU a result came from (docs/results.md, "Reproducibility")."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip() or None
    except OSError:
        pass
    return platform.processor() or None


def machine() -> dict[str, object]:
    """The facts that change floating-point results or timings: architecture, CPU model, cores, OS."""
    return {"arch": platform.machine(), "cpu": cpu_model(), "cpus": os.cpu_count(), "system": platform.system(),
            "release": platform.release()}


def provenance(command: str | Sequence[str] | None = None, threads: int | None = None,
               seed_pairs: int | None = None, device: torch.device | str | None = None) -> dict[str, object]:
    """The provenance record of a result produced now.

    ``command``: what a user types to regenerate it (default: this process's command line);
    ``threads``: intra-op threads it ran with (default: ``torch.get_num_threads()``);
    ``seed_pairs``: how many independently trained pairs stand behind its ratios, when relevant;
    ``device``: where it computed (default the CPU), recorded with the GPU's name (:func:`symalign.device.describe`).
    """
    from symalign.device import describe as device_of

    if command is None:
        command = [Path(sys.argv[0]).name, *sys.argv[1:]]
    if not isinstance(command, str):
        command = shlex.join(str(c) for c in command)
    rec: dict[str, object] = {
        "commit": git_commit(),
        "command": command,
        "threads": int(threads if threads is not None else torch.get_num_threads()),
        "versions": versions(),
        "machine": machine(),
        "arithmetic": describe(),
        **device_of(device),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    if seed_pairs is not None:
        rec["seed_pairs"] = int(seed_pairs)
    return rec
