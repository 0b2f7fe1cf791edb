r"""The one block-coordinate descent loop of whole-model matching, over any residency of the tensors.

Whole-model matching (seed 002, git re-basin's loop for any spec) minimises
``D(g) = sum_t ||A_t - (g . B)_t||^2`` over ``g = (g_s)`` by sweeps: in each sweep every space ``s``
takes the exact (or, for attention, the matcher's) minimiser of ``D`` given all the others, so
``D`` never rises. Two residencies run that sweep:

* the whole states in memory (:func:`symalign.match.whole.match_whole`: traced modules, built-in
  models): every unit space, then the attention spaces, then the residual stream;
* one layer of each model at a time (:class:`symalign.stream.model.StreamedWhole`: checkpoints, lazily
  read or resident): per layer its unit spaces and attention given the residual element ``O``, with
  the layer's share of the residual cross-Gram ``M`` accumulated, then ``O = nearest(M)``. Given ``O``
  the layers share no space, so this visits the same blocks with the same minimisers.

Both hand one sweep to :func:`descend` as a function of the sweep's index; the loop, the distances
recorded, the count of moved spaces and the stopping rule are here and nowhere else:

``converged`` when a sweep lowers ``D`` by at most ``rtol * D(identity)`` (or reaches
``1e-20 * D(identity)``), except after an *initialising* sweep -- the anchored first sweep that solved
some space on part of its tensors, which may end above the identity -- else after ``max_sweeps`` sweeps.
Because every block step is an exact minimiser, a sweep lowers ``D`` by the sum of its blocks'
decreases: the rule means no block improved by more than ``rtol * D(identity)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from symalign.errors import MatchError


@dataclass
class SweepReport:
    """What one sweep reports to :func:`descend`.

    ``distance``: ``D(g)`` after the sweep; ``moved``: unit spaces that took a new element (lowered their block
    distance by more than ``1e-12 * D(identity)``); ``unaligned``: ``D(identity)`` for a residency that sums it
    during its first sweep (one read of each layer; ``None`` when :func:`descend` was given it);
    ``initialising``: this was an anchored first sweep that solved some space on part of its tensors."""

    distance: float
    moved: int
    unaligned: float | None = None
    initialising: bool = False


@dataclass
class Descent:
    """The loop's record: ``distances[0] = D(identity)``, ``distances[k]`` after sweep ``k``; ``changes[k]``:
    spaces moved in sweep ``k + 1``; ``converged``: the last sweep met the stopping rule."""

    distances: list[float]
    changes: list[int]
    converged: bool


def stops(distances: list[float], rtol: float) -> bool:
    """The stopping rule on ``distances`` (``[D(identity), ..., previous, last]``): the last sweep lowered
    ``D`` by at most ``rtol * D(identity)``, or ``D`` reached ``1e-20 * D(identity)``."""
    d0, prev, d = distances[0], distances[-2], distances[-1]
    return prev - d <= rtol * d0 or d <= 1e-20 * d0


def descend(sweep: Callable[[int], SweepReport], *, max_sweeps: int, rtol: float, unaligned: float | None = None,
            progress: Callable[[int, float], None] | None = None, record: Descent | None = None) -> Descent:
    """Run ``sweep(0), sweep(1), ...`` until :func:`stops` (not after an initialising sweep) or ``max_sweeps``.

    ``unaligned``: ``D(identity)`` when known before the first sweep (else the first report gives it);
    ``progress``: called after every sweep with ``(sweep, distance)``; ``record``: an empty record to fill as the
    sweeps run (a progress callback may read it), returned. A non-finite distance raises :class:`MatchError` (NaN
    weights that passed the input checks, an overflow)."""
    if max_sweeps < 1:
        raise MatchError(f"max_sweeps must be at least 1, got {max_sweeps}")
    rec = record if record is not None else Descent([], [], False)
    distances, changes = rec.distances, rec.changes
    if unaligned is not None:
        distances.append(float(unaligned))
    for k in range(max_sweeps):
        r = sweep(k)
        if not distances:
            if r.unaligned is None:
                raise MatchError("internal error: the first sweep did not report the unaligned distance")
            distances.append(float(r.unaligned))
        if not math.isfinite(r.distance):
            raise MatchError("whole-model matching produced a non-finite distance; check the inputs")
        distances.append(float(r.distance))
        changes.append(int(r.moved))
        if progress is not None:
            progress(k + 1, r.distance)
        if not r.initialising and stops(distances, rtol):
            rec.converged = True
            break
    return rec
