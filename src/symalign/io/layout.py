r"""The safetensors files of a Hugging Face checkpoint: which files, which tensor where, header checks.

A ``save_pretrained`` folder holds its weights either in one ``model.safetensors`` or in
shards listed by ``model.safetensors.index.json`` (``{"metadata": {...}, "weight_map":
{tensor: shard file}}``). A safetensors file is ``u64 little-endian N``, ``N`` bytes of
JSON ``{name: {dtype, shape, data_offsets: [start, end]}, "__metadata__": {...}}``, then
the data section.

:func:`weight_layout` finds the files (a listed shard that is missing is named);
:func:`read_header` parses one header and checks that its data section covers the file
exactly (a truncated or corrupt file is refused before any tensor is read);
:func:`read_index` refuses an index that names a tensor twice. Nothing here reads
tensor data.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from symalign.errors import CheckpointError

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
    """Parse a safetensors header and check that the data section covers the file exactly (module docstring)."""
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


class _DuplicateKey(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for k, v in pairs:
        if k in seen:
            raise _DuplicateKey(k)
        seen[k] = v
    return seen


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


def weight_layout(path: Path) -> tuple[list[Path], dict[str, Any] | None, dict[str, str] | None]:
    """The shard files of a checkpoint (in index order), the index JSON (sharded) and its weight map."""
    path = Path(path)
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


def shard_map(like: Path) -> dict[str, str] | None:
    """A checkpoint's tensor -> shard file map, or ``None`` for a single ``model.safetensors``."""
    index = Path(like) / INDEX_NAME
    return dict(read_index(index)) if index.is_file() else None


def tensor_bytes(t: Tensor) -> memoryview:
    """The little-endian bytes of a (CPU) tensor, as safetensors stores them."""
    flat = t.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(np.zeros(0, np.uint8))
