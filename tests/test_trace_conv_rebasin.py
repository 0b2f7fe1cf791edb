"""The traced CNN specs against git-re-basin's weight matching written by hand, independently of the spec code.

git-re-basin (Ainsworth et al., weight matching): one permutation per hidden channel space, found by coordinate
descent -- for each permutation in turn, a linear assignment (scipy's ``linear_sum_assignment``) on
``S = sum_t W_A^t (W_B^t)^T`` over the tensors it acts on, the other permutations applied to B -- until no
assignment improves. Here every tensor is indexed by hand (axis -> permutation name), flatten is handled by
reshaping the first classifier weight ``(hidden, C * 4) -> (hidden, C, 4)`` (C-major, as ``nn.Flatten`` lays it
out), and ResNet's BatchNorm statistics are permuted along (they are part of the model's state). Nothing of
:mod:`symalign.spec` or :mod:`symalign.match` is used on this side. The objective is the squared weight distance
``sum_t ||W_A^t - W'_B^t||^2`` over the hand spec's tensors; symalign's default (traced spec, ``match_whole``)
must reach it within 2 % of the hand matcher's best of three random orders (issue 32's acceptance) over the same
group: the traced spec's permutations (where the traced spec also declares positive scales -- the VGG's ReLU units,
the ResNet's BatchNorm affine -- they are dropped for this comparison). With its scales, matched in the weights'
own gauge, symalign goes below the permutations' objective.
"""

from __future__ import annotations

import dataclasses

import _trace_models as M
import numpy as np
import pytest
import torch
from scipy.optimize import linear_sum_assignment

from symalign.groups import Permutation, PositiveMonomial
from symalign.match.whole import match_whole
from symalign.tracing import trace

X = torch.randn(3, 1, 8, 8, generator=torch.Generator().manual_seed(0))
Axes = dict[str, tuple[str | None, ...]]  # tensor -> the permutation acting on each axis (None: none)


def vgg_axes() -> Axes:
    ax: Axes = {}
    prev = None
    for i, conv in enumerate(("features.0", "features.2", "features.5", "features.7")):
        ax[f"{conv}.weight"], ax[f"{conv}.bias"] = (f"P{i}", prev, None, None), (f"P{i}",)
        prev = f"P{i}"
    ax["classifier.1.weight"], ax["classifier.1.bias"] = ("P4", "P3", None), ("P4",)  # reshaped (32, 16, 4)
    ax["classifier.3.weight"], ax["classifier.3.bias"] = (None, "P4"), (None,)
    return ax


def resnet_axes() -> Axes:
    ax: Axes = {}

    def conv_bn(conv: str, bn: str, out: str, inp: str | None) -> None:
        ax[f"{conv}.weight"] = (out, inp, None, None)
        for t in ("weight", "bias", "running_mean", "running_var"):
            ax[f"{bn}.{t}"] = (out,)

    conv_bn("conv1", "bn1", "R0", None)
    for k in range(3):
        blk, stream_in = f"layer{k + 1}.0", f"R{max(k - 1, 0)}"
        conv_bn(f"{blk}.conv1", f"{blk}.bn1", f"F{k}", stream_in)
        conv_bn(f"{blk}.conv2", f"{blk}.bn2", f"R{k}", f"F{k}")
        if k:
            conv_bn(f"{blk}.downsample.0", f"{blk}.downsample.1", f"R{k}", stream_in)
    ax["fc.weight"], ax["fc.bias"] = (None, "R2"), (None,)
    return ax


def prepared(state: dict, vgg: bool) -> dict[str, torch.Tensor]:
    out = {k: v.double().clone() for k, v in state.items() if v.is_floating_point()}
    if vgg:
        out["classifier.1.weight"] = out["classifier.1.weight"].reshape(32, 16, 4)
    return out


def permuted(ax: Axes, w: torch.Tensor, name: str, perm: dict, skip: str | None = None) -> torch.Tensor:
    for axis, p in enumerate(ax[name]):
        if p is not None and p != skip:
            w = w.index_select(axis, perm[p])
    return w


def hand_weight_matching(ax: Axes, a: dict, b: dict, seed: int) -> dict[str, torch.Tensor]:
    sizes = {p: a[t].shape[i] for t, ps in ax.items() for i, p in enumerate(ps) if p is not None}
    perm = {p: torch.arange(n) for p, n in sizes.items()}
    rng = np.random.default_rng(seed)
    for _ in range(100):
        improved = False
        for p in rng.permutation(sorted(sizes)):
            n = sizes[p]
            s = torch.zeros(n, n, dtype=torch.float64)
            for t, ps in ax.items():
                for i, q in enumerate(ps):
                    if q == p:
                        s += a[t].movedim(i, 0).reshape(n, -1) @ permuted(ax, b[t], t, perm, skip=p).movedim(i, 0) \
                            .reshape(n, -1).T
            _, cols = linear_sum_assignment(s.numpy(), maximize=True)
            new = torch.as_tensor(cols)
            if float(s[torch.arange(n), new].sum()) > float(s[torch.arange(n), perm[p]].sum()) + 1e-12:
                perm[p], improved = new, True
        if not improved:
            break
    return perm


def objective(ax: Axes, a: dict, b: dict) -> float:
    return sum(float((a[t] - b[t]).pow(2).sum()) for t in ax)


@pytest.mark.parametrize("name,seeds", [("VGG", (10, 20)), ("VGG", (1, 2)), ("ResNet", (10, 20)), ("ResNet", (3, 4))])
def test_traced_default_reaches_hand_written_rebasin_within_2_percent(name, seeds):
    vgg = name == "VGG"
    cls, ax = getattr(M, name), (vgg_axes() if vgg else resnet_axes())
    sa, sb = (M.randomise(cls(), s).state_dict() for s in seeds)
    a, b = prepared(sa, vgg), prepared(sb, vgg)
    hand = min(objective(ax, a, {t: permuted(ax, b[t], t, hand_weight_matching(ax, a, b, seed))
                                 for t in ax}) for seed in range(3))
    spec = trace(cls().eval(), X).spec
    perms = dataclasses.replace(spec, spaces={k: Permutation(g.n) for k, g in spec.spaces.items()})
    assert all(isinstance(g, PositiveMonomial) for g in spec.spaces.values())  # ReLU units / BatchNorm affine
    da = {k: v.double() for k, v in sa.items() if v.is_floating_point()}
    db = {k: v.double() for k, v in sb.items() if v.is_floating_point()}
    ours = objective(ax, a, prepared(match_whole(perms, da, db).apply(db), vgg))
    assert hand < objective(ax, a, b)  # the hand matcher does align
    assert ours <= 1.02 * hand, (ours, hand)
    scaled = objective(ax, a, prepared(match_whole(spec, da, db, gauge="raw").apply(db), vgg))
    assert scaled < 0.95 * hand, (scaled, hand)  # real freedom in the weights (VGG 0.90-0.91, ResNet 0.73-0.74)
