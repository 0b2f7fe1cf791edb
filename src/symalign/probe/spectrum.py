r"""Reading a nullity off singular values: the rank cut, the gap check, the near-null spectrum.

With ``s_1 >= s_2 >= ...`` the singular values of the (equilibrated) Jacobian
``J S`` (``m x P``), the measured nullity is ``P - #{s_i > tol s_1}``; ``P - min(m, P)``
of it are directions an ``m x P`` matrix with ``m < P`` has no singular value for.

**Clean gap.** In float64 exact null directions give ``s_i ~ 1e-16 .. 1e-13 s_1``
and the genuine singular values of the layers we probe are far above ``1e-7 s_1``.
A singular value inside the band ``(tol / margin, tol * margin] s_1`` (default
``(1e-11, 1e-7]``) cannot be called null or non-null with confidence: it is either
a true null direction spoiled by rounding (float32 arithmetic inside the module) or
a genuine but tiny singular value. The nullity then depends on where the cut is,
so :func:`analyse` refuses (:class:`AmbiguousSpectrumError`, naming the values and
the gap on either side) rather than report one.

**Near-null spectrum.** Singular values counted as rank but small -- below
``1e-3 s_1`` and ``1e-4 s_1`` -- are *approximate* symmetries: directions that
change the function, but only slightly (RoPE planes that barely rotate over the
context are the typical case). They are reported, not counted, as
``near_null = {"1e-3": n, "1e-4": n}``. The values are relative to the largest
singular value of the equilibrated ``J S`` (each parameter tensor's columns scaled
to unit rms), so they compare directions on a common scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from symalign.errors import SymalignError

DEFAULT_TOL = 1e-9
"""Relative singular-value threshold of the rank cut (float64)."""

GAP_MARGIN = 100.0
"""A clean spectrum has no singular value within this factor of ``tol`` (either side)."""

NEAR_NULL = (1e-3, 1e-4)
"""Relative thresholds of the near-null counts."""


class AmbiguousSpectrumError(SymalignError):
    """The singular values have no clean gap at the rank cut: the nullity is not determined."""


@dataclass
class Spectrum:
    """The reading of one singular-value spectrum (values relative to ``s_1``).

    ``gap = s_rank / s_{rank+1}`` (``inf`` when nothing is null); ``smallest_kept``
    and ``largest_null`` are ``s_rank / s_1`` and ``s_{rank+1} / s_1`` (``None`` when
    absent); ``near_null`` counts non-null values below each of :data:`NEAR_NULL`.
    """

    nullity: int
    rank: int
    gap: float
    smallest_kept: float | None
    largest_null: float | None
    near_null: dict[str, int] = field(default_factory=dict)
    ambiguous: list[float] = field(default_factory=list)


def _fmt(x: float) -> str:
    return f"{x:.1e}"


def analyse(s: Tensor, parameters: int, tol: float = DEFAULT_TOL, margin: float = GAP_MARGIN,
            refuse: bool = True, what: str = "the Jacobian") -> Spectrum:
    """Rank, nullity, gap and near-null counts of the singular values ``s`` (descending) of an ``m x P`` matrix.

    Raises :class:`AmbiguousSpectrumError` when ``refuse`` and some ``s_i / s_1`` lies in
    ``(tol / margin, tol * margin]`` (see the module docstring).
    """
    s = s.detach().to(torch.float64)
    if s.numel() == 0 or float(s[0]) == 0.0:
        return Spectrum(parameters, 0, math.inf, None, None, {_key(t): 0 for t in NEAR_NULL})
    rel = s / s[0]
    rank = int((rel > tol).sum())
    kept = float(rel[rank - 1]) if rank > 0 else None
    null = float(rel[rank]) if rank < rel.numel() else None
    gap = kept / null if kept is not None and null is not None and null > 0 else math.inf
    near = {_key(t): int(((rel > tol) & (rel < t)).sum()) for t in NEAR_NULL}
    band = rel[(rel > tol / margin) & (rel <= tol * margin)]
    spec = Spectrum(parameters - rank, rank, gap, kept, null, near, [float(x) for x in band])
    if refuse and band.numel():
        above = rel[rel > tol * margin]
        below = rel[rel <= tol / margin]
        low = int((band <= tol).sum())
        shown = ", ".join(_fmt(float(x)) for x in band[:8]) + (", ..." if band.numel() > 8 else "")
        raise AmbiguousSpectrumError(
            f"no clean gap in the singular values of {what}: {band.numel()} lie between "
            f"{_fmt(tol / margin)} and {_fmt(tol * margin)} of the largest ({shown}); the nearest clean values are "
            f"{_fmt(float(above[-1])) if above.numel() else 'none'} above and "
            f"{_fmt(float(below[0])) if below.numel() else 'none'} below, so the nullity is anywhere from "
            f"{parameters - rank - low} to {parameters - rank + band.numel() - low} "
            f"(rounding in lower-precision arithmetic, or genuinely tiny singular values); not reporting one")
    return spec


def _key(t: float) -> str:
    return f"{t:.0e}".replace("e-0", "e-")
