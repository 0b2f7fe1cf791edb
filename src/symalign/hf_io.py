"""Reading and writing Hugging Face ``save_pretrained`` directories, validated.

:func:`load_checkpoint` reads ``config.json`` and the safetensors weights
(``model.safetensors`` or shards listed in ``model.safetensors.index.json``) as a
plain state dict, without instantiating the model with real weights, and checks
them: a missing or truncated file names the file, a tensor whose shape the
config does not predict (or that is missing) is named, as is any NaN/Inf
tensor. :func:`check_same_architecture` refuses pairs of different families or
sizes. :func:`write_checkpoint` writes an output directory atomically.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
from torch import Tensor

from symalign.arch import Adapter
from symalign.families import get_adapter
from symalign.atomic import fix_modes, make_temp_dir
from symalign.errors import CheckpointError, MatchError

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
# Written into every checkpoint folder symalign produces: marks it as replaceable with --force and
# records how it was made (command, scope, whether its weights are in folded form).
MARKER_NAME = "symalign.json"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".safetensors.index.json",
                    ".bin.index.json")


@dataclass
class Checkpoint:
    """A loaded checkpoint: its directory, transformers config, adapter and state dict."""

    path: Path
    config: Any
    adapter: Adapter
    state: dict[str, Tensor]
    files: list[Path]

    @property
    def dtype(self) -> torch.dtype:
        floats = [t.dtype for t in self.state.values() if t.is_floating_point()]
        return max(set(floats), key=floats.count) if floats else torch.float32

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state.values())


def load_config(path: str | os.PathLike) -> Any:
    """The transformers config of a checkpoint directory (no weights read)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory (expected a save_pretrained checkpoint)")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{cfg_file} is missing (expected a save_pretrained checkpoint)")
    try:
        json.loads(cfg_file.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{cfg_file} is not valid JSON: {exc}") from None
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path))
    except Exception as exc:  # unknown model_type, bad fields...
        raise CheckpointError(f"{cfg_file}: transformers cannot read this config: {str(exc).splitlines()[0]}") from None


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint (single file, or the shards of the index)."""
    index = path / INDEX_NAME
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as exc:
            raise CheckpointError(f"{index} is not a valid safetensors index: {exc}") from None
        files = [path / s for s in shards]
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{f} is missing (listed in {index})")
        return files
    single = path / WEIGHTS_NAME
    if not single.is_file():
        others = sorted(p.name for p in path.iterdir() if p.name.endswith((".bin", ".pt", ".pth")))
        hint = f" (found {', '.join(others)}: re-save with safe_serialization=True)" if others else ""
        raise CheckpointError(f"{single} is missing{hint}")
    return [single]


def read_state(files: Iterable[Path]) -> dict[str, Tensor]:
    """All tensors of the safetensors ``files``; a truncated or corrupt file is named."""
    from safetensors.torch import load_file

    state: dict[str, Tensor] = {}
    for f in files:
        try:
            part = load_file(str(f))
        except Exception as exc:
            raise CheckpointError(f"{f} is truncated or not a safetensors file ({str(exc).splitlines()[0]})") from None
        dup = set(part) & set(state)
        if dup:
            raise CheckpointError(f"{f} repeats tensor {sorted(dup)[0]!r} of another shard")
        state.update(part)
    return state


def expected_shapes(adapter: Adapter, config: Any) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """Shapes the config predicts (model built on the meta device: no memory) and the tied keys."""
    cls = adapter.model_class(config)
    with torch.device("meta"):
        model = cls._from_config(config)
    tied = set(getattr(model, "all_tied_weights_keys", None) or getattr(model, "_tied_weights_keys", None) or {})
    state = model.state_dict()
    try:  # the names save_pretrained writes (transformers 5.x renames some families on save, e.g. ViT)
        from transformers.core_model_loading import revert_weight_conversion

        on_disk = revert_weight_conversion(model, dict(state))
        # a rename keeps the count; a split (fused experts written per expert) keeps the entries
        if len(on_disk) == len(state) or sum(v.numel() for v in on_disk.values()) == sum(
                v.numel() for v in state.values()):
            renamed = {id(v): k for k, v in on_disk.items()}
            tied = {renamed.get(id(state[k]), k) if k in state else k for k in tied}
            state = on_disk
    except Exception:  # pragma: no cover - older transformers: names are saved as in memory
        pass
    return {k: tuple(v.shape) for k, v in state.items()}, tied


def saved_names(config: Any, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``state`` under the names ``save_pretrained`` writes: unchanged when it has them already, else converted
    by transformers' own ``revert_weight_conversion`` (e.g. the fused 3-D expert tensors of a mixture of experts,
    ``experts.gate_up_proj`` ``(E, 2F, D)``, written back as one ``gate``/``up``/``down`` matrix per expert)."""
    adapter = get_adapter(config)
    shapes, _ = expected_shapes(adapter, config)
    if all(k in shapes for k in state):
        return dict(state)
    from transformers.core_model_loading import revert_weight_conversion

    with torch.device("meta"):
        model = adapter.model_class(config)._from_config(config)
    return revert_weight_conversion(model, dict(state))


