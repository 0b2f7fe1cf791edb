"""The RoPE planes of a head: which dimensions rotate together, and matrices built plane by plane."""

from __future__ import annotations

import torch
from torch import Tensor

from symalign.errors import GroupError
from symalign.groups.base import PAIRINGS


def rotary_pairs(n: int, pairing: str) -> tuple[Tensor, Tensor]:
    """Indices ``(j0, j1)`` of the rotation planes of a rotary width ``n``.

    ``"half"`` (Llama/NeoX ``rotate_half``): plane ``j`` is ``(j, j + n/2)``.
    ``"interleaved"`` (GPT-J/RoFormer): plane ``j`` is ``(2j, 2j + 1)``.
    """
    if n % 2:
        raise GroupError(f"the rotated width must be even, got {n}")
    if pairing == "half":
        j0 = torch.arange(n // 2)
        return j0, j0 + n // 2
    if pairing == "interleaved":
        j0 = torch.arange(0, n, 2)
        return j0, j0 + 1
    raise GroupError(f"unknown rotary pairing {pairing!r}; use one of {PAIRINGS}")


def rotary_block_matrix(a: Tensor, b: Tensor, n: int, pairing: str, rest: Tensor | None = None) -> Tensor:
    """Matrix of the element with complex scalars ``c_j = a_j + i b_j`` on the planes.

    ``a, b`` have shape ``(*batch, r/2)``; the block on plane ``(j0, j1)`` is
    ``[[a, -b], [b, a]]`` (so that, writing a plane of a column vector as
    ``z = x_{j0} + i x_{j1}``, the action is ``z -> c z``). ``rest`` is an optional
    ``(*batch, n - r, n - r)`` block acting on the unrotated dimensions ``r..n``.
    """
    r = 2 * a.shape[-1]
    batch = a.shape[:-1]
    out = torch.zeros(*batch, n, n, dtype=a.dtype, device=a.device)
    j0, j1 = rotary_pairs(r, pairing)
    out[..., j0, j0] = a
    out[..., j1, j1] = a
    out[..., j0, j1] = -b
    out[..., j1, j0] = b
    if r < n:
        if rest is None:
            raise GroupError("a partial rotary element needs the block on the unrotated dimensions")
        out[..., r:, r:] = rest
    return out


def plane_of(n: int, pairing: str, r: int, proportional: bool = False) -> Tensor:
    """``plane[j]``: the index of the RoPE plane (or unrotated coordinate) holding dimension ``j``.

    Rotated planes come first (``0 .. r/2 - 1``), then the unrotated coordinates in order.
    Partial RoPE rotates the first ``r`` dimensions in the planes of width ``r``
    (``rotary_pairs(r, pairing)``); ``proportional`` RoPE (transformers'
    ``rope_type="proportional"``) keeps the planes of the whole head
    (``rotary_pairs(n, pairing)``) and turns only the first ``r/2`` of them (the others have
    frequency zero), so with ``"half"`` pairing plane ``k < r/2`` is ``(k, k + n/2)``.
    """
    out = torch.empty(n, dtype=torch.long)
    j0, j1 = rotary_pairs(n if proportional else r, pairing)
    j0, j1 = j0[: r // 2], j1[: r // 2]
    out[j0] = torch.arange(r // 2)
    out[j1] = torch.arange(r // 2)
    rest = torch.ones(n, dtype=torch.bool)
    rest[j0] = rest[j1] = False
    out[rest] = torch.arange(n - r) + r // 2
    return out
