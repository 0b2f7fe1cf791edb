r"""The weighted average of checkpoint tensors: one place for its arithmetic (in memory and streamed).

``avg = round_s(sum_k w_k x_k)`` per floating tensor, ``round_s`` = rounding to the stored
dtype ``s`` (the first checkpoint's dtype of that tensor). The sum is accumulated in
:func:`accumulate_dtype`: **float32** for 16-bit stored dtypes (bfloat16, float16), float64
otherwise. Each input is converted exactly (a 16-bit float is a float32), then
``acc += w_k * x_k`` term by term (:func:`weighted_sum`; the in-memory merge and the streamed
merge call the same function, so they agree bit for bit).

Why float32 is as good as float64 for 16-bit storage. With unit roundoffs
``u_s`` (bfloat16 ``2^-8``, float16 ``2^-11``) and ``u = 2^-24`` (float32), the accumulated
value ``a`` of ``M`` terms satisfies ``|a - s| <= gamma_{M+1} |w| . |x|``
(``gamma_n = n u / (1 - n u)``, ``|w| . |x| = sum_k |w_k x_k|``; one rounding of each weight,
of each product and of each addition after the first), so the stored value obeys

    ``|round_s(a) - s| <= u_s |s| + (1 + u_s) gamma_{M+1} |w| . |x|``.

For convex weights (``|w| . |x| <= max_k |x_k|``) the second term is ``(M + 1) 2^-24`` of the
largest input, i.e. ``(M + 1) 2^-16`` (bfloat16) or ``(M + 1) 2^-13`` (float16) of the stored
rounding ``u_s``: the error is the storage rounding's, to that margin, and float64 (``u =
2^-53``) only shrinks the margin. ``round_s(a)`` differs from the correctly rounded ``round_s(s)``
by one unit in the last place only where ``s`` lies within ``gamma_{M+1} |w| . |x|`` of a
rounding midpoint of ``s``'s format; with two inputs and weights ``1/2`` never (the halving
is exact, and the sum of two 16-bit values is exact in float32 unless their exponents differ
by more than 16 -- bfloat16 -- or 13 -- float16 --, in which case the smaller is below half a
unit of the larger and both roundings give the larger's neighbourhood value; subnormal
halvings aside). The tests check both (bit-identical at ``1/2``, within the bound otherwise).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import Tensor

SHORT_FLOATS = (torch.bfloat16, torch.float16)


def accumulate_dtype(stored: torch.dtype) -> torch.dtype:
    """float32 for a 16-bit stored float dtype, float64 otherwise (module docstring)."""
    return torch.float32 if stored in SHORT_FLOATS else torch.float64


def unit_roundoff(dtype: torch.dtype) -> float:
    """``u = eps / 2`` of a float dtype."""
    return torch.finfo(dtype).eps / 2


def error_bound(stored: torch.dtype, n_terms: int) -> tuple[float, float]:
    """``(u_s, (1 + u_s) gamma_{M+1})``: ``|avg - s| <= u_s |s| + (1 + u_s) gamma_{M+1} sum_k |w_k x_k|``
    (module docstring) for ``M = n_terms`` inputs accumulated in :func:`accumulate_dtype`."""
    u_s = unit_roundoff(stored)
    u = unit_roundoff(accumulate_dtype(stored))
    gamma = (n_terms + 1) * u / (1 - (n_terms + 1) * u)
    return u_s, (1 + u_s) * gamma


def weighted_sum(xs: Sequence[Tensor], weights: Sequence[float], stored: torch.dtype, out: Tensor | None = None,
                 buf: Tensor | None = None) -> Tensor:
    """``sum_k w_k x_k`` accumulated in :func:`accumulate_dtype` of ``stored`` (not yet rounded to it):
    ``acc = w_1 x_1``, then ``acc += w_k x_k`` (each ``x_k`` converted exactly, times ``w_k`` rounded
    once, added rounded once). ``out``/``buf``: optional preallocated storage (at least ``numel``
    values of the accumulation dtype) for the sum and the current term, reused across calls."""
    dt = accumulate_dtype(stored)
    shape, n = xs[0].shape, xs[0].numel()
    acc = torch.empty(shape, dtype=dt) if out is None else out.view(-1)[:n].view(shape)
    acc.copy_(xs[0])
    acc.mul_(weights[0])
    for w, x in zip(weights[1:], xs[1:]):
        term = torch.empty(shape, dtype=dt) if buf is None else buf.view(-1)[:n].view(shape)
        term.copy_(x)
        term.mul_(w)
        acc.add_(term)
    return acc


def weighted_average(xs: Sequence[Tensor], weights: Sequence[float], stored: torch.dtype) -> Tensor:
    """:func:`weighted_sum` rounded to ``stored``."""
    return weighted_sum(xs, weights, stored).to(stored)


def average_states(states: Sequence[Mapping[str, Tensor]], weights: Sequence[float]) -> dict[str, Tensor]:
    """``sum_k w_k states[k]`` per floating tensor (first state's dtype; summed in float32 for 16-bit dtypes,
    float64 otherwise: :mod:`symalign.checkpoint.average`); others from the first."""
    out: dict[str, Tensor] = {}
    for name, ref in states[0].items():
        if ref.is_floating_point():
            out[name] = weighted_average([s[name] for s in states], weights, ref.dtype)
        else:
            out[name] = ref
    return out
