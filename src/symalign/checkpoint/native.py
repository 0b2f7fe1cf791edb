"""symalign's own run checkpoints: ``model.safetensors`` + ``config.json`` (+ ``optim.pt``), written atomically.

A run directory holds checkpoint directories ``ckpt-{step:08d}/`` and a file
``latest`` naming the newest one. A checkpoint is first written to a hidden
temporary directory and renamed into place (``os.replace``), then ``latest`` is
replaced atomically, then older checkpoints are pruned -- so an interruption at
any point leaves the previous complete checkpoint loadable.

``config.json`` holds the model config (for ``hf:`` families the whole transformers
config, so :func:`load_model` rebuilds the model), data name/options, training config,
seed, step, metrics, history and the SHA-256 of ``model.safetensors``;
``optim.pt`` holds the optimizer state and RNG states. Tied tensors (a GPT head
sharing the embedding) are stored once and listed under ``aliases``.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from symalign.atomic import file_digest, fix_modes, make_temp_dir, write_text
from symalign.errors import CheckpointError, SymalignError

FORMAT = "symalign.checkpoint"
VERSION = 1
MODEL_FILE, CONFIG_FILE, OPTIM_FILE, LATEST = "model.safetensors", "config.json", "optim.pt", "latest"


def _sha256(path: Path) -> str:
    return file_digest(path, "sha256")


def dedupe_state(state: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Tensors sharing storage are kept once: ``(unique, {alias: kept_name})``."""
    seen: dict[tuple, str] = {}
    unique, aliases = {}, {}
    for k, v in state.items():
        key = (v.data_ptr(), v.dtype, tuple(v.shape), v.stride(), v.device)
        if v.numel() and key in seen:
            aliases[k] = seen[key]
        else:
            seen[key] = k
            unique[k] = v.detach().cpu().contiguous()
    return unique, aliases


def save_run(run_dir: str | Path, model: nn.Module, meta: dict, optim: dict | None = None,
             keep: int = 1) -> Path:
    """Write ``ckpt-{meta['step']:08d}`` under ``run_dir`` atomically and point ``latest`` to it.

    ``meta`` must be JSON-serialisable and hold ``"model"`` (the config dict) and
    ``"step"``; ``optim`` (optimizer/RNG state) goes to ``optim.pt``. Keeps the
    newest ``keep`` checkpoints.
    """
    from safetensors.torch import save_file

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    name = f"ckpt-{int(meta['step']):08d}"
    final = run_dir / name
    tmp = make_temp_dir(run_dir, f".{name}.")
    try:
        unique, aliases = dedupe_state(model.state_dict())
        save_file(unique, str(tmp / MODEL_FILE), metadata={"format": FORMAT})
        meta = {**meta, "format": FORMAT, "version": VERSION, "aliases": aliases,
                "sha256": _sha256(tmp / MODEL_FILE)}
        with open(tmp / CONFIG_FILE, "w") as f:
            json.dump(meta, f, indent=2, sort_keys=True)
            f.write("\n")
        if optim is not None:
            torch.save(optim, tmp / OPTIM_FILE)
        fix_modes(tmp)
        if final.exists():  # same step saved again (e.g. stop, then final): replace it
            old = run_dir / f".{name}.old"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    latest = run_dir / LATEST
    write_text(latest, name + "\n")
    ckpts = sorted(p for p in run_dir.glob("ckpt-*") if p.is_dir())
    for p in ckpts[:-keep] if keep > 0 else []:
        if p != final:
            shutil.rmtree(p, ignore_errors=True)
    return final


def resolve_checkpoint(path: str | Path) -> Path:
    """The checkpoint directory for ``path``: itself (has ``config.json``) or what ``path/latest`` names."""
    path = Path(path)
    if (path / CONFIG_FILE).exists() or (path / MODEL_FILE).exists():
        return path
    latest = path / LATEST
    if latest.exists():
        target = path / latest.read_text().strip()
        if not target.is_dir():
            raise CheckpointError(f"{latest}: names {target.name}, which does not exist")
        return target
    raise CheckpointError(f"{path}: no checkpoint here (neither {CONFIG_FILE} nor a '{LATEST}' file)")


