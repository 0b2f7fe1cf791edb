r"""Declared symmetries of a network and their exact application to state dicts.

A :class:`SymmetrySpec` names *spaces* (``"heads.3"``, ``"qk.3"``, ``"vo.3"``,
``"ff.3"``, ``"residual"``), gives each the :class:`~symalign.groups.Group` that
acts on it, and labels every tensor axis that indexes a space with an
:class:`AxisAction` (space, axis, variance, representation). A
:data:`Transform` maps space names to group elements; :func:`apply` acts with
it on a state dict.

Several spaces may act on one axis; they act in the order listed for that
tensor. Attention axes list the head permutation first and the per-head
transform second, so on a query axis ``T = blockdiag(A) P``:
``W_Q^i <- A_i W_Q^{pi(i)}`` (PyTorch layout) -- the paper's
``W_Q^i <- W_Q^{pi(i)} A_i^T``. Because ``P blockdiag(A) P^{-1} =
blockdiag(A[pi])``, composing two transforms re-indexes the per-head blocks by
the permutation; the spec records which permutation space ``couples`` to which
per-head spaces so that :func:`compose` and :func:`invert` are exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import torch
from torch import Tensor

from symalign.errors import SpecError
from symalign.groups import Group, HeadPermutation, PerHead, Variance, _generator

Transform = dict[str, Tensor]
"""A group element per space name; spaces left out act as the identity."""


@dataclass(frozen=True)
class AxisAction:
    """Space ``space`` acts on ``axis`` of a tensor with the given variance and representation.

    ``segment=(start, length)`` restricts the action to a slice of the axis: fused
    tensors such as GPT-2's ``c_attn`` (columns ``[Q | K | V]``) or ModernBERT's
    ``Wqkv`` carry several spaces side by side on one axis.
    ``segment=(start, length, period)`` selects ``start .. start + length`` of every
    consecutive block of ``period`` entries (a per-head interleaved fused tensor such as
    GPT-NeoX's ``query_key_value``, laid out ``(head, [q | k | v])``: Q is
    ``(0, d, 3 d)``); the selected entries, in order, form the acted-on axis.
    """

    space: str
    axis: int
    variance: Variance = "co"
    rep: str | None = None
    segment: tuple[int, ...] | None = None

    def size_of(self, x: Tensor) -> int:
        return x.shape[self.axis] if self.segment is None else segment_size(self.segment, x.shape[self.axis])


def segment_size(segment: tuple[int, ...], n: int) -> int:
    """Entries a segment selects on an axis of ``n`` entries (see :class:`AxisAction`)."""
    if len(segment) == 2:
        return int(segment[1])
    return (n // int(segment[2])) * int(segment[1])


def segment_fits(segment: tuple[int, ...], n: int) -> bool:
    start, length = int(segment[0]), int(segment[1])
    period = int(segment[2]) if len(segment) > 2 else n
    return start >= 0 and start + length <= period and period > 0 and n % period == 0


def segment_index(segment: tuple[int, ...], n: int) -> Tensor:
    """The indices (in order) a segment selects on an axis of ``n`` entries."""
    start, length = int(segment[0]), int(segment[1])
    period = int(segment[2]) if len(segment) > 2 else n
    blocks = torch.arange(n // period).unsqueeze(1) * period if len(segment) > 2 else torch.zeros(1, 1, dtype=torch.long)
    return (blocks + start + torch.arange(length)).reshape(-1)


def segment_view(x: Tensor, axis: int, segment: tuple[int, ...]) -> Tensor:
    """The entries of ``x`` a segment selects along ``axis`` (a view for plain slices)."""
    axis = axis % x.dim()
    if len(segment) == 2:
        return x.narrow(axis, int(segment[0]), int(segment[1]))
    return x.index_select(axis, segment_index(segment, x.shape[axis]).to(x.device))


@dataclass
class SymmetrySpec:
    """Which group acts on which axis of which tensor.

    ``spaces``: space name -> group. ``tensors``: tensor name -> axis actions, in
    order of application. ``couplings``: permutation space -> the per-head spaces
    whose blocks it permutes (needed to compose transforms).
    """

    spaces: dict[str, Group] = field(default_factory=dict)
    tensors: dict[str, list[AxisAction]] = field(default_factory=dict)
    couplings: dict[str, tuple[str, ...]] = field(default_factory=dict)

    # -- building -----------------------------------------------------------
    def add_space(self, name: str, group: Group) -> None:
        if name in self.spaces:
            raise SpecError(f"space {name!r} is declared twice")
        self.spaces[name] = group

    def act_on(self, tensor: str, space: str, axis: int, variance: Variance = "co", rep: str | None = None,
               segment: tuple[int, ...] | None = None) -> None:
        if space not in self.spaces:
            raise SpecError(f"tensor {tensor!r} refers to undeclared space {space!r}")
        self.tensors.setdefault(tensor, []).append(AxisAction(space, axis, variance, rep, segment))

    def couple(self, permutation_space: str, *block_spaces: str) -> None:
        self.couplings[permutation_space] = tuple(self.couplings.get(permutation_space, ())) + block_spaces

    def merge(self, other: "SymmetrySpec", prefix: str = "") -> "SymmetrySpec":
        """A new spec holding both; ``other``'s tensor names get ``prefix``."""
        out = SymmetrySpec(dict(self.spaces), {k: list(v) for k, v in self.tensors.items()}, dict(self.couplings))
        for name, g in other.spaces.items():
            out.add_space(name, g)
        for t, acts in other.tensors.items():
            out.tensors.setdefault(prefix + t, []).extend(acts)
        for p, bs in other.couplings.items():
            out.couple(p, *bs)
        return out

    def restrict(self, spaces) -> "SymmetrySpec":
        """The sub-spec of the given spaces only (e.g. attention spaces of one layer)."""
        keep = set(spaces)
        out = SymmetrySpec({k: g for k, g in self.spaces.items() if k in keep})
        for t, acts in self.tensors.items():
            kept = [a for a in acts if a.space in keep]
            if kept:
                out.tensors[t] = kept
        out.couplings = {p: tuple(b for b in bs if b in keep) for p, bs in self.couplings.items() if p in keep}
        return out

    # -- queries ------------------------------------------------------------
    def tensors_of(self, space: str) -> list[tuple[str, AxisAction]]:
        """Every (tensor, action) on which ``space`` acts, in declaration order."""
        return [(t, a) for t, acts in self.tensors.items() for a in acts if a.space == space]

    @property
    def dim(self) -> int:
        """Total dimension of the declared group (sum over spaces)."""
        return sum(g.dim for g in self.spaces.values())

    def describe(self) -> dict[str, str]:
        return {name: g.describe() for name, g in self.spaces.items()}

    def check(self, state: Mapping[str, Tensor]) -> None:
        """Raise :class:`SpecError` naming the tensor if the spec does not fit ``state``."""
        for t, acts in self.tensors.items():
            if t not in state:
                raise SpecError(f"the spec acts on tensor {t!r}, which the state dict does not have")
            x = state[t]
            for a in acts:
                if not -x.dim() <= a.axis < x.dim():
                    raise SpecError(f"tensor {t!r} of shape {tuple(x.shape)} has no axis {a.axis} (space {a.space!r})")
                want = self.spaces[a.space].axis_size(a.rep)
                if a.segment is not None and not segment_fits(a.segment, x.shape[a.axis]):
                    raise SpecError(f"tensor {t!r} axis {a.axis} has {x.shape[a.axis]} entries; the segment "
                                    f"{a.segment} of space {a.space!r} does not fit")
                size = a.size_of(x)
                g = self.spaces[a.space]
                if want is not None and size != want:
                    raise SpecError(f"tensor {t!r} axis {a.axis} has {size} entries but space {a.space!r} "
                                    f"({g.describe()}) acts on {want}")
                if want is None and isinstance(g, PerHead) and size % g.n:
                    raise SpecError(f"tensor {t!r} axis {a.axis} has {size} entries, not a multiple of {g.n} "
                                    f"(space {a.space!r})")


