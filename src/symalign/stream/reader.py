r"""Lazy, validated reading of ``save_pretrained`` safetensors checkpoints (single file or sharded).

:func:`open_checkpoint` reads only ``config.json``, the index
(``model.safetensors.index.json``, if any) and each shard's header: no tensor data.
It checks, naming the file and the fix, that

* every shard the index lists exists, and its header is complete and covers the
  file exactly (a truncated or corrupt shard is refused before any work starts);
* the index names each tensor once (duplicate JSON keys are caught) and each
  tensor lies in the shard the index says (a tensor in two shards is refused);
* every tensor the config predicts is present with the predicted shape (the model
  is built on the meta device: no memory), and no other tensor is.

:meth:`LazyCheckpoint.read` then returns copies of a few tensors (a layer) through
``safetensors.safe_open``, which memory-maps the shard: the mapping is opened and
closed around each read, so mapped pages never pile up in the process's resident
set. Each tensor read is checked for NaN/Inf. Bytes read are counted in
:attr:`LazyCheckpoint.bytes_read`.
"""

from __future__ import annotations

import json
import os
import struct
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch
from torch import Tensor

from symalign.errors import CheckpointError
from symalign.families import get_adapter
from symalign.hf_io import check_same_layout, expected_shapes, load_config
from symalign.match.inputs import all_finite

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"

DTYPES: dict[str, torch.dtype] = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                                  "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
                                  "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
ST_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies: its shard, dtype, shape and byte range in the shard's data section."""

    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass
class ShardHeader:
    """A safetensors file's header: tensor entries (in file order), metadata, header length, file size."""

    path: Path
    entries: dict[str, dict[str, Any]]
    metadata: dict[str, str] | None
    header_len: int
    size: int


