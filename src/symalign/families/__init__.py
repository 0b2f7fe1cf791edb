r"""Model families, one module each: everything symalign knows about a family in one place.

Each module declares a :class:`~symalign.families.base.Decoder` (the tensors of a
layer, norms and where they sit, fusions, QK-norm) and a
:class:`~symalign.families.base.Family` with its ``model_type`` values; attention
scope, whole-model scope and the probe read it from there. :func:`get_family` finds
the family of a config; :data:`FAMILIES` lists them. Llama, Mistral and Qwen2 moved here
from the older pair of modules; GPT-2, BERT, ViT, RoFormer and ModernBERT (``Conv1D``
and encoder layouts) still live in :mod:`symalign.arch` (attention) and
:mod:`symalign.match.hfmodel` (whole model). :func:`symalign.arch.get_adapter` and
:func:`symalign.match.hfmodel.prepare` dispatch to both. Adding a family: docs/adapters.md.
"""

from __future__ import annotations

from typing import Any

from symalign.families.base import Decoder, Family
from symalign.families.falcon import FalconFamily
from symalign.families.gemma import Gemma2Family, Gemma3Family, GemmaFamily
from symalign.families.gpt_neox import GPTNeoXFamily
from symalign.families.gptj import GPTJFamily
from symalign.families.llama import LlamaFamily, MistralFamily, Qwen2Family
from symalign.families.olmo2 import Olmo2Family
from symalign.families.phi import PhiFamily
from symalign.families.phi3 import Phi3Family
from symalign.families.qwen3 import Qwen3Family

FAMILIES: tuple[Family, ...] = (
    LlamaFamily(), MistralFamily(), Qwen2Family(), GPTNeoXFamily(), GPTJFamily(), PhiFamily(), Phi3Family(),
    Qwen3Family(), Olmo2Family(), GemmaFamily(), Gemma2Family(), Gemma3Family(), FalconFamily(),
)


def get_family(model_or_config: Any) -> Family | None:
    """The family of a transformers model or config (by ``config.model_type``), or ``None``."""
    config = getattr(model_or_config, "config", model_or_config)
    mt = config.get("model_type") if isinstance(config, dict) else getattr(config, "model_type", None)
    return next((f for f in FAMILIES if mt in f.model_types), None)


def model_types() -> list[str]:
    return [mt for f in FAMILIES for mt in f.model_types]


__all__ = ["Decoder", "FAMILIES", "Family", "get_family", "model_types"]
