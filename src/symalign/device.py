r"""Which device a job computes on: ``--device auto|cpu|cuda|cuda:N|mps`` (and ``device=`` in the Python API).

:func:`resolve` turns the option into a :class:`torch.device` before any weight is loaded, and refuses in one line
(:class:`~symalign.errors.ConfigError`, exit 2) an unknown string or a device this machine lacks. ``auto`` is CUDA
device 0 when CUDA is present, else the CPU.

Numerics. A device changes where the arithmetic runs, never its precision: matching runs in the dtype the CPU
path uses (float64 where it does, float32 where it does), and TF32 -- which would round float32 matrix products
to a 10-bit mantissa on Ampere and later GPUs -- is off while matching and checking (:func:`exact_matmul`
restores the user's settings afterwards). Function checks keep their tolerances. What may differ between
devices is the summation order of reductions, hence the last bits, and through them the choice between two
assignments of equal cost (ties); a seeded run is repeatable on one device.

:func:`describe` is what every provenance records beside ``threads`` and ``arithmetic``: the device and, on a
GPU, its name. :func:`out_of_memory` turns a device out-of-memory error into one line naming the remedies.
"""

from __future__ import annotations

import contextlib
import re
from typing import Iterator

import torch

from symalign.errors import ConfigError

CHOICES = "auto, cpu, cuda, cuda:N or mps"
_FORM = re.compile(r"^(auto|cpu|mps|cuda)(?::(\d+))?$")

__all__ = ["CHOICES", "cap_memory", "describe", "exact_matmul", "is_out_of_memory", "kind", "oom_device",
           "out_of_memory", "parse_size", "peak_memory", "resolve", "to_device"]


def _parse(spec: str | None) -> tuple[str, str | None]:
    """``(kind, index)`` of a device string, checked in form only; an unknown string is refused in one line."""
    m = _FORM.match((spec or "auto").strip().lower())
    if m is None or (m.group(2) is not None and m.group(1) != "cuda"):
        raise ConfigError(f"unknown --device {spec!r}; use one of {CHOICES}")
    return m.group(1), m.group(2)


def kind(spec: str | None) -> str:
    """The kind ``spec`` names (``"auto"``, ``"cpu"``, ``"cuda"`` or ``"mps"``), checked in form only (for a device
    on another machine, e.g. a Ray cluster's)."""
    return _parse(spec)[0]


def resolve(spec: str | torch.device | None = "auto") -> torch.device:
    """The device ``spec`` names, checked to exist here (module docstring); ``None`` is ``"auto"``."""
    if isinstance(spec, torch.device):
        spec = str(spec)
    kind_, index = _parse(spec)
    if kind_ == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if kind_ == "cpu":
        return torch.device("cpu")
    if kind_ == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise ConfigError("--device mps: this machine has no Apple GPU (MPS) that torch can use; "
                              "use --device cpu (or auto)")
        return torch.device("mps")
    if not torch.cuda.is_available():
        why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
        raise ConfigError(f"--device {spec}: {why}; use --device cpu (or auto, which picks CUDA only where "
                          "it exists)")
    n = torch.cuda.device_count()
    i = int(index) if index is not None else 0
    if i >= n:
        raise ConfigError(f"--device {spec}: this machine has {n} CUDA device(s), numbered 0 to {n - 1}")
    return torch.device("cuda", i)


def describe(device: torch.device | str | None = None) -> dict[str, str]:
    """``{"device": "cuda:0", "gpu": "<name>"}`` (no ``gpu`` key on the CPU): what a provenance records."""
    dev = torch.device("cpu") if device is None else torch.device(device)
    if dev.type == "cuda":
        i = dev.index if dev.index is not None else 0
        return {"device": f"cuda:{i}", "gpu": torch.cuda.get_device_name(i)}
    return {"device": dev.type}


