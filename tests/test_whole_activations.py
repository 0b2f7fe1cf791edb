"""Activation matching recovers planted FF permutations, residual rotation and heads."""

from __future__ import annotations

import pytest
import torch

from _whole_util import inputs, model, rel_out, rel_state

from symalign.errors import MatchError
from symalign.match.activations import match_activations
from symalign.rewrite import rewrite_model
from symalign.spec import apply, invert, sample


@pytest.mark.parametrize("family,pe", [("gpt", "rope"), ("vit", "learned"), ("encoder", "sinusoidal"),
                                       ("gpt", "alibi")])
def test_planted_recovery_from_activations(family, pe):
    a = rewrite_model(model(family, pe))
    spec = a.symmetry_spec()
    g = sample(spec, 5)
    b = rewrite_model(model(family, pe))
    b.load_state_dict(apply(spec, g, a.state_dict()))
    x = inputs(a.cfg, n=8)
    yb = b(x)
    res = match_activations(a, b, x)
    ginv = invert(spec, g)
    for i in range(a.cfg.n_layers):
        assert torch.equal(res.transform[f"ff.{i}"], ginv[f"ff.{i}"])
    if "residual" in spec.spaces:
        # the rewritten stream is mean-free: O is determined on B's stream subspace R(1^perp) only
        r = g["residual"]
        centre = torch.eye(r.shape[0], dtype=torch.float64) - 1.0 / r.shape[0]
        assert float(((res.transform["residual"] - ginv["residual"]) @ r @ centre).abs().max()) <= 1e-8
    assert rel_state(a.state_dict(), res.apply(b.state_dict())) <= 1e-8
    b.load_state_dict(res.apply(b.state_dict()))
    assert rel_out(b(x), yb) <= 1e-9


def test_needs_data():
    a = rewrite_model(model("gpt", "rope"))
    with pytest.raises(MatchError, match="needs data"):
        match_activations(a, a, None)
    with pytest.raises(MatchError, match="needs data"):
        match_activations(a, a, [])


def test_pair_stats_in_chunks_equal_the_whole_sample():
    """PairStats accumulated over chunks gives the Pearson correlation (numpy's corrcoef) and the cross
    product of the concatenated sample (what activation matching used to compute from every stored activation)."""
    import numpy as np

    from symalign.match.activations import PairStats

    g = torch.Generator().manual_seed(0)
    a = torch.randn(300, 7, generator=g, dtype=torch.float64) * 3 + 5  # large means: cancellation check
    b = a[:, [2, 0, 1, 3, 6, 5, 4]] + 0.1 * torch.randn(300, 7, generator=g, dtype=torch.float64)
    st = PairStats()
    for lo in range(0, 300, 64):
        st.add(a[lo:lo + 64], b[lo:lo + 64].float())  # any dtype in, float64 sums
    assert st.n == 300
    assert torch.allclose(st.cross, a.T @ b.float().double(), rtol=1e-12, atol=1e-9)
    reference = np.corrcoef(a.numpy(), b.float().double().numpy(), rowvar=False)[:7, 7:]  # numpy's Pearson
    assert torch.allclose(st.correlation(), torch.from_numpy(reference), rtol=0, atol=1e-10)
