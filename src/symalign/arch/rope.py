"""What a family's RoPE actually rotates, read from its own rotary module.

The rotated width is ``2 * len(inv_freq)`` of the family's ``*RotaryEmbedding``
built from the config: this honours ``partial_rotary_factor`` exactly when the
model does (Llama's default RoPE, for instance, ignores it), so the declared
group ``H(r) (+) GL(d - r)`` is never larger than the true one.
"""

from __future__ import annotations

import importlib
from typing import Any

from symalign.errors import ConfigError


def rotary_module(config: Any, model_type: str | None = None):
    """Instantiate ``transformers.models.<type>.modeling_<type>.*RotaryEmbedding(config)``."""
    mt = model_type or config.model_type
    mod = importlib.import_module(f"transformers.models.{mt}.modeling_{mt}")
    names = [n for n in dir(mod) if n.endswith("RotaryEmbedding") and not n.startswith("_")]
    if not names:
        raise ConfigError(f"transformers' {mt} has no rotary embedding module")
    cls = getattr(mod, min(names, key=len))
    return cls(config=config)


def rotary_dims(config: Any, head_dim: int, layer_type: str | None = None) -> int:
    """Rotated width per head; ``layer_type`` picks the per-type table (ModernBERT global/local)."""
    rot = rotary_module(config)
    name = f"{layer_type}_inv_freq" if layer_type else "inv_freq"
    inv = getattr(rot, name)
    r = 2 * int(inv.numel())
    if not 0 < r <= head_dim:
        raise ConfigError(f"{config.model_type}: RoPE rotates {r} of head_dim={head_dim} dimensions")
    return r