def has_checkpoint(run_dir: str | Path) -> bool:
    return (Path(run_dir) / LATEST).exists() or (Path(run_dir) / CONFIG_FILE).exists()


@dataclass
class RunCheckpoint:
    """A loaded run checkpoint: its directory, ``config.json`` contents and model state."""

    path: Path
    meta: dict
    state: dict[str, Tensor]

    @property
    def config(self):
        """The model config: a :class:`~symalign.models.ModelConfig`, or an
        :class:`~symalign.models.hf.HFConfig` (``hf:`` families keep their transformers config here)."""
        from symalign.models import config_from_dict

        try:
            return config_from_dict(self.meta["model"])
        except (SymalignError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{self.path / CONFIG_FILE}: invalid model config ({exc})") from exc

    def optim_state(self, map_location="cpu") -> dict | None:
        """``optim.pt`` contents (optimizer and RNG state: tensors and plain containers), or ``None`` if
        absent; read without running pickled code (:func:`~symalign.io.statedict.load_plain`)."""
        p = self.path / OPTIM_FILE
        if not p.exists():
            return None
        from symalign.io.statedict import load_plain

        return load_plain(p, map_location)  # weights_only: a crafted pickle is refused, nothing in it runs




def load_run(path: str | Path, verify: bool = True) -> RunCheckpoint:
    """Read a checkpoint (a run directory or a ``ckpt-*`` directory).

    Raises :class:`CheckpointError` naming the file for a missing file, invalid
    JSON, a wrong format, a SHA-256 mismatch (``verify``) or unreadable tensors.
    """
    from safetensors.torch import load_file

    ckpt = resolve_checkpoint(path)
    cfg_path, model_path = ckpt / CONFIG_FILE, ckpt / MODEL_FILE
    for p in (cfg_path, model_path):
        if not p.exists():
            raise CheckpointError(f"{p}: missing")
    try:
        meta = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{cfg_path}: not valid JSON ({exc})") from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or "model" not in meta:
        raise CheckpointError(f"{cfg_path}: not a symalign checkpoint config (format {FORMAT!r} expected)")
    if verify and meta.get("sha256") and _sha256(model_path) != meta["sha256"]:
        raise CheckpointError(f"{model_path}: corrupt (SHA-256 differs from the one recorded in {CONFIG_FILE})")
    try:
        state = load_file(str(model_path))
    except Exception as exc:
        raise CheckpointError(f"{model_path}: cannot be read ({type(exc).__name__}: {exc})") from exc
    for alias, name in meta.get("aliases", {}).items():
        if name not in state:
            raise CheckpointError(f"{model_path}: tied tensor {alias!r} refers to missing {name!r}")
        state[alias] = state[name]
    return RunCheckpoint(ckpt, meta, state)


def load_state_into(model: nn.Module, state: dict[str, Tensor], where: Path | str) -> None:
    """Copy ``state`` into ``model``; missing/unexpected names or shape mismatches raise
    :class:`CheckpointError` naming ``where`` and the tensor."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise CheckpointError(f"{where}: does not match the model (missing {missing[:5]}, unexpected {unexpected[:5]})")
    for k, v in state.items():
        if tuple(v.shape) != tuple(own[k].shape):
            raise CheckpointError(f"{where}: tensor {k!r} has shape {tuple(v.shape)}, the model expects "
                                  f"{tuple(own[k].shape)}")
    model.load_state_dict(state)


def load_model(path: str | Path, device: str | torch.device = "cpu") -> tuple[nn.Module, RunCheckpoint]:
    """Build the model a checkpoint describes and load its weights."""
    from symalign.models import build_model

    ck = load_run(path)
    with torch.random.fork_rng(devices=[]):  # default init must not disturb the caller's RNG
        model = build_model(ck.config, seed=None)
    load_state_into(model, ck.state, ck.path / MODEL_FILE)
    return model.to(device), ck
