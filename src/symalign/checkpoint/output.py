"""Checkpoints symalign writes that need the model's family: names as ``save_pretrained`` writes them, and the
function check before the atomic commit.

The family-free mechanics (output-folder checks, the ``symalign.json`` marker, staging in the reference's shard
layout, :func:`~symalign.io.folder.commit`) live in :mod:`symalign.io.folder`. :func:`stage_checkpoint` stages
a state dict under the names its config saves with; :func:`verify_and_commit` commits a staged folder only if
it computes B's function.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

from torch import Tensor

from symalign.checkpoint.config import load_config, saved_names
from symalign.errors import CheckpointError
from symalign.io.folder import commit, discard, stage_tensors


def stage_checkpoint(out: str | os.PathLike, state: Mapping[str, Tensor], like: str | os.PathLike,
                     config_edits: Mapping[str, Any] | None = None, marker: Mapping[str, Any] | None = None
                     ) -> Path:
    """:func:`symalign.io.folder.stage_tensors`, with ``state`` saved under the names ``save_pretrained``
    writes for the staged config (:func:`symalign.checkpoint.config.saved_names`). Returns the folder."""
    return stage_tensors(out, state, like, config_edits, marker,
                         rename=lambda folder, st: saved_names(load_config(folder), st))


def write_checkpoint(out: str | os.PathLike, state: Mapping[str, Tensor], like: str | os.PathLike,
                     force: bool = False) -> Path:
    """Write ``state`` laid out like ``like`` with every non-weight file of ``like``, atomically
    (:func:`stage_checkpoint`, then :func:`commit`)."""
    out = Path(out).resolve()
    if out.exists() and not force:
        raise CheckpointError(f"{out} already exists; pass --force to replace it")
    return commit(stage_checkpoint(out, state, like), out)


def verify_and_commit(tmp: str | os.PathLike, out: str | os.PathLike, b: Any, b_dir: str | os.PathLike,
                      culprit: str, floor: float = 0.0) -> dict[str, Any]:
    """Commit the staged ``tmp`` as ``out`` only if it computes checkpoint B's function.

    ``b``: B as loaded or opened (``adapter``, ``config``, ``numel`` or ``state``, ``dtype``).
    The check (:func:`symalign.arch.check.check_function`): ``rel = ||f_tmp(x) - f_B(x)|| /
    ||f_B(x)||`` on a random batch, through ``from_pretrained`` (float64 when the model is small
    enough, else float32), at most :func:`symalign.tolerance.function_tolerance` of B's dtype and
    the check's dtype, the adapter's precision floor and ``floor``. Otherwise ``tmp`` is removed
    and a :class:`~symalign.errors.SymalignError` names ``rel``, the tolerance and ``culprit``
    (what has a bug). Returns the :class:`~symalign.tolerance.FunctionCheck`.
    """
    from symalign.arch.check import check_function

    try:
        check = check_function(b, b_dir, tmp, floor)
        check.require(f"refusing to write {out}: the aligned model's output differs from B's", culprit)
        commit(tmp, out)
    except BaseException:
        discard(tmp)
        raise
    return check


