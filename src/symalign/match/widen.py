r"""Widening a narrow model onto a wider one's hidden widths by splitting units (semi-permutations).

Two models of one architecture whose hidden-unit spaces differ in width (an MLP's hidden layers, the FF of a
Transformer block) share every other space. :func:`split_spec` declares, over the narrow model's tensors, a
:class:`~symalign.groups.SemiPermutation` for every space whose width differs (the narrow width onto the wide
one, labelled on the same axes as the space itself). A ReLU space (a group that scales units:
:attr:`~symalign.groups.Group.scales_units`) is split by positive homogeneity, ``f(x) = f(alpha x) +
f((1 - alpha) x)``; any other by splitting the output side, ``alpha f(x) + (1 - alpha) f(x)``, exact for an
elementwise activation (the caller checks the function: a space whose units meet a norm is no such space).

:func:`matched_split` fits the split space by space, in declaration order
(:meth:`~symalign.groups.SemiPermutation.fit`): a space's rows are taken from the tensors whose other axes are
already in the wide model's coordinates -- fixed axes (inputs, outputs), spaces split before it, or spaces of
equal widths that B was aligned in first (``aligned``) -- and, once fitted, the split is applied, so the next
space's rows are in A's coordinates. :func:`uniform_split` is the
unmatched split (the first units copied, equal shares). :func:`merge_units` is the left inverse (copies
merged back).
"""

from __future__ import annotations

from typing import Collection, Mapping

import torch
from torch import Tensor

from symalign.errors import MatchError
from symalign.groups import SemiPermutation
from symalign.spec import SymmetrySpec, Transform, apply, on_segment


def split_spec(narrow: SymmetrySpec, wide: SymmetrySpec) -> SymmetrySpec:
    """The splits taking ``narrow``'s spaces to ``wide``'s widths, over ``narrow``'s tensors (module docstring).

    Refuses (:class:`MatchError`) specs with different spaces or tensors, a space of a changing width that is not
    a hidden-unit space (role ``ff``) or lies on a segment of a fused tensor, and equal widths everywhere."""
    if list(narrow.spaces) != list(wide.spaces):
        raise MatchError("the two models have different symmetry spaces (" + ", ".join(
            sorted(set(narrow.spaces) ^ set(wide.spaces))[:4]) + "); widths can differ, the architecture cannot")
    spaces: dict[str, SemiPermutation] = {}
    for name, g in narrow.spaces.items():
        n, m = g.axis_size(), wide.spaces[name].axis_size()
        if n == m:
            continue
        if narrow.role(name) != "ff" or n is None or m is None:
            raise MatchError(f"space {name!r} ({g.describe()} vs {wide.spaces[name].describe()}) differs in width; "
                             "only hidden-unit (ff) widths may differ")
        if n > m:
            raise MatchError(f"space {name!r}: the first model is narrower ({m} units) than the second ({n}) here "
                             "but not everywhere; give the wider model first")
        # units split by positive homogeneity only where every tensor carries the scales (not a BatchNorm's input
        # side, rep "perm": its statistics do not split); else by copies
        homogeneous = g.scales_units and all(a.rep != "perm" for _, a in narrow.tensors_of(name))
        spaces[name] = SemiPermutation(n, m, homogeneous=homogeneous)
    if not spaces:
        raise MatchError("the two models have the same widths; merge them without --widths")
    out = SymmetrySpec()
    for name, g in spaces.items():
        out.add_space(name, g, role=narrow.role(name), layer=narrow.layer(name))
    for name in spaces:
        for t, a in narrow.tensors_of(name):
            if a.segment is not None:
                raise MatchError(f"space {name!r} lies on a segment of the fused tensor {t!r}; splitting it is "
                                 "not supported")
            if [(x.space, x.axis, x.variance) for x in wide.tensors.get(t, [])].count(
                    (name, a.axis, a.variance)) != 1:
                raise MatchError(f"tensor {t!r}: the wide model does not label axis {a.axis} with {name!r}")
            out.act_on(t, name, a.axis, a.variance, a.rep)
    return out


def _rows(x: Tensor, axis: int) -> Tensor:
    y = torch.movedim(x.to(torch.float64), axis, 0)
    return y.reshape(y.shape[0], -1)


def matched_split(split: SymmetrySpec, narrow: SymmetrySpec, state_a: Mapping[str, Tensor],
                  state_b: Mapping[str, Tensor], aligned: Collection[str] = ()) -> Transform:
    """The split of B (narrow) matched onto A (wide), space by space (module docstring). ``narrow``: B's full
    spec, which says which other spaces act on each tensor; ``aligned``: the spaces of the same width in which
    B is already in A's coordinates (e.g. a Transformer's residual stream and attention, aligned first), whose
    axes then count as fixed."""
    done: set[str] = set(aligned)
    state = dict(state_b)
    out: Transform = {}
    for name, g in split.spaces.items():
        rows = []
        for t, a in split.tensors_of(name):
            others = {x.space for x in narrow.tensors[t] if x.space != name}
            rest_a, rest_b = list(state_a[t].shape), list(state[t].shape)
            del rest_a[a.axis], rest_b[a.axis]
            if others <= done and rest_a == rest_b:
                rows.append((_rows(state_a[t], a.axis), _rows(state[t], a.axis), a.variance))
        if not rows:
            raise MatchError(f"space {name!r}: no tensor of it has its other axes fixed or already split, so its "
                             "units cannot be compared; widen the layers before it first")
        out[name] = g.fit(rows)
        state = apply(split.restrict([name]), {name: out[name]}, state)
        done.add(name)
    return out


def uniform_split(split: SymmetrySpec) -> Transform:
    """The unmatched split: per space, the first units copied, equal shares
    (:meth:`~symalign.groups.SemiPermutation.uniform`)."""
    return {name: g.uniform() for name, g in split.spaces.items()}  # type: ignore[attr-defined]


def widen(split: SymmetrySpec, transform: Mapping[str, Tensor], state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """B's state split onto the wide widths (:func:`symalign.spec.apply` of the splits)."""
    return apply(split, transform, state)


def merge_units(split: SymmetrySpec, transform: Mapping[str, Tensor],
                state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The left inverse of :func:`widen`: every split space's copies merged back
    (:meth:`~symalign.groups.SemiPermutation.merge`, in the reverse order of the actions); exact on a widened
    state, a projection on any other wide state."""
    out = dict(state)
    for t, acts in split.tensors.items():
        x = state[t]
        for a in reversed(acts):
            g = split.spaces[a.space]
            x = on_segment(x, a, lambda y, axis, g=g, a=a: g.merge(transform[a.space], y, axis,  # type: ignore
                                                                   a.variance, a.rep))
        out[t] = x
    return out
