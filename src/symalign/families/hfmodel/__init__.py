r"""Whole-model specs of Hugging Face checkpoints (``symalign align --scope model``), in their own format.

:func:`prepare` rewrites a checkpoint exactly (the same function, loadable as the
same architecture) and returns its whole-model :class:`~symalign.spec.SymmetrySpec`:
the adapter's attention spaces, one FF space ``ff.i`` per layer, and the residual
stream's group, which depends on where the norm gains sit:

==========================  =========================================  ==================================
family                      rewrite                                    residual group
==========================  =========================================  ==================================
Llama / Mistral / Qwen2     RMSNorm gains folded into the readers      ``O(D)`` (tied head: ``S_D``)
GPT-2, ViT                  LayerNorm gains/biases folded (GPT-2:      ``O_1(D)`` (rotations with
                            head untied)                               ``O 1 = 1``: they keep the centring)
BERT, RoFormer (post-LN)    none (gains on the residual path)          ``S_D`` (permutations)
ModernBERT                  none (the embeddings norm's gain scales    ``S_D``
                            the stream itself)
==========================  =========================================  ==================================

A checkpoint whose output *is* the stream (a bare ``BertModel``, ``ViTModel``...) or
whose head is not mapped gets no residual space (FF and attention only), with a
note saying so. ReLU FF units get positive per-unit scales as well
(:class:`~symalign.groups.PositiveMonomial`). One module per family here for GPT-2, ViT,
BERT/RoFormer and ModernBERT; Llama, Mistral, Qwen2 and the later families are
:class:`symalign.families.Family` objects (their ``prepare``), dispatched to below.
"""

from __future__ import annotations

from typing import Any, Mapping

from torch import Tensor

from symalign.errors import ConfigError
from symalign.families import get_family
from symalign.families.hfmodel.bert import prepare_bert
from symalign.families.common import Prepared
from symalign.families.hfmodel.gpt2 import prepare_gpt2
from symalign.families.hfmodel.modernbert import prepare_modernbert
from symalign.families.hfmodel.vit import prepare_vit
from symalign.spec import SymmetrySpec

LLAMA_LIKE = ("llama", "mistral", "qwen2")  # symalign.families.llama (RMSNorm, residual O(D))
SUPPORTED = LLAMA_LIKE + ("gpt2", "vit", "bert", "roformer", "modernbert")


def architecture(config: Any) -> str | None:
    """The model class a checkpoint was saved from (``config.architectures[0]``), if recorded."""
    archs = getattr(config, "architectures", None) or []
    return str(archs[0]) if archs else None


def prepare(config: Any, state: Mapping[str, Tensor], attention_spec: SymmetrySpec,
            arch: str | None = None) -> Prepared:
    """Rewrite ``state`` exactly and build its whole-model spec (see the module docstring).

    ``arch``: the model class (default :func:`architecture`); it decides which head
    reads the stream.
    """
    mt = config.model_type
    arch = arch or architecture(config)
    if mt == "gpt2":
        return prepare_gpt2(config, state, attention_spec)
    if mt == "vit":
        return prepare_vit(config, state, attention_spec, arch)
    if mt in ("bert", "roformer"):
        return prepare_bert(config, state, attention_spec, arch)
    if mt == "modernbert":
        return prepare_modernbert(config, state, attention_spec, arch)
    family = get_family(config)
    if family is not None:
        return family.prepare(config, state, attention_spec, arch)
    raise ConfigError(f"--scope model supports {', '.join(SUPPORTED)}; {mt!r} is not mapped yet "
                      "(use --scope attention)")


__all__ = ["LLAMA_LIKE", "SUPPORTED", "Prepared", "architecture", "prepare"]