def validate(ckpt: Checkpoint, check_finite: bool = True) -> None:
    """Raise :class:`CheckpointError` naming the first tensor the config does not predict, or non-finite."""
    shapes, tied = expected_shapes(ckpt.adapter, ckpt.config)
    where = ckpt.path
    for name, t in ckpt.state.items():
        if name not in shapes:
            raise CheckpointError(f"{where}: tensor {name!r} is not part of the model config.json describes")
        if tuple(t.shape) != shapes[name]:
            raise CheckpointError(f"{where}: tensor {name!r} has shape {tuple(t.shape)} but config.json implies "
                                  f"{shapes[name]} (config and weights do not match)")
    missing = sorted(set(shapes) - set(ckpt.state) - tied)
    if missing:
        raise CheckpointError(f"{where}: tensor {missing[0]!r} is missing from the weights "
                              f"({len(missing)} missing in all)")
    if check_finite:
        for name, t in ckpt.state.items():
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise CheckpointError(f"{where}: tensor {name!r} contains NaN or Inf values")


def load_checkpoint(path: str | os.PathLike, check: bool = True) -> Checkpoint:
    """Config + state dict of a ``save_pretrained`` directory, validated (see the module docstring)."""
    path = Path(path)
    config = load_config(path)
    adapter = get_adapter(config)
    files = weight_files(path)
    ckpt = Checkpoint(path, config, adapter, read_state(files), files)
    if check:
        validate(ckpt)
    return ckpt


def check_same_architecture(a: Checkpoint, b: Checkpoint) -> None:
    """Refuse two checkpoints of different families, tensor names or shapes."""
    check_same_layout(a.path, a.config, {k: v.shape for k, v in a.state.items()},
                      b.path, b.config, {k: v.shape for k, v in b.state.items()})


def check_same_layout(path_a: Any, config_a: Any, shapes_a: Mapping[str, Any],
                      path_b: Any, config_b: Any, shapes_b: Mapping[str, Any]) -> None:
    """Refuse two checkpoints of different families, head structures, tensor names or shapes, given
    their configs and ``{tensor name: shape}`` (from loaded tensors or from safetensors headers)."""
    ta, tb = config_a.model_type, config_b.model_type
    if ta != tb:
        raise MatchError(f"{path_a} is a {ta} model but {path_b} is a {tb} model: both must be the same architecture")
    check_same_heads(config_a, config_b, path_a, path_b)
    only_a, only_b = sorted(set(shapes_a) - set(shapes_b)), sorted(set(shapes_b) - set(shapes_a))
    if only_a or only_b:
        name, side = (only_a[0], path_a) if only_a else (only_b[0], path_b)
        raise MatchError(f"tensor {name!r} exists only in {side}: the two checkpoints differ in architecture")
    for name, shape in shapes_a.items():
        if tuple(shape) != tuple(shapes_b[name]):
            raise MatchError(f"tensor {name!r} has shape {tuple(shape)} in {path_a} but "
                             f"{tuple(shapes_b[name])} in {path_b}: the models differ in size")


def head_config(config: Any) -> dict[str, int | None]:
    """``{"heads", "kv_heads", "head_dim"}`` of a transformers config (``None`` where the model
    has no attention heads): query heads, key/value heads (GQA; = heads without it) and the
    per-head width (``head_dim`` when the config sets it, else ``hidden_size // heads``)."""
    heads = getattr(config, "num_attention_heads", None)
    if heads is None:
        return {"heads": None, "kv_heads": None, "head_dim": None}
    heads = int(heads)
    kv = getattr(config, "num_key_value_heads", None) or heads
    hd = getattr(config, "head_dim", None)
    if not isinstance(hd, int) or hd <= 0:
        width = getattr(config, "hidden_size", None)
        hd = int(width) // heads if width and heads else None
    return {"heads": heads, "kv_heads": int(kv), "head_dim": hd}


def check_same_heads(config_a: Any, config_b: Any, path_a: Any = "A", path_b: Any = "B") -> None:
    """Refuse two checkpoints whose attention heads differ (count, K/V heads, head width).

    Tensor shapes alone do not show it (4 heads of 16 and 8 heads of 8 have the same
    ``D x D`` projections), but the attention symmetry group -- and so every alignment and
    every interpolation that assumes one -- depends on the head structure.
    """
    ha, hb = head_config(config_a), head_config(config_b)
    if ha != hb:
        def fmt(h: dict) -> str:
            return f"{h['heads']} attention heads ({h['kv_heads']} key/value heads, head_dim {h['head_dim']})"

        raise MatchError(f"A ({path_a}) has {fmt(ha)} but B ({path_b}) has {fmt(hb)}: the models differ in their "
                         "head structure, so they have different attention symmetries; use two checkpoints with "
                         "the same head configuration")


