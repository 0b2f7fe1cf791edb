"""What a Hugging Face checkpoint's ``config.json`` says about its weights, and pair checks.

:func:`load_config` reads the transformers config (no weights); :func:`expected_shapes`
builds the model on the meta device (no memory) for the tensor names and shapes the
config predicts; :func:`check_shapes` compares a checkpoint's ``{name: shape}`` with
them. :func:`check_same_architecture` refuses a pair of checkpoints of different
families, head structures, tensor names or shapes -- for loaded and for lazily opened
checkpoints alike (anything with ``path``, ``config`` and ``shapes``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import Tensor

from symalign.arch import Adapter
from symalign.checkpoint.native import FORMAT, LATEST
from symalign.errors import CheckpointError, MatchError


BUILT_IN_HINT = ("align, interpolate and merge read save_pretrained folders of Hugging Face models: built-in "
                 "models are aligned and measured by `symalign experiment CONFIG.toml` (README, section 4)")
"""What to do with a built-in (``symalign train``) checkpoint given where a Hugging Face one is expected."""


def load_config(path: str | os.PathLike) -> Any:
    """The transformers config of a checkpoint directory (no weights read)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory (expected a save_pretrained checkpoint)")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        if (path / LATEST).is_file():  # a `symalign train` run folder
            raise CheckpointError(f"{path} is a `symalign train` run folder, not a Hugging Face checkpoint; "
                                  f"{BUILT_IN_HINT}")
        raise CheckpointError(f"{cfg_file} is missing (expected a save_pretrained checkpoint)")
    try:
        meta = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{cfg_file} is not valid JSON: {exc}") from None
    if isinstance(meta, dict) and meta.get("format") == FORMAT:
        family = (meta.get("model") or {}).get("family", "built-in")
        raise CheckpointError(f"{path} is a `symalign train` checkpoint (built-in {family} model), not a Hugging "
                              f"Face one; {BUILT_IN_HINT}")
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path))
    except Exception as exc:  # unknown model_type, bad fields...
        raise CheckpointError(f"{cfg_file}: transformers cannot read this config: {str(exc).splitlines()[0]}") from None


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
    from symalign.families import get_adapter

    adapter = get_adapter(config)
    shapes, _ = expected_shapes(adapter, config)
    if all(k in shapes for k in state):
        return dict(state)
    from transformers.core_model_loading import revert_weight_conversion

    with torch.device("meta"):
        model = adapter.model_class(config)._from_config(config)
    return revert_weight_conversion(model, dict(state))


def check_shapes(where: Any, adapter: Adapter, config: Any, shapes: Mapping[str, Any]) -> None:
    """Every tensor the config predicts is in ``shapes`` with its shape (tied ones may be absent),
    and no other; else :class:`CheckpointError` naming ``where`` and the first offending tensor."""
    want, tied = expected_shapes(adapter, config)
    for name, shape in shapes.items():
        if name not in want:
            raise CheckpointError(f"{where}: tensor {name!r} is not part of the model config.json describes")
        if tuple(shape) != want[name]:
            raise CheckpointError(f"{where}: tensor {name!r} has shape {tuple(shape)} but config.json implies "
                                  f"{want[name]} (config and weights do not match)")
    missing = sorted(set(want) - set(shapes) - tied)
    if missing:
        raise CheckpointError(f"{where}: tensor {missing[0]!r} is missing from the weights "
                              f"({len(missing)} missing in all)")


def check_same_architecture(a: Any, b: Any) -> None:
    """Refuse two checkpoints (loaded or lazily opened: ``path``, ``config``, ``shapes``) of different
    families, head structures, tensor names or shapes (:func:`check_same_layout`)."""
    check_same_layout(a.path, a.config, a.shapes, b.path, b.config, b.shapes)


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
