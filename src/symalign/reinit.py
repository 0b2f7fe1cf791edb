"""Re-initialisation scopes: copy a trained model, re-draw one part from a new seed.

Scopes (parameter-name prefixes of the built-in models):

* ``first-attention``: ``blocks.0.attn.*``
* ``all-attention``: ``blocks.{i}.attn.*`` for every layer
* ``first-block``: ``blocks.0.*`` (norms, attention, MLP)
* ``full``: every parameter

A model may define its own mapping as ``scope_names(scope) -> set of parameter names``
(Hugging Face families: :meth:`symalign.models.hf.HFModel.scope_names`, which reads
the attention tensors of each layer from the family's adapter);
:func:`scope_names` uses it when present.

The re-initialised values are exactly those of ``build_model(cfg, seed)``.
Parameters a model keeps fixed (``requires_grad=False`` when built, e.g. RoFormer's
sinusoidal table) stay fixed.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from symalign.errors import ConfigError
from symalign.models.config import SCOPES


def in_scope(name: str, scope: str) -> bool:
    """Whether parameter ``name`` of a built-in model belongs to ``scope``."""
    if scope == "full":
        return True
    if scope == "first-attention":
        return name.startswith("blocks.0.attn.")
    if scope == "all-attention":
        parts = name.split(".")
        return len(parts) > 2 and parts[0] == "blocks" and parts[2] == "attn"
    if scope == "first-block":
        return name.startswith("blocks.0.")
    raise ConfigError(f"unknown re-initialisation scope {scope!r}; use one of {', '.join(SCOPES)}")


def scope_names(model: nn.Module, scope: str) -> set[str]:
    """The names of ``model``'s parameters that ``scope`` covers."""
    if scope not in SCOPES:
        in_scope("", scope)  # raises with the list of scopes
    own = getattr(model, "scope_names", None)
    if callable(own):
        return set(own(scope))
    return {n for n, _ in model.named_parameters() if in_scope(n, scope)}


def reinit(base: nn.Module | str | Path, scope: str, seed: int, freeze: bool = False
           ) -> tuple[nn.Module, list[str]]:
    """A copy of ``base`` (a model or a checkpoint path) whose ``scope`` parameters are re-drawn
    from ``seed``; the rest are copied. With ``freeze``, parameters outside the scope get
    ``requires_grad=False``. Returns ``(model, re-initialised parameter names)``."""
    from symalign.models import build_model

    if isinstance(base, (str, Path)):
        from symalign.checkpoint import load_model

        base, _ = load_model(base)
    if scope not in SCOPES:
        in_scope("", scope)  # raises with the list of scopes
    fresh = build_model(base.cfg, seed=seed).to(next(base.parameters()).device)
    keep = scope_names(fresh, scope)
    names = [n for n, _ in fresh.named_parameters() if n in keep]
    with torch.no_grad():
        base_params = dict(base.named_parameters())
        for n, p in fresh.named_parameters():
            if n not in keep:
                p.copy_(base_params[n])
            p.requires_grad_(p.requires_grad and (n in keep or not freeze))
        base_buffers = dict(base.named_buffers())
        for n, b in fresh.named_buffers():
            b.copy_(base_buffers[n])
    return fresh, names
