r"""The many-model loss barrier over the simplex (seed 002's Dirichlet protocol).

For ``M`` parameter sets ``theta_1..theta_M`` of one architecture (aligned into one frame, or not:
the naive barrier) and a weighting ``w`` in the simplex (``w_k >= 0``, ``sum_k w_k = 1``), the merged
model is ``theta(w) = sum_k w_k theta_k`` (floating tensors; other entries from ``theta_1``) and its
barrier is

    B(w) = L(theta(w)) - sum_k w_k L(theta_k),

with ``L`` the held-out loss (:func:`symalign.lmc.evaluate`: mean cross-entropy, nats); the accuracy
barrier is ``sum_k w_k a_k - a(theta(w))``. For ``M = 2`` and ``w = (1 - t, t)`` these are the
two-model curve's terms at ``t`` (:mod:`symalign.lmc`). The protocol draws ``w^(1..n) ~ Dirichlet(alpha
1_M)`` (``alpha = 1``: uniform on the simplex) from ``numpy.random.default_rng(seed)`` and reports
``max_i B(w^(i))`` and ``mean_i B(w^(i))``; the same ``seed`` gives the same weightings, so naive and
aligned sets of one size are measured at the same points.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Mapping, Sequence

import numpy as np
from torch import Tensor, nn

from symalign.errors import SymalignError
from symalign.lmc import Batches, check_compatible, evaluate


@dataclass
class SimplexBarrier:
    """The draws ``weights[i]``, the merged loss / accuracy at each, the models' own, and the barriers."""

    weights: list[list[float]]
    loss: list[float]
    acc: list[float]
    model_loss: list[float]
    model_acc: list[float]
    alpha: float
    seed: int

    @property
    def barriers(self) -> list[float]:
        """``B(w) = L(theta(w)) - sum_k w_k L_k`` per draw."""
        return [lw - float(np.dot(w, self.model_loss)) for w, lw in zip(self.weights, self.loss)]

    @property
    def acc_barriers(self) -> list[float]:
        """``sum_k w_k a_k - a(theta(w))`` per draw."""
        return [float(np.dot(w, self.model_acc)) - aw for w, aw in zip(self.weights, self.acc)]

    @property
    def max_barrier(self) -> float:
        return max(self.barriers)

    @property
    def mean_barrier(self) -> float:
        return float(np.mean(self.barriers))

    def to_dict(self) -> dict:
        return {**asdict(self), "barriers": self.barriers, "acc_barriers": self.acc_barriers,
                "max_barrier": self.max_barrier, "mean_barrier": self.mean_barrier,
                "max_acc_barrier": max(self.acc_barriers), "mean_acc_barrier": float(np.mean(self.acc_barriers))}


def mix(states: Sequence[Mapping[str, Tensor]], w: Sequence[float]) -> dict[str, Tensor]:
    """``sum_k w_k theta_k`` over floating tensors (in the first state's dtype); other entries from the first."""
    out = {}
    for k, v in states[0].items():
        out[k] = sum(float(wk) * s[k].to(v.dtype) for wk, s in zip(w, states)) if v.is_floating_point() else v
    return out


def dirichlet_weights(m: int, draws: int, alpha: float = 1.0, seed: int = 0) -> np.ndarray:
    """``draws`` weightings ``w ~ Dirichlet(alpha 1_m)`` (``(draws, m)``) from ``default_rng(seed)``."""
    if m < 2 or draws < 1 or not alpha > 0:
        raise SymalignError(f"the simplex barrier needs >= 2 models, >= 1 draw and alpha > 0; got {m} models, "
                            f"{draws} draws, alpha={alpha}")
    return np.random.default_rng(seed).dirichlet(np.full(m, float(alpha)), size=draws)


def simplex_barrier(model: nn.Module, states: Sequence[Mapping[str, Tensor]], batches: Batches,
                    task: str = "classification", draws: int = 16, alpha: float = 1.0,
                    seed: int = 0) -> SimplexBarrier:
    """Measure ``B(w)`` at ``draws`` Dirichlet weightings (module docstring); ``model`` gives the architecture."""
    for s in states[1:]:
        check_compatible(states[0], s)
    ws = dirichlet_weights(len(states), draws, alpha, seed)
    was_training = model.training
    model.eval()
    try:
        own = [evaluate(model, s, batches, task) for s in states]
        at = [evaluate(model, mix(states, w), batches, task) for w in ws]
    finally:
        model.train(was_training)
    return SimplexBarrier([[float(x) for x in w] for w in ws], [a[0] for a in at], [a[1] for a in at],
                          [o[0] for o in own], [o[1] for o in own], float(alpha), int(seed))
