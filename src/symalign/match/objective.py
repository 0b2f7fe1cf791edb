r"""The objective of learned matching: the task loss of interpolated states, and the state plumbing
(``functional_call`` needs each tied parameter once).

``J = mean_{lambda, batches} L((1 - lambda) theta_A + lambda theta_B)`` over evenly spaced ``lambda``
(:func:`interpolated_objective`); ``L`` is the mean cross-entropy by default.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor, nn
from torch.func import functional_call

from symalign.spec import SymmetrySpec

Batch = tuple[Tensor, Tensor]
LossFn = Callable[[Tensor, Tensor], Tensor]


def default_loss(logits: Tensor, y: Tensor) -> Tensor:
    """Mean cross-entropy (classification ``(B, C)``/``(B,)`` or LM ``(B, T, V)``/``(B, T)``)."""
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))



def tied_names(model: nn.Module) -> list[list[str]]:
    """The groups of parameter names that share one parameter (e.g. ``[tok_emb.weight, head.weight]``)."""
    names_of: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    return [names for names in names_of.values() if len(names) > 1]



def functional_state(model: nn.Module, spec: SymmetrySpec) -> dict[str, Tensor]:
    """The model's ``state_dict`` (detached) with each tied parameter once, as ``functional_call``
    needs it (it refuses two values for tied names, e.g. a head tied to the token embedding): of
    the names sharing one parameter, the one the spec labels is kept (else the first)."""
    state = {k: v.detach() for k, v in model.state_dict().items()}
    labelled = set(spec.tensors)
    for names in tied_names(model):
        keep = next((n for n in names if n in labelled), names[0])
        for n in names:
            if n != keep:
                state.pop(n, None)
    return state



def restore_ties(model: nn.Module, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``state`` with the tied names :func:`functional_state` dropped filled in again (same tensor),
    so that it loads with ``model.load_state_dict``."""
    out = dict(state)
    for names in tied_names(model):
        present = next((n for n in names if n in out), None)
        if present is not None:
            for n in names:
                out.setdefault(n, out[present])
    return out



def floating(state: Mapping[str, Tensor]) -> list[str]:
    return [k for k, v in state.items() if v.is_floating_point()]



def mix_states(states: Sequence[Mapping[str, Tensor]], weights: Sequence[float]) -> dict[str, Tensor]:
    """``sum_k w_k theta_k`` over floating tensors (others from the first state); differentiable."""
    out = {}
    for k, v in states[0].items():
        out[k] = sum(w * s[k] for w, s in zip(weights, states)) if v.is_floating_point() else v
    return out



@torch.no_grad()
def mean_loss(model: nn.Module, state: Mapping[str, Tensor], data: Sequence[Batch], loss: LossFn) -> float:
    """Mean over ``data`` of ``loss(model_state(x), y)``."""
    return float(sum(float(loss(functional_call(model, dict(state), (x,)), y)) for x, y in data) / len(data))


LAM = (0.2, 0.8)  # the default lambda range (module docstring: why not seed 002's (0.4, 0.6))


def interpolated_objective(model: nn.Module, state_a: Mapping[str, Tensor], state_b: Mapping[str, Tensor],
                           data: Sequence[Batch], loss: LossFn | None = None, lam: tuple[float, float] = LAM,
                           points: int = 5) -> float:
    """``J = mean_{lambda, batches} L((1 - lambda) A + lambda B)`` on ``points`` evenly spaced ``lambda``."""
    loss = loss or default_loss
    lams = np.linspace(lam[0], lam[1], points) if points > 1 else [0.5 * (lam[0] + lam[1])]
    return float(np.mean([mean_loss(model, mix_states([state_a, state_b], [1 - t, t]), data, loss) for t in lams]))
