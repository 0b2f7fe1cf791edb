"""A merged model in the rewritten (gainless-norm) form of universe matching: written and read back.

:func:`save_merged` writes ``model.safetensors`` and then ``config.json`` (the model config, the
rewrite plan and the merge's info), each atomically, the weights first: a folder with
``config.json`` is complete. :func:`load_merged` rebuilds the rewritten model
(:func:`symalign.rewrite.rewritten_model`) in the stored dtype.
"""

from __future__ import annotations

import json
from pathlib import Path

from torch import Tensor, nn


def save_merged(path: str | Path, model: nn.Module, state: dict[str, Tensor], info: dict | None = None) -> Path:
    """Write a merged rewritten model: ``model.safetensors`` + ``config.json`` (config, rewrite plan, info).

    Each file is written atomically, the weights first: a folder with ``config.json`` is complete.
    """
    from safetensors.torch import save_file

    from symalign.atomic import atomic_path, write_json
    from symalign.rewrite import plan

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = model.cfg  # type: ignore[attr-defined]
    with atomic_path(path / "model.safetensors") as tmp:
        save_file({k: v.detach().contiguous() for k, v in state.items()}, str(tmp))
    write_json(path / "config.json", {"model": cfg.to_dict(), "rewrite": plan(cfg).to_dict(), "info": info or {}})
    return path


def load_merged(path: str | Path) -> nn.Module:
    """The rewritten model written by :func:`save_merged` (dtype of the stored weights)."""
    from safetensors.torch import load_file

    from symalign.rewrite import rewritten_model

    path = Path(path)
    meta = json.loads((path / "config.json").read_text())
    state = load_file(str(path / "model.safetensors"))
    model = rewritten_model(meta["model"])
    dtype = next(iter(state.values())).dtype
    model = model.to(dtype)
    model.load_state_dict(state)
    return model.eval()
