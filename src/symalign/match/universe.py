r"""Universe matching (seed 002): align many models to an evolving shared reference.

With states ``theta_1..theta_M`` (rewritten built-in models of one config) and the
reference ``U^(0) = theta_1``: in round ``r`` every model is matched to ``U^(r)``
by whole-model weight matching (warm-started from its previous transform),
``theta_k' = T_k . theta_k``, and ``U^(r+1) = mean_k theta_k'``. The merged model is
the final average. Each ``theta_k'`` computes ``theta_k``'s function exactly
(``T_k`` is a symmetry); the merged model is a new model. The spread
``sum_k ||theta_k' - U||^2`` is recorded per round.

The Dirichlet-sampled learned refinement starting from this result is
:func:`symalign.match.learned_many.learn_many`. :func:`symalign.checkpoint.merged.save_merged`
writes a merge as a checkpoint (each file atomically; also importable from here).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from torch import Tensor, nn

from symalign.checkpoint.merged import load_merged, save_merged
from symalign.errors import MatchError
from symalign.match.distance import distance
from symalign.match.whole import check_configs, match_whole
from symalign.spec import SymmetrySpec, Transform


@dataclass
class UniverseMatch:
    """Per-model transforms (``aligned[k] = apply(spec, transforms[k], states[k])``) and the merged state."""

    transforms: list[Transform]
    merged: dict[str, Tensor]
    spread: list[float]
    spec: SymmetrySpec = field(repr=False)
    time_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"models": len(self.transforms), "rounds": len(self.spread), "spread": list(self.spread),
                "time_s": self.time_s}


def mean_state(states: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """The uniform average of state dicts (floating tensors, summed in float64, cast back; others from the first)."""
    out = {}
    for k, v in states[0].items():
        if v.is_floating_point():
            out[k] = (sum(s[k].double() for s in states) / len(states)).to(v.dtype)
        else:
            out[k] = v
    return out


def check_models(models: Sequence[nn.Module]) -> None:
    """At least two models with compatible configs (:class:`MatchError` otherwise)."""
    if len(models) < 2:
        raise MatchError("universe matching needs at least two models")
    cfgs = [getattr(m, "cfg", None) for m in models]
    if all(c is not None for c in cfgs):
        for c in cfgs[1:]:
            check_configs(cfgs[0], c)


def match_universe(models: Sequence[nn.Module], *, rounds: int = 3, **kw) -> UniverseMatch:
    """Universe matching of ``models`` (>= 2, same config); ``kw`` go to :func:`match_whole`."""
    t0 = time.perf_counter()
    check_models(models)
    spec = models[0].symmetry_spec()
    states = [{k: v.detach() for k, v in m.state_dict().items()} for m in models]
    ref = states[0]
    transforms: list[Transform | None] = [None] * len(states)
    spread: list[float] = []
    for _ in range(rounds):
        aligned = []
        for k, st in enumerate(states):
            res = match_whole(spec, ref, st, init=transforms[k], **kw)
            transforms[k] = res.transform
            aligned.append(res.apply(st))
        ref = mean_state(aligned)
        spread.append(sum(distance(spec, ref, a) for a in aligned))
    return UniverseMatch([t for t in transforms if t is not None], ref, spread, spec, time.perf_counter() - t0)




__all__ = ["UniverseMatch", "check_models", "match_universe", "mean_state", "save_merged", "load_merged"]
