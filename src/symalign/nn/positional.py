r"""Positional encodings: sinusoidal tables, rotary embeddings (RoPE), ALiBi.

RoPE (Su et al.) rotates plane ``j`` of a query/key at position ``m`` by the
angle ``m * theta_j`` with ``theta_j = base^{-2j/r}`` (``r`` the rotated width),
i.e. ``z_j -> e^{i m theta_j} z_j`` where ``z_j = x_{j0} + i x_{j1}`` and the
planes ``(j0, j1)`` are given by the *pairing* (:func:`symalign.groups.rotary_pairs`).
Only the first ``r`` dimensions of a head are rotated (partial rotary when
``r < d_h``); the scores then depend on positions only through ``m - n``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from symalign.groups import rotary_pairs


def sinusoidal_table(max_len: int, d_model: int, dtype=torch.float32) -> Tensor:
    """Vaswani et al.'s fixed table ``P[t, 2i] = sin(t / 10000^{2i/D})``, ``P[t, 2i+1] = cos(...)``."""
    pos = torch.arange(max_len, dtype=torch.float64).unsqueeze(1)
    div = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float64) * (-math.log(10000.0) / d_model))
    table = torch.zeros(max_len, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(pos * div)
    table[:, 1::2] = torch.cos(pos * div[: d_model // 2])
    return table.to(dtype)


def rope_angles(seq_len: int, rotary_dims: int, base: float = 10000.0, offset: int = 0) -> Tensor:
    """Angles ``m * theta_j`` of shape ``(seq_len, rotary_dims / 2)`` (float64)."""
    theta = base ** (-torch.arange(0, rotary_dims, 2, dtype=torch.float64) / rotary_dims)
    pos = torch.arange(offset, offset + seq_len, dtype=torch.float64)
    return pos.unsqueeze(1) * theta.unsqueeze(0)


def apply_rope(x: Tensor, angles: Tensor, pairing: str) -> Tensor:
    """Rotate the first ``2 * angles.shape[-1]`` dims of ``x`` (``(..., T, d_h)``) plane by plane."""
    r = 2 * angles.shape[-1]
    cos = angles.cos().to(x.dtype)
    sin = angles.sin().to(x.dtype)
    if pairing == "half":  # planes (j, j + r/2): slices, no gather/scatter (the planes of rotary_pairs)
        x0, x1 = x[..., : r // 2], x[..., r // 2: r]
        parts = [x0 * cos - x1 * sin, x1 * cos + x0 * sin]
        return torch.cat(parts + ([x[..., r:]] if r < x.shape[-1] else []), dim=-1)
    if pairing == "interleaved":  # planes (2j, 2j + 1)
        x0, x1 = x[..., 0:r:2], x[..., 1:r:2]
        rot = torch.stack([x0 * cos - x1 * sin, x1 * cos + x0 * sin], dim=-1).flatten(-2)
        return torch.cat([rot, x[..., r:]], dim=-1) if r < x.shape[-1] else rot
    j0, j1 = rotary_pairs(r, pairing)  # raises for an unknown pairing
    x0, x1 = x[..., j0], x[..., j1]
    y = x.clone()
    y[..., j0] = x0 * cos - x1 * sin
    y[..., j1] = x1 * cos + x0 * sin
    return y


def alibi_slopes(n_heads: int) -> Tensor:
    """Press et al.'s head slopes: the geometric sequence ``2^{-8 i / n}`` (interpolated for non-powers of 2)."""

    def pow2(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start ** i for i in range(n)]

    if math.log2(n_heads).is_integer():
        s = pow2(n_heads)
    else:
        closest = 2 ** math.floor(math.log2(n_heads))
        s = pow2(closest) + pow2(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(s, dtype=torch.float64)


def alibi_bias(slopes: Tensor, seq_len: int) -> Tensor:
    """Score bias ``-slope_h |m - n|`` of shape ``(h, T, T)`` (symmetric; causal masking is separate)."""
    pos = torch.arange(seq_len, dtype=torch.float64)
    dist = (pos.view(-1, 1) - pos.view(1, -1)).abs()
    return -slopes.view(-1, 1, 1) * dist
