"""The dataset container, deterministic splits and the on-disk cache.

Every loader returns a :class:`Dataset`. Classification: ``x_*`` are inputs
(float images ``(N, C, H, W)`` in [0, 1], or int64 byte sequences ``(N, L)``)
and ``y_*`` int64 labels. Language modelling: ``x_*`` are 1-D uint8 byte
streams and ``y_*`` is ``None`` (targets are the next bytes).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
from torch import Tensor

from symalign.atomic import atomic_path

BYTE_VOCAB = 256
ARRAYS = ("x_train", "y_train", "x_val", "y_val", "x_test", "y_test")


@dataclass
class Dataset:
    """Train/val/test tensors plus what a model needs to know about them."""

    name: str
    task: str  # "classification" | "lm"
    x_train: Tensor
    y_train: Tensor | None
    x_val: Tensor
    y_val: Tensor | None
    x_test: Tensor
    y_test: Tensor | None
    n_classes: int | None = None
    vocab_size: int | None = None
    input_shape: tuple[int, ...] = ()
    modality: str = "image"  # "image" | "text"
    options: dict = field(default_factory=dict)

    def split(self, which: str) -> tuple[Tensor, Tensor | None]:
        """``(x, y)`` of ``"train"``, ``"val"`` or ``"test"``."""
        return getattr(self, f"x_{which}"), getattr(self, f"y_{which}")

    def summary(self) -> dict:
        sizes = {s: int(getattr(self, f"x_{s}").shape[0]) for s in ("train", "val", "test")}
        return {"name": self.name, "task": self.task, "modality": self.modality, "sizes": sizes,
                "n_classes": self.n_classes, "vocab_size": self.vocab_size, "input_shape": list(self.input_shape)}


def split_indices(n: int, seed: int, fractions: tuple[float, float] = (0.1, 0.1)) -> tuple[np.ndarray, ...]:
    """A seeded permutation of ``range(n)`` cut into train / val / test (val, test fractions given)."""
    perm = np.random.default_rng(seed).permutation(n)
    n_val, n_test = int(round(n * fractions[0])), int(round(n * fractions[1]))
    return perm[n_val + n_test:], perm[:n_val], perm[n_val:n_val + n_test]


def split_stream(data: np.ndarray, seed: int, block: int = 1 << 16,
                 fractions: tuple[float, float] = (0.05, 0.05)) -> tuple[np.ndarray, ...]:
    """Cut a byte stream into ``block``-sized chunks and assign them to train/val/test by a seeded
    permutation (at least one chunk each); each split keeps its chunks in original order."""
    n_blocks = max(3, -(-len(data) // block))
    block = -(-len(data) // n_blocks)
    perm = np.random.default_rng(seed).permutation(n_blocks)
    n_val = max(1, int(round(n_blocks * fractions[0])))
    n_test = max(1, int(round(n_blocks * fractions[1])))
    parts = (np.sort(perm[n_val + n_test:]), np.sort(perm[:n_val]), np.sort(perm[n_val:n_val + n_test]))
    return tuple(np.concatenate([data[i * block:(i + 1) * block] for i in p]) for p in parts)


def encode_bytes(texts: list[str], length: int) -> np.ndarray:
    """UTF-8 bytes of each text, truncated / right-padded with 0 to ``length``: ``(N, length)`` uint8."""
    out = np.zeros((len(texts), length), dtype=np.uint8)
    for i, t in enumerate(texts):
        b = np.frombuffer(t.encode("utf-8")[:length], dtype=np.uint8)
        out[i, :len(b)] = b
    return out


def cache_dir() -> Path:
    """``$SYMALIGN_CACHE`` or ``~/.cache/symalign``."""
    return Path(os.environ.get("SYMALIGN_CACHE") or Path.home() / ".cache" / "symalign")


def cache_path(name: str, options: dict) -> Path:
    key = hashlib.sha256(json.dumps(options, sort_keys=True).encode()).hexdigest()[:12]
    return cache_dir() / f"{name}-{key}.npz"


def save_npz_atomic(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Write ``arrays`` to ``path`` via a temp file in the same directory and ``os.replace``."""
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)


def cached(name: str, options: dict, build: Callable[[], dict[str, np.ndarray]], use_cache: bool = True
           ) -> dict[str, np.ndarray]:
    """Arrays from the cache, else from ``build()`` (then cached). A corrupt cache file is rebuilt."""
    path = cache_path(name, options)
    if use_cache and path.exists():
        try:
            with np.load(path, allow_pickle=False) as z:
                return {k: z[k] for k in z.files}
        except Exception:  # corrupt / partial file from an older version: rebuild
            pass
    arrays = build()
    if use_cache:
        try:
            save_npz_atomic(path, arrays)
        except OSError:
            pass  # read-only home: work uncached
    return arrays
