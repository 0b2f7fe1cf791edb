r"""The tensors of a ``save_pretrained`` folder, read lazily and checked, knowing no model family.

:func:`open_tensors` reads the index (``model.safetensors.index.json``, if any) and each shard's header: no
tensor data. It checks, naming the file and the fix, that every shard the index lists exists and its header is
complete and covers the file exactly (a truncated or corrupt shard is refused before any work starts), that the
index names each tensor once (duplicate JSON keys are caught) and that each tensor lies in the shard the index
says (a tensor in two shards is refused).

:meth:`ShardedTensors.read` then returns copies of a few tensors (a layer) through ``safetensors.safe_open``,
which memory-maps the shard: the mapping is opened and closed around each read, so mapped pages never pile up
in the process's resident set. Each tensor read is checked for NaN/Inf. Bytes read are counted in
:attr:`ShardedTensors.bytes_read`.

:class:`StateTensors` is the same interface over a state dict already in memory, so a job can take either
source. Which tensors a *model* predicts, and the family, are the business of :mod:`symalign.checkpoint`.
"""

from __future__ import annotations

import os
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Protocol

import torch
from torch import Tensor

from symalign.device import is_out_of_memory
from symalign.errors import CheckpointError
from symalign.io.layout import DTYPES, ShardHeader, TensorInfo, read_header, weight_layout
from symalign.tolerance import all_finite

__all__ = ["TensorSource", "ShardedTensors", "StateTensors", "open_tensors", "aligned_copy"]

ALIGNMENT = 64  # bytes: torch's CPU allocator's alignment (c10's gAlignment)


def aligned_copy(t: Tensor, dtype: torch.dtype | None = None, fresh: bool = True) -> Tensor:
    """``t`` (floating tensors in ``dtype`` if given) in contiguous memory of its own starting at a multiple of
    :data:`ALIGNMENT` bytes; a copy unless ``fresh=False`` and ``t`` already is one (a tensor safetensors just
    decoded).

    Why the alignment: a BLAS kernel may sum in an order that depends on where its operand starts (MKL's float64
    matrix-vector product on an AMD EPYC differs in the last bit between 8- and 16-byte aligned ``W`` in ``W @ b``),
    and safetensors hands out tensors at any 8-byte offset. Reading every tensor to an aligned buffer makes a
    fold or rotation of the same values the same bits wherever they were read from (a shard, a row range, a
    resident state), so the in-memory and streamed engines agree bit for bit."""
    if dtype is not None and t.is_floating_point() and t.dtype != dtype:
        t = t.to(dtype, memory_format=torch.contiguous_format)  # a fresh (aligned) tensor
    elif fresh:
        t = t.clone(memory_format=torch.contiguous_format)
    if t.is_contiguous() and t.data_ptr() % ALIGNMENT == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


class TensorSource(Protocol):
    """What a job reads tensors through: their names and shapes, and copies of a few at a time."""

    @property
    def keys(self) -> list[str]: ...

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]: ...

    def read(self, names: Iterable[str], dtype: torch.dtype | None = None,
             check_finite: bool = True) -> dict[str, Tensor]: ...

    def read_rows(self, name: str, start: int, stop: int, dtype: torch.dtype | None = None,
                  check_finite: bool = True) -> Tensor: ...


