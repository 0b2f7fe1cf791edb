"""When ``symalign align`` streams (the dispatch is :func:`symalign.pipeline.align`)."""

from __future__ import annotations

import os
from pathlib import Path

from symalign.errors import ConfigError

STREAM_FRACTION = 0.25  # stream when A + B exceed this fraction of the physical memory


def physical_memory() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 16 << 30


def weights_bytes(path: Path) -> int:
    path = Path(path)
    if not path.is_dir():
        return 0
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def streamable(a_dir: Path, scope: str) -> str | None:
    """``None`` if the streamed engine covers this checkpoint and scope, else why not."""
    from symalign.checkpoint.config import load_config
    from symalign.families import get_adapter

    config = load_config(a_dir)
    why = getattr(get_adapter(config), "no_stream", None)
    if why is not None:
        return why
    if scope == "attention":
        return None
    from symalign.checkpoint.lazy import open_checkpoint
    from symalign.stream.fold import refusal

    return refusal(open_checkpoint(a_dir))  # the family's rewrite on the tensor headers only


def should_stream(a_dir: Path, b_dir: Path, scope: str, stream: bool | None) -> bool:
    """``stream`` if given (an unsupported combination is refused), else by size."""
    if stream is False:
        return False
    if stream is None:
        big = weights_bytes(a_dir) + weights_bytes(b_dir) > STREAM_FRACTION * physical_memory()
        if not big:
            return False
        try:
            return streamable(a_dir, scope) is None
        except Exception:  # unreadable config: let the in-memory path report it
            return False
    why = streamable(a_dir, scope)
    if why is not None:
        raise ConfigError(why)
    return True

