r"""Model families, one module each: everything symalign knows about a family in one place.

Each module declares its layout as data -- a :class:`~symalign.families.base.Decoder`
(decoder-only families and GPT-2's ``Conv1D`` layout) or an
:class:`~symalign.families.encoder.Encoder` (BERT, RoFormer, ViT, ModernBERT: embeddings,
norms on the stream, heads per model class) -- and a
:class:`~symalign.families.base.Family` subclass (T5, an encoder-decoder, lists its own layouts; the
mixtures of experts Mixtral, Qwen2-MoE and OLMoE share :mod:`symalign.families.moe`) with its ``model_type`` values; the
attention scope, the whole-model scope (:func:`prepare`), ``probe --hf`` and the folded
reference of ``interpolate`` read it from there. Each module also declares, as data
(:mod:`symalign.families.declared`), its tiny test models, the cases the generic tests run, its
scopes and its ``hf:`` experiment model. :func:`get_adapter` finds
the family of a config; :data:`FAMILIES` lists them, read from the modules named in
:data:`REGISTRY`. Adding a family: one module here and its line in :data:`REGISTRY`
(docs/adapters.md); the generic tests, the families table and the docs pick it up.
"""

from __future__ import annotations

from typing import Any, Mapping

from torch import Tensor

import importlib

from symalign.arch.base import DOCS, Adapter, UnsupportedArchitectureError
from symalign.families.base import Decoder, Family
from symalign.families.common import Prepared
from symalign.families.encoder import Encoder, Head
from symalign.families.llama import LLAMA_LIKE
from symalign.spec import SymmetrySpec

REGISTRY: tuple[str, ...] = (
    "gpt2",
    "bert",
    "vit",
    "roformer",
    "modernbert",
    "llama",
    "gpt_neox",
    "gptj",
    "phi",
    "phi3",
    "qwen3",
    "olmo2",
    "gemma",
    "falcon",
    "t5",
    "moe",
    "stablelm",
)
"""The family modules of :mod:`symalign.families`, one line each: a new family is its module plus its line here."""


def _declared(module: str) -> list[Family]:
    """The families a module defines: its :class:`Family` subclasses with ``model_types``, in definition order."""
    mod = importlib.import_module(f"{__name__}.{module}")
    return [obj() for obj in vars(mod).values() if isinstance(obj, type) and issubclass(obj, Family)
            and obj.__module__ == mod.__name__ and getattr(obj, "model_types", ())]


FAMILIES: tuple[Family, ...] = tuple(f for module in REGISTRY for f in _declared(module))


def model_types() -> list[str]:
    """The ``model_type`` values with a family (both scopes: attention and whole model)."""
    return [mt for f in FAMILIES for mt in f.model_types]


# Known families not mapped yet: refused with the reason.
UNSUPPORTED: dict[str, str] = {
    "gemma3": "the multimodal Gemma 3 checkpoint is not mapped; its text model (gemma3_text) is",
    "cohere": "optional per-head Q/K layer norms are not covered",
    "bloom": "its fused layout is not mapped yet (ALiBi itself is: Falcon with alibi=True, heads pinned)",
    "mpt": "its fused layout is not mapped yet (ALiBi itself is: Falcon with alibi=True, heads pinned)",
}


def get_adapter(model_or_config: Any) -> Family:
    """The family of a transformers model or config (by ``config.model_type``); refuses an unknown one."""
    config = getattr(model_or_config, "config", model_or_config)
    model_type = config.get("model_type") if isinstance(config, dict) else getattr(config, "model_type", None)
    family = next((f for f in FAMILIES if model_type in f.model_types), None)
    if family is not None:
        return family
    why = f" ({UNSUPPORTED[model_type]})" if model_type in UNSUPPORTED else ""
    raise UnsupportedArchitectureError(
        f"no adapter for architecture {model_type!r}{why}; supported: {', '.join(model_types())}. "
        f"See {DOCS} to write one")


def architecture(config: Any) -> str | None:
    """The model class a checkpoint was saved from (``config.architectures[0]``), if recorded."""
    archs = getattr(config, "architectures", None) or []
    return str(archs[0]) if archs else None


def prepare(config: Any, state: Mapping[str, Tensor], attention_spec: SymmetrySpec,
            arch: str | None = None) -> Prepared:
    """Rewrite ``state`` exactly and build its whole-model spec (``--scope model``): the family's
    :meth:`~symalign.families.base.Family.prepare`. ``arch``: the model class (default
    :func:`architecture`); it decides which head reads the stream."""
    return get_adapter(config).prepare(config, state, attention_spec, arch or architecture(config))


__all__ = ["Adapter", "Decoder", "Encoder", "FAMILIES", "REGISTRY",
           "Family", "Head", "LLAMA_LIKE", "Prepared", "UNSUPPORTED",
           "architecture", "get_adapter", "model_types", "prepare"]
