"""Plain PyTorch state-dict files (``torch.save(model.state_dict(), path)``), as ``align --module`` reads and writes.

:func:`load_state_file` reads one with ``weights_only=True`` (no code runs), refusing with one
line a missing file, a foreign or corrupt file, or an object that is not a state dict;
:func:`save_state_file` writes one atomically (a temporary file renamed into place);
:func:`load_plain` reads any other ``torch.save`` file symalign writes (optimizer and RNG state,
learned-matching resume files) the same way: tensors and plain containers only, never pickled code.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

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


def load_plain(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> Any:
    """The contents of a ``torch.save`` file symalign wrote (tensors, numbers, strings, ``None`` and
    dicts/lists/tuples of them), read with ``weights_only=True``: a file whose pickle names any other
    object -- one whose ``__reduce__`` would run code, e.g. a run folder from someone else -- is refused
    in one line naming it, before anything in it runs. Other unreadable files: one line too."""
    import pickle

    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        if "weights_only" in str(e) or "Weights only load failed" in str(e):
            raise CheckpointError(f"{path}: refused to load: it holds Python objects other than tensors and plain "
                                  "containers (loading would run code it names); delete it if you did not write it "
                                  "(symalign then starts that step afresh)") from None
        raise CheckpointError(f"{path}: cannot be read (corrupt or not a torch.save file: {e}); delete it to "
                              "start that step afresh") from None
    except Exception as e:  # noqa: BLE001 -- truncated, corrupt or foreign file
        raise CheckpointError(f"{path}: cannot be read ({type(e).__name__}: {e}); delete it to start that step "
                              "afresh") from None


def save_state_file(state: Mapping[str, Tensor], path: str | os.PathLike) -> Path:
    """Write ``state`` with ``torch.save`` to ``path`` atomically; returns the path."""
    with atomic_path(Path(path)) as tmp:
        torch.save(dict(state), tmp)
    return Path(path)
