r"""Merging checkpoints: the weighted average of aligned state dicts, written like the first checkpoint.

With checkpoints ``theta_1 .. theta_M`` each aligned to the first
(``theta_k' = T_k . theta_k``, ``T_1 = id``; :mod:`symalign.commands.align`) and
weights ``w_k > 0`` (finite) normalised to ``sum_k w_k = 1``, the merged model is

    ``theta = sum_k w_k theta_k'``

per floating tensor (summed in float32 for bfloat16/float16 tensors, in float64
otherwise -- :mod:`symalign.checkpoint.average` states why float32 is as good for 16-bit
storage --, rounded to the first checkpoint's dtype of that tensor); integer tensors are taken
from the first checkpoint.

The merged state is written laid out like the first checkpoint by
:func:`symalign.checkpoint.output.stage_checkpoint` (its non-weight files, its shard
files).

:func:`symalign.stream.universe.universe_states` aligns every checkpoint to their evolving weighted
average instead of to the first (seed 002's universe matching).
"""

from __future__ import annotations

import math
from typing import Sequence

from symalign.errors import ConfigError


def normalise_weights(weights: Sequence[float] | None, n: int) -> list[float]:
    """``weights`` (default uniform) checked and scaled to sum 1: ``n`` of them, each finite and positive
    (a zero weight would drop a model: leave it out instead). They are divided by their largest first,
    so the sum cannot overflow (``1e308, 1e308`` is ``0.5, 0.5``) and the result is finite."""
    if weights is None or len(weights) == 0:
        return [1.0 / n] * n
    if len(weights) != n:
        raise ConfigError(f"--weights has {len(weights)} values for {n} models; give one per model")
    w = [float(x) for x in weights]
    bad = [x for x in w if not (math.isfinite(x) and x > 0)]
    if bad:
        raise ConfigError(f"--weights must be finite and positive (a model weighted 0 is left out instead), "
                          f"got {bad[0]!r} in {w}")
    top = max(w)
    scaled = [x / top for x in w]  # in (0, 1], the largest exactly 1: the sum is in [1, n]
    total = math.fsum(scaled)
    out = [x / total for x in scaled]
    if not all(math.isfinite(x) and x > 0 for x in out):
        raise ConfigError(f"--weights {w}: the normalised weights {out} are not all finite and positive; "
                          "give weights of comparable size")
    return out


__all__ = ["normalise_weights"]
