r"""The objective a checkpoint is evaluated on, read from its head, and its per-batch statistics.

=========================== ======================== =========================================
head (class name ends with)  objective                loss (nats), accuracy
=========================== ======================== =========================================
``ForCausalLM``,             ``causal-lm``            next-token cross-entropy: logits at
``LMHeadModel``                                       position ``i`` predict ``labels[i+1]``
``ForMaskedLM``              ``masked-lm``            cross-entropy at the masked positions
                                                      (``labels != -100``)
``ForSequenceClassification`` ``sequence-classification`` cross-entropy of the class logits
``ForImageClassification``   ``image-classification``  cross-entropy of the class logits
``ForConditionalGeneration`` ``seq2seq``              teacher-forced cross-entropy of the target
(encoder-decoder with the                             given the source: decoder inputs = labels
model's own ``_shift_right``,                         shifted right (``decoder_start_token_id``
e.g. T5)                                              first), logits at ``j`` predict ``labels[j]``,
                                                      pad positions (``-100``) ignored
=========================== ======================== =========================================

The conventions are those of the models' own ``loss`` (Hugging Face
``ForCausalLMLoss`` / ``ForMaskedLMLoss``: mean over the positions whose label is
not ``-100``), so ``sum / count`` over one batch equals ``model(**batch).loss``.
Sums are taken in float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor, nn

from symalign.errors import ConfigError

IGNORE = -100
OBJECTIVES = ("causal-lm", "masked-lm", "sequence-classification", "image-classification", "seq2seq")
_SUFFIXES = (
    (("ForCausalLM", "LMHeadModel"), "causal-lm"),
    (("ForMaskedLM",), "masked-lm"),
    (("ForSequenceClassification",), "sequence-classification"),
    (("ForImageClassification",), "image-classification"),
)


def head_objective(model_or_class: nn.Module | type | str, config: object | None = None) -> str:
    """The objective of a model (or class, or class name; ``config``: its config when a class or name is
    given); :class:`ConfigError` for heads without one. Callable on the class a config names, so an
    unsupported checkpoint is refused before its weights are loaded."""
    if isinstance(model_or_class, str):
        name = model_or_class
    else:
        name = (model_or_class if isinstance(model_or_class, type) else type(model_or_class)).__name__
    for suffixes, objective in _SUFFIXES:
        if name.endswith(suffixes):
            return objective
    cfg = config if config is not None else getattr(model_or_class, "config", None)
    if getattr(cfg, "is_encoder_decoder", False):
        if name.endswith("ForConditionalGeneration") and hasattr(model_or_class, "_shift_right"):
            return "seq2seq"
        raise ConfigError(f"{name} is an encoder-decoder (sequence-to-sequence) model and symalign's evaluation "
                          "has no sequence-to-sequence objective for it (it evaluates causal LM, masked LM, "
                          "classification heads and T5-style ...ForConditionalGeneration models), so it cannot "
                          "be interpolated; `symalign align` supports it")
    raise ConfigError(f"{name} has no task head symalign can evaluate; save the model as a ...ForCausalLM, "
                      "...ForMaskedLM, ...ForSequenceClassification, ...ForImageClassification or (T5) "
                      "...ForConditionalGeneration")


@dataclass
class Stats:
    """Summed loss (nats), number of predictions and number correct."""

    loss_sum: float = 0.0
    count: int = 0
    correct: int = 0

    def add(self, other: "Stats") -> None:
        self.loss_sum += other.loss_sum
        self.count += other.count
        self.correct += other.correct


def batch_stats(objective: str, logits: Tensor, labels: Tensor) -> Stats:
    """Statistics of one batch. ``logits``: ``(B, T, V)`` (LM) or ``(B, K)``; ``labels``: ``(B, T)`` token ids
    (causal: the input ids; masked: ``-100`` except at masked positions; seq2seq: the target ids, ``-100`` at
    padding, aligned with the decoder's logits) or ``(B,)`` classes."""
    if objective == "causal-lm":
        logits, labels = logits[:, :-1], labels[:, 1:]
    if objective in ("causal-lm", "masked-lm", "seq2seq"):
        logits = logits.reshape(-1, logits.shape[-1])
        labels = labels.reshape(-1)
        keep = labels != IGNORE
        logits, labels = logits[keep], labels[keep]
    loss = F.cross_entropy(logits.double(), labels, reduction="sum")
    correct = (logits.argmax(-1) == labels).sum()
    return Stats(float(loss), int(labels.numel()), int(correct))


def logits_of(out) -> Tensor:
    """The logits of a model output (ModelOutput, tuple or tensor)."""
    if isinstance(out, Tensor):
        return out
    logits = getattr(out, "logits", None)
    if logits is not None:
        return logits
    if isinstance(out, (tuple, list)):
        return out[0]
    raise ConfigError(f"cannot find logits in a model output of type {type(out).__name__}")


__all__ = ["OBJECTIVES", "IGNORE", "Stats", "head_objective", "batch_stats", "logits_of"]
