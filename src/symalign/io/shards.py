r"""Streamed, atomic writing of a checkpoint laid out exactly like another one (B).

:class:`ShardWriter` writes OUT with B's shard files: the same file names, the same
tensors in each, the same header bytes (names, dtypes, shapes and offsets, copied
verbatim), the same ``model.safetensors.index.json``, and every non-weight file of
B (config, tokenizer, generation config...). Tensors arrive one at a time in any
order (:meth:`ShardWriter.put`, :meth:`ShardWriter.copy`) and are written at their
offsets, so only the tensor being written is in memory.

Atomicity. Each shard is created as an *anonymous* file (``O_TMPFILE``) in OUT's
parent folder: it has no name until the end, so a run killed at any point (even by
``SIGKILL``) leaves nothing behind -- the kernel frees the space. When every tensor
is written, :meth:`ShardWriter.stage` gives the shards names inside a temporary
sibling folder ``.OUT.tmp-*`` together with B's other files, and
:func:`symalign.io.folder.commit` renames that folder to OUT. Where ``O_TMPFILE`` is not
supported the shards are named temporary files inside that folder from the start
(removed on any Python-level failure).
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import Tensor

from symalign.atomic import fix_modes, make_temp_dir
from symalign.io.layout import INDEX_NAME, ST_NAMES, TensorInfo, tensor_bytes
from symalign.io.tensors import ShardedTensors
from symalign.io.folder import copy_non_weights
from symalign.errors import CheckpointError, SymalignError
from symalign.tolerance import all_finite

__all__ = ["ShardWriter", "tensor_bytes"]

_AT_FDCWD = -100
_AT_SYMLINK_FOLLOW = 0x400


def _anonymous_file(folder: Path) -> int | None:
    """A nameless file in ``folder`` (``O_TMPFILE``), or ``None`` where unsupported."""
    flag = getattr(os, "O_TMPFILE", None)
    if flag is None:
        return None
    try:
        return os.open(folder, flag | os.O_RDWR, 0o644)
    except OSError:
        return None


def _link(fd: int, dest: Path) -> None:
    """Give the anonymous file ``fd`` the name ``dest`` (``linkat`` through ``/proc/self/fd``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    src = f"/proc/self/fd/{fd}".encode()
    if libc.linkat(_AT_FDCWD, src, _AT_FDCWD, str(dest).encode(), _AT_SYMLINK_FOLLOW) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"cannot link the written shard to {dest}: {os.strerror(err)}")


