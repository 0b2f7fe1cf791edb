"""The discrete part of the symmetry: does swapping two heads (through the spec) preserve the function?"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

from symalign.groups import HeadPermutation
from symalign.nn.attention import MultiHeadAttention, attention_spec
from symalign.probe.jacobian import _as_tuple, _flatten_outputs, _to_double, double_copy
from symalign.probe.precision import Float64Mode
from symalign.spec import SymmetrySpec, apply

HEAD_SWAP_RTOL = 1e-10
"""A head swap "preserves" the function when the relative output change is at most this (float64)."""


def head_permutation_spec(module: nn.Module, spec: SymmetrySpec | None = None) -> SymmetrySpec | None:
    """A spec with a head-permutation space for ``module`` (None if there is none to test).

    For :class:`MultiHeadAttention` under ALiBi the layer's own spec has no heads
    space (ALiBi pins the heads); the labelling of the same tensors is then taken
    from the spec of a copy of the config without ALiBi -- which is exactly the
    permutation whose (non-)invariance we want to test.
    """
    if spec is not None and any(g.permutes_heads for g in spec.spaces.values()):
        return spec
    if isinstance(module, MultiHeadAttention):
        cfg = module.cfg
        if cfg.pe == "alibi":
            cfg = dataclasses.replace(cfg, pe="none")
        return attention_spec(cfg)
    return None


def head_swap(group: HeadPermutation) -> Tensor | None:
    """Swap two K/V groups (first two), or two query heads inside group 0 when ``h_kv = 1``."""
    kv, g = group.kv, group.group_size
    taus = torch.arange(g).repeat(kv, 1)
    if kv >= 2:
        sigma = torch.arange(kv)
        sigma[[0, 1]] = sigma[[1, 0]]
        return group.from_parts(sigma, taus)
    if g >= 2:
        taus[0, [0, 1]] = taus[0, [1, 0]]
        return group.from_parts(torch.arange(kv), taus)
    return None


def head_permutations_preserved(module: nn.Module, inputs: Any, spec: SymmetrySpec | None = None,
                                rtol: float = HEAD_SWAP_RTOL) -> bool | None:
    """Whether swapping two heads (via :func:`symalign.spec.apply`) leaves the float64 output unchanged.

    None when no head-permutation space is known or there is only one head.
    """
    hspec = head_permutation_spec(module, spec)
    if hspec is None:
        return None
    name, group = next((n, g) for n, g in hspec.spaces.items() if g.permutes_heads)
    pi = head_swap(group)
    if pi is None:
        return None
    model = double_copy(module)
    args = tuple(_to_double(x) for x in _as_tuple(inputs))
    state = {k: v.detach() for k, v in model.state_dict().items()}
    swapped = apply(hspec.restrict([name]), {name: pi}, state)
    with torch.no_grad(), Float64Mode():
        y0 = _flatten_outputs(model(*args))
        y1 = _flatten_outputs(functional_call(model, swapped, args))
    return bool((y1 - y0).norm() <= rtol * y0.norm())