# ----------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------


def _inside(child: Path, parent: Path) -> bool:
    return child == parent or parent in child.parents


def check_output_dir(out: str | os.PathLike, inputs: Iterable[str | os.PathLike], force: bool) -> Path:
    """Refuse an output directory that exists (unless ``force``) or overlaps an input directory."""
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


def _is_weight_file(name: str) -> bool:
    return name.endswith(_WEIGHT_SUFFIXES)


def write_checkpoint(out: str | os.PathLike, state: Mapping[str, Tensor], like: str | os.PathLike,
                     force: bool = False) -> Path:
    """Write ``state`` as ``OUT/model.safetensors`` with every non-weight file of ``like``, atomically.

    The directory is built in a temporary sibling of ``out`` (:func:`stage_checkpoint`)
    and renamed into place (:func:`commit`).
    """
    out = Path(out).resolve()
    if out.exists() and not force:
        raise CheckpointError(f"{out} already exists; pass --force to replace it")
    return commit(stage_checkpoint(out, state, like), out)


def copy_non_weights(like: str | os.PathLike, dest: Path, config_edits: Mapping[str, Any] | None = None,
                     marker: Mapping[str, Any] | None = None) -> None:
    """Copy ``like``'s files other than weights into ``dest`` (config, tokenizer, processor...), merge
    ``config_edits`` into ``config.json`` and write the marker :data:`MARKER_NAME`
    (``{"tool": "symalign", **marker}``, replacing a marker ``like`` had)."""
    for entry in Path(like).iterdir():
        if _is_weight_file(entry.name):
            continue
        if entry.is_dir():
            shutil.copytree(entry, dest / entry.name, ignore=lambda d, names: [n for n in names if _is_weight_file(n)])
        else:
            shutil.copy2(entry, dest / entry.name)
    if config_edits:
        cfg_file = dest / "config.json"
        cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), **config_edits}, indent=2))
    (dest / MARKER_NAME).write_text(json.dumps({"tool": "symalign", **(marker or {})}, indent=2) + "\n")


def stage_checkpoint(out: str | os.PathLike, state: Mapping[str, Tensor], like: str | os.PathLike,
                     config_edits: Mapping[str, Any] | None = None, marker: Mapping[str, Any] | None = None
                     ) -> Path:
    """A complete checkpoint in a temporary sibling directory of ``out`` (removed on failure):
    ``like``'s non-weight files, ``config_edits`` merged into its ``config.json``, ``state``,
    and the marker file :data:`MARKER_NAME` holding ``{"tool": "symalign", **marker}``."""
    from safetensors.torch import save_file

    out = Path(out).resolve()
    like = Path(like)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = make_temp_dir(out.parent, f".{out.name}.tmp-")
    try:
        copy_non_weights(like, tmp, config_edits, marker)
        tensors = {k: v.detach().contiguous() for k, v in saved_names(load_config(tmp), state).items()}
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        fix_modes(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp


def verify_and_commit(tmp: str | os.PathLike, out: str | os.PathLike, b: Checkpoint, b_dir: str | os.PathLike,
                      culprit: str, floor: float = 0.0) -> dict[str, Any]:
    """Commit the staged ``tmp`` as ``out`` only if it computes checkpoint B's function.

    The check: ``rel = ||f_tmp(x) - f_B(x)|| / ||f_B(x)||`` on a random batch
    (:func:`symalign.arch.check.functional_difference`, in float64 when the model is small
    enough, else float32) must be at most ``tol = max(tolerance of B's dtype, of the check's
    dtype, the adapter's precision floor, floor)``. Otherwise ``tmp`` is removed and a
    :class:`~symalign.errors.SymalignError` names ``rel``, ``tol`` and ``culprit`` (what has
    a bug). Returns ``{"relative_output_change", "tolerance", "dtype"}``.
    """
    from symalign.arch.check import TOLERANCE, check_dtype, functional_difference
    from symalign.errors import SymalignError

    try:
        dtype = check_dtype(sum(t.numel() for t in b.state.values()))
        rel = functional_difference(b.adapter, b.config, b_dir, tmp, dtype)
        tol = max(TOLERANCE.get(b.dtype, 1e-4), TOLERANCE[dtype], b.adapter.precision_floor, floor)
        if not rel <= tol:
            raise SymalignError(f"refusing to write {out}: the aligned model's output differs from B's by "
                                f"{rel:.2e} (relative, > {tol:g}); this is a bug in {culprit}, please report it")
        commit(tmp, out)
    except BaseException:
        discard(tmp)
        raise
    return {"relative_output_change": rel, "tolerance": tol, "dtype": str(dtype).replace("torch.", "")}


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
