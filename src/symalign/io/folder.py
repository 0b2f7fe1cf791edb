r"""Output folders, knowing no model family: checks, the ``symalign.json`` marker, staging and the atomic commit.

An output is staged complete in a temporary sibling folder of OUT (:func:`stage_tensors`: the reference's
non-weight files, the tensors in the reference's shard layout, the marker) and renamed into place
(:func:`commit`); a failure removes the temporary folder (:func:`discard`) and leaves any previous OUT as it was.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from torch import Tensor

from symalign.atomic import check_writable, fix_modes, make_temp_dir
from symalign.errors import CheckpointError
from symalign.io.layout import INDEX_NAME, WEIGHTS_NAME, shard_map

MARKER_NAME = "symalign.json"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".safetensors.index.json",
                   ".bin.index.json")


def _inside(child: Path, parent: Path) -> bool:
    return child == parent or parent in child.parents


def check_output_dir(out: str | os.PathLike, inputs: Iterable[str | os.PathLike], force: bool) -> Path:
    """Refuse an output directory that exists (unless ``force``; never one symalign did not write), overlaps
    an input directory, or lies where nothing can be written (:func:`symalign.atomic.check_writable`)."""
    out_r = Path(out).resolve()
    for src in inputs:
        src_r = Path(src).resolve()
        if _inside(out_r, src_r):
            raise CheckpointError(f"the output directory {out} is inside the input directory {src}; pick another")
        if _inside(src_r, out_r):
            raise CheckpointError(f"the input directory {src} is inside the output directory {out}; pick another")
    if out_r.exists() and not out_r.is_dir():
        raise CheckpointError(f"{out} is an existing file, not a folder; pick another output folder")
    if out_r.exists() and not force:
        raise CheckpointError(f"{out} already exists; pass --force to replace it")
    if out_r.exists() and not is_symalign_output(out_r):
        raise CheckpointError(f"{out} exists and is not an output of symalign (no {MARKER_NAME}); --force only "
                              "replaces symalign's own outputs: remove it yourself or pick another folder")
    check_writable(out_r.parent, f"output folder {out}")  # OUT is built beside itself, then renamed
    return out_r


def is_symalign_output(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder symalign wrote (it holds the marker file :data:`MARKER_NAME`)."""
    return (Path(path) / MARKER_NAME).is_file()


def read_marker(path: str | os.PathLike) -> dict[str, Any]:
    """The metadata symalign recorded in an output folder (``{}`` for any other checkpoint)."""
    f = Path(path) / MARKER_NAME
    if not f.is_file():
        return {}
    try:
        obj = json.loads(f.read_text())
    except (OSError, ValueError):
        return {}
    return obj if isinstance(obj, dict) else {}


def is_weight_file(name: str) -> bool:
    return name.endswith(WEIGHT_SUFFIXES)


def copy_non_weights(like: str | os.PathLike, dest: Path, config_edits: Mapping[str, Any] | None = None,
                     marker: Mapping[str, Any] | None = None) -> None:
    """Copy ``like``'s files other than weights into ``dest`` (config, tokenizer, processor...), merge
    ``config_edits`` into ``config.json`` and write the marker :data:`MARKER_NAME`
    (``{"tool": "symalign", **marker}``, replacing a marker ``like`` had; inputs it names that were
    resolved from Hub ids add ``"hub"``, :func:`symalign.io.hub.marker_fields`)."""
    for entry in Path(like).iterdir():
        if is_weight_file(entry.name):
            continue
        if entry.is_dir():
            shutil.copytree(entry, dest / entry.name, ignore=lambda d, names: [n for n in names if is_weight_file(n)])
        else:
            shutil.copy2(entry, dest / entry.name)
    if config_edits:
        cfg_file = dest / "config.json"
        cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), **config_edits}, indent=2))
    from symalign.io.hub import marker_fields

    marker = dict(marker or {})
    marker.update(marker_fields(marker))  # inputs resolved from Hub ids: id, revision, commit, snapshot
    (dest / MARKER_NAME).write_text(json.dumps({"tool": "symalign", **marker}, indent=2) + "\n")


def write_tensors(folder: Path, state: Mapping[str, Tensor], layout: Mapping[str, str] | None) -> None:
    """``state`` as safetensors in ``folder``: one ``model.safetensors`` (``layout`` ``None``), or the shard
    files of ``layout`` (tensor -> file; a tensor it lacks goes to its last file) with their index."""
    from safetensors.torch import save_file

    tensors = {k: v.detach().contiguous() for k, v in state.items()}
    if layout is None:
        save_file(tensors, str(folder / WEIGHTS_NAME), metadata={"format": "pt"})
        return
    files = sorted(set(layout.values()))
    weight_map = {k: layout.get(k, files[-1]) for k in tensors}
    for f in files:
        part = {k: v for k, v in tensors.items() if weight_map[k] == f}
        save_file(part, str(folder / f), metadata={"format": "pt"})
    total = sum(v.numel() * v.element_size() for v in tensors.values())
    (folder / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total},
                                                 "weight_map": dict(sorted(weight_map.items()))}, indent=2))


def stage_tensors(out: str | os.PathLike, state: Mapping[str, Tensor], like: str | os.PathLike,
                  config_edits: Mapping[str, Any] | None = None, marker: Mapping[str, Any] | None = None,
                  rename: Callable[[Path, Mapping[str, Tensor]], Mapping[str, Tensor]] | None = None) -> Path:
    """A complete checkpoint laid out like ``like`` in a temporary sibling folder of ``out`` (removed on
    failure; module docstring): ``like``'s non-weight files, ``config_edits`` merged into its
    ``config.json``, ``state`` in ``like``'s shard files, the marker ``{"tool": "symalign", **marker}``,
    and the modes the umask gives. ``rename(folder, state)``, if given, returns ``state`` under the names
    to save it with, once the folder holds its (edited) config. Returns the folder."""
    out = Path(out).resolve()
    like = Path(like)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = make_temp_dir(out.parent, f".{out.name}.tmp-")
    try:
        copy_non_weights(like, tmp, config_edits, marker)
        write_tensors(tmp, rename(tmp, state) if rename else state, shard_map(like))
        fix_modes(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp


def discard(tmp: str | os.PathLike) -> None:
    shutil.rmtree(tmp, ignore_errors=True)


def commit(tmp: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Rename the staged ``tmp`` to ``out``; an existing ``out`` is renamed aside first, then removed.

    ``out`` is never half written: it is either the old directory, briefly absent,
    or the new one.
    """
    tmp, out = Path(tmp), Path(out).resolve()
    if not out.exists():
        os.replace(tmp, out)
        return out
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    old.rmdir()
    os.replace(out, old)
    try:
        os.replace(tmp, out)
    except BaseException:
        os.replace(old, out)
        raise
    if old.is_dir():
        shutil.rmtree(old, ignore_errors=True)
    else:
        old.unlink(missing_ok=True)
    return out
