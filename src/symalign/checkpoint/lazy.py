r"""A Hugging Face checkpoint opened lazily: its tensors (:mod:`symalign.io.tensors`), config and family.

:func:`open_checkpoint` reads only ``config.json``, the index (if any) and each shard's header: no tensor data.
Beyond the file checks of :func:`symalign.io.tensors.open_tensors` it checks, naming the file and the fix, that
every tensor the config predicts is present with the predicted shape (the model is built on the meta device: no
memory), and no other tensor is. Loading a whole checkpoint (:func:`symalign.checkpoint.hf.load_checkpoint`) is
opening it and reading every tensor.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from symalign.checkpoint.config import check_same_architecture, check_shapes, load_config
from symalign.families import get_adapter
from symalign.io.tensors import ShardedTensors, tensor_table

__all__ = ["LazyCheckpoint", "open_checkpoint", "check_against_config", "check_same_architecture"]


@dataclass
class LazyCheckpoint(ShardedTensors):
    """A checkpoint's lazily read tensors with its transformers ``config`` and family ``adapter``."""

    config: Any = None
    adapter: Any = None


def open_checkpoint(path: str | os.PathLike, check_shapes: bool = True) -> LazyCheckpoint:
    """Config, adapter and tensor directory of a checkpoint, validated (see the module docstring)."""
    path = Path(path)
    config = load_config(path)
    adapter = get_adapter(config)
    tensors, shards, index = tensor_table(path)
    ck = LazyCheckpoint(path, tensors, shards, index, config=config, adapter=adapter)
    if check_shapes:
        check_against_config(ck)
    return ck


def check_against_config(ck: LazyCheckpoint) -> None:
    """Every tensor the config predicts is present with its shape, and no other (headers only)."""
    check_shapes(ck.path, ck.adapter, ck.config, ck.shapes)
