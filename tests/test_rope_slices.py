"""``apply_rope`` by slices equals the gather/scatter definition bit for bit (every pairing,
partial rotary widths, float32 and float64)."""

from __future__ import annotations

import pytest
import torch

from symalign.groups import rotary_pairs
from symalign.nn.positional import apply_rope, rope_angles


def _by_index(x, angles, pairing):
    r = 2 * angles.shape[-1]
    j0, j1 = rotary_pairs(r, pairing)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    y = x.clone()
    y[..., j0] = x[..., j0] * cos - x[..., j1] * sin
    y[..., j1] = x[..., j1] * cos + x[..., j0] * sin
    return y


@pytest.mark.parametrize("pairing", ["half", "interleaved"])
@pytest.mark.parametrize("rotary", [8, 6, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_slices_equal_index_definition(pairing, rotary, dtype):
    g = torch.Generator().manual_seed(rotary)
    x = torch.randn(2, 3, 7, 8, generator=g, dtype=dtype)
    a = rope_angles(7, rotary, offset=3)
    assert torch.equal(apply_rope(x, a, pairing), _by_index(x, a, pairing))


def test_unknown_pairing_still_refused():
    from symalign.errors import GroupError

    with pytest.raises(GroupError):
        apply_rope(torch.zeros(1, 4, 8), rope_angles(4, 8), "diagonal")
