"""Memory of the streamed mixture-of-experts paths: no float64 copy of a whole layer's experts.

A Mixtral-8x7B layer is 1.41G parameters: 5.6 GB in float32, 11.3 GB in float64. The streamed
model scope (align and merge) folds a mixture of experts' layer one expert at a time, the expert
matcher forms one expert's float64 features at a time, and a stacked tensor is rotated and
multiplied one expert at a time. These tests instrument the float64 conversions on tiny models
(the sizes scale with the layer; ``benchmarks/profile_moe_stream.py`` measures the peak RSS) and
check that the lean forms give what the whole-tensor formulas give.
"""

from __future__ import annotations

import json

import pytest
import torch

from _cli_util import run_symalign
from test_match_experts import layer
from test_stream import _state
from test_stream_families import _moe_pair, _worst

import symalign.families.base as base
from symalign.groups import apply_on_axis
from symalign.match.experts import match_experts
from symalign.stream import blocks

T = pytest.importorskip("transformers")


def _expert_values(state) -> int:
    """Real (not placeholder) float64 values of expert tensors stored one per expert."""
    return sum(v.numel() for k, v in state.items() if ".experts." in k and not v.is_meta)


@pytest.mark.parametrize("command", ["align", "merge"])
@pytest.mark.slow
def test_streamed_model_scope_folds_one_expert_at_a_time(command, tmp_path, monkeypatch, capsys):
    """Every float64 copy the rewrite makes during a streamed ``--scope model`` run (align; merge, whose first
    checkpoint is also read folded) holds at most one expert's three tensors, not the layer's ``E`` experts."""
    da, db = _moe_pair(tmp_path, "mixtral", tie_word_embeddings=False)
    cfg = json.loads((da / "config.json").read_text())
    one_expert = 3 * cfg["intermediate_size"] * cfg["hidden_size"]
    seen: list[int] = []
    real = base.to_f64

    def spy(state):
        seen.append(_expert_values(state))
        return real(state)

    monkeypatch.setattr(base, "to_f64", spy)
    code, out, err = run_symalign(monkeypatch, capsys, command, da, db, "-o", tmp_path / "OUT", "--stream",
                                  "--scope", "model", "--max-sweeps", "1", "--json")
    assert code == 0, err
    assert max(seen) == one_expert, (max(seen), one_expert)  # the layer's experts: 4 x one_expert


def test_match_experts_forms_one_expert_in_float64_at_a_time(monkeypatch):
    """On a float32 layer, no float64 tensor the matcher forms (converted, allocated, concatenated or stacked)
    is larger than one expert's features (the old ``(E, F, K)`` features of a side were ``E`` times that), and
    the result is the one on float64 copies."""
    E, F, D = 8, 16, 6
    spec, a, units = layer(E, F, D, 0)
    _, b, _ = layer(E, F, D, 3)
    a32, b32 = ({k: v.float() for k, v in s.items()} for s in (a, b))
    want = match_experts(spec, "experts", units, {k: v.double() for k, v in a32.items()},
                         {k: v.double() for k, v in b32.items()}, method="all-pairs")
    big: list[int] = []

    def spied(real):
        def spy(*args, **kw):
            r = real(*args, **kw)
            if isinstance(r, torch.Tensor) and r.dtype == torch.float64:
                big.append(r.numel())
            return r
        return spy

    for owner, name in ((torch.Tensor, "to"), (torch.Tensor, "double"), (torch, "empty"), (torch, "cat"),
                        (torch, "stack")):  # every way a float64 copy of the features could be formed
        monkeypatch.setattr(owner, name, spied(getattr(owner, name)))
    for method in ("exact", "all-pairs", "paired"):
        got = match_experts(spec, "experts", units, a32, b32, method=method)
        if method != "paired":
            assert all(torch.equal(got[k], want[k]) for k in want), method
    monkeypatch.undo()
    K = 3 * D  # gate, up (F x D each) and down (D x F, unit axis first)
    assert big and max(big) <= F * K, (max(big), F * K)


def test_stacked_tensor_rotated_slice_by_slice_equals_whole():
    """``apply_on_axis`` on an ``(E, 2F, D)`` tensor (one expert at a time) = the whole-tensor product (float64
    rounding: on this machine's BLAS, bit for bit)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 10, 6, generator=g, dtype=torch.float32)
    o = torch.linalg.qr(torch.randn(6, 6, generator=g, dtype=torch.float64))[0]
    for axis, m in ((2, o), (1, torch.randn(10, 10, generator=g, dtype=torch.float64))):
        want = torch.movedim(torch.tensordot(m, x.double(), dims=([1], [axis])), 0, axis).float()
        got = apply_on_axis(x, axis, m)
        assert got.dtype == x.dtype and got.shape == x.shape
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    with pytest.raises(Exception, match="axis 2 has 6 entries"):
        apply_on_axis(x, 2, torch.eye(5, dtype=torch.float64))


@pytest.mark.parametrize("block", [24, 1 << 22])
def test_cross_gram_of_a_stacked_tensor_equals_its_rows(block, monkeypatch):
    """``cross_gram_axis_into`` (the slices' rows side by side, no moved copy) = ``cross_gram_into`` on the
    rows of the axis, bit for bit, also with column blocks that straddle two slices (``block``: 24 values)."""
    monkeypatch.setattr(blocks, "BLOCK_ELEMENTS", block)
    g = torch.Generator().manual_seed(1)
    xa, xb = (torch.randn(3, 8, 5, generator=g, dtype=torch.float32) for _ in range(2))
    for axis in (1, 2):
        n = xa.shape[axis]
        want, got = torch.zeros(n, n, dtype=torch.float64), torch.zeros(n, n, dtype=torch.float64)
        blocks.cross_gram_into(want, blocks.as_rows(xa, axis), blocks.as_rows(xb, axis))
        blocks.cross_gram_axis_into(got, xa, xb, axis)
        assert torch.equal(got, want), axis


def test_folded_expert_reads_equal_the_whole_layer_fold(tmp_path):
    """``FoldedCheckpoint`` (merge's first checkpoint) reads each expert folded alone: the same tensors, under
    the stored names, as folding the whole layer in memory (``prepare`` on the fused state, written back by
    transformers' own conversion), and the router under its stored name."""
    from symalign.checkpoint.config import saved_names
    from symalign.checkpoint.lazy import open_checkpoint
    from symalign.families import prepare
    from symalign.stream.fold import FoldedCheckpoint

    da, _ = _moe_pair(tmp_path, "mixtral", tie_word_embeddings=False)
    ck = open_checkpoint(da)
    folded = FoldedCheckpoint(ck)
    state = _state(da)
    p = prepare(ck.config, state, ck.adapter.spec(ck.config, ck.keys))
    want = saved_names(ck.config, p.state)
    got = folded.read(list(ck.keys))
    assert set(got) == set(state) and _worst(got, {k: want[k] for k in got}) == 0.0
