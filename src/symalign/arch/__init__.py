"""Architecture adapters: Hugging Face model families -> exact symmetry specs.

``get_adapter(model_or_config)`` picks the adapter by ``config.model_type``; see
``docs/adapters.md`` for the supported families, their layouts and groups, and
how to write a new adapter.
"""

from __future__ import annotations

from typing import Any

from symalign.arch.base import DOCS, Adapter, AttentionLayout, Proj, UnsupportedArchitectureError, layout_spec
from symalign.arch.bert import BertAdapter
from symalign.arch.gpt2 import GPT2Adapter
from symalign.arch.modernbert import ModernBertAdapter
from symalign.arch.roformer import RoFormerAdapter
from symalign.arch.vit import ViTAdapter

# Llama, Mistral, Qwen2 and the later decoder families: symalign.families (one module each, attention and
# whole model); found by get_adapter after these.
ADAPTERS: tuple[Adapter, ...] = (GPT2Adapter(), BertAdapter(), ViTAdapter(), RoFormerAdapter(), ModernBertAdapter())

# Known families whose attention breaks the per-head groups: refused with the reason.
UNSUPPORTED: dict[str, str] = {
    "gemma3": "the multimodal Gemma 3 checkpoint is not mapped; its text model (gemma3_text) is",
    "cohere": "optional per-head Q/K layer norms are not covered",
    "bloom": "ALiBi pins every head (no head permutation) and the fused layout is not mapped yet",
    "mpt": "ALiBi pins every head and the fused layout is not mapped yet",
}


def supported() -> list[str]:
    """The ``model_type`` values with an adapter (here, or a family of :mod:`symalign.families`)."""
    from symalign.families import model_types

    return [mt for a in ADAPTERS for mt in a.model_types] + model_types()


def get_adapter(model_or_config: Any) -> Adapter:
    """The adapter for a transformers model or config (by ``config.model_type``)."""
    config = getattr(model_or_config, "config", model_or_config)
    model_type = getattr(config, "model_type", None)
    if model_type is None and isinstance(config, dict):
        model_type = config.get("model_type")
    for adapter in ADAPTERS:
        if adapter.model_type == model_type or (model_type is not None and adapter.matches(config)):
            return adapter
    from symalign.families import get_family

    family = get_family(config)
    if family is not None:
        return family
    why = f" ({UNSUPPORTED[model_type]})" if model_type in UNSUPPORTED else ""
    raise UnsupportedArchitectureError(
        f"no adapter for architecture {model_type!r}{why}; supported: {', '.join(supported())}. "
        f"See {DOCS} to write one")


__all__ = ["ADAPTERS", "Adapter", "AttentionLayout", "Proj", "UnsupportedArchitectureError", "get_adapter",
           "layout_spec", "supported", "UNSUPPORTED"]