class ShardWriter:
    """Write OUT shard by shard in B's layout (see the module docstring)."""

    def __init__(self, out: str | os.PathLike, like: ShardedTensors,
                 extra: Mapping[str, tuple[torch.dtype, tuple[int, ...]]] | None = None):
        """``extra``: tensors B lacks (name -> dtype, shape; e.g. a head the rewrite unties), appended to B's
        last shard file (by name, as :func:`symalign.io.folder.write_tensors` places a new tensor):
        that file gets a new header (B's entries, then these at the end of its data section) and the index,
        if any, names them."""
        self.out = Path(out).resolve()
        self.like = like
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self._fds: dict[Path, int] = {}
        self._named: Path | None = None  # the temporary folder, when anonymous files are unavailable
        self._infos: dict[str, TensorInfo] = dict(like.tensors)
        self._heads: dict[Path, tuple[bytes | None, int, int]] = {
            sh.path: (None, sh.header_len, sh.size) for sh in like.shards}  # header (None: B's), its length, size
        self.extra = dict(extra or {})
        if self.extra:
            self._append(sorted(like.shards, key=lambda sh: sh.path.name)[-1])
        self._pending = set(self._infos)
        self.bytes_written = 0
        try:
            for sh in like.shards:
                fd = _anonymous_file(self.out.parent)
                if fd is None:
                    if self._named is None:
                        self._named = make_temp_dir(self.out.parent, f".{self.out.name}.tmp-")
                    fd = os.open(self._named / sh.path.name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
                self._fds[sh.path] = fd
                head, header_len, size = self._heads[sh.path]
                os.ftruncate(fd, size)
                if head is None:
                    with open(sh.path, "rb") as f:
                        head = f.read(8 + header_len)
                os.pwrite(fd, head, 0)
        except BaseException:
            self.abort()
            raise

    def _append(self, sh) -> None:
        """The header of shard ``sh`` with :attr:`extra` appended to its data section (module docstring)."""
        data = sh.size - 8 - sh.header_len
        entries: dict[str, Any] = {"__metadata__": sh.metadata} if sh.metadata is not None else {}
        entries.update(sh.entries)
        for name, (dtype, shape) in self.extra.items():
            if name in self._infos:
                raise SymalignError(f"internal error: the output already has a tensor {name!r}")
            n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
            entries[name] = {"dtype": ST_NAMES[dtype], "shape": list(shape), "data_offsets": [data, data + n]}
            self._infos[name] = TensorInfo(name, sh.path, dtype, tuple(shape), data, data + n)
            data += n
        text = json.dumps(entries, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # safetensors pads the header to 8 bytes
        self._heads[sh.path] = (len(text).to_bytes(8, "little") + text, len(text), 8 + len(text) + data)

    def _info(self, name: str) -> TensorInfo:
        if name not in self._infos:
            raise SymalignError(f"internal error: the output has no tensor {name!r}")
        return self._infos[name]

    def _write(self, info: TensorInfo, data: memoryview | bytes) -> None:
        if len(data) != info.nbytes:
            raise SymalignError(f"internal error: tensor {info.name!r} has {len(data)} bytes, expected {info.nbytes}")
        fd = self._fds[info.file]
        off, view = 8 + self._heads[info.file][1] + info.start, memoryview(data)
        while len(view):
            n = os.pwrite(fd, view, off)
            view, off = view[n:], off + n
        self._pending.discard(info.name)
        self.bytes_written += info.nbytes

    def put(self, name: str, t: Tensor) -> None:
        """Write tensor ``name`` (cast to B's dtype for it; its shape must be B's)."""
        info = self._info(name)
        if tuple(t.shape) != info.shape:
            raise SymalignError(f"internal error: tensor {name!r} has shape {tuple(t.shape)}, B has {info.shape}")
        self._write(info, tensor_bytes(t.to(info.dtype)))

    def put_rows(self, name: str, start: int, t: Tensor) -> None:
        """Write rows ``start:start + len(t)`` (axis 0) of tensor ``name``; the tensor counts as written
        when its last row is."""
        info = self._info(name)
        if tuple(t.shape[1:]) != info.shape[1:] or start + t.shape[0] > info.shape[0]:
            raise SymalignError(f"internal error: rows {start}..{start + t.shape[0]} of {name!r} do not fit "
                                f"{info.shape}")
        row = info.nbytes // max(1, info.shape[0])
        data = tensor_bytes(t.to(info.dtype))
        off, view = 8 + self._heads[info.file][1] + info.start + start * row, data
        while len(view):
            n = os.pwrite(self._fds[info.file], view, off)
            view, off = view[n:], off + n
        self.bytes_written += len(data)
        if start + t.shape[0] == info.shape[0]:
            self._pending.discard(name)

    def copy(self, name: str, check_finite: bool = True) -> None:
        """Copy B's tensor ``name`` unchanged (its bytes, checked for NaN/Inf)."""
        info = self._info(name)
        data = self.like.read_raw(name)
        if check_finite and info.dtype.is_floating_point and info.numel:
            t = torch.frombuffer(bytearray(data), dtype=info.dtype)
            if not all_finite(t):
                raise CheckpointError(f"{self.like.path}: tensor {name!r} contains NaN or Inf values")
            del t
        self._write(info, data)

    @property
    def pending(self) -> set[str]:
        return set(self._pending)

    def stage(self, config_edits: Mapping[str, Any] | None = None, marker: Mapping[str, Any] | None = None) -> Path:
        """Name the shards inside a temporary sibling folder of OUT with B's other files (B's own
        ``symalign.json`` replaced by ``{"tool": "symalign", **marker}``, modes from the umask);
        return the folder."""
        if self._pending:
            raise SymalignError(f"internal error: {len(self._pending)} tensors were not written "
                                f"(e.g. {sorted(self._pending)[0]!r})")
        tmp = self._named or make_temp_dir(self.out.parent, f".{self.out.name}.tmp-")
        self._named = tmp
        try:
            for src, fd in self._fds.items():
                os.fsync(fd)
                if not (tmp / src.name).exists():
                    _link(fd, tmp / src.name)
            self.close()
            if (self.like.path / INDEX_NAME).is_file() and self.extra:
                index = json.loads((self.like.path / INDEX_NAME).read_text())
                for name in self.extra:
                    info = self._infos[name]
                    index.setdefault("weight_map", {})[name] = info.file.name
                    meta = index.setdefault("metadata", {})
                    meta["total_size"] = int(meta.get("total_size", 0)) + info.nbytes
                index["weight_map"] = dict(sorted(index["weight_map"].items()))
                (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2))
            elif (self.like.path / INDEX_NAME).is_file():
                shutil.copy2(self.like.path / INDEX_NAME, tmp / INDEX_NAME)
            copy_non_weights(self.like.path, tmp, config_edits, marker)
            fix_modes(tmp)
        except BaseException:
            self.abort()
            raise
        return tmp

    def close(self) -> None:
        for fd in self._fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds = {}

    def abort(self) -> None:
        """Drop everything written (anonymous shards vanish when closed)."""
        self.close()
        if self._named is not None:
            shutil.rmtree(self._named, ignore_errors=True)
            self._named = None