@dataclass
class ShardedTensors:
    """The tensors of a folder of safetensors shards, known by their headers; read on demand (:meth:`read`).

    A tensor source: ``keys``, ``shapes``, ``dtype`` and ``read(names, dtype)`` -- the interface
    :class:`StateTensors` gives an in-memory state dict too.
    """

    path: Path
    tensors: dict[str, TensorInfo]
    shards: list[ShardHeader]
    index: dict[str, Any] | None = None  # the index JSON (``metadata`` + ``weight_map``), if sharded
    bytes_read: int = 0
    _checked: set[str] = field(default_factory=set, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def _count(self, n: int) -> None:
        """Add ``n`` to :attr:`bytes_read` (reads may come from a writer thread too)."""
        with self._lock:
            self.bytes_read += n

    @property
    def keys(self) -> list[str]:
        return list(self.tensors)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: t.shape for k, t in self.tensors.items()}

    @property
    def files(self) -> list[Path]:
        return [s.path for s in self.shards]

    @property
    def dtype(self) -> torch.dtype:
        """The most common floating dtype (by tensor count)."""
        floats = [t.dtype for t in self.tensors.values() if t.dtype.is_floating_point]
        return max(set(floats), key=floats.count) if floats else torch.float32

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors.values())

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name].shape

    def read(self, names: Iterable[str], dtype: torch.dtype | None = None,
             check_finite: bool = True) -> dict[str, Tensor]:
        """Copies of the tensors ``names`` (in ``dtype`` if given), each checked for NaN/Inf.

        Each shard involved is memory-mapped for the duration of this call only.
        """
        from safetensors import safe_open

        by_file: dict[Path, list[str]] = defaultdict(list)
        for n in names:
            by_file[self.tensors[n].file].append(n)
        out: dict[str, Tensor] = {}
        for f, group in by_file.items():
            try:
                with safe_open(str(f), framework="pt") as h:
                    for n in group:
                        t = aligned_copy(h.get_tensor(n), dtype, fresh=False)
                        self._count(self.tensors[n].nbytes)
                        if check_finite and t.is_floating_point() and not all_finite(t):
                            raise CheckpointError(f"{self.path}: tensor {n!r} contains NaN or Inf values")
                        out[n] = t
            except CheckpointError:
                raise
            except Exception as exc:  # a shard changed or broke since its header was read
                if is_out_of_memory(exc):
                    raise  # not the shard's fault: the CLI names the remedies
                raise CheckpointError(f"{f} cannot be read ({str(exc).splitlines()[0]}); re-save or re-download "
                                      "it") from None
        return out

    def read_rows(self, name: str, start: int, stop: int, dtype: torch.dtype | None = None,
                  check_finite: bool = True) -> Tensor:
        """Rows ``start:stop`` (axis 0) of one tensor, copied (in ``dtype`` if given), checked for NaN/Inf."""
        from safetensors import safe_open

        info = self.tensors[name]
        try:
            with safe_open(str(info.file), framework="pt") as h:
                t = aligned_copy(h.get_slice(name)[start:stop], dtype, fresh=False)
        except Exception as exc:
            if is_out_of_memory(exc):
                raise
            raise CheckpointError(f"{info.file} cannot be read ({str(exc).splitlines()[0]}); re-save or re-download "
                                  "it") from None
        self._count(t.numel() * info.nbytes // max(1, info.numel))
        if check_finite and t.is_floating_point() and not all_finite(t):
            raise CheckpointError(f"{self.path}: tensor {name!r} contains NaN or Inf values")
        return t

    def read_rows_into(self, name: str, start: int, stop: int, buf: Tensor) -> Tensor:
        """Rows ``start:stop`` (axis 0) of one tensor as stored, read straight into ``buf`` (any contiguous
        tensor with at least their byte count; no NaN/Inf check, no other copy). Returns a view of ``buf``
        with the rows' dtype and shape."""
        info = self.tensors[name]
        row = info.nbytes // max(1, info.shape[0]) if info.shape else info.nbytes
        n = (stop - start) * row if info.shape else info.nbytes
        raw = buf.view(-1).view(torch.uint8)
        if raw.numel() < n:
            raise ValueError(f"buffer of {raw.numel()} bytes for {n} bytes of {name!r}")
        sh = next(s for s in self.shards if s.path == info.file)
        view = memoryview(raw.numpy())[:n]
        off = 8 + sh.header_len + info.start + (start * row if info.shape else 0)
        with open(info.file, "rb", buffering=0) as f:
            while len(view):
                got = os.preadv(f.fileno(), [view], off)
                if got <= 0:
                    raise CheckpointError(f"{info.file} is truncated (tensor {name!r}); re-save or re-download it")
                view, off = view[got:], off + got
        self._count(n)
        return raw[:n].view(info.dtype).view((stop - start, *info.shape[1:]) if info.shape else ())

    def read_raw(self, name: str) -> bytes:
        """The stored bytes of one tensor (no decoding)."""
        info = self.tensors[name]
        sh = next(s for s in self.shards if s.path == info.file)
        with open(info.file, "rb") as f:
            f.seek(8 + sh.header_len + info.start)
            data = f.read(info.nbytes)
        if len(data) != info.nbytes:
            raise CheckpointError(f"{info.file} is truncated (tensor {name!r}); re-save or re-download it")
        self._count(info.nbytes)
        return data



@dataclass
class StateTensors:
    """A state dict in memory as a tensor source (:class:`TensorSource`): ``read`` returns copies."""

    state: Mapping[str, Tensor]
    path: Path | str = "<memory>"

    @property
    def keys(self) -> list[str]:
        return list(self.state)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v.shape) for k, v in self.state.items()}

    def read_rows(self, name: str, start: int, stop: int, dtype: torch.dtype | None = None,
                  check_finite: bool = True) -> Tensor:
        """Rows ``start:stop`` (axis 0) of one tensor, copied (in ``dtype`` if given), checked for NaN/Inf."""
        t = aligned_copy(self.state[name][start:stop], dtype)
        if check_finite and t.is_floating_point() and not all_finite(t):
            raise CheckpointError(f"{self.path}: tensor {name!r} contains NaN or Inf values")
        return t

    def read(self, names: Iterable[str], dtype: torch.dtype | None = None,
             check_finite: bool = True) -> dict[str, Tensor]:
        """Copies of ``names`` (in ``dtype`` if given, for floating tensors), each checked for NaN/Inf."""
        out: dict[str, Tensor] = {}
        for n in names:
            t = aligned_copy(self.state[n], dtype)
            if check_finite and t.is_floating_point() and not all_finite(t):
                raise CheckpointError(f"{self.path}: tensor {n!r} contains NaN or Inf values")
            out[n] = t
        return out


