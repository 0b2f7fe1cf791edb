"""Attention-layout adapters: the :class:`Adapter` protocol and :func:`layout_spec`, plus the
adapters of GPT-2, BERT, ViT, RoFormer and ModernBERT (one module each).

The registry that picks a family's adapter by ``config.model_type``
(``get_adapter``, ``supported``) is :mod:`symalign.families`, one layer above: it holds
these adapters and the decoder families. See ``docs/adapters.md``.
"""

from __future__ import annotations

from symalign.arch.base import DOCS, Adapter, AttentionLayout, Proj, UnsupportedArchitectureError, layout_spec

__all__ = ["DOCS", "Adapter", "AttentionLayout", "Proj", "UnsupportedArchitectureError", "layout_spec"]
