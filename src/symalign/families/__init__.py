r"""Model families, one module each: everything symalign knows about a family in one place.

Each module declares a :class:`~symalign.families.base.Decoder` (the tensors of a
layer, norms and where they sit, fusions, QK-norm) and a
:class:`~symalign.families.base.Family` with its ``model_type`` values; attention
scope, whole-model scope and the probe read it from there. :func:`get_family` finds
the family of a config; :data:`FAMILIES` lists them. The mixtures of experts (Mixtral, Qwen2-MoE,
OLMoE) share one module, :mod:`symalign.families.moe`. Llama, Mistral and Qwen2 moved here
from the older pair of modules; GPT-2, BERT, ViT, RoFormer and ModernBERT (``Conv1D``
and encoder layouts) still live in :mod:`symalign.arch` (attention) and
:mod:`symalign.families.hfmodel` (whole model). :func:`get_adapter` (here) and
:func:`symalign.families.hfmodel.prepare` dispatch to both. Adding a family: docs/adapters.md.
"""

from __future__ import annotations

from typing import Any

from symalign.arch.base import DOCS, Adapter, UnsupportedArchitectureError
from symalign.arch.bert import BertAdapter
from symalign.arch.gpt2 import GPT2Adapter
from symalign.arch.modernbert import ModernBertAdapter
from symalign.arch.roformer import RoFormerAdapter
from symalign.arch.vit import ViTAdapter
from symalign.families.base import Decoder, Family
from symalign.families.falcon import FalconFamily
from symalign.families.gemma import Gemma2Family, Gemma3Family, GemmaFamily
from symalign.families.gpt_neox import GPTNeoXFamily
from symalign.families.gptj import GPTJFamily
from symalign.families.llama import LlamaFamily, MistralFamily, Qwen2Family
from symalign.families.moe import MixtralFamily, OlmoeFamily, Qwen2MoeFamily
from symalign.families.olmo2 import Olmo2Family
from symalign.families.phi import PhiFamily
from symalign.families.phi3 import Phi3Family
from symalign.families.qwen3 import Qwen3Family

FAMILIES: tuple[Family, ...] = (
    LlamaFamily(), MistralFamily(), Qwen2Family(), GPTNeoXFamily(), GPTJFamily(), PhiFamily(), Phi3Family(),
    Qwen3Family(), Olmo2Family(), GemmaFamily(), Gemma2Family(), Gemma3Family(), FalconFamily(),
    MixtralFamily(), Qwen2MoeFamily(), OlmoeFamily(),
)


def get_family(model_or_config: Any) -> Family | None:
    """The family of a transformers model or config (by ``config.model_type``), or ``None``."""
    config = getattr(model_or_config, "config", model_or_config)
    mt = config.get("model_type") if isinstance(config, dict) else getattr(config, "model_type", None)
    return next((f for f in FAMILIES if mt in f.model_types), None)


def model_types() -> list[str]:
    return [mt for f in FAMILIES for mt in f.model_types]

# The adapters of symalign.arch (GPT-2's Conv1D layout and the encoders), tried before the decoder families.
ADAPTERS: tuple[Adapter, ...] = (GPT2Adapter(), BertAdapter(), ViTAdapter(), RoFormerAdapter(), ModernBertAdapter())

# Known families whose attention breaks the per-head groups: refused with the reason.
UNSUPPORTED: dict[str, str] = {
    "gemma3": "the multimodal Gemma 3 checkpoint is not mapped; its text model (gemma3_text) is",
    "cohere": "optional per-head Q/K layer norms are not covered",
    "bloom": "ALiBi pins every head (no head permutation) and the fused layout is not mapped yet",
    "mpt": "ALiBi pins every head and the fused layout is not mapped yet",
}


def supported() -> list[str]:
    """The ``model_type`` values with an adapter (an :mod:`symalign.arch` adapter or a family here)."""
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
    family = get_family(config)
    if family is not None:
        return family
    why = f" ({UNSUPPORTED[model_type]})" if model_type in UNSUPPORTED else ""
    raise UnsupportedArchitectureError(
        f"no adapter for architecture {model_type!r}{why}; supported: {', '.join(supported())}. "
        f"See {DOCS} to write one")


__all__ = ["ADAPTERS", "Decoder", "FAMILIES", "Family", "UNSUPPORTED", "get_adapter", "get_family", "model_types",
           "supported"]
