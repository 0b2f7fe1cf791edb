"""Unfused views of fused tensors, for solvers that do not read ``AxisAction.segment``.

GPT-2's ``c_attn`` and ModernBERT's ``Wqkv`` hold Q, K and V side by side on
one axis, labelled with ``segment=(start, length)``. :func:`split_segments`
returns an equivalent spec in which every segment is its own (virtual) tensor
``"<name>[<start>:<end>]"`` and the state dicts cut accordingly. Spaces, groups
and couplings are unchanged, so a transform found on the split view is a
transform of the original spec: ``apply(spec, t, state)`` restricted to a
segment equals ``apply(split_spec, t, split_state)`` on its virtual tensor.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping

from torch import Tensor

from symalign.spec import SymmetrySpec, segment_view


def segment_name(tensor: str, segment: tuple[int, ...]) -> str:
    tail = f"::{segment[2]}" if len(segment) > 2 else ""
    return f"{tensor}[{segment[0]}:{segment[0] + segment[1]}{tail}]"


def split_segments(spec: SymmetrySpec, *states: Mapping[str, Tensor]) -> tuple[SymmetrySpec, list[dict[str, Tensor]]]:
    """The spec with one virtual tensor per segment, and each state restricted to the labelled tensors."""
    out = SymmetrySpec(dict(spec.spaces), {}, dict(spec.couplings), dict(spec.info))
    cuts: dict[str, tuple[str, int, tuple[int, ...] | None]] = {}
    for t, acts in spec.tensors.items():
        for a in acts:
            name = t if a.segment is None else segment_name(t, a.segment)
            out.tensors.setdefault(name, []).append(replace(a, segment=None))
            cuts[name] = (t, a.axis, a.segment)
    views = []
    for st in states:
        view = {}
        for name, (t, axis, seg) in cuts.items():
            x = st[t]
            view[name] = x if seg is None else segment_view(x, axis, seg)
        views.append(view)
    return out, views
