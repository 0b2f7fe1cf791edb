"""The one block-coordinate descent loop (:mod:`symalign.match.descent`): its stopping rule, and both
residencies of whole-model matching -- whole states (``match_whole``) and one layer at a time
(``StreamedWhole``, checkpoints) -- run through it and agree sweep by sweep on the same prepared pair."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from hf_families import make
from symalign.checkpoint.hf import load_checkpoint
from symalign.checkpoint.lazy import ResidentCheckpoint
from symalign.errors import MatchError
from symalign.match import descent
from symalign.match.descent import SweepReport, descend, stops


def _reports(ds, initialising=()):
    def sweep(k):
        return SweepReport(ds[k], moved=k, initialising=k in initialising)
    return sweep


def test_stops_when_a_sweep_gains_at_most_rtol_of_the_unaligned_distance():
    out = descend(_reports([5.0, 4.0, 3.95, 3.0]), max_sweeps=10, rtol=0.01, unaligned=10.0)
    assert out.converged and out.distances == [10.0, 5.0, 4.0, 3.95] and out.changes == [0, 1, 2]
    out = descend(_reports([5.0, 4.0, 3.0]), max_sweeps=3, rtol=0.01, unaligned=10.0)
    assert not out.converged and len(out.distances) == 4
    assert stops([10.0, 1e-21], 0.0) and not stops([10.0, 5.0], 0.0)


def test_an_initialising_sweep_never_stops_the_descent():
    """An anchored first sweep that solved a space on part of its tensors may end above the identity: no stop there."""
    sweep = _reports([12.0, 4.0, 4.0], initialising={0})
    out = descend(sweep, max_sweeps=10, rtol=0.01, unaligned=10.0)
    assert out.distances == [10.0, 12.0, 4.0, 4.0] and out.converged
    plain = descend(_reports([12.0, 4.0, 4.0]), max_sweeps=10, rtol=0.01, unaligned=10.0)
    assert plain.distances == [10.0, 12.0]  # the same sweep not flagged stops at once


def test_unaligned_from_the_first_report_a_live_record_and_errors():
    seen = []
    rec = descent.Descent([], [], False)

    def progress(k, d):
        seen.append((k, d, list(rec.distances)))

    def sweep(k):
        return SweepReport(3.0 - k, 1, unaligned=4.0 if k == 0 else None)

    out = descend(sweep, max_sweeps=2, rtol=0.0, progress=progress, record=rec)
    assert out is rec and rec.distances == [4.0, 3.0, 2.0]
    assert seen == [(1, 3.0, [4.0, 3.0]), (2, 2.0, [4.0, 3.0, 2.0])]
    with pytest.raises(MatchError, match="non-finite"):
        descend(_reports([math.nan]), max_sweeps=2, rtol=0.0, unaligned=1.0)
    with pytest.raises(MatchError, match="max_sweeps"):
        descend(_reports([1.0]), max_sweeps=0, rtol=0.0, unaligned=1.0)


def _pair(tmp: Path, family: str) -> tuple[Path, Path]:
    out = []
    for seed, name in ((0, "A"), (1, "B")):
        make(family, dtype=torch.float64, seed=seed).save_pretrained(tmp / name)
        out.append(tmp / name)
    return out[0], out[1]


@pytest.mark.parametrize("family", ["llama", "gpt2"])  # O(D) after the RMSNorm rewrite; O_1(D) (LayerNorm)
def test_both_residencies_run_the_one_loop_and_agree_sweep_by_sweep(family, tmp_path, monkeypatch):
    """``match_whole`` on the prepared whole states and ``StreamedWhole`` on the same checkpoints held resident
    (one layer of each at a time) each call :func:`descend` once, and give the same distance after every sweep and
    the same residual element: one loop, two residencies of the tensors."""
    from symalign.families import prepare
    from symalign.match import whole
    from symalign.match.whole import CHECKPOINT_SETTINGS, match_whole
    from symalign.stream import model as streamed
    from symalign.stream.fold import att_spec_of
    from symalign.stream.model import StreamedWhole

    calls = []

    def spy(sweep, **kw):
        calls.append(kw["max_sweeps"])
        return descend(sweep, **kw)

    monkeypatch.setattr(whole, "descend", spy)
    monkeypatch.setattr(streamed, "descend", spy)
    a_dir, b_dir = _pair(tmp_path, family)
    ca, cb = load_checkpoint(a_dir), load_checkpoint(b_dir)
    ra, rb = ResidentCheckpoint.of(ca), ResidentCheckpoint.of(cb)
    w = StreamedWhole(ra, rb)
    w.match(True, "full", 3, 0.0, False)
    sa = prepare(ca.config, dict(ca.state), att_spec_of(ra)).state
    sb = prepare(cb.config, dict(cb.state), att_spec_of(rb)).state
    m = match_whole(w.spec, sa, sb, **{**CHECKPOINT_SETTINGS, "rtol": 0.0}, max_sweeps=3)
    assert calls == [3, 3]
    assert len(m.distances) == len(w.distances) == 4
    for x, y in zip(w.distances, m.distances):
        assert abs(x - y) <= 1e-9 * m.distances[0], (w.distances, m.distances)
    assert m.distances[-1] < m.distances[0]
    o_s, o_m = w.transform()["residual"], m.transform["residual"]
    assert float((o_s.double() - o_m.double()).abs().max()) < 1e-8
