r"""``symalign align --scope model`` (decoders and encoders, with one residual stream or none): alternating passes
over the layers.

The whole-model problem (docs/whole-model.md) is: find the residual element ``O``
(one element for the whole stream, of the group the family's rewrite declares: ``O(D)``,
``O_1(D)`` for a LayerNorm stream, ``S_D`` for a permuted one), per layer ``i`` the FF permutation
``P_i`` and the attention element ``g_i``, minimising
``sum_t ||A_t - (O, P, g) . B_t||^2`` over every labelled tensor of the exactly
rewritten checkpoints (norm gains folded, :func:`symalign.families.prepare`).
The residual couples the layers; given ``O`` the layers are independent (a model without a residual space --
a bare model, whose output is the stream -- has no ``O``: each layer's FF units and attention alone). So each
**pass** reads the layers of A and B in order, one layer of each in memory, and

1. applies the current ``O`` to B's layer and solves the layer's FF permutations
   (linear assignment on ``C = sum X_A X_B^T``) and its attention (the attention
   matcher) -- the exact block minimisers of block-coordinate descent;
2. with those applied (``B'_i``), adds the layer's share of the residual cross-Gram
   ``M += sum_t X_A^t (X_{B'}^t)^T`` (rows: the tensor's residual axis) and of the
   norms ``||A_t||^2``, ``||B'_t||^2``.

After the pass ``O = polar(M + M_free)`` (the group's own nearest element: Procrustes,
on the centred subspace for ``O_1(D)``, an assignment for ``S_D``), where ``M_free`` is the
cross-Gram of the tensors only the residual acts on (embedding, head: computed
once, in row chunks, in pass 0, which also gives the initial ``O``; also a permuted
stream's norm gains: a post-LN encoder's gains on the stream). A global the residual acts on twice (an
encoder's MLM transform, ``A_t ~ O B_t O^T``) enters ``M_free`` as ``match_whole`` counts it (once per axis, B
untransformed on the other) and its distance is formed directly after each pass (it is not linear in ``O``).
Unit spaces other than plain FF permutations (ReLU units, the
expert blocks of a mixture of experts) are solved by :func:`~symalign.match.whole.match_whole`'s
own steps on the layer; a mixture of experts' layer is prepared in transformers' fused layout one
expert at a time (:func:`symalign.stream.fold.prepare_experts`, into stacked tensors in the
working dtype) and written back one tensor per expert. Because ``O`` is orthogonal (a
permutation matrix too), the distance after the pass needs no further read:

``d = sum_t (||A_t||^2 + ||B'_t||^2) - 2 <O, M + M_free>`` (plus the tensors no
residual acts on, and those it acts on twice, summed directly).

A "layer" here is a block of the model (:func:`block_prefixes`). Blocks whose attention shares a space are
solved together (:func:`attention_groups`): T5's self-attention layers share one head permutation per stack
(their common position-bias table), so each of its stacks' blocks are held until the stack's last one is read,
and their attention is matched at once; every other family's blocks are independent given ``O``.

This is exactly the sweep of :func:`symalign.match.whole.match_whole` (FF, attention,
residual), run by the same loop (:func:`symalign.match.descent.descend`), so passes stop on the same rule:
the distance falls by at most ``rtol`` times the unaligned distance, or ``max_sweeps`` passes. A final pass over B
applies the transform, checks each layer through the family's code
(:class:`~symalign.stream.layercheck.LayerChecker`: ``layer'(O x) = O layer(x)``),
and writes OUT. Memory: one layer of A and one of B (float64; float32 above
:data:`symalign.stream.attention.FLOAT64_MAX_LAYER_PARAMS`), the FF cost matrix
``d_ff x d_ff``, ``M`` and ``O`` (``D x D``), the per-layer transforms and the globals the residual acts on twice
(an MLM transform: ``D x D``, A's and B's). A mixture of experts' layer
adds B's expert tensors with the other elements applied (the expert matcher's input) and one expert's
float64 features of each side at a time (:mod:`symalign.match.experts`), and in the final pass the
one-layer model of the check and B's layer as stored: no float64 copy of a whole layer anywhere.
"""

from __future__ import annotations

import contextlib
import math
import re
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import Tensor

from symalign.align_result import AlignResult, CheckReport, PhaseClock, new_result
from symalign.device import exact_matmul, to_device
from symalign.errors import ConfigError, MatchError
from symalign.match.descent import Descent, SweepReport, descend
from symalign.match.whole import CHECKPOINT_SETTINGS
from symalign.spec import SymmetrySpec, apply, segment_view
from symalign.stream import blocks
from symalign.stream.fold import (CHUNK_ELEMENTS, SMALL_ELEMENTS, Preparer, added_tensors, att_spec_of, own_tensors,
                                  prepare_experts, prepare_parts, preparer_of, refusal, residual_space, stored_names)
from symalign.stream.attention import exact_tolerance, open_pair, stored_tolerance, work_dtype
from symalign.stream.layercheck import LayerChecker, sparse_layer
from symalign.io.prefetch import enabled as read_ahead_enabled
from symalign.io.prefetch import read_ahead
from symalign.stream.memory import bound_heap, peak_rss, release
from symalign.stream.progress import progress_bar
from symalign.tolerance import dtype_name
from symalign.checkpoint.lazy import LazyCheckpoint, ResidentCheckpoint
from symalign.io.shards import ShardWriter
def _res_action(spec: SymmetrySpec, t: str, res: str):
    return next((a for a in spec.tensors.get(t, []) if a.space == res), None)


def _res_actions(spec: SymmetrySpec, t: str, res: str) -> list:
    """Every action of the residual space ``res`` on ``t`` (two on an encoder's MLM transform ``O W O^T``)."""
    return [a for a in spec.tensors.get(t, []) if a.space == res]


def _rotate_all(spec: SymmetrySpec, t: str, x: Tensor, res: str, o: Tensor) -> Tensor:
    """``O`` on every axis of ``x`` the residual acts on (``O x``, ``x O^T``, or ``O x O^T``)."""
    for a in _res_actions(spec, t, res):
        x = blocks.rotate(x, a.axis, o)
    return x


def _apply_one(spec: SymmetrySpec, transform: Mapping[str, Tensor], t: str, x: Tensor) -> Tensor:
    """:func:`symalign.spec.apply` on the one tensor ``t`` (the actions on ``t`` alone)."""
    if t not in spec.tensors:
        return x
    return apply(SymmetrySpec(spec.spaces, {t: spec.tensors[t]}, spec.couplings), transform, {t: x})[t]


