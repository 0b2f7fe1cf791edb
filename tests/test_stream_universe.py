"""``merge --universe`` on the one whole-model loop: :class:`symalign.stream.model.StreamedWhole` over rewritten
resident states (:class:`symalign.stream.fold.PreparedSource`), warm-started as
:func:`symalign.match.whole.match_whole`'s ``init``.

The references are ``match_whole`` itself: warm-started from the same element, the loop's squared distances after
every pass are ``match_whole``'s (to rounding); the universe rounds' spreads are those of the ``match_whole`` loop the
merge ran before; transformed copies of one model merge to that model (spread 0); T5 too (its stacks'
self-attention layers share a head space: the loop solves them together).
"""

from __future__ import annotations

import pytest
import torch

from hf_families import make
from hf_tiny import rel

from symalign.families import FAMILIES

# the encoder-decoder family whose self-attention layers share one head space per stack (so it declines --stream):
# the loop solves such blocks together
T5 = next(f.model_types[0] for f in FAMILIES if f.no_stream)


def _ck(tmp_path, name: str, seed: int, family: str = "llama", state=None):
    from symalign.checkpoint.hf import load_checkpoint

    m = make(family, seed=seed)
    if state is not None:
        m.load_state_dict(state)
    m.save_pretrained(tmp_path / name)
    return load_checkpoint(tmp_path / name)


def _prepared(c):
    from symalign.families import prepare

    return prepare(c.config, c.state, c.adapter.spec(c.config, c.state.keys()))


def _old_universe(ckpts, weights, rounds, max_sweeps):
    """The loop ``merge --universe`` ran before: ``match_whole`` on the rewritten states, warm-started."""
    from symalign.checkpoint.average import average_states
    from symalign.match.distance import distance
    from symalign.match.whole import CHECKPOINT_SETTINGS, match_whole
    from symalign.spec import apply

    prepared = [_prepared(c) for c in ckpts]
    ref, transforms, spread = prepared[0].state, [None] * len(prepared), []
    for _ in range(rounds):
        aligned = []
        for k, p in enumerate(prepared):
            res = match_whole(p.spec, ref, p.state, spec_b=prepared[0].spec, init=transforms[k],
                              max_sweeps=max_sweeps, **CHECKPOINT_SETTINGS)
            transforms[k] = res.transform
            aligned.append(apply(p.spec, res.transform, p.state))
        ref = average_states(aligned, weights)
        spread.append(float(sum(distance(prepared[0].spec, ref, a) for a in aligned)))
    return spread


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_warm_started_loop_equals_match_whole_with_init(family, tmp_path):
    """From the same starting element (a random group element), the loop's distances after each pass are
    ``match_whole``'s with ``init`` (no residual initialisation, no anchored first sweep)."""
    from symalign.match.whole import CHECKPOINT_SETTINGS, match_whole
    from symalign.spec import sample
    from symalign.stream.fold import PreparedSource
    from symalign.stream.model import StreamedWhole

    ca, cb = _ck(tmp_path, "A", 0, family), _ck(tmp_path, "B", 1, family)
    pa, pb = _prepared(ca), _prepared(cb)
    init = sample(pb.spec, 5)
    ref = match_whole(pa.spec, pa.state, pb.state, spec_b=pb.spec, init=init, max_sweeps=4, **CHECKPOINT_SETTINGS)
    w = StreamedWhole(PreparedSource(ca, pa), PreparedSource(cb, pb))
    w.match(True, "full", 4, CHECKPOINT_SETTINGS["rtol"], progress=False, init=init)
    dr, dw = ref.to_dict()["distances"], w.distances
    assert len(dw) == len(dr) and all(abs(x - y) <= 1e-9 * dr[0] for x, y in zip(dw, dr)), (dw, dr)
    cold = StreamedWhole(PreparedSource(ca, pa), PreparedSource(cb, pb))
    cold.match(True, "full", 4, CHECKPOINT_SETTINGS["rtol"], progress=False)
    assert cold.distances[1:] != dw[1:]  # the start matters: init is not ignored


def test_prepared_source_equals_the_checkpoint_read_through_the_rewrite(tmp_path):
    """Matching the rewritten states (:class:`PreparedSource`) takes the passes of matching the checkpoints."""
    from symalign.checkpoint.lazy import ResidentCheckpoint
    from symalign.match.whole import CHECKPOINT_SETTINGS
    from symalign.stream.fold import PreparedSource
    from symalign.stream.model import StreamedWhole

    ca, cb = _ck(tmp_path, "A", 0, "gpt2"), _ck(tmp_path, "B", 1, "gpt2")
    ws = [StreamedWhole(PreparedSource(ca, _prepared(ca)), PreparedSource(cb, _prepared(cb))),
          StreamedWhole(ResidentCheckpoint.of(ca), ResidentCheckpoint.of(cb))]
    for w in ws:
        w.match(True, "full", 3, CHECKPOINT_SETTINGS["rtol"], progress=False)
    assert ws[0].distances == ws[1].distances
    t0, t1 = ws[0].transform(), ws[1].transform()
    assert set(t0) == set(t1) and all(torch.equal(t0[k], t1[k]) for k in t0)


@pytest.mark.parametrize("family", ["llama", "gpt2", T5])
@pytest.mark.slow
def test_universe_spreads_equal_the_match_whole_loop(family, tmp_path):
    """Three independent models, two rounds: the spread after each round is the ``match_whole`` loop's."""
    from symalign.stream.universe import universe_states

    ckpts = [_ck(tmp_path, f"M{k}", k, family) for k in range(3)]
    w = [0.5, 0.3, 0.2]
    uni = universe_states(ckpts, w, rounds=2, max_sweeps=4)
    old = _old_universe(ckpts, w, rounds=2, max_sweeps=4)
    assert len(uni.spread) == 2 and all(abs(x - y) <= 1e-8 * old[0] for x, y in zip(uni.spread, old)), (uni.spread, old)


def test_universe_of_transformed_copies_has_no_spread(tmp_path):
    """``B = g . A``, ``C = h . A`` (whole-model group elements on A's rewritten state): every round's spread is 0
    and each aligned state is A's rewritten state."""
    from symalign.checkpoint.hf import load_checkpoint
    from symalign.checkpoint.output import write_checkpoint
    from symalign.spec import apply, sample
    from symalign.stream.universe import universe_states

    ca = _ck(tmp_path, "A", 0)
    pa = _prepared(ca)
    cks = [ca]
    for k, seed in ((1, 3), (2, 4)):
        write_checkpoint(tmp_path / f"C{k}", apply(pa.spec, sample(pa.spec, seed), pa.state), tmp_path / "A")
        cks.append(load_checkpoint(tmp_path / f"C{k}"))
    uni = universe_states(cks, [1 / 3] * 3, rounds=2)
    assert max(uni.spread) <= 1e-16 * sum(float(x.double().pow(2).sum()) for x in pa.state.values())
    for s in uni.states:
        assert max(rel(s[n], pa.state[n]) for n in pa.spec.tensors) <= 1e-8
