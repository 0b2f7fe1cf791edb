r"""Which floating-point code a run executes: the CPU's fastest (``native``) or the same on every x86-64
CPU (``portable``).

Training sums millions of products; another summation order changes the last bits, and over hundreds of
optimisation steps the last bits become another model (docs/results.md, "Reproducibility": an emulated
AVX2 CPU shares 28 of the demo's 152 numbers with an AVX-512 one). For one torch build the order depends
on the CPU through three libraries, each of which picks SIMD code for the CPU it finds:

* torch's own kernels (element-wise ops, reductions, softmax): ``ATEN_CPU_CAPABILITY``;
* MKL's matrix products: ``MKL_CBWR`` (``COMPATIBLE,STRICT``: Intel's conditional numerical
  reproducibility, one code path on every x86-64 CPU, and -- ``STRICT`` -- whatever the operands'
  alignment);
* oneDNN (torch's float32 convolutions and some linear layers): ``ONEDNN_MAX_CPU_ISA``.

The three variables fix the SIMD level, not everything a CPU decides: oneDNN's own matrix product
(``gemm:jit``, which runs torch's convolutions) blocks its sums by the CPU's cache sizes, so the demo in
the first version of this mode (oneDNN capped at SSE4.1, no ``STRICT``) gave 152 of 152 numbers of the
Intel machine's ``results/demo.json`` on every CPU emulated there, and 13 of 152 on a real AMD EPYC
(docs/results.md, "Reproducibility"). A portable process therefore also turns oneDNN off in torch
(:func:`apply`: convolutions and linear layers then run as MKL products under CNR).

``portable`` sets the variables to a level every x86-64 CPU has (:data:`PORTABLE_ENV`). Each library reads
its variable once, when the process first uses it, so the mode must be in the environment before Python
starts: :func:`reexec` starts the command again with it (one more start-up, about a second). Asked for
with ``SYMALIGN_ARITHMETIC=portable`` (any command) or ``symalign demo --arithmetic portable`` (the
demo's default, so that its table is the README's on any x86-64 CPU). The mode is recorded beside the
thread count (:func:`describe`). Portable code is slower (baseline SIMD); it does not make two thread
counts agree, nor another torch build, nor a non-x86 CPU.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import NoReturn, Sequence

from symalign.errors import ConfigError

ENV_VAR = "SYMALIGN_ARITHMETIC"
MODES: tuple[str, ...] = ("native", "portable")
#: the variables of the portable mode and their values
PORTABLE_ENV: dict[str, str] = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE,STRICT",
                                "ONEDNN_MAX_CPU_ISA": "SSE41"}

#: the command's arguments when this process is the ``symalign`` command itself (set by the console
#: script, :func:`symalign.cli.entry`); ``None`` in a library call or a test runner, which are not restarted
ENTRY_ARGV: list[str] | None = None


def _mode(value: str, what: str) -> str:
    """``value`` as one of :data:`MODES` (case and spaces ignored); ``what`` names it in the error."""
    mode = value.strip().lower()
    if mode not in MODES:
        raise ConfigError(f"{what} must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def requested(env: dict[str, str] | None = None) -> str | None:
    """The mode ``$SYMALIGN_ARITHMETIC`` asks for (``None``: not set)."""
    value = (os.environ if env is None else env).get(ENV_VAR, "").strip()
    return _mode(value, ENV_VAR) if value else None


def active(env: dict[str, str] | None = None) -> str:
    """The mode this process runs in: ``portable`` when every variable of :data:`PORTABLE_ENV` has its value."""
    env = os.environ if env is None else env
    ok = all(env.get(k, "").strip().lower() == v.lower() for k, v in PORTABLE_ENV.items())
    return "portable" if ok else "native"


def environment(mode: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) changed to run in ``mode``, with ``$SYMALIGN_ARITHMETIC`` set to it."""
    out = dict(os.environ if env is None else env)
    if mode == "portable":
        out.update(PORTABLE_ENV)
    else:
        for k in PORTABLE_ENV:
            out.pop(k, None)
    out[ENV_VAR] = mode
    return out


def apply() -> str:
    """Set what the environment cannot in this process (torch reads no variable for it): in portable mode,
    torch's oneDNN backend off (``torch.backends.mkldnn.enabled = False``), so that convolutions and linear
    layers run as MKL products under CNR instead of oneDNN's cache-blocked ``gemm:jit``. Returns the mode."""
    import torch

    mode = active()
    if mode == "portable":
        torch.backends.mkldnn.enabled = False
    return mode


def describe() -> dict[str, str | bool | None]:
    """The record of this process's arithmetic: the mode, the SIMD level torch dispatches to, the variables,
    and whether torch's oneDNN backend is on."""
    import torch

    return {"mode": active(), "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            **{k: os.environ.get(k) for k in PORTABLE_ENV}, "onednn": bool(torch.backends.mkldnn.enabled)}


def reexec(mode: str, argv: Sequence[str]) -> NoReturn:
    """Replace this process by the ``symalign`` command ``argv`` running in ``mode``."""
    script = Path(sys.argv[0])  # the console script, or symalign/cli.py under ``python -m symalign.cli``
    head = [str(script)] if script.is_file() and script.suffix != ".py" else ["-m", "symalign.cli"]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *head, *argv], environment(mode))


def ensure(mode: str) -> str:
    """Run in ``mode``: returns when this process already does; restarts the command in it when this process
    is the ``symalign`` command (:data:`ENTRY_ARGV`); otherwise (a library call, a test runner) keeps the
    current mode and returns it, for the caller to record."""
    mode = _mode(mode, "arithmetic")
    if active() == mode:
        return apply()
    if ENTRY_ARGV is not None:
        reexec(mode, ENTRY_ARGV)
    return apply()