def read_header(path: Path) -> ShardHeader:
    """Parse a safetensors header and check that the data section covers the file exactly.

    Format: ``u64 little-endian N``, ``N`` bytes of JSON
    ``{name: {dtype, shape, data_offsets: [start, end]}, "__metadata__": {...}}``, then the data.
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError("shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", raw)
            if n > min(size - 8, 100_000_000):
                raise ValueError(f"header length {n} exceeds the file")
            header = json.loads(f.read(n))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is truncated or not a safetensors file ({exc}); re-save or re-download "
                              "it") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path} is not a safetensors file (its header is not a JSON object)")
    meta = header.pop("__metadata__", None)
    end = 0
    for name, e in header.items():
        try:
            dt = DTYPES[e["dtype"]]
            shape = [int(s) for s in e["shape"]]
            s0, s1 = (int(x) for x in e["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry; the file is corrupt") \
                from None
        numel = 1
        for s in shape:
            numel *= s
        if s1 - s0 != numel * torch.empty((), dtype=dt).element_size() or s0 < 0:
            raise CheckpointError(f"{path}: tensor {name!r} has {s1 - s0} bytes for shape {shape}; the file is "
                                  "corrupt")
        end = max(end, s1)
    if 8 + n + end != size:
        what = "truncated" if 8 + n + end > size else "longer than its header says"
        raise CheckpointError(f"{path} is {what} ({size} bytes, header describes {8 + n + end}); re-save or "
                              "re-download it")
    return ShardHeader(path, header, meta, n, size)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for k, v in pairs:
        if k in seen:
            raise _DuplicateKey(k)
        seen[k] = v
    return seen


class _DuplicateKey(ValueError):
    pass


def read_index(path: Path) -> dict[str, str]:
    """``weight_map`` of an index file; a tensor named twice is refused."""
    try:
        data = json.loads(path.read_text(), object_pairs_hook=_no_duplicates)
        wm = data["weight_map"]
        if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
            raise ValueError("weight_map is not a mapping of tensor names to file names")
    except _DuplicateKey as exc:
        raise CheckpointError(f"{path} names tensor {exc.args[0]!r} twice; fix or regenerate the index") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path} is not a valid safetensors index: {exc}") from None
    return wm


@dataclass
class LazyCheckpoint:
    """A checkpoint known by its headers; tensors are read on demand (:meth:`read`)."""

    path: Path
    config: Any
    adapter: Any
    tensors: dict[str, TensorInfo]
    shards: list[ShardHeader]
    index: dict[str, Any] | None = None  # the index JSON (``metadata`` + ``weight_map``), if sharded
    bytes_read: int = 0
    _checked: set[str] = field(default_factory=set, repr=False)

    @property
    def keys(self) -> list[str]:
        return list(self.tensors)

    @property
    def dtype(self) -> torch.dtype:
        """The most common floating dtype (by tensor count), as :class:`symalign.hf_io.Checkpoint`."""
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
                        t = h.get_tensor(n)
                        t = t.to(dtype) if dtype is not None and t.is_floating_point() else t.clone()
                        self.bytes_read += self.tensors[n].nbytes
                        if check_finite and t.is_floating_point() and not all_finite(t):
                            raise CheckpointError(f"{self.path}: tensor {n!r} contains NaN or Inf values")
                        out[n] = t
            except CheckpointError:
                raise
            except Exception as exc:  # a shard changed or broke since its header was read
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
                t = h.get_slice(name)[start:stop]
                t = t.to(dtype) if dtype is not None and t.is_floating_point() else t.clone()
        except Exception as exc:
            raise CheckpointError(f"{info.file} cannot be read ({str(exc).splitlines()[0]}); re-save or re-download "
                                  "it") from None
        self.bytes_read += t.numel() * info.nbytes // max(1, info.numel)
        if check_finite and t.is_floating_point() and not all_finite(t):
            raise CheckpointError(f"{self.path}: tensor {name!r} contains NaN or Inf values")
        return t

    def read_raw(self, name: str) -> bytes:
        """The stored bytes of one tensor (no decoding)."""
        info = self.tensors[name]
        sh = next(s for s in self.shards if s.path == info.file)
        with open(info.file, "rb") as f:
            f.seek(8 + sh.header_len + info.start)
            data = f.read(info.nbytes)
        if len(data) != info.nbytes:
            raise CheckpointError(f"{info.file} is truncated (tensor {name!r}); re-save or re-download it")
        self.bytes_read += info.nbytes
        return data


def weight_layout(path: Path) -> tuple[list[Path], dict[str, Any] | None, dict[str, str] | None]:
    """The shard files of a checkpoint, the index JSON (sharded) and its weight map."""
    index = path / INDEX_NAME
    if index.is_file():
        wm = read_index(index)
        data = json.loads(index.read_text())
        files = []
        for s in dict.fromkeys(wm.values()):
            f = path / s
            if not f.is_file():
                raise CheckpointError(f"{f} is missing (listed in {index}); restore the shard or re-save the model")
            files.append(f)
        return files, data, wm
    single = path / WEIGHTS_NAME
    if not single.is_file():
        others = sorted(p.name for p in path.iterdir() if p.name.endswith((".bin", ".pt", ".pth")))
        hint = f" (found {', '.join(others)}: re-save with safe_serialization=True)" if others else ""
        raise CheckpointError(f"{single} is missing{hint}")
    return [single], None, None


def open_checkpoint(path: str | os.PathLike, check_shapes: bool = True) -> LazyCheckpoint:
    """Config, adapter and tensor directory of a checkpoint, validated (see the module docstring)."""
    path = Path(path)
    config = load_config(path)
    adapter = get_adapter(config)
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
    ck = LazyCheckpoint(path, config, adapter, tensors, shards, index)
    if check_shapes:
        check_against_config(ck)
    return ck


def check_against_config(ck: LazyCheckpoint) -> None:
    """Every tensor the config predicts is present with its shape, and no other (headers only)."""

    shapes, tied = expected_shapes(ck.adapter, ck.config)
    for name, info in ck.tensors.items():
        if name not in shapes:
            raise CheckpointError(f"{ck.path}: tensor {name!r} is not part of the model config.json describes")
        if info.shape != shapes[name]:
            raise CheckpointError(f"{ck.path}: tensor {name!r} has shape {info.shape} but config.json implies "
                                  f"{shapes[name]} (config and weights do not match)")
    missing = sorted(set(shapes) - set(ck.tensors) - tied)
    if missing:
        raise CheckpointError(f"{ck.path}: tensor {missing[0]!r} is missing from the weights "
                              f"({len(missing)} missing in all)")


def check_same_architecture(a: LazyCheckpoint, b: LazyCheckpoint) -> None:
    """Refuse two checkpoints of different families, head structures, tensor names or shapes (headers only;
    :func:`symalign.hf_io.check_same_layout`)."""
    check_same_layout(a.path, a.config, {k: t.shape for k, t in a.tensors.items()},
                      b.path, b.config, {k: t.shape for k, t in b.tensors.items()})
