r"""Where a job puts the tensors it computes: a sink, beside the source it reads (:mod:`symalign.checkpoint.lazy`).

A sink takes tensors one at a time, in any order: :meth:`put` (a whole tensor), :meth:`put_rows` (rows
``start:start + len(t)`` of a tensor, axis 0), :meth:`copy` (the reference's tensor as it is), and
:meth:`abort` (drop everything). Two implementations:

* :class:`~symalign.io.shards.ShardWriter` writes OUT in the reference's shard layout, atomically (streamed);
* :class:`StateSink` collects a state dict in memory (the in-memory path, and ``merge``, which averages it).

Nothing here knows a family; a job decides what goes in, and checks what it wrote.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol

import torch
from torch import Tensor

from symalign.errors import SymalignError

__all__ = ["TensorSink", "StateSink"]


class TensorSink(Protocol):
    """What a job writes its output through (see the module docstring)."""

    bytes_written: int

    def put(self, name: str, t: Tensor) -> None: ...

    def put_rows(self, name: str, start: int, t: Tensor) -> None: ...

    def copy(self, name: str, check_finite: bool = True) -> None: ...

    def abort(self) -> None: ...


class StateSink:
    """A sink collecting a state dict in memory (:attr:`state`), its tensors laid out like ``like``'s.

    ``like``: the reference source (``tensors``: dtype and shape of each name; ``read``: for :meth:`copy`);
    ``extra``: tensors the reference lacks (name -> dtype, shape), which only :meth:`put_rows` needs to know.
    A copied tensor is the reference's own tensor object when the reference is resident (no copy is made:
    nothing in OUT changes it afterwards), else a read copy.
    """

    def __init__(self, like: Any, extra: Mapping[str, tuple[torch.dtype, tuple[int, ...]]] | None = None):
        self.like = like
        self.extra = dict(extra or {})
        self.state: dict[str, Tensor] = {}
        self.bytes_written = 0

    def _count(self, t: Tensor) -> None:
        self.bytes_written += t.numel() * t.element_size()

    def _layout(self, name: str) -> tuple[torch.dtype, tuple[int, ...]] | None:
        if name in self.extra:
            return self.extra[name]
        info = self.like.tensors.get(name)
        return None if info is None else (info.dtype, tuple(info.shape))

    def put(self, name: str, t: Tensor) -> None:
        """Tensor ``name``, cast to the reference's dtype for it (as :meth:`ShardWriter.put`)."""
        lay = self._layout(name)
        if lay is not None:
            if tuple(t.shape) != lay[1]:
                raise SymalignError(f"internal error: tensor {name!r} has shape {tuple(t.shape)}, B has {lay[1]}")
            t = t.to(lay[0])
        self.state[name] = t
        self._count(t)

    def put_rows(self, name: str, start: int, t: Tensor) -> None:
        """Rows ``start:start + t.shape[0]`` of ``name`` (its full tensor allocated on the first rows)."""
        if name not in self.state:
            lay = self._layout(name)
            if lay is None:
                raise SymalignError(f"internal error: the output has no tensor {name!r}")
            self.state[name] = torch.empty(lay[1], dtype=lay[0])
        dest = self.state[name]
        dest[start:start + t.shape[0]] = t
        self.bytes_written += t.numel() * dest.element_size()  # as stored (as ShardWriter counts)

    def copy(self, name: str, check_finite: bool = True) -> None:
        state = getattr(self.like, "state", None)
        t = state[name] if state is not None else self.like.read([name], check_finite=check_finite)[name]
        self.put(name, t)

    def abort(self) -> None:
        self.state.clear()
