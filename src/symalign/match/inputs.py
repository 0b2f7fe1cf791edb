"""Checks on the two state dicts a matcher receives (one place for the messages).

:func:`check_pair`: every named tensor exists in A and B, with the same shape and only
finite entries. :func:`check_spec_fits`: the spec's axes fit both states
(:meth:`symalign.spec.SymmetrySpec.check`). Both raise :class:`~symalign.errors.MatchError`
naming the tensor and the model.
"""

from __future__ import annotations

from typing import Iterable, Mapping

from torch import Tensor

from symalign.errors import MatchError, SymalignError
from symalign.spec import SymmetrySpec
from symalign.tolerance import all_finite


def check_pair(names: Iterable[str], state_a: Mapping[str, Tensor], state_b: Mapping[str, Tensor],
               context: str = "", missing_hint: str = "", shape_hint: str = "") -> None:
    """Every tensor of ``names`` is in both states, with equal shapes and finite entries.

    ``context`` prefixes each message (e.g. ``"layer '0': "``); the hints follow a missing
    tensor or a shape mismatch (what usually causes it).
    """
    for t in names:
        for who, st in (("A", state_a), ("B", state_b)):
            if t not in st:
                raise MatchError(f"{context}model {who} has no tensor {t!r}{missing_hint}")
        xa, xb = state_a[t], state_b[t]
        if xa.shape != xb.shape:
            raise MatchError(f"{context}tensor {t!r} has shape {tuple(xa.shape)} in A but {tuple(xb.shape)} in B"
                             f"{shape_hint}")
        for who, x in (("A", xa), ("B", xb)):
            if x.is_floating_point() and not all_finite(x):
                raise MatchError(f"{context}tensor {t!r} of model {who} has NaN or Inf entries")


def check_spec_fits(spec: SymmetrySpec, state_a: Mapping[str, Tensor], state_b: Mapping[str, Tensor]) -> None:
    """The spec's axes and sizes fit both state dicts."""
    try:
        spec.check(state_a)
        spec.check(state_b)
    except SymalignError as e:
        raise MatchError(f"the spec does not fit the state dicts: {e}") from e