# ----------------------------------------------------------------------------
# Transforms
# ----------------------------------------------------------------------------


def apply(spec: SymmetrySpec, transform: Mapping[str, Tensor], state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Return a new state dict ``g . state``; ``state`` is never modified.

    Tensors no space acts on are passed through by reference (they are not
    copied, and not changed). Products are formed in float64 and cast back to
    each tensor's dtype.
    """
    unknown = set(transform) - set(spec.spaces)
    if unknown:
        raise SpecError(f"the transform names spaces the spec does not declare: {sorted(unknown)}")
    spec.check(state)
    out = dict(state)
    for t, acts in spec.tensors.items():
        x = state[t]
        for a in acts:
            if a.space in transform:
                x = _act(spec.spaces[a.space], transform[a.space], x, a)
        if x is not state[t]:
            out[t] = x
    return out


def _act(group: Group, element: Tensor, x: Tensor, a: AxisAction) -> Tensor:
    """Act on the whole axis, or only on ``a.segment`` of it (the rest is copied unchanged)."""
    if a.segment is None:
        return group.act(element, x, a.axis, a.variance, a.rep)
    axis = a.axis % x.dim()
    if len(a.segment) > 2:
        idx = segment_index(a.segment, x.shape[axis]).to(x.device)
        part = group.act(element, x.index_select(axis, idx), axis, a.variance, a.rep)
        return x.clone().index_copy_(axis, idx, part.to(x.dtype))
    start, length = a.segment
    part = group.act(element, x.narrow(axis, start, length), axis, a.variance, a.rep)
    head = x.narrow(axis, 0, start)
    tail = x.narrow(axis, start + length, x.shape[axis] - start - length)
    return torch.cat([head, part, tail], dim=axis)


def identity(spec: SymmetrySpec) -> Transform:
    return {name: g.identity() for name, g in spec.spaces.items()}


def sample(spec: SymmetrySpec, gen: int | torch.Generator | None = None, spaces=None) -> Transform:
    """A random element of the declared group (of ``spaces`` only, if given)."""
    g = _generator(gen)
    names = spec.spaces if spaces is None else spaces
    return {name: spec.spaces[name].sample(g) for name in names}


def _block_index(spec: SymmetrySpec, perm_space: str, perm: Tensor, block_space: str) -> Tensor:
    pg = spec.spaces[perm_space]
    bg = spec.spaces[block_space]
    if isinstance(pg, HeadPermutation):
        if bg.n_blocks == pg.kv:  # type: ignore[attr-defined]
            return pg.kv_permutation(perm)
        if bg.n_blocks == pg.n_heads:  # type: ignore[attr-defined]
            return perm
    raise SpecError(f"cannot couple {perm_space!r} ({pg.describe()}) with {block_space!r} ({bg.describe()})")


def compose(spec: SymmetrySpec, a: Mapping[str, Tensor], b: Mapping[str, Tensor]) -> Transform:
    """``b`` first, then ``a``: ``apply(compose(a, b), s) == apply(a, apply(b, s))``."""
    full_a = {**identity(spec), **a}
    full_b = {**identity(spec), **b}
    out: Transform = {}
    for name, g in spec.spaces.items():
        bb = full_b[name]
        for p, blocks in spec.couplings.items():
            if name in blocks:  # P_a B_b P_a^{-1} = blockdiag(B_b[pi_a])
                bb = bb[_block_index(spec, p, full_a[p], name)]
        out[name] = g.compose(full_a[name], bb)
    return out


def invert(spec: SymmetrySpec, t: Mapping[str, Tensor]) -> Transform:
    """The inverse transform: ``apply(invert(t), apply(t, s)) == s``."""
    full = {**identity(spec), **t}
    out: Transform = {}
    perm_inv = {p: spec.spaces[p].inverse(full[p]) for p in spec.couplings}
    for name, g in spec.spaces.items():
        inv = g.inverse(full[name])
        for p, blocks in spec.couplings.items():
            if name in blocks:  # (B P)^{-1} = P^{-1} B^{-1} = blockdiag(B^{-1}[pi^{-1}]) P^{-1}
                inv = inv[_block_index(spec, p, perm_inv[p], name)]
        out[name] = inv
    return out
