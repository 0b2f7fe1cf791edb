r"""Activation sites: where a forward pass shows the activations a symmetry space acts on.

Activation matching (:func:`symalign.match.activations.match_activations`) reads no module
names: a model that supports it lists its sites, ``model.activation_sites()`` (the built-in
models, :class:`symalign.models.hf.HFModel` through its family adapter), and the matcher
records them with forward pre-hooks. A site is the **input** of one module:

* role ``residual``: the residual stream ``h`` (``(..., D)``) -- the input of every block and
  of the final norm; a space may have several sites (their statistics are summed);
* role ``ff``: the FF hidden units after the nonlinearity (``(..., d_ff)``) -- the input of the
  FF output projection (for a gated FF, ``act(gate) * up``);
* role ``heads``: each head's contribution to the stream ``y_k = W_O^k z_k`` -- the input ``z``
  of the attention output projection (``(..., h d)``, heads concatenated) mapped by
  :attr:`ActivationSite.read` to ``(N, h, D)`` (:func:`head_outputs`).

A site's ``space`` is a space name of the model's symmetry spec; a space the spec does not
declare is skipped by the matcher. Rows are flattened over batch and positions (``N`` rows)
and kept in float64.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class ActivationSite:
    """The input of ``module`` shows the activations space ``space`` acts on (module docstring).

    ``read``: maps the input to the recorded rows; ``None``: the last axis is the feature
    axis, rows ``(N, n)``.
    """

    space: str
    module: nn.Module
    read: Callable[[Tensor], Tensor] | None = None

    def rows(self, x: Tensor) -> Tensor:
        """The recorded activations of input ``x``: ``read(x)``, else ``x`` as float64 ``(N, n)``."""
        x = x.detach()
        if self.read is not None:
            return self.read(x)
        return x.to(torch.float64).reshape(-1, x.shape[-1])


@runtime_checkable
class HasActivationSites(Protocol):
    """A model that supports activation matching."""

    def activation_sites(self) -> list[ActivationSite]: ...


def head_outputs(z: Tensor, w_out: Tensor, n_heads: int) -> Tensor:
    r"""Per-head contributions ``y_k = W_O^k z_k`` (float64, ``(N, h, D)``).

    ``z``: the output projection's input ``(..., h d)`` (head ``k`` at entries ``k d .. (k + 1) d``);
    ``w_out``: the projection as a ``(D, h d)`` matrix (``nn.Linear.weight``; transpose a GPT-2
    ``Conv1D`` weight). ``sum_k y_k + b_O`` is the attention output.
    """
    d = w_out.shape[1] // n_heads
    zz = z.to(torch.float64).reshape(-1, n_heads, d)
    w = w_out.detach().to(torch.float64).reshape(w_out.shape[0], n_heads, d)
    return torch.einsum("nkd,Dkd->nkD", zz, w)


def linear_heads_site(space: str, o_proj: nn.Module, n_heads: int, transposed: bool = False) -> ActivationSite:
    """The ``heads`` site of an output projection ``o_proj`` (``nn.Linear``, or ``transposed``: a weight
    stored ``(h d, D)`` such as GPT-2's ``Conv1D``); its weight is read at each call."""
    def read(z: Tensor) -> Tensor:
        w = o_proj.weight
        return head_outputs(z, w.T if transposed else w, n_heads)

    return ActivationSite(space, o_proj, read)


def module_input(args: tuple, kwargs: dict[str, Any]) -> Tensor:
    """The tensor a module was called on: its first positional argument, else ``hidden_states``
    (transformers layers may be called with keywords only)."""
    if args and isinstance(args[0], Tensor):
        return args[0]
    x = kwargs.get("hidden_states")
    if isinstance(x, Tensor):
        return x
    raise TypeError("an activation site's module was called without a tensor input")


__all__ = ["ActivationSite", "HasActivationSites", "head_outputs", "linear_heads_site", "module_input"]
