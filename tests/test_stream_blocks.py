"""The blockwise float64 products of the streamed model scope (:mod:`symalign.stream.blocks`) against the
whole-tensor formulas they replace, and the streamed model scope with tiny blocks against its default."""

from __future__ import annotations

import pytest
import torch

from symalign.groups import apply_on_axis, assign_max
from symalign.stream import blocks


@pytest.fixture
def tiny_blocks(monkeypatch):
    monkeypatch.setattr(blocks, "BLOCK_ELEMENTS", 7)  # several blocks, a ragged last one


def _orth(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    return q


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("axis", [0, 1])
def test_rotate_is_apply_on_axis(axis, dtype, tiny_blocks):
    o = _orth(6, 0)
    x = torch.randn(6, 9, dtype=dtype) if axis == 0 else torch.randn(9, 6, dtype=dtype)
    want = apply_on_axis(x, axis, o)
    got = blocks.rotate(x, axis, o)
    assert got.dtype == dtype and got.shape == x.shape and got.is_contiguous()
    eps = torch.finfo(dtype).eps
    assert float((got - want).abs().max()) <= 4 * eps * float(want.abs().max())


@pytest.mark.parametrize("res_axis", [0, 1])
def test_rotated_rows_are_the_rows_of_the_rotated_tensor(res_axis, tiny_blocks):
    o = _orth(5, 1)
    x = torch.randn(5, 8) if res_axis == 0 else torch.randn(8, 5)
    rows_axis = 1 - res_axis
    want = torch.movedim(apply_on_axis(x.double(), res_axis, o), rows_axis, 0).reshape(8, 5)
    got = blocks.rotated_rows(x, res_axis, rows_axis, o).full()
    assert got.dtype == torch.float64 and got.shape == (8, 5)
    assert torch.allclose(got, want, rtol=0, atol=1e-14)


def test_costs_grams_and_norms_in_blocks(tiny_blocks):
    xa, xb = [torch.randn(11, 4, dtype=torch.float32) for _ in range(2)]
    ya, yb = [torch.randn(11, 3, dtype=torch.float64) for _ in range(2)]
    c = blocks.cost_into(None, xa, xb.double())
    c = blocks.cost_into(c, ya, yb)
    want = xa.double() @ xb.double().T + ya @ yb.T
    assert torch.allclose(c, want, rtol=0, atol=1e-13)
    m = torch.zeros(11, 11, dtype=torch.float64)
    blocks.cross_gram_into(m, xa, xb)
    assert torch.allclose(m, xa.double() @ xb.double().T, rtol=0, atol=1e-13)
    assert blocks.sq(xa) == pytest.approx(float(xa.double().pow(2).sum()), rel=1e-14)
    assert blocks.sq_diff(xa, xb) == pytest.approx(float((xa - xb).double().pow(2).sum()), rel=1e-14)
    assert blocks.sq(torch.tensor(3.0)) == 9.0


def test_assign_in_place_is_scipy_maximize():
    g = torch.Generator().manual_seed(3)
    c = torch.randn(40, 40, generator=g, dtype=torch.float64)
    want = assign_max(c)
    work = c.clone()
    got = blocks.assign_max_inplace(work)
    assert torch.equal(got, want)
    assert torch.equal(work, -c)  # consumed: negated in place, no copy
    assert torch.equal(blocks.assign_max_inplace(c.float()), want)  # other dtypes: converted first


@pytest.mark.slow
def test_streamed_model_scope_same_output_with_tiny_blocks(tmp_path, monkeypatch):
    """Blocks change only the order of float64 sums: the same distances (1e-12 relative) and the same aligned
    checkpoint to float64 rounding amplified by the polar factor (``O = polar(M)`` moves by about
    ``||dM|| / sigma_min(M)``): 1e-10 relative to the largest weight. A different FF permutation or head
    assignment would move weights by O(1)."""
    from test_stream import _pair, _state

    from symalign.stream.model import run_stream_model

    _pair(tmp_path, dtype=torch.float64, shard="20KB", tie_word_embeddings=False)
    ref = run_stream_model(tmp_path / "A", tmp_path / "B", tmp_path / "REF", progress=False, max_sweeps=3)
    monkeypatch.setattr(blocks, "BLOCK_ELEMENTS", 37)
    got = run_stream_model(tmp_path / "A", tmp_path / "B", tmp_path / "BLK", progress=False, max_sweeps=3)
    for x, y in zip(ref.match["distances"], got.match["distances"]):
        assert abs(x - y) <= 1e-12 * ref.match["distances"][0]
    a, b = _state(tmp_path / "REF"), _state(tmp_path / "BLK")
    assert set(a) == set(b)
    scale = max(float(a[k].abs().max()) for k in a)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-10 * scale


@pytest.mark.slow
def test_per_tensor_folding_is_the_whole_layer_fold(tmp_path, monkeypatch):
    """Every 2-D tensor read and folded on its own (the 7B path) gives the checkpoint bit for bit."""
    from test_stream import _pair, _state

    from symalign.stream import model

    _pair(tmp_path, dtype=torch.bfloat16, shard="20KB", tie_word_embeddings=False)
    model.run_stream_model(tmp_path / "A", tmp_path / "B", tmp_path / "REF", progress=False, max_sweeps=2)
    monkeypatch.setattr(model, "SMALL_ELEMENTS", 64)  # only the norm gains count as small
    model.run_stream_model(tmp_path / "A", tmp_path / "B", tmp_path / "ONE", progress=False, max_sweeps=2)
    a, b = _state(tmp_path / "REF"), _state(tmp_path / "ONE")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("res_axis", [0, 1])
def test_cost_of_rotated_rows_in_blocks(res_axis, tiny_blocks):
    """``C = X_A X_{O.B}^T + Y_A Y_B^T`` with B's rotated rows formed a block at a time equals the whole formula
    (every entry one float64 dot product: equal to rounding)."""
    o = _orth(5, 2)
    rows_axis = 1 - res_axis
    xb = torch.randn(5, 13) if res_axis == 0 else torch.randn(13, 5)
    xa = torch.randn(13, 5, dtype=torch.float32)
    ya, yb = torch.randn(13, 4, dtype=torch.float64), torch.randn(13, 4, dtype=torch.float64)
    lazy = blocks.rotated_rows(xb, res_axis, rows_axis, o)
    assert lazy.shape == (13, 5)
    c = blocks.cost_into(None, xa, lazy)
    c = blocks.cost_into(c, ya, yb)
    rot = torch.movedim(apply_on_axis(xb.double(), res_axis, o), rows_axis, 0).reshape(13, 5)
    want = xa.double() @ rot.T + ya @ yb.T
    assert torch.allclose(c, want, rtol=0, atol=1e-13)
    empty = torch.full((13, 13), float("nan"), dtype=torch.float64)  # a fresh C ignores what it held
    assert torch.allclose(blocks.cost_into(None, ya, yb), ya @ yb.T, rtol=0, atol=1e-13)
    assert not torch.isnan(empty.addmm_(ya, yb.T, beta=0.0)).any()


def test_rotated_rows_of_other_layouts():
    """A tensor whose residual axis is also its rows axis (or not a matrix) is rotated once, then sliced."""
    o = _orth(4, 3)
    x = torch.randn(4, 4, 3, dtype=torch.float64)
    lazy = blocks.rotated_rows(x, 0, 1, o)
    want = torch.movedim(apply_on_axis(x, 0, o), 1, 0).reshape(4, -1)
    assert torch.allclose(lazy.full(), want, rtol=0, atol=1e-14)
    assert torch.allclose(lazy.rows(1, 3), want[1:3], rtol=0, atol=1e-14)


@pytest.mark.parametrize("res_axis", [0, 1])
def test_rotated_rows_of_a_permutation_gather(res_axis, tiny_blocks):
    """A permuted stream (``S_D``: the element is an index vector) gives the rows of the permuted tensor."""
    perm = torch.tensor([2, 0, 4, 1, 3])
    x = torch.randn(5, 7) if res_axis == 0 else torch.randn(7, 5)
    lazy = blocks.rotated_rows(x, res_axis, 1 - res_axis, perm)
    want = torch.movedim(apply_on_axis(x.double(), res_axis, blocks.matrix(perm)), 1 - res_axis, 0).reshape(7, 5)
    assert torch.equal(lazy.full(), want)
    xa = torch.randn(7, 5, dtype=torch.float64)
    assert torch.allclose(blocks.cost_into(None, xa, lazy), xa @ want.T, rtol=0, atol=1e-13)
