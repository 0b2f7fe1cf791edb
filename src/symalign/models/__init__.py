"""Built-in Transformers (ViT, GPT, text encoder) with pluggable positional encodings,
and Hugging Face families (``family = "hf:<model_type>"``, :mod:`symalign.models.hf`).

:func:`build_model` makes one from a :class:`ModelConfig` (or an
:class:`~symalign.models.hf.HFConfig`); every model has ``symmetry_spec()``
declaring its exact parameter symmetries.
"""

from __future__ import annotations

from torch import nn

from symalign.models.config import ModelConfig
from symalign.models.encoder import EncoderClassifier
from symalign.models.gpt import GPT
from symalign.models.hf import HFConfig, is_hf_family
from symalign.models.vit import ViT

MODEL_CLASSES = {"vit": ViT, "gpt": GPT, "encoder": EncoderClassifier}


def config_from_dict(d: dict) -> ModelConfig | HFConfig:
    """The model config a ``to_dict()`` came from (a checkpoint's ``config.json`` ``model`` entry)."""
    if is_hf_family(d.get("family")):
        return HFConfig.from_dict(d)
    return ModelConfig.from_dict(d)


def build_model(cfg: ModelConfig | HFConfig | dict, seed: int | None = 0) -> nn.Module:
    """A fresh model for ``cfg``, initialised from ``seed`` (``None``: PyTorch's default init)."""
    if isinstance(cfg, dict):
        cfg = config_from_dict(cfg)
    if isinstance(cfg, HFConfig):
        from symalign.models.hf import HFModel

        return HFModel(cfg, seed=seed)
    model = MODEL_CLASSES[cfg.family](cfg)
    if seed is not None:
        model.reset_parameters(seed)
    return model


__all__ = ["ModelConfig", "HFConfig", "build_model", "config_from_dict", "GPT", "ViT", "EncoderClassifier",
           "MODEL_CLASSES"]
