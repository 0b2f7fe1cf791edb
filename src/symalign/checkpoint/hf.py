"""Loading a whole Hugging Face ``save_pretrained`` checkpoint into memory, validated.

:func:`load_checkpoint` opens the checkpoint lazily (:func:`symalign.checkpoint.lazy.open_checkpoint`:
config, index and shard headers checked, every tensor's name and shape checked against
what the config predicts) and then reads every tensor (each checked for NaN/Inf). A
missing or truncated file names the file; a tensor the config does not predict, one
that is missing, or a non-finite one is named. The model is never instantiated with
real weights.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from symalign.arch import Adapter
from symalign.checkpoint.config import check_same_architecture, check_shapes
from symalign.checkpoint.lazy import open_checkpoint
from symalign.errors import CheckpointError
from symalign.tolerance import all_finite

__all__ = ["HFCheckpoint", "load_checkpoint", "validate", "check_same_architecture"]


@dataclass
class HFCheckpoint:
    """A loaded checkpoint: its directory, transformers config, adapter, state dict and weight files."""

    path: Path
    config: Any
    adapter: Adapter
    state: dict[str, Tensor]
    files: list[Path]

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.shape) for k, v in self.state.items()}

    @property
    def dtype(self) -> torch.dtype:
        floats = [t.dtype for t in self.state.values() if t.is_floating_point()]
        return max(set(floats), key=floats.count) if floats else torch.float32

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state.values())

    @property
    def numel(self) -> int:
        return sum(t.numel() for t in self.state.values())


def validate(ckpt: HFCheckpoint, check_finite: bool = True) -> None:
    """Raise :class:`CheckpointError` naming the first tensor the config does not predict, or non-finite."""
    check_shapes(ckpt.path, ckpt.adapter, ckpt.config, ckpt.shapes)
    if check_finite:
        for name, t in ckpt.state.items():
            if t.is_floating_point() and not all_finite(t):
                raise CheckpointError(f"{ckpt.path}: tensor {name!r} contains NaN or Inf values")


def load_checkpoint(path: str | os.PathLike, check: bool = True) -> HFCheckpoint:
    """Config + state dict of a ``save_pretrained`` directory, validated (module docstring);
    ``check=False`` skips the shape and NaN/Inf checks (the files are still checked)."""
    lazy = open_checkpoint(path, check_shapes=check)
    state = lazy.read(lazy.keys, check_finite=check)
    return HFCheckpoint(lazy.path, lazy.config, lazy.adapter, state, lazy.files)
