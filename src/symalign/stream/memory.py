"""Keep the C heap from holding on to freed layers (glibc only; a no-op elsewhere).

glibc serves allocations below its *mmap threshold* from the heap, and raises that
threshold (up to 32 MiB) each time a large mmapped block is freed. A streamed run
allocates and frees layer-sized buffers over and over; with the dynamic threshold
they end up in the heap, which fragments and keeps growing with the number of
layers. :func:`bound_heap` pins the threshold (256 KiB: every tensor of any size
worth counting is its own mapping, returned to the system when freed) and
:func:`release` trims the heap after each layer.
"""

from __future__ import annotations

import ctypes

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 256 << 10


def _libc():
    try:
        libc = ctypes.CDLL(None)
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:  # pragma: no cover
        return None


def bound_heap() -> bool:
    """Pin glibc's mmap threshold (see the module docstring); True when it applied."""
    libc = _libc()
    if libc is None:
        return False
    ok = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
    libc.mallopt(_M_TRIM_THRESHOLD, 4 * MMAP_THRESHOLD)
    return ok


def release() -> None:
    """Return the heap's free memory to the system (``malloc_trim(0)``)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def peak_rss() -> int:
    """This process's peak resident set size in bytes (``ru_maxrss``; Linux reports KiB)."""
    import resource
    import sys

    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(r if sys.platform == "darwin" else r * 1024)
