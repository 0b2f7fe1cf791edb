"""The checkpoint average's arithmetic (:mod:`symalign.checkpoint.average`): float32 sums for 16-bit storage."""

from __future__ import annotations

import pytest
import torch

from symalign.checkpoint import average


def _wide(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Values over a wide exponent range (both signs), exactly representable in ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    span = 30 if dtype == torch.bfloat16 else 12
    x = torch.randn(n, generator=g, dtype=torch.float64) * torch.exp2(torch.randint(-span, span, (n,), generator=g))
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_halves_bit_identical_to_float64(dtype):
    """Two inputs, weights 1/2: the float32 sum rounds to the same 16-bit value as the float64 one."""
    a, b = _wide(1 << 20, dtype, 0), _wide(1 << 20, dtype, 1)
    assert average.accumulate_dtype(dtype) == torch.float32
    got = average.weighted_average([a, b], [0.5, 0.5], dtype)
    want = (0.5 * a.double() + 0.5 * b.double()).to(dtype)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))  # bit for bit, the sign of zero included


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("weights", [[0.3, 0.7], [0.2, 0.5, 0.3], [1 / 3, 1 / 3, 1 / 3]])
def test_within_documented_bound(dtype, weights):
    """``|avg - s| <= u_s |s| + (1 + u_s) gamma_{M+1} sum |w_k x_k|`` (``s`` exact; float64 here, whose own error
    ``2^-52 sum |w_k x_k|`` is added), and the float32 result is the float64 one but for rare ties near rounding
    midpoints."""
    xs = [_wide(1 << 18, dtype, k) for k in range(len(weights))]
    got = average.weighted_average(xs, weights, dtype).double()
    exact = sum(w * x.double() for w, x in zip(weights, xs))
    mag = sum(abs(w) * x.double().abs() for w, x in zip(weights, xs))
    u_s, g = average.error_bound(dtype, len(weights))
    fine = exact.abs() >= torch.finfo(dtype).tiny  # normal range (below it the absolute subnormal spacing rules)
    err = (got - exact).abs()
    assert bool((err <= u_s * exact.abs() + (g + 2.0 ** -52) * mag)[fine].all())
    assert float((err / exact.abs())[fine].max()) > 0.5 * u_s  # the bound is tight: storage rounding dominates
    f64 = (sum(w * x.double() for w, x in zip(weights, xs))).to(dtype).double()
    diff = got != f64
    assert float(diff[fine].double().mean()) < 1e-2  # ties only: s within gamma |w|.|x| of a rounding midpoint


def test_float64_accumulation_for_wider_dtypes():
    assert average.accumulate_dtype(torch.float32) == torch.float64
    assert average.accumulate_dtype(torch.float64) == torch.float64
    x = torch.randn(100, dtype=torch.float32)
    assert average.weighted_sum([x, x], [0.25, 0.75], torch.float32).dtype == torch.float64


def test_preallocated_storage_gives_the_same_bits():
    xs = [_wide(1000, torch.bfloat16, k) for k in range(3)]
    w = [0.2, 0.5, 0.3]
    out, buf = torch.full((4096,), float("nan")), torch.full((4096,), float("nan"))
    assert torch.equal(average.weighted_sum(xs, w, torch.bfloat16, out, buf),
                       average.weighted_sum(xs, w, torch.bfloat16))
