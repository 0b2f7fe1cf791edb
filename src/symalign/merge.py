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

:func:`universe_states` aligns every checkpoint to their evolving weighted
average instead of to the first (seed 002's universe matching).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from torch import Tensor

from symalign.checkpoint import average
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


def average_states(states: Sequence[Mapping[str, Tensor]], weights: Sequence[float]) -> dict[str, Tensor]:
    """``sum_k w_k states[k]`` per floating tensor (first state's dtype; summed in float32 for 16-bit dtypes,
    float64 otherwise: :mod:`symalign.checkpoint.average`); others from the first."""
    out: dict[str, Tensor] = {}
    for name, ref in states[0].items():
        if ref.is_floating_point():
            out[name] = average.weighted_average([s[name] for s in states], weights, ref.dtype)
        else:
            out[name] = ref
    return out




def universe_states(ckpts: list[Any], weights: list[float], rounds: int = 3, stage2: str = "full",
                    experts: str = "exact") -> tuple[list[dict], bool, list[float]]:
    r"""Seed 002's universe matching on Hugging Face checkpoints (whole-model symmetries).

    Every checkpoint is rewritten exactly in its own format
    (:func:`symalign.families.prepare`); with ``U^(0) = theta_1``, round ``r``
    matches every ``theta_k`` to ``U^(r)`` (:func:`symalign.match.whole.match_whole`,
    warm-started from its previous transform), ``theta_k' = T_k . theta_k`` and
    ``U^(r+1) = sum_k w_k theta_k'``; ``experts``: the mixture-of-experts method of ``match_whole``.
    Returns the aligned states of the last round, whether the head was untied, and the spread
    ``sum_k ||theta_k' - U||^2`` per round.
    """
    from symalign.match.distance import distance
    from symalign.families import prepare
    from symalign.match.whole import CHECKPOINT_SETTINGS, match_whole
    from symalign.spec import apply

    if rounds < 1:
        raise ConfigError(f"--rounds must be at least 1, got {rounds}")
    prepared = [prepare(c.config, c.state, c.adapter.spec(c.config, c.state.keys())) for c in ckpts]
    ref = prepared[0].state
    transforms: list[Any] = [None] * len(prepared)
    spread: list[float] = []
    aligned: list[dict] = []
    for _ in range(rounds):
        aligned = []
        for k, p in enumerate(prepared):
            res = match_whole(p.spec, ref, p.state, spec_b=prepared[0].spec, init=transforms[k], stage2=stage2,
                              experts=experts, **CHECKPOINT_SETTINGS)  # as the streamed merge aligns
            transforms[k] = res.transform
            aligned.append(apply(p.spec, res.transform, p.state))
        ref = average_states(aligned, weights)
        spread.append(float(sum(distance(prepared[0].spec, ref, a) for a in aligned)))
    return aligned, any(p.untied for p in prepared), spread


__all__ = ["average_states", "normalise_weights", "universe_states"]
