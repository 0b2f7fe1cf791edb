r"""Seed 002's universe matching on Hugging Face checkpoints (``symalign merge --universe``), on the one
whole-model loop.

Every checkpoint ``theta_k`` is rewritten exactly in its own format once (:func:`symalign.families.prepare`:
norm gains folded; the symmetries then act on the rewritten tensors). With ``U^(0) = theta_1`` and weights
``w_k`` (summing to 1), round ``r`` matches every ``theta_k`` to ``U^(r)``,

    ``T_k^(r) = argmin_T ||U^(r) - T . theta_k||^2``   (warm-started from ``T_k^(r-1)``),

sets ``theta_k' = T_k^(r) . theta_k`` and ``U^(r+1) = sum_k w_k theta_k'``. Each match is
:class:`~symalign.stream.model.StreamedWhole`'s passes over the two resident, already rewritten states
(:class:`~symalign.stream.fold.PreparedSource`; ``init`` warm-starts them as ``match_whole``'s ``init`` does), so
a universe merge takes the same steps as a pairwise ``--scope model`` merge.

The spread ``sum_k ||theta_k' - U^(r+1)||^2`` is recorded per round; it is 0 for transformed copies of one model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from torch import Tensor

from symalign.checkpoint.average import average_states
from symalign.errors import ConfigError
from symalign.match.whole import CHECKPOINT_SETTINGS


@dataclass
class UniverseStates:
    """The aligned, rewritten states of the last round (input order), whether the rewrite untied the head (the
    merged model is then written untied), and the spread after each round."""

    states: list[dict[str, Tensor]]
    untied: bool
    spread: list[float]


def universe_states(ckpts: Sequence[Any], weights: Sequence[float], rounds: int = 3, stage2: str = "full",
                    experts: str = "exact", max_sweeps: int = 20, device: Any = None) -> UniverseStates:
    """Universe matching of loaded checkpoints (:class:`~symalign.checkpoint.hf.HFCheckpoint`, same architecture)
    with normalised ``weights``: ``rounds`` rounds (module docstring), ``stage2`` and ``experts`` as for a pairwise
    whole-model match, at most ``max_sweeps`` passes per match; ``device``: where the passes compute."""
    from symalign.families import prepare
    from symalign.match.distance import distance
    from symalign.spec import apply
    from symalign.stream.fold import PreparedSource
    from symalign.stream.model import StreamedWhole

    if rounds < 1:
        raise ConfigError(f"--rounds must be at least 1, got {rounds}")
    prepared = [prepare(c.config, c.state, c.adapter.spec(c.config, c.state.keys())) for c in ckpts]
    sources = [PreparedSource(c, p) for c, p in zip(ckpts, prepared)]  # each model's rewritten state, once
    ref = prepared[0].state
    transforms: list[Any] = [None] * len(prepared)
    spread: list[float] = []
    aligned: list[dict[str, Tensor]] = []
    for _ in range(rounds):
        u = PreparedSource(ckpts[0], prepared[0], state=ref)  # U^(r), served as checkpoint 1's rewritten state
        aligned = []
        for k, p in enumerate(prepared):
            w = StreamedWhole(u, sources[k], experts, device)
            w.match(True, stage2, max_sweeps, CHECKPOINT_SETTINGS["rtol"], progress=False, init=transforms[k])
            transforms[k] = w.transform()
            aligned.append(apply(p.spec, transforms[k], p.state))
        ref = average_states(aligned, weights)
        spread.append(float(sum(distance(prepared[0].spec, ref, a) for a in aligned)))
    return UniverseStates(aligned, any(p.untied for p in prepared), spread)


__all__ = ["UniverseStates", "universe_states"]
