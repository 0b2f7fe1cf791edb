r"""Canonical per-head views of attention tensors, read from a :class:`SymmetrySpec`.

The matcher is architecture-blind: it finds attention layers by the spaces' roles
(a ``heads`` space coupled to a ``qk`` and a ``vo`` per-head space, or a bare
``qk``/``vo`` pair of one layer for layers without a head permutation, e.g.
ALiBi) and gets every tensor from :meth:`SymmetrySpec.tensors_of`.

Paper layout
------------
For a per-head space with blocks of width ``d``, every tensor axis it acts on is
cut into blocks; the other axes of the tensor become *rows*. A block of an
``nn.Linear`` weight ``(n d, D)`` acted on along axis 0 is the ``D x d`` matrix
``W^i`` of the paper; a bias ``(n d,)`` gives one extra row (the homogeneous
coordinate, ``W~ = [W ; b]``). With ``T = U`` the block of the group element:

* covariant parts (Q, V): ``W' = T W`` in PyTorch layout, i.e. each row
  ``w -> w U^T`` (paper: ``W_Q U^T``);
* contravariant parts (K, O): ``W' = T^{-T} W``, i.e. ``w -> w U^{-1}``.

Under GQA a query-head axis (``rep="query"``) of a space with ``h_kv`` blocks
holds ``g = h / h_kv`` consecutive sub-blocks per block; all ``g`` query heads'
rows are stacked under the one transform of their K/V group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch
from torch import Tensor

from symalign.errors import MatchError
from symalign.groups import HeadPermutation, PerHead, RotaryPlanes
from symalign.spec import SymmetrySpec, segment_view


@dataclass(frozen=True)
class Part:
    """One tensor (or one segment of a fused tensor) on one side of a per-head space.

    ``homogeneous``: a 1-D tensor (a bias), contributing one row per head.
    ``segment``: ``(start, length)`` on ``axis`` when the tensor is fused (GPT-2's
    ``c_attn`` holds Q, K and V side by side), or ``(start, length, period)`` for a per-head
    interleaved one (GPT-NeoX); :meth:`read` returns the selected entries (see
    :func:`symalign.spec.segment_view`).
    """

    tensor: str
    axis: int
    variance: str
    rep: str | None
    homogeneous: bool
    segment: tuple[int, ...] | None = None

    def read(self, state: Mapping[str, Tensor]) -> Tensor:
        """The part's tensor from ``state``: the segment's slice of ``axis`` (a view) or the whole tensor."""
        x = state[self.tensor]
        if self.segment is None:
            return x
        return segment_view(x, self.axis, self.segment)


@dataclass(frozen=True)
class SpaceSides:
    """A per-head space and its covariant (Q/V) and contravariant (K/O) parts."""

    name: str
    group: PerHead
    co: tuple[Part, ...]
    contra: tuple[Part, ...]

    @property
    def rope(self) -> RotaryPlanes | None:
        inner = self.group.inner
        return inner if inner.block_matcher == "rope" else None  # type: ignore[return-value]


@dataclass(frozen=True)
class AttentionLayer:
    """The spaces of one attention layer: ``heads`` (optional), ``qk`` and ``vo``."""

    tag: str
    heads: str | None
    heads_group: HeadPermutation | None
    qk: SpaceSides
    vo: SpaceSides

    @property
    def n_kv(self) -> int:
        return self.qk.group.n_blocks

    @property
    def head_dim(self) -> int:
        return self.qk.group.inner.n

    @property
    def n_heads(self) -> int:
        return self.heads_group.n_heads if self.heads_group is not None else self.n_kv

    @property
    def tensors(self) -> list[str]:
        names: list[str] = []
        for s in (self.qk, self.vo):
            for p in s.co + s.contra:
                if p.tensor not in names:
                    names.append(p.tensor)
        return names


def _sides(spec: SymmetrySpec, space: str) -> SpaceSides:
    g = spec.spaces[space]
    block = g.head_block
    if block is None or block.block_matcher not in ("gl", "rope"):  # type: ignore[attr-defined]
        raise MatchError(f"space {space!r} ({g.describe()}) is not a per-head GL/RoPE space; "
                         "the attention matcher needs PerHead(GeneralLinear) or PerHead(RotaryPlanes)")
    if block.block_matcher == "rope" and block.r % 2:  # type: ignore[attr-defined]
        raise MatchError(f"space {space!r}: odd rotated width {block.r}; RoPE planes need an even width")
    co, contra = [], []
    for t, a in spec.tensors_of(space):
        part = Part(t, a.axis, a.variance, a.rep, homogeneous=False, segment=a.segment)  # biases: _mark_bias
        (co if a.variance == "co" else contra).append(part)
    if not co or not contra:
        raise MatchError(f"space {space!r} needs tensors on both sides (covariant and contravariant); "
                         f"found {len(co)} covariant and {len(contra)} contravariant")
    return SpaceSides(space, g, tuple(co), tuple(contra))


def find_layers(spec: SymmetrySpec, state: Mapping[str, Tensor] | None = None) -> list[AttentionLayer]:
    """Every attention layer of ``spec``, in declaration order of its ``qk`` spaces.

    A layer is a space of role ``qk`` and the ``vo`` space of the same head permutation
    (coupling; of the same layer when that permutation is shared by several layers), or of
    the same layer when no head permutation is declared. Its ``tag`` is
    the layer number (the ``qk`` space's name when it has none).
    With ``state`` given, parts whose tensor is 1-D are marked homogeneous (biases).
    """
    heads_of: dict[str, str] = {}
    for p, blocks in spec.couplings.items():
        for b in blocks:
            heads_of[b] = p
    layers = []
    for name in spec.select(role="qk"):
        layer = spec.layer(name)
        tag = name if layer is None else str(layer)
        hq = heads_of.get(name)
        if hq is not None:
            vos = [b for b in spec.couplings[hq] if spec.role(b) == "vo"]
            if len(vos) > 1:  # a head space shared by several layers (T5): this layer's V-O space
                vos = [b for b in vos if spec.layer(b) == layer]
        else:
            vos = [s for s in spec.select(role="vo", layer=layer) if s not in heads_of] if layer is not None else []
        if len(vos) != 1:
            raise MatchError(f"layer {tag!r}: space {name!r} needs exactly one V-O space (role 'vo') "
                             f"{'coupled to ' + repr(hq) if hq is not None else 'of the same layer'}; found {vos}")
        vo = vos[0]
        hv = heads_of.get(vo)
        if hq != hv:
            raise MatchError(f"layer {tag!r}: {name!r} and {vo!r} are coupled to different head spaces ({hq}, {hv})")
        hg = spec.spaces[hq] if hq is not None else None
        if hg is not None and not hg.permutes_heads:
            raise MatchError(f"layer {tag!r}: head space {hq!r} is {hg.describe()}, not a HeadPermutation")
        qk, vos = _sides(spec, name), _sides(spec, vo)
        if state is not None:
            qk, vos = (_mark_bias(s, state) for s in (qk, vos))
        if qk.group.n_blocks != vos.group.n_blocks or qk.group.inner.n != vos.group.inner.n:
            raise MatchError(f"layer {tag!r}: qk ({qk.group.describe()}) and vo ({vos.group.describe()}) "
                             "have different block structures")
        layers.append(AttentionLayer(tag, hq, hg, qk, vos))
    return layers


def _mark_bias(s: SpaceSides, state: Mapping[str, Tensor]) -> SpaceSides:
    def mark(ps):
        return tuple(Part(p.tensor, p.axis, p.variance, p.rep, state[p.tensor].dim() == 1, p.segment) for p in ps)

    return SpaceSides(s.name, s.group, mark(s.co), mark(s.contra))


def direct_distance(s: SpaceSides, state_a, state_b) -> Tensor:
    """``||X_A - X_B||^2 + ||Y_A - Y_B||^2`` per block, directly from the tensors.

    The difference is taken in the tensors' common dtype and its squares are summed in
    float64 (relative error ``<= 3 u`` of that dtype; exact to float64 for float64 weights).
    """
    nb = s.group.n_blocks
    out = torch.zeros(nb, dtype=torch.float64, device=state_a[(s.co + s.contra)[0].tensor].device)
    for p in s.co + s.contra:
        xa, xb = p.read(state_a), p.read(state_b)
        dt = torch.promote_types(xa.dtype, xb.dtype)
        sq = torch.sub(xa.to(dt), xb.to(dt)).pow_(2)
        other = [i for i in range(sq.dim()) if i != p.axis]
        per_index = sq.sum(other, dtype=torch.float64) if other else sq.double()
        out += per_index.reshape(nb, -1).sum(1)
    return out


def block_rows(x: Tensor, part: Part, n_blocks: int, d: int, dtype=torch.float64) -> Tensor:
    """The part as ``(n_blocks, repeat, rows, d)`` in the paper layout (rows = all other axes).

    ``repeat`` is ``g`` for a query-head axis under GQA and 1 otherwise; a bias gives
    ``rows = 1``.
    """
    xd = torch.movedim(x, part.axis, 0)
    size = xd.shape[0]
    if size % (n_blocks * d):
        raise MatchError(f"tensor {part.tensor!r}: axis {part.axis} has {size} entries, "
                         f"not a multiple of {n_blocks} blocks of {d}")
    rep = size // (n_blocks * d)
    return xd.reshape(n_blocks, rep, d, -1).transpose(-1, -2).to(dtype)


def head_rows(x: Tensor, part: Part, d: int, dtype=torch.float64) -> tuple[Tensor, int]:
    """The part as ``(n_units, rows, d)`` with one unit per head block on the axis.

    Returns the view and ``n_units`` (``n_heads`` for a query-head axis, ``h_kv`` for a
    K/V axis under GQA).
    """
    xd = torch.movedim(x, part.axis, 0)
    units = xd.shape[0] // d
    return xd.reshape(units, d, -1).transpose(-1, -2).to(dtype), units


def side_gram(a_parts: list[Tensor], b_parts: list[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """Per-block Gram matrices of one side, summed over parts (rows and query heads), float64.

    Inputs are ``(n_blocks, repeat, rows, d)`` views of A and B (any dtype; see
    :func:`block_rows`). Returns ``(bb, ab, aa_diag)`` with ``bb = X_B^T X_B`` and
    ``ab = X_A^T X_B`` of shape ``(n_blocks, d, d)`` and ``aa_diag = diag(X_A^T X_A)`` of
    shape ``(n_blocks, d)``, where ``X`` stacks all rows of the block (the canonical
    per-block matrix). Each side is first copied once into a float64 ``(n_blocks, d, R)``
    array (``X^T``), then two batched products.
    """
    xa, xb = stacked_rows(a_parts), stacked_rows(b_parts)
    bb = xb @ xb.mT
    ab = xa @ xb.mT
    aa = torch.linalg.vecdot(xa, xa)
    return bb, ab, aa


def stacked_rows(parts: list[Tensor], dtype=torch.float64) -> Tensor:
    """``X^T`` ``(n_blocks, d, R)`` of a block's rows stacked over parts and repeats, in ``dtype``
    (one strided copy per part, no intermediate)."""
    nb, d = parts[0].shape[0], parts[0].shape[-1]
    total = sum(p.shape[1] * p.shape[2] for p in parts)
    out = torch.empty(nb, d, total, dtype=dtype, device=parts[0].device)
    off = 0
    for p in parts:
        rep, rows = p.shape[1], p.shape[2]
        out[:, :, off:off + rep * rows].view(nb, d, rep, rows).copy_(p.permute(0, 3, 1, 2))
        off += rep * rows
    return out
