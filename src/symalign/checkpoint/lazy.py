r"""A Hugging Face checkpoint as a tensor source with its config and family: opened lazily, or resident.

:func:`open_checkpoint` reads only ``config.json``, the index (if any) and each shard's header: no tensor data.
Beyond the file checks of :func:`symalign.io.tensors.open_tensors` it checks, naming the file and the fix, that
every tensor the config predicts is present with the predicted shape (the model is built on the meta device: no
memory), and no other tensor is. Loading a whole checkpoint (:func:`symalign.checkpoint.hf.load_checkpoint`) is
opening it and reading every tensor.

:class:`ResidentCheckpoint` is the same interface over a state dict already in memory (a loaded checkpoint):
the jobs take either source (:func:`symalign.stream.attention.align_attention`,
:class:`symalign.stream.model.StreamedWhole`), so keeping the weights resident is a choice of source, not a
second implementation.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
from torch import Tensor

from symalign.checkpoint.config import check_same_architecture, check_shapes, load_config
from symalign.families import get_adapter
from symalign.io.layout import TensorInfo
from symalign.io.tensors import ShardedTensors, StateTensors, tensor_table

__all__ = ["LazyCheckpoint", "ResidentCheckpoint", "open_checkpoint", "check_against_config",
           "check_same_architecture"]


@dataclass
class LazyCheckpoint(ShardedTensors):
    """A checkpoint's lazily read tensors with its transformers ``config`` and family ``adapter``."""

    config: Any = None
    adapter: Any = None


class ResidentCheckpoint(StateTensors):
    """A checkpoint held in memory behind :class:`LazyCheckpoint`'s interface: ``keys``, ``tensors`` (name ->
    :class:`~symalign.io.layout.TensorInfo`: dtype, shape, ``numel``, ``nbytes``), ``shapes``, ``dtype``,
    ``nbytes``, ``read(names, dtype)`` and ``read_rows`` (copies, as a lazy read returns), ``bytes_read`` (bytes
    handed out), ``config`` and ``adapter``. ``checked``: the state was already checked for NaN/Inf when loaded
    (:func:`symalign.checkpoint.hf.load_checkpoint`), so reads skip that check."""

    def __init__(self, path: str | os.PathLike, state: Mapping[str, Tensor], config: Any = None, adapter: Any = None,
                 checked: bool = False):
        super().__init__(state, Path(path))
        self.config, self.adapter, self.checked = config, adapter, checked
        self.tensors = {n: TensorInfo(n, self.path, t.dtype, tuple(t.shape), 0, t.numel() * t.element_size())
                        for n, t in state.items()}
        self.shards: list = []
        self.bytes_read = 0

    @classmethod
    def of(cls, ck: Any) -> "ResidentCheckpoint":
        """A loaded :class:`~symalign.checkpoint.hf.HFCheckpoint` (``path``, ``state``, ``config``, ``adapter``)."""
        return cls(ck.path, ck.state, ck.config, ck.adapter, checked=True)

    dtype = ShardedTensors.dtype
    nbytes = ShardedTensors.nbytes
    numel = ShardedTensors.numel

    def read(self, names: Iterable[str], dtype: torch.dtype | None = None,
             check_finite: bool = True) -> dict[str, Tensor]:
        """Copies of ``names`` (in ``dtype`` if given), as :meth:`ShardedTensors.read`."""
        out = super().read(names, dtype, check_finite and not self.checked)
        self.bytes_read += sum(self.tensors[n].nbytes for n in out)
        return out

    def read_rows(self, name: str, start: int, stop: int, dtype: torch.dtype | None = None,
                  check_finite: bool = True) -> Tensor:
        """Rows ``start:stop`` (axis 0) of one tensor, copied, as :meth:`ShardedTensors.read_rows`."""
        t = super().read_rows(name, start, stop, dtype, check_finite and not self.checked)
        self.bytes_read += t.numel() * self.state[name].element_size()
        return t


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
