"""Plain PyTorch state-dict files (``torch.save(model.state_dict(), path)``), as ``align --module`` reads and writes.

:func:`load_state_file` reads one with ``weights_only=True`` (no code runs), refusing with one
line a missing file, a foreign or corrupt file, or an object that is not a state dict;
:func:`save_state_file` writes one atomically (a temporary file renamed into place).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

import torch
from torch import Tensor

from symalign.atomic import atomic_path
from symalign.errors import CheckpointError


def load_state_file(path: str | os.PathLike, who: str = "checkpoint") -> dict[str, Tensor]:
    """The state dict saved at ``path``; ``who`` names it in errors (e.g. ``"checkpoint B"``)."""
    if not Path(path).is_file():
        raise CheckpointError(f"{who} {path} is not a file (expected torch.save(model.state_dict(), path))")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 -- corrupt or foreign file
        raise CheckpointError(f"cannot read {who} {path} as a torch state dict ({type(e).__name__})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{who} {path} holds a {type(state).__name__}, not a state dict")
    return state


def save_state_file(state: Mapping[str, Tensor], path: str | os.PathLike) -> Path:
    """Write ``state`` with ``torch.save`` to ``path`` atomically; returns the path."""
    with atomic_path(Path(path)) as tmp:
        torch.save(dict(state), tmp)
    return Path(path)
