"""A checkpoint's *folded* form: the coordinates in which ``align --scope model`` aligns.

Whole-model alignment first rewrites both checkpoints exactly
(:func:`symalign.families.prepare`): norm gains folded into the weights that read
the normalised stream, and -- GPT-2 -- ``lm_head`` untied from ``wte``. The aligned
output B' is written in those coordinates. Interpolating B' with A itself would mix two
parametrisations of A's function: ``(1 - t) A + t B'`` is not the path the matcher made
short; ``(1 - t) fold(A) + t B'`` is. :func:`write_folded` writes ``fold(A)`` as a
loadable checkpoint (``align --write-reference``), checked to compute A's function before it
is committed; ``interpolate`` folds A in memory when B' is marked folded and A is not.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from symalign.checkpoint.hf import HFCheckpoint
from symalign.checkpoint.output import stage_checkpoint, verify_and_commit
from symalign.io.folder import read_marker
from symalign.tolerance import FunctionCheck


def fold(ckpt: HFCheckpoint):
    """The :class:`~symalign.families.common.Prepared` rewrite of a loaded checkpoint."""
    from symalign.families import prepare

    return prepare(ckpt.config, ckpt.state, ckpt.adapter.spec(ckpt.config, ckpt.state.keys()))


def stage_folded(ckpt: HFCheckpoint, out: str | os.PathLike, marker: dict[str, Any] | None = None) -> Path:
    """``fold(ckpt)`` staged as a checkpoint beside ``out`` (see :func:`symalign.checkpoint.output.stage_checkpoint`),
    marked ``{"folded": true}``; returns the staging folder."""
    p = fold(ckpt)
    edits = {"tie_word_embeddings": False} if p.untied else None
    mark = {"command": "align --write-reference", "folded": True, "folded_from": str(Path(ckpt.path).resolve()),
            "untied_head": p.untied, **(marker or {})}
    return stage_checkpoint(out, p.state, ckpt.path, edits, marker=mark)


def write_folded(ckpt: HFCheckpoint, out: str | os.PathLike, marker: dict[str, Any] | None = None
                 ) -> FunctionCheck:
    """Write ``fold(ckpt)`` to ``out`` (checked first with
    :func:`symalign.checkpoint.output.check_output_dir`) only if it computes ``ckpt``'s function
    (the adapter's precision floor covers float32 RMSNorm); returns the check."""
    tmp = stage_folded(ckpt, out, marker)
    return verify_and_commit(tmp, Path(out).resolve(), ckpt, ckpt.path, "the folded reference")


def is_folded(path: str | os.PathLike) -> bool:
    """Whether symalign marked the checkpoint at ``path`` as being in folded form."""
    return bool(read_marker(path).get("folded"))


