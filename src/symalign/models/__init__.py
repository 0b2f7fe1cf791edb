"""Built-in Transformers (ViT, GPT, text encoder) with pluggable positional encodings.

:func:`build_model` makes one from a :class:`ModelConfig`; every model has
``symmetry_spec()`` declaring its exact parameter symmetries.
"""

from __future__ import annotations

from torch import nn

from symalign.models.config import ModelConfig
from symalign.models.encoder import Encoder
from symalign.models.gpt import GPT
from symalign.models.vit import ViT

MODEL_CLASSES = {"vit": ViT, "gpt": GPT, "encoder": Encoder}


def build_model(cfg: ModelConfig | dict, seed: int | None = 0) -> nn.Module:
    """A fresh model for ``cfg``, initialised from ``seed`` (``None``: PyTorch's default init)."""
    if isinstance(cfg, dict):
        cfg = ModelConfig.from_dict(cfg)
    model = MODEL_CLASSES[cfg.family](cfg)
    if seed is not None:
        model.reset_parameters(seed)
    return model


__all__ = ["ModelConfig", "build_model", "GPT", "ViT", "Encoder", "MODEL_CLASSES"]
