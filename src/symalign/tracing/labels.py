r"""Axis labels and feature spaces for the tracer.

Every axis of every traced tensor is a row-major product of *atoms*:

* ``("d", size)`` -- a data axis (batch, positions, input features): never transformed;
* ``("f", sid, stride, size)`` -- the feature index ``f = sum_k j_k stride_k`` of feature space
  ``sid``: an axis ``(sid, 1, n)`` indexes the whole space, a head split of a width ``h d``
  space is ``(sid, d, h)`` x ``(sid, 1, d)``;
* ``("p", {(param, axis), ...}, size)`` -- a parameter axis not yet tied to a space.

A :class:`Space` is a feature space found in the graph: produced by a Linear/Conv1D
output, an embedding, a parameter added to the stream, or a contiguous *segment* of a
fused projection (``parent``/``offset``). Spaces are merged (union-find) when the graph
adds or concatenates them (a residual stream), and each operation applied to a space
narrows the set of groups that can act on it exactly (``allowed``):

====================================  ===========================================
operation on the feature axis         groups that commute with it
====================================  ===========================================
Linear or convolution in/out,         ``GL(n)``
addition, scalar mul, average pooling
ReLU / LeakyReLU, max pooling         positive monomials ``S_n x R_{>0}^n``
other elementwise nonlinearity,       permutations ``S_n``
gain (elementwise product), sum,
BatchNorm, depthwise convolution
grouped convolution (g groups) out    ``(S_m)^g`` (x positive scales), see :mod:`.blocks`
GroupNorm (g groups)                  ``S_m wr S_g``
RMSNorm without gain                  ``O(n)`` (and its subgroups)
LayerNorm without affine, adding a    ``O_1(n) = {O : O 1 = 1}``
constant to every feature
a fixed buffer along the axis,        none: the space is pinned (listed in ``skipped``)
model output, unrecognised operation
====================================  ===========================================
"""

from __future__ import annotations

from dataclasses import dataclass, field

OUTPUT, OUTPUT_REASON = "(output)", "is an axis of the model's output"  # the pin of an output feature axis
KINDS = ("gl", "o", "o1", "posmon", "perm")  # groups a space may still carry, largest first

Atom = tuple
Axis = tuple  # tuple of atoms
Labels = tuple  # tuple of axes


def data(shape) -> Labels:
    return tuple((("d", int(s)),) for s in shape)


def atom_size(a: Atom) -> int:
    return int(a[-1])


def axis_size(ax: Axis) -> int:
    n = 1
    for a in ax:
        n *= atom_size(a)
    return n


@dataclass
class Space:
    """One feature space (see the module docstring)."""

    sid: int
    n: int
    layer: str
    kind: str  # "hidden" (Linear output), "embed", "param", "attn_out", "segment"
    allowed: set = field(default_factory=lambda: set(KINDS))
    pinned: list = field(default_factory=list)  # (layer, reason)
    uses: list = field(default_factory=list)  # consumer kinds ("linear_in", "sdpa", "norm", "add", ...)
    notes: list = field(default_factory=list)
    parent: int | None = None
    offset: int = 0
    split: bool = False
    stream: bool = False
    order: int = 0
    blocks: int = 1  # grouped convolution / GroupNorm: the g contiguous channel groups a permutation must keep
    in_place: bool = False  # the blocks must stay in place ((S_m)^g); else they may move (S_m wr S_g)