def tensor_table(path: str | os.PathLike) -> tuple[dict[str, TensorInfo], list[ShardHeader], dict[str, Any] | None]:
    """The tensor directory of a checkpoint folder, its shard headers and its index, validated (module docstring)."""
    path = Path(path)
    files, index, wm = weight_layout(path)
    shards = [read_header(f) for f in files]
    tensors: dict[str, TensorInfo] = {}
    for sh in shards:
        for name, e in sh.entries.items():
            if name in tensors:
                raise CheckpointError(f"{sh.path} repeats tensor {name!r} of {tensors[name].file.name}; keep one "
                                      "copy and fix the index")
            if wm is not None and wm.get(name) != sh.path.name:
                where = f"in {wm[name]}" if name in wm else "absent"
                raise CheckpointError(f"{sh.path} holds tensor {name!r} but the index says it is {where}; "
                                      "regenerate the index")
            tensors[name] = TensorInfo(name, sh.path, DTYPES[e["dtype"]], tuple(int(s) for s in e["shape"]),
                                       *(int(x) for x in e["data_offsets"]))
    if wm is not None:
        missing = [n for n in wm if n not in tensors]
        if missing:
            raise CheckpointError(f"{path / wm[missing[0]]} lacks tensor {missing[0]!r} that the index lists; "
                                  "the shard is incomplete")
    return tensors, shards, index


def open_tensors(path: str | os.PathLike) -> ShardedTensors:
    """The safetensors of folder ``path`` as a lazy, validated :class:`ShardedTensors`."""
    tensors, shards, index = tensor_table(path)
    return ShardedTensors(Path(path), tensors, shards, index)
