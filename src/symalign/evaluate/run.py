r"""Evaluating parameter sets on an :class:`~symalign.evaluate.build.EvalSet`, and the interpolation curve.

:func:`evaluate_state` runs the model with the given state dict through
:func:`torch.func.functional_call` (no model copy) on every fixed batch and sums
the statistics of :func:`~symalign.evaluate.objective.batch_stats`:

* ``loss``: mean nats per prediction (token, masked token or example);
* ``accuracy``: fraction of predictions whose arg-max is the label;
* causal LM: ``perplexity = exp(loss)`` and ``loss_per_byte = sum nats / bytes``
  (bytes of the predicted text, when the tokenizer gives offsets).

:func:`eval_curve` evaluates ``theta(t) = (1 - t) theta_A + t theta_B`` at
``points`` evenly spaced ``t`` (:func:`symalign.lmc.interpolate`), reporting each
finished point to ``progress``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable, Mapping

import torch
from torch import Tensor, nn
from torch.func import functional_call

from symalign import lmc
from symalign.errors import SymalignError
from symalign.evaluate.build import EvalSet
from symalign.evaluate.objective import Stats, batch_stats, logits_of


@dataclass
class Metrics:
    """One evaluation: mean loss (nats), accuracy, predictions, and for causal LMs perplexity / nats per byte."""

    loss: float
    accuracy: float
    count: int
    perplexity: float | None = None
    loss_per_byte: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def evaluate_state(model: nn.Module, state: Mapping[str, Tensor], evalset: EvalSet) -> Metrics:
    """Metrics of ``model`` with parameters ``state`` on ``evalset`` (see the module docstring). Each batch is
    moved to the device ``state`` lives on (the batches stay on the CPU between points)."""
    total = Stats()
    dev = next((v.device for v in state.values() if isinstance(v, Tensor)), torch.device("cpu"))
    for batch in evalset.batches:
        batch = {k: (v.to(dev) if isinstance(v, Tensor) else v) for k, v in batch.items()}
        kwargs = {k: v for k, v in batch.items() if k != "labels"}
        logits = logits_of(functional_call(model, dict(state), (), kwargs))
        total.add(batch_stats(evalset.objective, logits, batch["labels"]))
    if total.count == 0:
        raise SymalignError("the evaluation set holds no predictions; give more data")
    loss = total.loss_sum / total.count
    m = Metrics(loss, total.correct / total.count, total.count)
    if evalset.objective == "causal-lm":
        m.perplexity = math.exp(min(loss, 700.0))
        if evalset.n_bytes:
            m.loss_per_byte = total.loss_sum / evalset.n_bytes
    return m


def evaluate_model(model: nn.Module, evalset: EvalSet) -> Metrics:
    """Metrics of ``model`` with its own weights."""
    was = model.training
    model.eval()
    try:
        return evaluate_state(model, lmc.full_state(model), evalset)
    finally:
        model.train(was)


def eval_curve(model: nn.Module, state_a: Mapping[str, Tensor], state_b: Mapping[str, Tensor], evalset: EvalSet,
               points: int = 25, progress: Callable[[int, float], None] | None = None
               ) -> tuple[lmc.Curve, list[Metrics]]:
    """The curve (loss, accuracy) at ``points`` evenly spaced ``t`` and every point's full metrics."""
    if points < 2:
        raise SymalignError(f"an interpolation curve needs at least 2 points, got {points}")
    lmc.check_compatible(state_a, state_b)
    ts = [i / (points - 1) for i in range(points)]
    metrics: list[Metrics] = []
    was = model.training
    model.eval()
    try:
        for i, t in enumerate(ts):
            st = state_a if t == 0.0 else state_b if t == 1.0 else lmc.interpolate(state_a, state_b, t)
            metrics.append(evaluate_state(model, st, evalset))
            del st
            if progress is not None:
                progress(i, t)
    finally:
        model.train(was)
    return lmc.Curve(ts, [m.loss for m in metrics], [m.accuracy for m in metrics]), metrics


__all__ = ["Metrics", "evaluate_state", "evaluate_model", "eval_curve"]