class Spaces:
    """Union-find over :class:`Space` with parameter bindings ``(param, axis) -> space``."""

    def __init__(self):
        self.items: dict[int, Space] = {}
        self.up: dict[int, int] = {}
        self.bind: dict[tuple[str, int], int] = {}
        self.bind_uses: dict[tuple[str, int], list[tuple[str, str]]] = {}  # -> [(tensor name, variance)]
        self.fixed: dict[tuple[str, int], str] = {}  # parameter axes that must not move (reason)
        self.layout: dict[tuple[str, int], tuple | None] = {}  # segments of a blockwise binding (bind_param)

    def new(self, n: int, layer: str, kind: str, parent: int | None = None, offset: int = 0) -> int:
        sid = len(self.items)
        self.items[sid] = Space(sid, int(n), layer, kind, parent=parent, offset=offset, order=sid)
        self.up[sid] = sid
        return sid

    def find(self, sid: int) -> int:
        while self.up[sid] != sid:
            self.up[sid] = self.up[self.up[sid]]
            sid = self.up[sid]
        return sid

    def get(self, sid: int) -> Space:
        return self.items[self.find(sid)]

    def union(self, a: int, b: int, stream: bool = False) -> int:
        """Merge two spaces; ``stream``: they are added or concatenated (a residual stream)."""
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return ra
        sa, sb = self.items[ra], self.items[rb]
        if sa.n != sb.n:
            raise ValueError(f"cannot merge feature spaces of widths {sa.n} and {sb.n}")
        keep, drop = (sa, sb) if sa.order <= sb.order else (sb, sa)
        keep.allowed &= drop.allowed
        keep.pinned += drop.pinned
        keep.uses += drop.uses
        keep.notes += drop.notes
        keep.split = keep.split or drop.split
        keep.stream = keep.stream or drop.stream or stream
        keep.blocks, keep.in_place = combine_blocks(keep.n, (keep.blocks, keep.in_place),
                                                    (drop.blocks, drop.in_place))
        self.up[drop.sid] = keep.sid
        return keep.sid

    def blockify(self, sid: int, blocks: int, in_place: bool) -> None:
        """Only permutations (and positive scales) that keep ``blocks`` contiguous groups act on ``sid``
        (``in_place``: each group stays where it is)."""
        s = self.get(sid)
        s.allowed &= {"posmon", "perm"}
        s.blocks, s.in_place = combine_blocks(s.n, (s.blocks, s.in_place), (blocks, in_place))

    def restrict(self, sid: int, kinds, why: str = "") -> None:
        self.get(sid).allowed &= set(kinds)

    def pin(self, sid: int, layer: str, reason: str) -> None:
        self.get(sid).pinned.append((layer, reason))

    def use(self, sid: int, kind: str) -> None:
        self.get(sid).uses.append(kind)

    def bind_param(self, pa: tuple[str, int], sid: int | None, name: str, variance: str, n: int, layer: str,
                   kind: str = "param", layout: tuple | None = None) -> int:
        """Tie parameter axis ``pa`` (canonical name, axis) to ``sid`` (or to a new space); returns the space.

        ``layout``: the segments (:class:`symalign.spec.AxisAction`) through which the space indexes the
        axis when the axis is the space times data (a convolution's output flattened: ``(j, 1, HW)`` for
        each spatial position ``j``); ``None``: the whole axis."""
        if self.layout.get(pa, layout) != layout:
            self.fix(pa, "is read with two different layouts of its feature space")
        self.layout.setdefault(pa, layout)
        if pa in self.bind:
            cur = self.bind[pa]
            sid = cur if sid is None else self.union(cur, sid)
        elif sid is None:
            sid = self.new(n, layer, kind)
        self.bind[pa] = sid
        uses = self.bind_uses.setdefault(pa, [])
        if (name, variance) not in uses:
            uses.append((name, variance))
        return self.find(sid)

    def fix(self, pa: tuple[str, int], reason: str) -> None:
        self.fixed.setdefault(pa, reason)

    def roots(self) -> list[Space]:
        return [s for s in self.items.values() if self.find(s.sid) == s.sid]


def combine_blocks(n: int, a: tuple[int, bool], b: tuple[int, bool]) -> tuple[int, bool]:
    """The block structure ``(blocks, in_place)`` whose permutations keep both ``a`` and ``b``.

    Equal blocks: the stricter of the two. Nested blocks (one count divides the other): the
    finer blocks, kept in place -- a subgroup of both. Otherwise ``(n, True)``: no permutation.
    """
    (ga, fa), (gb, fb) = a, b
    if ga == 1:
        return gb, fb
    if gb == 1:
        return ga, fa
    if ga == gb:
        return ga, fa or fb
    if ga % gb == 0 or gb % ga == 0:
        return max(ga, gb), True
    return n, True


def simplify(ax: list) -> Axis:
    """Merge adjacent atoms (contiguous feature strides, data with data) and drop size-1 atoms."""
    out: list = []
    for a in ax:
        if atom_size(a) == 1:
            continue
        if out:
            b = out[-1]
            if a[0] == b[0] == "d":
                out[-1] = ("d", b[1] * a[1])
                continue
            if a[0] == b[0] == "f" and a[1] == b[1] and b[2] == a[2] * a[3]:
                out[-1] = ("f", a[1], a[2], b[3] * a[3])
                continue
        out.append(a)
    return tuple(out) if out else (("d", 1),)


def split_atom(a: Atom, outer: int) -> tuple[Atom, Atom] | None:
    """Split ``a`` (size ``outer * inner``) row-major into an outer and an inner atom."""
    n = atom_size(a)
    if outer <= 0 or n % outer:
        return None
    inner = n // outer
    if a[0] == "d":
        return ("d", outer), ("d", inner)
    if a[0] == "f":
        return ("f", a[1], a[2] * inner, outer), ("f", a[1], a[2], inner)
    return None  # a parameter axis split: not tracked


def regroup(labels: Labels, shape) -> Labels | None:
    """Labels of ``view``/``reshape`` of a tensor with ``labels`` to ``shape`` (None: not expressible)."""
    atoms = [a for ax in labels for a in ax if atom_size(a) != 1]
    out = []
    i = 0
    for target in shape:
        target = int(target)
        group: list = []
        prod = 1
        while prod < target:
            if i >= len(atoms):
                return None
            a = atoms[i]
            sz = atom_size(a)
            if target % (prod * sz) == 0:
                group.append(a)
                prod *= sz
                i += 1
            else:
                if target % prod:
                    return None
                parts = split_atom(a, target // prod)
                if parts is None:
                    return None
                group.append(parts[0])
                atoms[i] = parts[1]
                prod *= atom_size(parts[0])
        if prod != target:
            return None
        out.append(simplify(group) if group else (("d", 1),))
    if i != len(atoms):
        return None
    return tuple(out)
