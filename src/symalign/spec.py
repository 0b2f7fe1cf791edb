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

Roles and layers
----------------
Every space carries a **role** (what it is) and a **layer** (which block it belongs
to, ``None`` for model-wide spaces), declared with
``add_space(name, group, role=..., layer=...)`` and queried with
:meth:`SymmetrySpec.select`. Solvers and scopes read these, never the names (which
are for display and stable result keys). The roles are a closed set, :data:`ROLES`:

* ``"heads"``: a permutation of attention heads (:class:`~symalign.groups.HeadPermutation`);
* ``"qk"``: the per-head transform of the query-key bilinear form (``GL(d_h)``, ``H`` under RoPE);
* ``"vo"``: the per-head transform between values and the output projection;
* ``"ff"``: the hidden units of a feed-forward/MLP layer (permutations, positive monomials for ReLU; the
  units inside each expert of a mixture of experts: :class:`~symalign.groups.BlockPermutations`, coupled
  to the layer's ``"experts"`` space, which permutes the blocks as a head permutation does per-head blocks);
* ``"residual"``: the residual stream (permutation, orthogonal or a subgroup);
* ``"experts"``: a permutation of the experts of a mixture-of-experts layer.

A space declared without a role gets the one its name implies when the name follows
the built-in scheme (``heads.L``, ``qk.L``, ``vo.L``, ``ff.L``, ``residual``), and no
role otherwise; solvers then go by its group alone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Collection, Mapping

import torch
from torch import Tensor

from symalign.errors import SpecError
from symalign.groups import BlockPermutations, Group, HeadPermutation, PerHead, Permutation, Variance, as_generator

Transform = dict[str, Tensor]
"""A group element per space name; spaces left out act as the identity."""

ROLES: tuple[str, ...] = ("heads", "qk", "vo", "ff", "residual", "experts")
"""The roles a space may carry (see the module docstring)."""
ATTENTION_ROLES: tuple[str, ...] = ("heads", "qk", "vo")

_BUILTIN_NAME = re.compile(r"^(heads|qk|vo|ff)\.(\d+)$")


@dataclass(frozen=True)
class SpaceInfo:
    """What a space is (``role``, one of :data:`ROLES` or ``None``) and its block (``layer``)."""

    role: str | None = None
    layer: int | None = None


def implied_info(name: str) -> SpaceInfo:
    """The role and layer a built-in space name implies (``"qk.3"`` -> ``qk``, 3); else none."""
    if name == "residual":
        return SpaceInfo("residual", None)
    m = _BUILTIN_NAME.match(name)
    return SpaceInfo(m.group(1), int(m.group(2))) if m else SpaceInfo()


def _as_set(x) -> set | None:
    if x is None:
        return None
    if isinstance(x, (str, int)):
        return {x}
    return set(x)


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
    if len(segment) > 2:
        blocks = torch.arange(n // period).unsqueeze(1) * period
    else:
        blocks = torch.zeros(1, 1, dtype=torch.long)
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
    info: dict[str, SpaceInfo] = field(default_factory=dict)

    def __post_init__(self):
        self.info = {name: self.info.get(name) or implied_info(name) for name in self.spaces}

    # -- building -----------------------------------------------------------
    def add_space(self, name: str, group: Group, role: str | None = None, layer: int | None = None) -> None:
        """Declare space ``name`` acted on by ``group``, with its ``role`` (one of :data:`ROLES`) and ``layer``.

        Without ``role`` and ``layer``, the ones the name implies (:func:`implied_info`).
        """
        if name in self.spaces:
            raise SpecError(f"space {name!r} is declared twice")
        if role is not None and role not in ROLES:
            raise SpecError(f"space {name!r}: unknown role {role!r}; use one of {', '.join(ROLES)}")
        self.spaces[name] = group
        self.info[name] = implied_info(name) if role is None and layer is None else SpaceInfo(
            role, None if layer is None else int(layer))

    def act_on(self, tensor: str, space: str, axis: int, variance: Variance = "co", rep: str | None = None,
               segment: tuple[int, ...] | None = None) -> None:
        if space not in self.spaces:
            raise SpecError(f"tensor {tensor!r} refers to undeclared space {space!r}")
        self.tensors.setdefault(tensor, []).append(AxisAction(space, axis, variance, rep, segment))

    def couple(self, permutation_space: str, *block_spaces: str) -> None:
        self.couplings[permutation_space] = tuple(self.couplings.get(permutation_space, ())) + block_spaces

    def merge(self, other: "SymmetrySpec", prefix: str = "") -> "SymmetrySpec":
        """A new spec holding both; ``other``'s tensor names get ``prefix``."""
        out = SymmetrySpec(dict(self.spaces), {k: list(v) for k, v in self.tensors.items()}, dict(self.couplings),
                           dict(self.info))
        for name, g in other.spaces.items():
            out.add_space(name, g, other.role(name), other.layer(name))
        for t, acts in other.tensors.items():
            out.tensors.setdefault(prefix + t, []).extend(acts)
        for p, bs in other.couplings.items():
            out.couple(p, *bs)
        return out

    def restrict(self, spaces) -> "SymmetrySpec":
        """The sub-spec of the given spaces only (e.g. attention spaces of one layer)."""
        keep = set(spaces)
        out = SymmetrySpec({k: g for k, g in self.spaces.items() if k in keep},
                           info={k: i for k, i in self.info.items() if k in keep})
        for t, acts in self.tensors.items():
            kept = [a for a in acts if a.space in keep]
            if kept:
                out.tensors[t] = kept
        out.couplings = {p: tuple(b for b in bs if b in keep) for p, bs in self.couplings.items() if p in keep}
        return out

    def with_tensors(self, tensors: dict[str, list[AxisAction]]) -> "SymmetrySpec":
        """The same spaces (groups, roles, layers, couplings) labelling other tensors."""
        return SymmetrySpec(self.spaces, tensors, self.couplings, self.info)

    # -- queries ------------------------------------------------------------
    def role(self, space: str) -> str | None:
        """The role of ``space`` (one of :data:`ROLES`, or ``None`` when undeclared)."""
        return self.info.get(space, SpaceInfo()).role

    def layer(self, space: str) -> int | None:
        """The layer of ``space`` (``None`` for model-wide spaces such as the residual stream)."""
        return self.info.get(space, SpaceInfo()).layer

    def select(self, role: str | Collection[str] | None = None,
               layer: int | Collection[int] | None = None) -> list[str]:
        """The spaces with the given role(s) and layer(s), in declaration order (``None``: any)."""
        roles, layers = _as_set(role), _as_set(layer)
        return [s for s in self.spaces if (roles is None or self.role(s) in roles)
                and (layers is None or self.layer(s) in layers)]

    def layers(self, role: str | Collection[str] | None = None) -> list[int]:
        """The distinct layers of the spaces with the given role(s), sorted."""
        return sorted({self.layer(s) for s in self.select(role)} - {None})

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
                x = act_on(spec.spaces[a.space], transform[a.space], x, a)
        if x is not state[t]:
            out[t] = x
    return out


def on_segment(x: Tensor, a: AxisAction, fn) -> Tensor:
    """``fn(x, axis)`` on the whole tensor, or on the entries ``a.segment`` selects on axis ``a.axis`` only
    (the rest is copied unchanged; differentiable). ``fn`` receives the selected part and the non-negative
    axis; a strided segment ``(start, length, period)`` is gathered, acted on and scattered back."""
    axis = a.axis % x.dim()
    if a.segment is None:
        return fn(x, axis)
    if len(a.segment) > 2:
        idx = segment_index(a.segment, x.shape[axis]).to(x.device)
        part = fn(x.index_select(axis, idx), axis)
        return x.index_copy(axis, idx, part.to(x.dtype))
    start, length = a.segment
    part = fn(x.narrow(axis, start, length), axis)
    head = x.narrow(axis, 0, start)
    tail = x.narrow(axis, start + length, x.shape[axis] - start - length)
    return torch.cat([head, part, tail], dim=axis)


def act_on(group: Group, element: Tensor, x: Tensor, a: AxisAction) -> Tensor:
    """``group``'s ``element`` acting on ``x`` as the action ``a`` says: on the whole axis, or only on
    ``a.segment`` of it (the rest is copied unchanged)."""
    return on_segment(x, a, lambda y, axis: group.act(element, y, axis, a.variance, a.rep))




def identity(spec: SymmetrySpec) -> Transform:
    return {name: g.identity() for name, g in spec.spaces.items()}


def sample(spec: SymmetrySpec, gen: int | torch.Generator | None = None, spaces=None) -> Transform:
    """A random element of the declared group (of ``spaces`` only, if given)."""
    g = as_generator(gen)
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
    if isinstance(pg, Permutation) and isinstance(bg, BlockPermutations) and bg.n_blocks == pg.n:
        return perm  # experts permuted with their per-expert unit permutations
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