def _rows(x: Tensor, axis: int) -> Tensor:
    return torch.movedim(x.to(torch.float64), axis % x.dim(), 0).reshape(x.shape[axis], -1)


def block_prefixes(att: SymmetrySpec) -> list[str]:
    """The model's blocks as name prefixes (``"model.layers.3."``, ``"decoder.block.0."``): each attention tensor's
    name up to its first ``.<number>.``, in the order of the attention layers, each once (T5's decoder block holds
    a self- and a cross-attention layer)."""
    out: list[str] = []
    for t in att.tensors:
        m = re.search(r"\.\d+\.", t)
        if m is None:
            raise ConfigError(f"cannot find a block index in tensor name {t!r}")
        if t[:m.end()] not in out:
            out.append(t[:m.end()])
    return out


def attention_groups(spec: SymmetrySpec, spaces: list[list[str]]) -> list[tuple[int, ...]]:
    """Per block, the blocks its attention is solved with: those connected to it through a shared space (T5: one
    head permutation for every self-attention layer of a stack, for their common position-bias table); a block
    alone in every other family. A shared space that is not an attention space is refused (the passes solve unit
    spaces block by block)."""
    owner: dict[str, list[int]] = {}
    for i, sp in enumerate(spaces):
        for x in sp:
            owner.setdefault(x, []).append(i)
    root = list(range(len(spaces)))

    def find(i: int) -> int:
        while root[i] != i:
            i = root[i]
        return i

    for x, ids in owner.items():
        if len(ids) > 1:
            if spec.role(x) in ("ff", "residual", "experts"):
                raise ConfigError(f"space {x!r} ({spec.role(x)}) spans several blocks; the whole-model passes cannot "
                                  "solve it block by block")
            for j in ids[1:]:
                root[find(j)] = find(ids[0])
    groups: dict[int, list[int]] = {}
    for i in range(len(spaces)):
        groups.setdefault(find(i), []).append(i)
    return [tuple(groups[find(i)]) for i in range(len(spaces))]


