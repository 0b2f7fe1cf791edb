"""Derive a module's exact symmetry spec from its graph: :func:`trace` (see :mod:`symalign.tracing.api`)."""

from symalign.tracing.align import ModuleAlignment, align_states
from symalign.tracing.api import Skipped, TraceResult, check_spec, trace

__all__ = ["trace", "TraceResult", "Skipped", "check_spec", "align_states", "ModuleAlignment"]