@contextlib.contextmanager
def exact_matmul() -> Iterator[None]:
    """TF32 off (CUDA matrix products and cuDNN convolutions) and float32 matmul precision ``"highest"`` inside
    the block; the caller's settings restored on the way out, also on an error."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.get_float32_matmul_precision())
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[0], saved[1]
        torch.set_float32_matmul_precision(saved[2])


def to_device(state: dict, device: torch.device | None) -> dict:
    """``state`` with every tensor on ``device`` (unchanged dtypes; the same dict when ``device`` is ``None``)."""
    if device is None:
        return state
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in state.items()}


def out_of_memory(device: torch.device | str, where: str = "") -> ConfigError:
    """The one-line error for a device out of memory (raise it ``from None`` in place of torch's)."""
    at = f" while {where}" if where else ""
    return ConfigError(f"{device} ran out of memory{at}; stream the checkpoints (--stream), cap what stays on the "
                       "device (--max-device-memory), lower --batch-size, or use --device cpu")


_OOM_TEXT = ("out of memory", "can't allocate memory", "failed to allocate memory")


def is_out_of_memory(exc: BaseException | None) -> bool:
    """Whether ``exc`` -- or an exception it was raised from or during -- is torch running out of memory:
    :class:`torch.OutOfMemoryError` (CUDA), or a :class:`RuntimeError` saying so (``CUDA error: out of memory``,
    ``MPS backend out of memory``, the CPU allocator's ``can't allocate memory``). The CLI turns it into one line
    (:func:`out_of_memory`, exit 2)."""
    oom = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", None)
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if oom is not None and isinstance(exc, oom):
            return True
        if isinstance(exc, RuntimeError) and any(t in str(exc).lower() for t in _OOM_TEXT):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def oom_device(exc: BaseException) -> str:
    """The device an out-of-memory error names (``cuda:N``, ``mps``, ``the CPU``), else ``"the device"``."""
    text = str(exc)
    m = re.search(r"GPU (\d+)", text)
    if m or (getattr(torch, "OutOfMemoryError", None) and isinstance(exc, torch.OutOfMemoryError)):
        return f"cuda:{m.group(1)}" if m else "the GPU"
    if "MPS" in text:
        return "mps"
    if "CPUAllocator" in text or "can't allocate memory" in text:
        return "the CPU"
    return "the device"


def peak_memory(device: torch.device | str | None = None) -> dict[str, int | None]:
    """``{"host_peak_rss_bytes": ..., "device_peak_bytes": ...}``: this process's peak resident set (``ru_maxrss``)
    and, on a CUDA device, the most memory torch's allocator held there (``max_memory_allocated``; ``None``
    elsewhere: the CPU's share is in the host's figure)."""
    import resource
    import sys

    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out: dict[str, int | None] = {"host_peak_rss_bytes": int(r if sys.platform == "darwin" else r * 1024),
                                  "device_peak_bytes": None}
    dev = torch.device("cpu") if device is None else torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        out["device_peak_bytes"] = int(torch.cuda.max_memory_allocated(dev))
    return out


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 10 ** 3, "m": 1 << 20, "mib": 1 << 20, "mb": 10 ** 6,
          "g": 1 << 30, "gib": 1 << 30, "gb": 10 ** 9, "t": 1 << 40, "tib": 1 << 40, "tb": 10 ** 12}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$")


def parse_size(text: str, option: str = "--max-device-memory") -> int:
    """Bytes in ``text``: a number of bytes (``1073741824``), or a number and a unit -- binary ``K``/``KiB``,
    ``M``/``MiB``, ``G``/``GiB``, ``T``/``TiB`` (powers of 1024), decimal ``KB``, ``MB``, ``GB``, ``TB`` (powers of
    1000; Hugging Face's ``5GB`` shards), case-insensitive. Anything else, or zero, is refused in one line."""
    m = _SIZE.match(str(text).lower())
    if m is None or m.group(2) not in _UNITS:
        raise ConfigError(f"{option} {text!r}: use a size such as 8GiB, 512MiB, 20GB or a number of bytes")
    n = int(float(m.group(1)) * _UNITS[m.group(2)])
    if n <= 0:
        raise ConfigError(f"{option} {text!r}: must be more than 0 bytes")
    return n


def cap_memory(device: torch.device | str | None, max_bytes: int | None) -> dict[str, float | int | None]:
    """Cap what torch's allocator may hold on ``device`` at ``max_bytes`` for the rest of this process.

    CUDA: :func:`torch.cuda.set_per_process_memory_fraction` with ``max_bytes / total`` (at most 1); an
    allocation past it raises torch's out-of-memory error, which the CLI reports in one line
    (:func:`out_of_memory`). Elsewhere the cap is accepted and recorded but bounds nothing (``fraction`` ``None``):
    on the CPU the host's memory is what ``--stream`` bounds. Returns what ``--json`` records:
    ``{"max_device_memory_bytes", "device_memory_fraction"}``."""
    out: dict[str, float | int | None] = {"max_device_memory_bytes": max_bytes, "device_memory_fraction": None}
    dev = torch.device("cpu") if device is None else torch.device(device)
    if max_bytes is None or dev.type != "cuda":
        return out
    i = dev.index if dev.index is not None else 0
    fraction = min(1.0, max_bytes / torch.cuda.get_device_properties(i).total_memory)
    torch.cuda.set_per_process_memory_fraction(fraction, i)
    out["device_memory_fraction"] = fraction
    return out