class StreamedWhole:
    """State of the streamed whole-model match (see the module docstring), over any two tensor sources: lazily
    opened checkpoints (streamed) or resident ones (:class:`~symalign.checkpoint.lazy.ResidentCheckpoint`); the
    residency is one layer of each either way. :func:`write_aligned` puts the result into any sink.

    ``device`` (:mod:`symalign.device`): where the passes compute -- each prepared layer of A and B is moved there,
    and the FF cost matrices, the rotations by ``O``, the attention matcher (its ``device``), the other unit steps
    and the residual cross-Gram ``M`` (``M_free`` too) are formed there, in the same dtypes, with exact matmuls
    (TF32 off, :func:`~symalign.device.exact_matmul`); the FF assignments and the residual element's own solve
    (``O = nearest(M)``, one ``D x D`` problem per pass) run on the CPU, where every transform is kept, and the
    final pass (:func:`write_aligned`: apply, check, write) is on the CPU. ``None``: where the tensors are read
    (the CPU); ``"cpu"`` takes the same steps with no-op moves, bit for bit the same."""

    def __init__(self, a: LazyCheckpoint | ResidentCheckpoint, b: LazyCheckpoint | ResidentCheckpoint,
                 experts: str = "exact", device: str | torch.device | None = None):
        from symalign.device import resolve

        self.device = None if device is None else resolve(device)  # where the passes compute (None: as read)
        for ck in (b, a):
            why = refusal(ck)
            if why is not None:
                raise ConfigError(why)
        att = att_spec_of(b)
        self.a, self.b = a, b
        self.experts = experts
        self.prep_a, self.prep_b = preparer_of(a, att), preparer_of(b, att)
        spec = self.prep_b.spec
        if spec.describe() != self.prep_a.spec.describe():
            raise MatchError("the models have different symmetry groups -- different depth or widths?")
        self.spec = spec
        self.res = residual_space(spec)
        self.prefixes = block_prefixes(att)  # the blocks, in the order of their first attention layer
        self.L = len(self.prefixes)
        self.layer_names = [[n for n in b.keys if n.startswith(p)] for p in self.prefixes]  # as stored
        self.pnames = [[n for n in self.prep_b.names if n.startswith(p)] for p in self.prefixes]  # as prepared
        in_layer = {n for names in self.layer_names for n in names}
        self.globals = [n for n in b.keys if n not in in_layer]
        self.big = [n for n in self.globals if b.tensors[n].numel > (1 << 20)]
        for n in self.globals:
            acts = spec.tensors.get(n, [])
            if any(x.space != self.res for x in acts):
                raise ConfigError(f"{n!r} carries a non-residual space; streamed --scope model cannot chunk it")
            if n in self.big and acts and any(x.axis % len(b.tensors[n].shape) == 0 for x in acts):
                raise ConfigError(f"{n!r}: the residual acts on its row axis; streamed --scope model cannot chunk it")
        # globals the residual acts on twice (an encoder's MLM transform, O W O^T): small, kept (A's and B's) from
        # pass 0, their distance formed directly after each pass (it is not linear in O)
        self.twice = [n for n in self.globals if len(_res_actions(spec, n, self.res)) > 1]
        self.twice_pairs: dict[str, tuple[Tensor, Tensor]] = {}
        self.block_spaces = [self.layer_spaces(i) for i in range(self.L)]
        self.groups = attention_groups(spec, self.block_spaces)
        layered = [n for names in self.pnames for n in names if len(_res_actions(spec, n, self.res)) > 1]
        if layered:
            raise ConfigError(f"{layered[0]!r}: the residual acts on two of its axes inside a layer; streamed "
                              "--scope model cannot solve it; use --no-stream")
        self.layer_params = max(sum(b.tensors[n].numel for n in names) for names in self.layer_names)
        self.dtype = work_dtype(self.layer_params)
        # the residual element: a D x D matrix, or a permutation's indices; None without a residual space (a bare
        # model outputs the stream: its layers are independent, FF units and attention only)
        self.group = spec.spaces[self.res] if self.res is not None else None
        self.O = self.group.identity() if self.group is not None else None
        self.layer_t: list[dict[str, Tensor]] = [{} for _ in range(self.L)]
        self.attention: list[Any] = [None] * self.L
        self.distances: list[float] = []
        self.changes: list[int] = []  # per pass: the unit spaces that took a new element (match_whole's ``changes``)
        self.att_totals: list[dict[str, float]] = [{} for _ in range(self.L)]  # the attention matcher's, per layer
        self.n_free = 0  # tensors (or row chunks) in M_free: none leaves O at its start, as match_whole notes
        self.time_s = 0.0  # seconds in :meth:`match`
        self.written_distance: float | None = None  # the distance of what write_aligned(measure=True) wrote
        self.stage1, self.stage2 = True, "full"
        self.norm_a = 0.0  # sum_t ||A_t||^2 over the labelled tensors (prepared A)
        self.bytes_read = 0  # over all matching passes (pass 0 included)
        self.t_grams = 0.0  # seconds in the exact Gram products (FF costs, residual cross-Gram, attention stage 1
        #                     -- products and its small head assignment -- and stage-2 Grams)

    # -- reading ---------------------------------------------------------------
    def layer(self, ck: LazyCheckpoint, prep: Preparer, i: int, raw: Mapping[str, Tensor] | None = None,
              consume: bool = False):
        """Layer ``i`` of ``ck`` (``raw``: already read), prepared, in the working dtype. ``consume``: each tensor
        is popped from ``raw`` (a dict the caller gives up) as it is read, so the stored layer leaves memory
        while the prepared one is formed, as when it is read from ``ck`` tensor by tensor.

        Read, converted and folded one big tensor at a time with the layer's small tensors
        (the norm gains and biases the folds read; :func:`prepare_parts`): :func:`symalign.families.prepare`
        works in float64, and the folds rewrite each tensor from itself and the small ones, so this
        equals folding the whole layer at once without a float64 copy of the layer (1.4 GB at 7B).
        A mixture of experts' experts are read and folded one expert at a time into their stacked tensors
        (:func:`prepare_experts`; 11 GB in float64 for a Mixtral-8x7B layer, where one expert is 1.4 GB)."""
        names = self.layer_names[i]

        def get(ns):
            if raw is None:
                return ck.read(ns)
            return {n: raw.pop(n) for n in ns} if consume else {n: raw[n] for n in ns}  # type: ignore[attr-defined]

        def read(n):
            return get([n])[n].to(self.dtype)

        experts = prep.experts_of(names)
        stacked = stored_names(experts)
        rest = [n for n in names if n not in stacked]
        # a tensor the fused layout renames (a router) is folded with the small ones
        big = [n for n in rest if ck.tensors[n].numel > SMALL_ELEMENTS and n not in prep.renamed]
        small = {n: v.to(self.dtype) for n, v in get([n for n in rest if n not in big]).items()}
        out, done = prepare_parts(prep, small, big, read, need=[n for n in small if n not in prep.renamed])
        out.update(done)
        out.update(prepare_experts(prep, small, experts, read))
        return {n: out[n] for n in (self.pnames[i] if prep.fused else names)}

    def raw_pair(self, i: int) -> tuple[dict[str, Tensor] | None, dict[str, Tensor] | None]:
        """A's and B's layer ``i`` as stored, for :meth:`layer` (read ahead, :mod:`symalign.io.prefetch`);
        ``(None, None)`` for a mixture-of-experts layer, which :meth:`layer` reads one expert at a time."""
        names = self.layer_names[i]
        return (None, None) if self.prep_b.experts_of(names) else (self.a.read(names), self.b.read(names))

    def global_chunks(self, ck: LazyCheckpoint, prep: Preparer):
        """``(name, start, prepared rows)`` over every global tensor (small ones whole, ``start`` 0; a small
        one folded with a big one -- a head's bias -- after that tensor's last chunk)."""
        small = ck.read([n for n in self.globals if n not in self.big], self.dtype)
        done = {k: v for k, v in prep.with_one(small).items() if not v.is_meta}
        for n, v in done.items():
            yield n, 0, v
        for n in self.big:
            rows = ck.tensors[n].shape[0]
            step = max(1, CHUNK_ELEMENTS // max(1, ck.tensors[n].numel // rows))
            owned = [k for k in own_tensors(n, small) if k not in done]
            parts: dict[str, list[Tensor]] = {k: [] for k in owned}
            for s in range(0, rows, step):
                part = ck.read_rows(n, s, min(rows, s + step), self.dtype)
                r = prep.with_one(small, n, part, s)
                for k in owned:
                    parts[k].append(r[k])
                yield n, s, r[n]
                for k in prep.extra:  # the untied head: the same rows of the folded embedding
                    if k in r:
                        yield k, s, r[k]
            for k in owned:
                done[k] = torch.cat(parts[k])
                yield k, 0, done[k]
        lost = [k for k in small if k not in done]
        if lost:
            raise ConfigError(f"internal error: the rewrite of {lost[0]!r} depends on more than one big tensor; "
                              "use --no-stream")

    def layer_spec(self, i: int, with_res: bool = True) -> SymmetrySpec:
        names = [n for n in self.pnames[i] if n in self.spec.tensors]
        sub = SymmetrySpec(self.spec.spaces, {t: self.spec.tensors[t] for t in names}, self.spec.couplings)
        keep = [s for s in self.layer_spaces(i)] + ([self.res] if with_res and self.res is not None else [])
        return sub.restrict(keep)

    def layer_spaces(self, i: int) -> list[str]:
        return [s for s in self.spec.spaces if s != self.res and any(
            t in self.spec.tensors and any(x.space == s for x in self.spec.tensors[t]) for t in self.pnames[i])]

    def rotate(self, sub: SymmetrySpec, state: Mapping[str, Tensor], o: Tensor) -> dict[str, Tensor]:
        """The residual element on every tensor of ``state`` it acts on (``O^{-T} = O``: one product)."""
        return {t: self.rotate_one(sub, t, x, o) for t, x in state.items()}

    def rotate_one(self, sub: SymmetrySpec, t: str, x: Tensor, o: Tensor) -> Tensor:
        a = _res_action(sub, t, self.res)
        return x if a is None else blocks.rotate(x, a.axis, o)

    def aligned_layer(self, ck: LazyCheckpoint, prep: Preparer, i: int,
                      raw: Mapping[str, Tensor] | None = None) -> dict[str, Tensor]:
        """``O (P_i, g_i) . B_i`` in the working dtype, tensor by tensor (B's prepared layer is consumed as
        each tensor is transformed)."""
        lb = self.layer(ck, prep, i, raw)
        sub, lsub = self.layer_spec(i), self.layer_spec(i, with_res=False)
        out = {}
        for t in list(lb):
            out[t] = self.rotate_one(sub, t, _apply_one(lsub, self.layer_t[i], t, lb.pop(t)), self.O)
        return out

    # -- the passes ------------------------------------------------------------
    def free(self, i: int) -> list[str]:
        """Layer ``i``'s tensors only the residual acts on (norm gains of a permuted stream, a LayerNorm bias
        kept behind a bias-free reader): like the embedding, their cross term is the same in every pass."""
        return [t for t in self.pnames[i] if t in self.spec.tensors
                and all(x.space == self.res for x in self.spec.tensors[t])]

    def free_layer_tensors(self, ck: LazyCheckpoint, prep: Preparer, i: int) -> dict[str, Tensor]:
        """The prepared :meth:`free` tensors of layer ``i`` (one big tensor in memory at a time)."""
        names, free = self.layer_names[i], self.free(i)
        if not free:
            return {}
        if prep.fused:
            lay = self.layer(ck, prep, i)
            return {t: lay[t] for t in free}
        big = [n for n in names if ck.tensors[n].numel > SMALL_ELEMENTS]
        small = {n: v.to(self.dtype) for n, v in ck.read([n for n in names if n not in big]).items()}
        out, done = prepare_parts(prep, small, [n for n in big if n in free],
                                  lambda n: ck.read([n])[n].to(self.dtype), need=free)
        out.update(done)
        return {t: out[t] for t in free}

    def pass0(self) -> tuple[Tensor | None, Tensor | None, float, float]:
        """``M_free``, ``M_twice``, ``sum ||A_t||^2 + ||B_t||^2`` over the free tensors (globals, :meth:`free`) the
        residual acts on once, and the unaligned distance of all free tensors
        (:func:`symalign.match.whole.match_whole` computes this cross term once too).

        ``M_twice``: for each global ``t`` the residual acts on twice (:attr:`twice`, ``A_t ~ O B_t O^T``),
        ``sum_axes X_A X_B^T`` with ``B_t`` untransformed on the other axis -- the constant term ``match_whole``'s
        residual step gives such a tensor (its free pairs, one per action); it enters the solve for ``O`` but not
        the distance formula (``||A_t - O B_t O^T||^2`` is not linear in ``O``: :meth:`twice_distance`)."""
        if self.group is None:  # no residual space: nothing is free of the layers' spaces
            return None, None, 0.0, 0.0
        D = self.group.n
        m = torch.zeros(D, D, dtype=torch.float64, device=self.device)
        m2 = torch.zeros(D, D, dtype=torch.float64, device=self.device) if self.twice else None
        norms = d0 = 0.0

        def pairs():
            yield from zip(self.global_chunks(self.a, self.prep_a), self.global_chunks(self.b, self.prep_b))
            for i in range(self.L):
                fa = self.free_layer_tensors(self.a, self.prep_a, i)
                fb = self.free_layer_tensors(self.b, self.prep_b, i)
                for t in fa:
                    yield (t, 0, fa[t]), (t, 0, fb[t])

        for (n, _, ca), (_, _, cb) in pairs():
            acts = _res_actions(self.spec, n, self.res)
            if not acts:
                continue
            self.n_free += 1
            if n in self.twice:
                self.twice_pairs[n] = (ca, cb)
                for a in acts:
                    m2 += _rows(ca, a.axis).to(m2.device) @ _rows(cb, a.axis).to(m2.device).T
                d0 += blocks.sq_diff(ca, cb)
                self.norm_a += blocks.sq(ca)
                continue
            xa, xb = _rows(ca, acts[0].axis), _rows(cb, acts[0].axis)
            if self.device is not None:
                xa, xb = xa.to(self.device), xb.to(self.device)
            m += xa @ xb.T
            norms += blocks.sq(xa) + blocks.sq(xb)
            d0 += blocks.sq_diff(xa, xb)
            self.norm_a += blocks.sq(xa)
        return m.cpu(), (None if m2 is None else m2.cpu()), norms, d0

    def twice_distance(self) -> float:
        """``sum_t ||A_t - O B_t O^T||^2`` over the globals the residual acts on twice (:attr:`twice`)."""
        return sum((blocks.sq_diff(ca, _rotate_all(self.spec, n, cb, self.res, self.O))
                    for n, (ca, cb) in self.twice_pairs.items()), 0.0)

    def units(self, i: int):
        """``(fast, other, attention)`` spaces of layer ``i`` as :func:`symalign.match.whole.partition` splits
        them: plain FF permutations (solved here, tensor by tensor), the other unit spaces (ReLU units, expert
        blocks: :func:`~symalign.match.whole.anchored_step` / :func:`~symalign.match.whole.unit_step`), and
        the attention spaces (:func:`symalign.match.match_attention`)."""
        from symalign.match.whole import partition, unit_spaces

        sub = self.layer_spec(i)
        part = partition(sub)
        units, _ = unit_spaces(sub, part)
        fast = [u for u in units if sub.spaces[u].is_permutation and u not in part.experts
                and all(x.space in (u, self.res) for t, _ in sub.tensors_of(u) for x in sub.tensors[t])]
        return fast, [u for u in units if u not in fast], part.attention

    def sweep(self, first: bool, bar=None, anchored: bool | None = None) -> tuple[Tensor | None, float, float, int,
                                                                                   bool]:
        """One pass: FF and attention per layer given ``O``; returns ``M`` (layers), norms+direct, ``d0``, the unit
        spaces that moved, and whether an anchored first pass solved some space on part of its tensors
        (:func:`~symalign.match.whole.anchored_step`: then the pass initialises, :mod:`symalign.match.descent`).

        Each space is solved as :func:`~symalign.match.whole.match_whole`'s sweep solves it (all other
        elements applied; the first pass is its anchored first sweep unless the match is warm-started:
        ``anchored`` defaults to ``first``; ``first`` also sums the unaligned distance ``d0``). Memory: A's and B's
        prepared layer, and one tensor's float64 temporaries at a time for plain FF permutations
        (:mod:`~symalign.stream.blocks`): B's layer is rotated by ``O`` tensor by tensor as the
        FF costs and the attention matcher need it, never as a whole; each tensor leaves memory
        once its share of ``M`` is added. Other unit spaces (ReLU units, expert blocks) get
        ``match_whole``'s own step on the layer (their tensors with ``O`` applied)."""
        dev = self.device
        o = self.O if dev is None or self.O is None else self.O.to(dev)  # O where the products are formed
        m = None if self.group is None else torch.zeros(self.group.n, self.group.n, dtype=torch.float64, device=dev)
        acc = d0 = 0.0
        moved, partial = 0, False
        held: dict[tuple[int, ...], list] = {}  # blocks waiting for the joint attention solve of their group
        # Where read-ahead is on (a CUDA device), layer i + 1 is read as stored while layer i is matched; else each
        # layer is read tensor by tensor as it is prepared, so the stored layers never sit beside the prepared ones.
        pairs = read_ahead(self.raw_pair, range(self.L), dev) if read_ahead_enabled(dev) else None
        for i in range(self.L):
            # not zip(): its reused result tuple would keep the pair until the next layer
            raw_a, raw_b = next(pairs) if pairs is not None else (None, None)
            release()
            if bar is not None:
                bar.update(self.a.bytes_read + self.b.bytes_read, f"layer {i + 1}/{self.L}")
            la = to_device(self.layer(self.a, self.prep_a, i, raw_a, consume=True), dev)
            del raw_a  # (consumed) before B's layer is prepared
            lb = to_device(self.layer(self.b, self.prep_b, i, raw_b, consume=True), dev)
            del raw_b
            sub = self.layer_spec(i)
            free = set(self.free(i))  # in M_free and the norms since pass 0
            bound = [t for t in sub.tensors if t not in free]
            if first:
                d0 += sum(blocks.sq_diff(la[t], lb[t]) for t in bound)
                self.norm_a += sum(blocks.sq(la[t]) for t in bound)
            fast, other, att_spaces = self.units(i)
            anchor = first if anchored is None else anchored
            t_i, n_fast = self._solve_fast_units(i, sub, fast, la, lb, o, anchor)
            n_other, part_i = self._solve_other_units(i, sub, other, att_spaces, la, lb, o, anchor, t_i)
            moved, partial = moved + n_fast + n_other, partial or part_i
            group = self.groups[i]
            held.setdefault(group, []).append((i, sub, att_spaces, la, lb, bound, t_i))
            del la, lb
            if i != group[-1]:
                continue  # a block whose attention shares a space with a later block waits for it
            t_att = self._solve_attention(held[group], o)
            for j, sub_j, _, la_j, lb_j, bound_j, t_j in held.pop(group):
                t_j.update({k: v for k, v in t_att.items() if k in self.block_spaces[j]})
                self.layer_t[j] = t_j
                acc += self._accumulate(j, sub_j, bound_j, la_j, lb_j, t_j, m)
            del t_att
        return (None if m is None else m.cpu()), acc, d0, moved, partial

    def _solve_fast_units(self, i: int, sub: SymmetrySpec, fast: list[str], la: dict, lb: dict, o: Tensor | None,
                          first: bool) -> tuple[dict[str, Tensor], int]:
        """Layer ``i``'s plain FF permutations: ``P = argmax <P, C>``, ``C = sum_t X_A^t (X_{O.B}^t)^T`` formed one
        tensor (segment) at a time, assigned on the CPU. Returns the permutations and how many moved (the block
        distance ``const - 2 <P, C>`` fell by more than ``tol``: ``match_whole``'s ``unit_step`` rule)."""
        t_i: dict[str, Tensor] = {}
        moved = 0
        for s in fast:
            tg = time.perf_counter()
            c = None
            for t, x in sub.tensors_of(s):
                r = _res_action(sub, t, self.res)
                ta, tb = la[t], lb[t]
                if x.segment is not None:  # fused gate|up: each half's rows
                    ta, tb = segment_view(ta, x.axis, x.segment), segment_view(tb, x.axis, x.segment)
                xb = blocks.rotated_rows(tb, r.axis, x.axis, o) if r is not None else _rows(tb, x.axis)
                c = blocks.cost_into(c, blocks.as_rows(ta, x.axis), xb)
                del xb, ta, tb
            self.t_grams += time.perf_counter() - tg
            c = c.cpu()  # the assignment (scipy) on the CPU
            old = None if first else self.layer_t[i].get(s)
            before = None if old is None else float(c.gather(1, old.view(-1, 1)).sum())
            t_i[s] = blocks.assign_max_inplace(c)  # c is -C now
            after = -float(c.gather(1, t_i[s].view(-1, 1)).sum())
            moved += 1 if before is None else int(2.0 * (after - before) > self.tol)
            del c
            release()
        return t_i, moved

    def _solve_other_units(self, i: int, sub: SymmetrySpec, other: list[str], att_spaces: list[str], la: dict,
                           lb: dict, o: Tensor | None, first: bool, t_i: dict[str, Tensor]) -> tuple[int, bool]:
        """Layer ``i``'s other unit spaces (ReLU units, expert blocks) by ``match_whole``'s own step (anchored on
        the first pass), with ``O`` and the layer's current elements applied; their elements go into ``t_i`` (on
        the CPU). Returns how many moved and whether the anchored step solved one on part of its tensors."""
        if not other:
            return 0, False
        from symalign.match.whole import anchored_step, unit_step

        dev = self.device
        tr = {**({self.res: o} if self.res is not None else {}),
              **to_device({k: v for k, v in self.layer_t[i].items() if k not in att_spaces}, dev)}
        partial = False
        if first:
            moved, partial = anchored_step(sub, other, tr, la, lb, set(tr), self.experts)
        else:
            moved = unit_step(sub, other, tr, la, lb, other, self.tol, self.experts)
        found = {k: v for k, v in tr.items() if k != self.res and k not in t_i}
        t_i.update(found if dev is None else to_device(found, torch.device("cpu")))
        release()
        return moved, partial

    def _solve_attention(self, group: list[tuple], o: Tensor | None) -> dict[str, Tensor]:
        """The attention spaces of a group's blocks (one block, or blocks that share an attention space:
        :func:`attention_groups`; each entry ``(i, sub, attention spaces, A's layer, B's layer, ...)``) by one
        :func:`~symalign.match.match_attention` on A and ``O . B`` (fused segments split); records its report and
        timings at the group's last block. Returns its transform (on the CPU)."""
        from symalign.arch.fused import split_segments
        from symalign.match import match_attention

        la, cur, tensors = {}, {}, {}
        ids = [g[0] for g in group]
        for _, sub, spaces, a, b, *_ in group:
            part = sub.restrict(spaces)
            tensors.update({t: self.spec.tensors[t] for t in part.tensors})
            la.update({t: a[t] for t in part.tensors})
            cur.update({t: self.rotate_one(sub, t, b[t], o) for t in part.tensors})
        att_sub = SymmetrySpec(self.spec.spaces, tensors, self.spec.couplings).restrict(
            sorted({x for g in group for x in g[2]}))
        view_spec, (va, vb) = split_segments(att_sub, la, cur)
        att = match_attention(view_spec, va, vb, stage1=self.stage1, stage2=self.stage2,
                              stage1_dtype=torch.float32 if self.b.dtype != torch.float64 else None,
                              device=self.device)
        self.t_grams += att.totals.get("time_stage1_s", 0.0) + att.totals.get("time_grams_s", 0.0)
        for j in ids[:-1]:
            self.attention[j], self.att_totals[j] = None, {}
        self.attention[ids[-1]] = att.to_dict()["layers"]
        self.att_totals[ids[-1]] = dict(att.totals)
        return att.transform

    def _accumulate(self, i: int, sub: SymmetrySpec, bound: list[str], la: dict, lb: dict, t_i: dict[str, Tensor],
                    m: Tensor | None) -> float:
        """``B'_t = (P, g) . B_t`` for each bound tensor of layer ``i``, one at a time (popped from ``la``/``lb``):
        tensors on the residual add ``X_A^T X_B'`` on their residual axis into ``M`` (in place) and return
        ``||X_A||^2 + ||X_B'||^2``; the others return ``||X_A - X_B'||^2``. The sum of those is returned."""
        lsub = self.layer_spec(i, with_res=False)
        t_on = to_device(t_i, self.device)
        acc = 0.0
        for t in bound:
            xa, xb = la.pop(t), _apply_one(lsub, t_on, t, lb.pop(t))
            a = _res_action(sub, t, self.res)
            if a is None:
                acc += blocks.sq_diff(xa, xb)
            else:
                tg = time.perf_counter()
                blocks.cross_gram_axis_into(m, xa, xb, a.axis)
                self.t_grams += time.perf_counter() - tg
                acc += blocks.sq(xa) + blocks.sq(xb)
            del xa, xb
        return acc

    def match(self, stage1: bool, stage2: str, max_sweeps: int, rtol: float, progress: bool,
              report: Callable[[int, float], None] | None = None, init: Mapping[str, Tensor] | None = None) -> bool:
        """The passes (module docstring) until the stopping rule or ``max_sweeps``; whether it converged.
        ``progress``: a progress bar per pass; ``report``: called after each pass with ``(pass, distance)``;
        ``init``: a starting transform (:meth:`start_from`), as ``match_whole``'s ``init``."""
        t0 = time.perf_counter()
        self.stage1, self.stage2 = stage1, stage2
        with exact_matmul() if self.device is not None else contextlib.nullcontext():
            return self._match(max_sweeps, rtol, progress, report, t0, init)

    def start_from(self, init: Mapping[str, Tensor]) -> None:
        """A warm start, as :func:`~symalign.match.whole.match_whole`'s ``init``: ``O`` and each layer's unit
        elements taken from ``init`` (a :meth:`transform` of the same spec; spaces it lacks stay at the identity),
        so the first pass is an ordinary one -- no initialisation of ``O`` from the free tensors, no anchored
        first sweep. The attention elements are solved afresh in every pass either way."""
        if self.res is not None and self.res in init:
            self.O = init[self.res].detach().cpu().clone()
        for i in range(self.L):
            self.layer_t[i] = {s: init[s].detach().cpu() for s in self.block_spaces[i] if s in init}

    def _match(self, max_sweeps: int, rtol: float, progress: bool, report: Callable[[int, float], None] | None,
               t0: float, init: Mapping[str, Tensor] | None = None) -> bool:
        m_free, m_twice, free_norms, d_glob = self.pass0()
        self.bytes_read += self.a.bytes_read + self.b.bytes_read
        if init is not None:
            self.start_from(init)
        elif m_free is not None:  # initialisation from the free tensors, as match_whole
            self.O = self.group.nearest(m_free if m_twice is None else m_free + m_twice)
        self.tol = 0.0
        total = self.a.nbytes + self.b.nbytes

        def sweep(k: int) -> SweepReport:
            """Pass ``k + 1`` over the layers, then the residual element from the accumulated cross-Gram."""
            self.a.bytes_read = self.b.bytes_read = 0
            with progress_bar(total, f"align (model, streamed) pass {k + 1}", progress) as bar:
                m, acc, d0, moved, partial = self.sweep(first=(k == 0), bar=bar, anchored=(k == 0 and init is None))
            self.bytes_read += self.a.bytes_read + self.b.bytes_read
            unaligned = d_glob + d0 if k == 0 else None
            if unaligned is not None:
                self.tol = 1e-12 * unaligned  # match_whole's threshold for counting a unit space as moved
            d = acc if m is None else self.solve_residual(m + m_free, m_twice, acc + free_norms)
            return SweepReport(max(d, 0.0), moved, unaligned, partial)

        self.distances, self.changes = [], []
        out = descend(sweep, max_sweeps=max_sweeps, rtol=rtol, progress=report,
                      record=Descent(self.distances, self.changes, False))
        self.time_s = time.perf_counter() - t0
        return out.converged

    def solve_residual(self, m: Tensor, m_twice: Tensor | None, norms: float) -> float:
        """``O = nearest(M + M_free (+ M_twice))`` -- Procrustes (``O(D)``, ``O_1(D)``) or an assignment (``S_D``): the
        group's own -- and the distance after the pass, ``norms - 2 <O, M + M_free>`` plus the twice-acted globals'
        (``m``: ``M + M_free``; ``norms``: the squared norms and the directly summed distances)."""
        self.O = self.group.nearest(m if m_twice is None else m + m_twice)
        return norms - 2.0 * blocks.inner(self.O, m) + self.twice_distance()

    def relative(self, d: float) -> float:
        """``sqrt(d / sum_t ||A_t||^2)`` (absolute where A is 0): a distance of :attr:`distances` relative to A."""
        return math.sqrt(d / self.norm_a) if self.norm_a else math.sqrt(d)

    def transform(self) -> dict[str, Tensor]:
        """The group element found: the residual element and every layer's FF and attention elements."""
        res = {self.res: self.O} if self.res is not None else {}
        return {**res, **{k: v for t in self.layer_t for k, v in t.items()}}

    def summary(self, converged: bool) -> dict[str, Any]:
        """The matcher's JSON summary, with the keys of :meth:`symalign.match.whole.WholeMatch.to_dict` (the
        attention part as :meth:`symalign.match.api.AttentionMatch.to_dict`, over the last pass's layers)."""
        from symalign.match.whole import expert_units, partition

        d = self.distances
        layers = [x for att in self.attention if att is not None for x in att]
        totals: dict[str, float] = {}
        for t in self.att_totals:
            for k, v in t.items():
                totals[k] = totals.get(k, 0.0) + v
        conds = [c for lay in layers for c in lay.get("qk_cond", []) + lay.get("vo_cond", [])]
        notes = [n for n in (self.spec.spaces[s].note(s) for s in partition(self.spec).orthogonal) if n]
        if not self.n_free and self.res is not None:
            notes.append(f"{self.res}: no tensor free of other spaces; initialised at the identity")
        return {"method": "weight", "iterations": len(d) - 1, "sweeps": len(d) - 1, "converged": converged,
                "distances": list(d), "changes": list(self.changes),
                "relative_distance_after": math.sqrt(d[-1] / d[0]) if d[0] else 0.0,
                "spaces": self.spec.describe(), "time_s": self.time_s, "notes": notes,
                "experts": self.experts if expert_units(self.spec) else None,
                "attention": {"stage1": self.stage1, "stage2": self.stage2, "totals": totals,
                              "worst_condition": max(conds) if conds else 1.0, "layers": layers}}


def stream_inputs(checker: LayerChecker, w: StreamedWhole) -> dict[str, Tensor]:
    """The one-layer model's tensors outside its layer that the residual acts on (embedding, learned
    positions; head and final norm, which the check does not read), with the residual element applied, by
    module name (every name sharing a tied tensor gets the same value). The aligned run then feeds the layer
    ``O x`` where B's run feeds it ``x``: the check is ``layer'(O x) = O layer(x)``, which is what the residual
    group means -- for ``O_1(D)`` too, since ``O`` commutes with the centring of a LayerNorm and keeps norms."""
    out: dict[str, Tensor] = {}
    by_ptr: dict[int, list[str]] = {}
    for k, v in checker.names.items():
        by_ptr.setdefault(v.data_ptr(), []).append(k)
    for disk, local in checker.disk.items():
        if disk not in w.globals or not _res_actions(w.spec, disk, w.res) or local not in checker.base:
            continue
        x = _rotate_all(w.spec, disk, checker.base[local], w.res, w.O)
        for k in by_ptr.get(checker.names[local].data_ptr(), [local]):
            out[k] = x
    return out


def write_aligned(w: StreamedWhole, sink: Any, clock: PhaseClock, progress: bool = True,
                  out_name: str = "OUT", check_layers: bool = True, measure: bool = False) -> list:
    """The final pass of a matched :class:`StreamedWhole` over B: each layer transformed, checked through the
    family's code (exact and as stored; ``layer'(O x) = O layer(x)``) and put into ``sink`` (a
    :class:`~symalign.stream.sink.TensorSink`: OUT's shards, or a state dict), then the embedding and head in
    row chunks. Returns the layer checks; raises (nothing committed) when one fails. The caller owns the sink.
    ``check_layers``: the per-layer checks (the streamed check; an in-memory caller checks the whole model
    instead, as :func:`symalign.stream.attention.align_attention`'s in-memory caller does); the tensors put into
    the sink are the same either way. ``measure``: also read A's prepared layers and embedding alongside and set
    ``w.written_distance`` to ``sum_t ||A_t - B'_t||^2`` over the labelled tensors, formed directly from the
    working-dtype tensors before they are rounded to B's dtypes (as :func:`symalign.match.distance.distance` on the
    whole states): the passes' distance ``sum (||A||^2 + ||B'||^2) - 2 <O, M>`` cancels to about
    ``sqrt(eps)`` relative near zero, this one does not (a planted pair: about ``1e-15``)."""
    from symalign.checkpoint.config import saved_names

    b = w.b
    checkers: dict[bool | None, tuple[LayerChecker, dict[str, Tensor]]] = {}

    def checker_for(i: int) -> tuple[LayerChecker, dict[str, Tensor]]:
        """The one-layer model for layer ``i``'s kind (dense or sparse FF, :func:`sparse_layer`) and its rotated
        inputs; built once per kind."""
        kind = sparse_layer(b.config, i)
        if kind not in checkers:
            with clock("prepare"):
                c = LayerChecker(b.config, b.adapter, w.prefixes[0], shrink_ff=False, layer_params=w.layer_params,
                                 sparse=kind)
                checkers[kind] = (c, stream_inputs(c, w))
        return checkers[kind]

    if check_layers:
        checker, _ = checker_for(0)
        floor = b.adapter.precision_floor  # HF RMSNorm computes in float32: a rotated stream changes its rounding
        exact_tol = exact_tolerance(w.dtype, checker.dtype, floor)
        tol = stored_tolerance(b.dtype, checker.dtype, floor)
        rot = blocks.matrix(w.O) if w.O is not None else None
    checks = []
    labelled = w.spec.tensors
    w.written_distance = 0.0 if measure else None
    b.bytes_read = 0
    with progress_bar(b.nbytes, "align (model, streamed) writing", progress) as bar:
        raws = read_ahead(lambda j: b.read(w.layer_names[j]), range(w.L), None, lambda: clock("read"))
        for i in range(w.L):
            raw = next(raws)  # not zip(): its reused result tuple would keep the layer until the next one
            release()
            bar.update(b.bytes_read, f"layer {i + 1}/{w.L}")
            with clock("match"):
                out = w.aligned_layer(b, w.prep_b, i, raw)
                if measure:
                    la = w.layer(w.a, w.prep_a, i)
                    w.written_distance += sum(blocks.sq_diff(la[t], out[t]) for t in out if t in labelled)
                    del la
                if w.prep_b.fused and check_layers:  # the check runs the model's own (fused) layout
                    raw = b.adapter.fused(raw)
            if check_layers:
                checker, rotated_emb = checker_for(i)
                why = f"refusing to write {out_name}: aligned layer {i} differs from O times B's layer"
                with clock("verify"):
                    exact = checker.check(raw, out, i, exact_tol, rotated_emb, rotate=rot, stored=False)
                    exact.require(why, "whole-model alignment")
            with clock("match"):  # rounded to B's dtype a tensor at a time, the exact one then dropped
                stored = {n: out.pop(n).to(b.tensors[n].dtype if n in b.tensors else b.dtype) for n in list(out)}
            if check_layers:
                with clock("verify"):
                    kept = checker.check(raw, stored, i, tol, rotated_emb, rotate=rot)
                    kept.require(why, "whole-model alignment")
                    checks += [exact, kept]
            with clock("write"):
                if w.prep_b.fused:  # back to the names save_pretrained writes (one tensor per expert)
                    stored = saved_names(b.config, stored)
                for n, v in stored.items():
                    sink.put(n, v)
            del out, stored, raw
        bar.update(b.bytes_read, "embedding and head")
        with clock("write"):
            of_a = w.global_chunks(w.a, w.prep_a) if measure else None  # the same names and rows, in order
            for n, start, chunk in w.global_chunks(b, w.prep_b):
                chunk = _rotate_all(w.spec, n, chunk, w.res, w.O)
                if of_a is not None:
                    ca = next(of_a)[2]
                    if n in labelled:
                        w.written_distance += blocks.sq_diff(ca, chunk)
                if chunk.dim():
                    sink.put_rows(n, start, chunk)
                else:
                    sink.put(n, chunk)
    return checks


def align_model_into(a: LazyCheckpoint | ResidentCheckpoint, b: LazyCheckpoint | ResidentCheckpoint,
                     sink_for: Callable[[StreamedWhole], Any], stage2: str = "full", stage1: bool = True,
                     progress: bool = True, max_sweeps: int = 20, rtol: float = CHECKPOINT_SETTINGS["rtol"],
                     clock: PhaseClock | None = None, experts: str = "exact",
                     device: str | torch.device | None = None, out_name: str = "OUT") -> AlignResult:
    """B aligned to A over the whole model into a sink: :class:`StreamedWhole` matched, then :func:`write_aligned`
    into ``sink_for(w)`` (a :class:`~symalign.stream.sink.TensorSink`; the matched loop is passed so that a
    writer can lay out the tensors the rewrite adds, :func:`added_tensors`). Every layer is checked before it is
    put; raises (the caller aborts its sink) when one fails. The result has no ``out``: the caller names it."""
    clock = clock or PhaseClock()
    with clock("prepare"):
        w = StreamedWhole(a, b, experts, device)
    with clock("match"):
        converged = w.match(stage1, stage2, max_sweeps, rtol, progress)
    passes = len(w.distances) - 1
    bytes_matching = w.bytes_read
    sink = sink_for(w)
    checks = write_aligned(w, sink, clock, progress, out_name)
    d = w.distances
    summary = w.summary(converged)
    match = {k: summary[k] for k in ("method", "iterations", "converged", "distances", "relative_distance_after")}
    match["attention"] = {"layers": summary["attention"]["layers"]}  # the streamed JSON as before
    res = new_result(b, w.spec, "streamed", {"total": w.relative(d[0])}, {"total": w.relative(d[-1])}, passes,
                     converged, CheckReport.per_layer(checks), notes=list(w.prep_b.notes), folded=True,
                     untied_head=bool(w.prep_b.untied), match=match,
                     stream={"passes": passes, "reads": {"A": passes, "B": passes + 1},
                             "work_dtype": dtype_name(w.dtype),
                             "bytes_read": bytes_matching + b.bytes_read, "bytes_written": sink.bytes_written,
                             "shards": len(b.shards), "time_grams_s": w.t_grams, "peak_rss_bytes": peak_rss(),
                             "check": "per layer, through a one-layer model of the family (rotated stream)"})
    res.scope, res.stage1, res.stage2, res.max_sweeps = "model", stage1, stage2, max_sweeps
    res.timings = clock.timings()
    return res


def run_stream_model(a_dir: Path, b_dir: Path, out_dir: Path, stage2: str = "full", stage1: bool = True,
                     force: bool = False, progress: bool = True, max_sweeps: int = 20,
                     rtol: float = CHECKPOINT_SETTINGS["rtol"], clock: PhaseClock | None = None,
                     experts: str = "exact", device: str | torch.device | None = None) -> AlignResult:
    """Streamed whole-model alignment (see the module docstring): both checkpoints opened lazily and aligned
    (:func:`align_model_into`) into a :class:`~symalign.io.shards.ShardWriter`, OUT committed only when every
    layer passed. ``clock``: sums the time of each phase (the matching passes count as ``match``;
    :func:`symalign.pipeline.align`); ``experts``: how mixture-of-experts blocks are solved
    (:func:`symalign.match.experts.match_experts`); ``device``: where the passes compute (:class:`StreamedWhole`;
    reading, the per-layer checks and writing stay on the CPU)."""
    from symalign.io.folder import check_output_dir, commit

    clock = clock or PhaseClock()
    bound_heap()
    out_path = check_output_dir(out_dir, [a_dir, b_dir], force)
    with clock("read"):
        a, b = open_pair(a_dir, b_dir)
    made: list[ShardWriter] = []

    def writer_for(w: StreamedWhole) -> ShardWriter:
        made.append(ShardWriter(out_path, b, extra=added_tensors(b, w.prep_b)))
        return made[0]

    try:
        res = align_model_into(a, b, writer_for, stage2, stage1, progress, max_sweeps, rtol, clock, experts,
                               device, str(out_path))
        with clock("write"):
            tmp = made[0].stage({"tie_word_embeddings": False} if res.untied_head else None,
                                marker={"command": "align", "scope": "model", "folded": True, "streamed": True,
                                        "untied_head": bool(res.untied_head),
                                        "a": str(Path(a_dir).resolve()), "b": str(Path(b_dir).resolve())})
            commit(tmp, out_path)
    except BaseException:
        for wr in made:
            wr.abort()
        raise
    res.a, res.b, res.out = str(a_dir), str(b_dir), str(out_path)
    res.timings = clock.timings()
    return res
