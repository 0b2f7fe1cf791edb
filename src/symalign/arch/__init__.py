"""Family-independent attention machinery: the :class:`Adapter` protocol, :class:`AttentionLayout`
and :func:`layout_spec` (layouts -> spec), RoPE widths (:mod:`symalign.arch.rope`), unfused
views of fused tensors (:mod:`symalign.arch.fused`) and the functional check
(:mod:`symalign.arch.check`).

No module here knows a family: every family is one module of :mod:`symalign.families`,
one layer above, whose registry (``get_adapter``, ``supported``) picks it by
``config.model_type``. See ``docs/adapters.md``.
"""

from __future__ import annotations

from symalign.arch.base import DOCS, Adapter, AttentionLayout, Proj, UnsupportedArchitectureError, layout_spec

__all__ = ["DOCS", "Adapter", "AttentionLayout", "Proj", "UnsupportedArchitectureError", "layout_spec"]
