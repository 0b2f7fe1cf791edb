r"""Whole-model weight matching (seed 002): residual ``O``, FF permutations, attention.

Given a :class:`~symalign.spec.SymmetrySpec` with

* attention spaces ``heads.i``/``qk.i``/``vo.i`` (matched by
  :func:`symalign.match.match_attention`),
* permutation spaces not coupled to per-head blocks (``ff.i``; also a permuted
  ``residual`` when only ``S_D`` is exact) -- :mod:`symalign.match.ff`,
* orthogonal spaces (``residual`` = ``O(D)`` after the RMSNorm rewrite, or the
  centred ``O_1(D)`` for a LayerNorm stream) -- :mod:`symalign.match.residual`,

find ``g`` with ``g . theta_B`` close to ``theta_A`` in the squared Frobenius
distance ``D(g) = sum_t ||A_t - (g . B)_t||^2`` summed over every tensor the spec
labels, by block-coordinate descent (git re-basin's loop, for any spec):

0. initialise the residual space from the tensors no other space acts on
   (embeddings, positions, CLS token, head, output biases): those are comparable
   before anything else is aligned;
1. each unit space (role ``ff`` or ``experts``, or any other permutation space that
   is not the residual stream), in a random (seeded) or fixed order, solved **with
   every other current element applied**: with ``B^{(s)} = g_{-s} . B`` (all spaces
   but ``s`` applied to the tensors ``s`` acts on),
   ``g_s = argmin_h sum_t ||A_t - h . B^{(s)}_t||^2``, a linear assignment on
   ``C = sum_t X_A^t (X_{B^{(s)}}^t)^T`` (each tensor's axis ``s`` first, the other axes,
   already transformed by their own spaces, flattened). ReLU units
   (:class:`~symalign.groups.PositiveMonomial`) get the exact joint minimiser over
   permutation and positive per-unit scales: one assignment on the per-pair costs, each
   pair at its own best scale (:meth:`symalign.groups.PositiveMonomial.fit`). Either way the
   step is the exact block minimiser, so ``D`` never rises. Chains of unit spaces
   that share tensors (an MLP: ``fc_2`` carries ``ff.0`` on its columns and ``ff.1`` on
   its rows) are thereby really coordinate-descended. A mixture-of-experts layer's expert
   permutation and the per-expert unit permutations coupled to it are one block, solved
   jointly and exactly by :func:`symalign.match.experts.match_experts` (the assignment
   over experts of each pair's best unit-matching score plus router-row similarity;
   ``experts="paired"``: its cheaper approximate pairing instead).
   In the first sweep (``start="anchored"``, the default) the unit spaces are instead
   visited outward from what is already comparable (:func:`anchored_step`): each is
   solved on the tensors on which every other space is already solved -- for an MLP,
   layer-wise matching from the input. From the identity, a space solved first against
   tensors whose other axes are still unaligned takes an arbitrary element that the rest
   then adapts to: on two trained 4-hidden-layer MLP pairs (digits) 2 of 5 sweep orders each
   ended at fixed points far above the others (weight distance 373-385 vs 364-366, test-loss
   barrier 0.29-1.09 vs 0.03-0.07); started anchored, all 5 orders of both pairs ended at
   364.7-366.2;
2. the attention spaces by :func:`match_attention` on ``B`` with every non-attention
   element applied (actions on different axes commute);
3. each residual-stream space (orthogonal: Procrustes; a permuted stream: linear
   assignment) given every other current element;

and repeat 1-3 (a *sweep*) until a sweep lowers ``D`` by at most ``rtol * D(identity)``
(``converged``; not tested after an anchored first sweep that solved some space on part of
its tensors: that sweep is an initialisation and may end above the identity), or ``max_sweeps`` sweeps:
the one descent loop of :mod:`symalign.match.descent`, which the layer-by-layer residency of checkpoints
(:class:`symalign.stream.model.StreamedWhole`) runs too. Steps 1 and 3 are exact minimisers of their block
(for permutation, positive-monomial and orthogonal spaces), and a sweep lowers ``D`` by the sum of its
blocks' decreases, so the rule means that no space improved by more than ``rtol * D(identity)``
(``rtol = 0``: a fixed point, where every space is the exact minimiser given all the others); step 2 is the
attention matcher's (exact on planted pairs). The per-sweep distances are recorded in
:attr:`WholeMatch.distances`, the number of unit spaces that moved in each sweep in
:attr:`WholeMatch.changes`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
from torch import Tensor

from symalign.errors import MatchError
from symalign.match.api import match_attention
from symalign.match.descent import SweepReport, descend
from symalign.match.distance import distance
from symalign.match.experts import METHODS, expert_units, match_experts
from symalign.match.inputs import check_pair, check_spec_fits
from symalign.groups import PositiveMonomial
from symalign.match.residual import axis_rows, cross
from symalign.models.config import ModelConfig
from symalign.spec import SymmetrySpec, Transform, apply, compose, invert, segment_index


@dataclass
class Partition:
    """The spaces of a spec by role (``experts``: mixture-of-experts permutations, each solved jointly with
    its coupled per-expert unit spaces, :mod:`symalign.match.experts`)."""

    attention: list[str]
    permutations: list[str]
    orthogonal: list[str]
    experts: list[str] = field(default_factory=list)


def partition(spec: SymmetrySpec) -> Partition:
    """Split the spaces into attention / permutation / orthogonal (anything else: :class:`MatchError`)."""
    moe = expert_units(spec)
    in_moe = set(moe) | {u for us in moe.values() for u in us}
    coupled = {b for p, bs in spec.couplings.items() if p not in moe for b in bs} | (set(spec.couplings) - set(moe))
    att, perm, orth = [], [], []
    for name, g in spec.spaces.items():  # each group says which step solves it (Group.matcher)
        if name in in_moe:  # experts and their units: solved jointly per layer (match.experts)
            continue
        if name in coupled or g.matcher == "attention":
            att.append(name)
        elif g.matcher == "permutation":
            perm.append(name)
        elif g.matcher == "orthogonal":
            orth.append(name)
        elif g.changes_width:
            raise MatchError(f"space {name!r} ({g.describe()}) changes widths: widen the model with it first "
                             "(symalign.match.widen), then match the widened model's own spec")
        else:
            raise MatchError(f"space {name!r} ({g.describe()}) is not supported by whole-model matching "
                             "(expected attention, permutation or orthogonal spaces)")
    return Partition(att, perm, orth, list(moe))


def validate_states(spec: SymmetrySpec, state_a: Mapping[str, Tensor], state_b: Mapping[str, Tensor]) -> None:
    """Every labelled tensor exists in both states with equal shapes and finite entries, and the spec fits."""
    check_pair(spec.tensors, state_a, state_b, missing_hint=" (the models differ in depth or structure)",
               shape_hint="; whole-model matching needs equal widths (FF width, heads, model width)")
    check_spec_fits(spec, state_a, state_b)


def _without(transform: Mapping[str, Tensor], names) -> Transform:
    drop = set(names)
    return {k: v for k, v in transform.items() if k not in drop}


def apply_subset(spec: SymmetrySpec, transform: Mapping[str, Tensor], state: Mapping[str, Tensor],
                 spaces, only_bound: bool = False) -> dict[str, Tensor]:
    """``transform . state`` restricted to the tensors the given spaces act on (the rest is not computed);
    ``only_bound``: only those on which some other space acts as well."""
    names = {t for s in spaces for t, _ in spec.tensors_of(s)}
    if only_bound:
        names = {t for t in names if any(not _is_free(spec, t, s) for s in spaces)}
    sub = spec.with_tensors({t: spec.tensors[t] for t in names})
    return apply(sub, transform, {t: state[t] for t in names})


def _is_free(spec: SymmetrySpec, t: str, space: str) -> bool:
    return all(b.space == space for b in spec.tensors[t])


def _pairs(spec: SymmetrySpec, space: str, free: bool | None = None):
    """The ``(tensor, action)`` pairs of ``space``; ``free=True``/``False``: only tensors no other space
    acts on / only the others (``None``: all)."""
    return [(t, a) for t, a in spec.tensors_of(space) if free is None or _is_free(spec, t, space) == free]


def _project(spec: SymmetrySpec, space: str, m: Tensor) -> Tensor:
    """The element of ``space`` maximising ``<T, m>`` (assignment or Procrustes: :meth:`Group.nearest`)."""
    return spec.spaces[space].nearest(m)


def _solve_space(spec: SymmetrySpec, space: str, state_a, state_b, only_free: bool = False,
                 constant: Tensor | None = None) -> Tensor | None:
    """Assignment / Procrustes for one space. ``constant``: the (cached) cross term of its free tensors,
    which no other space changes; then only the other tensors are read."""
    pairs = _pairs(spec, space, True if only_free else (False if constant is not None else None))
    if not pairs and constant is None:
        return None
    m = cross(pairs, state_a, state_b) if pairs else None
    if constant is not None:
        m = constant if m is None else m + constant
    return _project(spec, space, m)


def attention_step(spec: SymmetrySpec, names: list[str], state_a, state_b, stage1: bool = True,
                   stage2: str = "full"):
    """:func:`match_attention` on the attention sub-spec (it reads fused segments itself)."""
    return match_attention(spec.restrict(names), state_a, state_b, stage1=stage1, stage2=stage2)


@dataclass
class WholeMatch:
    """Result of :func:`match_whole`; ``apply(state_b)`` is B aligned to A.

    ``distances[0]`` is the unaligned distance, ``distances[k]`` the distance after
    sweep ``k`` (squared Frobenius, summed over the labelled tensors); ``converged``:
    the last sweep met the stopping rule (else ``max_sweeps`` ran out); ``changes[k]``:
    how many unit spaces (step 1) took a new element in sweep ``k + 1``; ``experts``: the method that
    solved the mixture-of-experts blocks (``"exact"``, ``"all-pairs"``, ``"paired"``; ``None`` without any).
    """

    transform: Transform
    spec: SymmetrySpec = field(repr=False)
    distances: list[float]
    converged: bool
    method: str = "weight"
    attention: Any = field(default=None, repr=False)
    time_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    changes: list[int] = field(default_factory=list, kw_only=True)
    experts: str | None = field(default=None, kw_only=True)

    @property
    def iterations(self) -> int:
        return len(self.distances) - 1

    @property
    def sweeps(self) -> int:
        """Number of block-coordinate sweeps run (same as :attr:`iterations`)."""
        return self.iterations

    def apply(self, state_b: Mapping[str, Tensor]) -> dict[str, Tensor]:
        return apply(self.spec, self.transform, state_b)

    def to_dict(self) -> dict[str, Any]:
        d0 = self.distances[0] if self.distances else float("nan")
        return {"method": self.method, "iterations": self.iterations, "sweeps": self.sweeps,
                "converged": self.converged, "distances": list(self.distances), "changes": list(self.changes),
                "relative_distance_after": math.sqrt(self.distances[-1] / d0) if d0 else 0.0,
                "spaces": self.spec.describe(), "time_s": self.time_s, "notes": list(self.notes),
                "experts": self.experts,
                "attention": self.attention.to_dict() if self.attention is not None else None}


ORDERS = ("random", "fixed")
STARTS = ("anchored", "identity")
_UNGUARDED = "identity, unguarded"  # internal: the identity start's own descent (start="identity" runs both)


def unit_spaces(spec: SymmetrySpec, part: Partition) -> tuple[list[str], list[str]]:
    """``(units, stream)``: the permutation spaces solved in step 1 (everything but the residual
    stream) and the residual-stream spaces of step 3 (orthogonal ones, and a permuted stream)."""
    stream = part.orthogonal + [p for p in part.permutations if spec.role(p) == "residual"]
    return [p for p in part.permutations if p not in stream] + part.experts, stream


def solve_unit(spec: SymmetrySpec, name: str, state_a, cur) -> Tensor | None:
    """The best element of unit space ``name`` against ``cur`` (B with every other element applied)."""
    pairs = _pairs(spec, name)
    if not pairs:
        return None
    # the group's exact block minimiser (an assignment; ReLU units: permutation and positive scales)
    # a tensor the scales do not reach (rep "perm": a BatchNorm's input side) enters the fit as variance "perm"
    return spec.spaces[name].fit([(axis_rows(state_a[t], a), axis_rows(cur[t], a),
                                   "perm" if a.rep == "perm" else a.variance) for t, a in pairs])


def _block_distance(spec: SymmetrySpec, name: str, el: Tensor | None, state_a, cur) -> float:
    """``sum_t ||A_t - (el . cur)_t||^2`` over the tensors of space ``name`` (``el=None``: identity)."""
    tensors = {t for t, _ in spec.tensors_of(name)}
    moved = cur if el is None else apply_subset(spec, {name: el}, cur, [name])
    return float(sum(float((state_a[t].double() - moved[t].double()).pow(2).sum()) for t in tensors))


def _group_distance(spec: SymmetrySpec, group: list[str], els: Transform, state_a, cur) -> float:
    """``sum_t ||A_t - (els . cur)_t||^2`` over the tensors the spaces ``group`` act on, one tensor moved at a
    time (a mixture of experts' block: one stacked tensor, not the layer's experts, besides ``cur``)."""
    total = 0.0
    for t in dict.fromkeys(t for s in group for t, _ in spec.tensors_of(s)):
        moved = apply(spec.with_tensors({t: spec.tensors[t]}), els, {t: cur[t]})[t]
        total += _sq_diff(state_a[t], moved)
        del moved
    return total


def _sq_diff(x: Tensor, y: Tensor) -> float:
    """``||x - y||^2`` in float64; a stacked tensor (three or more axes) one slice of its first axis at a time,
    so the float64 temporaries are those of one slice (an expert)."""
    if x.dim() < 3:
        return float((x.double() - y.double()).pow(2).sum())
    return float(sum(float((x[i].double() - y[i].double()).pow(2).sum()) for i in range(x.shape[0])))


def anchored_pairs(spec: SymmetrySpec, name: str, solved) -> list:
    """The ``(tensor, action)`` pairs of ``name`` on tensors that every other space acting on them has
    already been solved for (``solved``): the part of its cost that is comparable now."""
    return [(t, a) for t, a in spec.tensors_of(name)
            if all(b.space == name or b.space in solved for b in spec.tensors[t])]


def anchored_step(spec: SymmetrySpec, units: list[str], transform: Transform, state_a, state_b,
                  solved, experts: str = "exact") -> tuple[int, bool]:
    r"""The first sweep of step 1, outward from what is already comparable.

    Starting from the identity, a unit space whose tensors are also acted on by unsolved
    spaces sees those tensors in an arbitrary basis: their part of its cost is noise, and the
    element it takes there steers every later step (in a deep MLP a random first space often
    leads the descent into a much worse fixed point). Here the spaces are visited greedily:
    next is the unsolved space with the most entries in tensors on which every other space
    is already solved (``solved``: the residual-stream spaces initialised from their free
    tensors, and the unit spaces done so far; ties in declaration order), and it is solved on
    those tensors only (:func:`anchored_pairs`; on all of its tensors when it has none): for an
    MLP, hidden layer 0 from ``fc_0`` (whose input side is fixed), then layer 1 from ``fc_1``
    with layer 0 applied, and so on -- layer-wise weight matching from the input. The
    permutation is the assignment of that partial cost, with unit scales for ReLU units (their
    scales need both sides; the later sweeps solve both exactly). Updates ``transform`` in
    place and returns the number of spaces solved and whether any was solved on part of its
    tensors only. A Transformer's FF spaces act only on tensors whose other axes belong to the
    (initialised) residual stream, so there every space is solved on all its tensors given all
    the others: the ordinary step (in an order that does not matter, as they share no tensor).
    ``experts``: the method of :func:`~symalign.match.experts.match_experts` for expert blocks."""
    todo, done, partial = list(units), set(solved), False
    moe = expert_units(spec)
    while todo:
        size = {n: sum(state_b[t].numel() for t, _ in anchored_pairs(spec, n, done)) for n in todo}
        name = max(todo, key=lambda n: size[n])
        if name in moe:  # experts and the units inside each: one joint block, as in unit_step
            group = [name, *moe[name]]
            cur = apply_subset(spec, _without(transform, group), state_b, group)
            transform.update(match_experts(spec, name, moe[name], state_a, cur, method=experts))
            todo.remove(name)
            done.update(group)
            continue
        pairs = anchored_pairs(spec, name, done) or spec.tensors_of(name)
        partial |= len(pairs) < len(spec.tensors_of(name))
        cur = apply_subset(spec, _without(transform, [name]), state_b, [name])
        transform[name] = _project(spec, name, cross(pairs, state_a, cur))
        todo.remove(name)
        done.add(name)
    return len(units), partial


def unit_step(spec: SymmetrySpec, units: list[str], transform: Transform, state_a, state_b,
              order: list[str], tol: float, experts: str = "exact") -> int:
    """Step 1 in ``order``: each unit space given every other current element; updates ``transform`` in
    place and returns how many spaces moved (lowered their block distance by more than ``tol``).
    ``experts``: the method of :func:`~symalign.match.experts.match_experts` for expert blocks."""
    changed = 0
    moe = expert_units(spec)
    for name in order:
        if name in moe:  # experts and the units inside each, jointly (symalign.match.experts)
            group = [name, *moe[name]]
            cur = apply_subset(spec, _without(transform, group), state_b, group)
            old = {k: transform[k] for k in group if k in transform}
            new = match_experts(spec, name, moe[name], state_a, cur, method=experts)
            d_old = _group_distance(spec, group, old, state_a, cur)
            transform.update(new)
            changed += int(_group_distance(spec, group, new, state_a, cur) < d_old - tol)
            continue
        cur = apply_subset(spec, _without(transform, [name]), state_b, [name])
        el = solve_unit(spec, name, state_a, cur)
        if el is None:
            continue
        d_old = _block_distance(spec, name, transform.get(name), state_a, cur)
        transform[name] = el
        changed += int(_block_distance(spec, name, el, state_a, cur) < d_old - tol)
    return changed


GAUGES = ("raw", "balanced")

#: What the Hugging Face checkpoint paths (``align``/``merge --scope model``) pass to :func:`match_whole`: the
#: settings the streamed engine (:mod:`symalign.stream.model`) implements -- it has no balanced gauge -- so that
#: ``--stream`` and the in-memory path give the same result. The defaults of issue 32 (balanced gauge,
#: ``rtol=1e-3``) were chosen on traced modules (``benchmarks/bench_peers.py``).
CHECKPOINT_SETTINGS: dict[str, Any] = {"gauge": "raw", "rtol": 1e-6}

#: What the papers' protocol (``symalign experiment``, ``symalign demo``) passes to :func:`match_whole`: the settings
#: every committed protocol result (``results/*.json``, the README's demo table) was made with, so that rerunning a
#: recorded command reproduces its numbers; the library defaults above may move with new measurements.
PROTOCOL_SETTINGS: dict[str, Any] = dict(CHECKPOINT_SETTINGS)


def balanced_gauge(spec: SymmetrySpec, state: Mapping[str, Tensor], max_passes: int = 500,
                   rtol: float = 1e-13) -> Transform:
    r"""The positive scales that put every ReLU unit (:class:`~symalign.groups.PositiveMonomial`
    space) of ``state`` in the balanced gauge.

    Scaling unit ``i`` by ``s_i`` maps the squared norm of its covariant rows
    (``fc_in`` row and bias) ``p_i -> s_i^2 p_i`` and of its contravariant ones
    (``fc_out`` column) ``r_i -> r_i / s_i^2``. The balanced gauge minimises the total
    squared norm ``sum_i p_i s_i^2 + r_i s_i^{-2}`` over all scales, a strictly convex
    function of ``log s`` when every unit has nonzero in- and out-weights: its unique
    minimiser has ``p_i = r_i`` for every unit. Spaces that share tensors (an MLP chain)
    are solved by exact coordinate descent: each space in turn takes
    ``s = (r / p)^{1/4}`` given the others, until a pass moves no scale by more than
    ``rtol`` (relative) or ``max_passes`` passes. Units with ``p = 0`` or ``r = 0`` keep
    scale 1. The gauge is a property of the function's orbit: ``state`` and ``h . state``,
    ``h`` any positive scaling, have the same balanced state. Returns the transform
    (unit permutations, the scales) taking ``state`` there; ``{}`` without ReLU spaces."""
    names = [n for n, g in spec.spaces.items() if g.scales_units]
    if not names:
        return {}
    total = {n: torch.ones(spec.spaces[n].n, dtype=torch.float64) for n in names}
    # The squared entries of the scaled tensors, float64, updated in place: a scaling never permutes, so each
    # step multiplies the acted-on axis (its segment's positions) by s^2 (co) or s^-2 (contra).
    sq = {t: state[t].detach().to(torch.float64).pow(2) for n in names for t, a in spec.tensors_of(n)
          if a.rep != "perm"}
    acts = {n: [(t, a.axis % sq[t].dim(), a.variance,
                 None if a.segment is None else segment_index(a.segment, sq[t].shape[a.axis]))
                for t, a in spec.tensors_of(n) if a.rep != "perm"] for n in names}  # rep "perm": scales do not act
    for _ in range(max_passes):
        moved = 0.0
        for n in names:
            p = torch.zeros(spec.spaces[n].n, dtype=torch.float64)
            r = torch.zeros_like(p)
            for t, axis, variance, idx in acts[n]:
                x = sq[t]
                line = x.sum(dim=[d for d in range(x.dim()) if d != axis]) if x.dim() > 1 else x
                (p if variance == "co" else r).add_(line if idx is None else line[idx])
            ok = (p > 0) & (r > 0)
            sc = torch.where(ok, (r / torch.where(ok, p, torch.ones_like(p))) ** 0.25, torch.ones_like(p))
            moved = max(moved, float((sc - 1).abs().max()))
            for t, axis, variance, idx in acts[n]:
                x = sq[t]
                f = sc * sc if variance == "co" else 1.0 / (sc * sc)
                if idx is not None:
                    f = torch.ones(x.shape[axis], dtype=torch.float64).index_copy(0, idx, f)
                shape = [1] * x.dim()
                shape[axis] = x.shape[axis]
                x.mul_(f.view(shape))
            total[n] = total[n] * sc
        if moved <= rtol:
            break
    return {n: PositiveMonomial.pack(torch.arange(spec.spaces[n].n), total[n]) for n in names}


def match_whole(spec: SymmetrySpec, state_a: Mapping[str, Tensor], state_b: Mapping[str, Tensor], *,
                max_sweeps: int = 20, rtol: float = 1e-3, stage1: bool = True, stage2: str = "full",
                init: Transform | None = None, spec_b: SymmetrySpec | None = None,
                order: str = "random", seed: int = 0,
                start: str = "anchored", gauge: str = "balanced", experts: str = "exact",
                progress: Callable[[int, float], None] | None = None,
                device: str | torch.device | None = None) -> WholeMatch:
    """Align every declared space of B to A by block-coordinate descent (see the module docstring).

    Args:
        spec: the symmetry spec (e.g. :func:`symalign.rewrite.whole_spec`).
        state_a, state_b: state dicts with the tensors the spec labels.
        max_sweeps: maximum number of sweeps.
        rtol: a sweep that lowers the distance by at most ``rtol * distances[0]`` ends the
            descent (``converged``).
        order: ``"random"`` (a fresh permutation of the unit spaces every sweep, from ``seed``)
            or ``"fixed"`` (declaration order).
        stage1, stage2: passed to :func:`match_attention`.
        start: ``"anchored"`` (the first sweep of the unit spaces is :func:`anchored_step`) or
            ``"identity"``: the descent whose first sweep is an ordinary one from the identity, guarded: the
            anchored descent is run as well and the one with the lower final distance is returned (a note says
            which). From the identity alone a first space solved against unaligned tensors can steer the descent
            into a far worse fixed point (a 6-hidden-layer ReLU MLP pair: barrier 1.415 against 0.1 anchored);
            ``init={}`` runs that unguarded descent for ablations. Ignored with ``init``.
        gauge: ``"balanced"`` (the default) or ``"raw"`` (match the weights as stored). Balanced: A and B are
            first moved to
            the balanced gauge of their ReLU units (:func:`balanced_gauge`, ``d_A``, ``d_B``), matched
            there (``g``), and the result is ``d_A^{-1} g d_B``; the linear path is then the one between
            the balanced models mapped back by ``d_A^{-1}``, so the result does not depend on the scale
            gauge either model happens to be stored in. ``distances`` are those of the balanced pair.
            Without ReLU spaces the two are the same. The default since issue 32: over the benchmark set of
            ``benchmarks/bench_peers.py`` (ReLU MLPs of 2-8 hidden layers, a VGG) it is at or below rebasin on
            every row's mean, where the raw gauge is not (docs/results.md, "Peers").
        experts: how each mixture-of-experts block (experts and the units inside each) is solved
            (:func:`symalign.match.experts.match_experts`): ``"exact"`` (branch and bound: the joint
            optimum), ``"all-pairs"`` (the reference: ``E^2`` unit assignments) or ``"paired"``
            (approximate: experts paired by a product-free lower bound, then ``E`` products and
            assignments). Recorded in :attr:`WholeMatch.experts` (``None`` without expert blocks).
        init: a starting transform (skips the residual initialisation and the anchored first sweep).
        spec_b: B's spec; must describe the same groups.
        progress: called after every sweep with ``(sweep, distance)`` (e.g. a progress line on stderr).
        device: compute on this device (:mod:`symalign.device`; the spec's tensors moved there, the same dtypes,
            TF32 off); the transform comes back on the CPU. ``None``: where the tensors are.

    Raises:
        MatchError: different specs, shapes (depth/width), NaN weights, unsupported spaces, unknown order.
    """
    opts = dict(max_sweeps=max_sweeps, rtol=rtol, stage1=stage1, stage2=stage2, init=init, spec_b=spec_b,
                order=order, seed=seed, start=start, gauge=gauge, experts=experts, progress=progress)
    if device is not None:
        return _match_on_device(spec, state_a, state_b, device, opts)
    t0 = time.perf_counter()
    _check_choice("sweep order", order, ORDERS)
    _check_choice("gauge", gauge, GAUGES)
    _check_choice("expert matching method", experts, METHODS)
    res = _match_balanced(spec, state_a, state_b, opts) if gauge == "balanced" else None
    if res is None and start != _UNGUARDED:
        _check_choice("start", start, STARTS)
    if res is None and start == "identity" and init is None:
        res = _match_guarded(spec, state_a, state_b, opts)
    if res is not None:
        res.time_s = time.perf_counter() - t0
        return res
    _check_pair(spec, spec_b, state_a, state_b, max_sweeps)
    return _descend(_Descent.begin(spec, state_a, state_b, init, stage1, stage2, experts), opts, t0)


def _check_choice(what: str, value: str, allowed) -> None:
    """One of the named options (else :class:`MatchError` listing them)."""
    if value not in allowed:
        raise MatchError(f"unknown {what} {value!r}; use one of {', '.join(allowed)}")


def _match_on_device(spec: SymmetrySpec, state_a, state_b, device, opts: dict) -> WholeMatch:
    """:func:`match_whole` with the spec's tensors (and ``init``) on ``device``, exact matmuls (TF32 off); the
    transform comes back on the CPU."""
    from symalign.device import exact_matmul, resolve, to_device

    spec_b, init = opts["spec_b"], opts["init"]
    dev, names = resolve(device), set(spec.tensors) | (set(spec_b.tensors) if spec_b is not None else set())
    with exact_matmul():
        res = match_whole(spec, to_device({k: v for k, v in state_a.items() if k in names}, dev),
                          to_device({k: v for k, v in state_b.items() if k in names}, dev),
                          **{**opts, "init": None if init is None else to_device(dict(init), dev)})
    res.transform = to_device(dict(res.transform), torch.device("cpu"))
    return res


def _match_balanced(spec: SymmetrySpec, state_a, state_b, opts: dict) -> WholeMatch | None:
    """The balanced gauge: ``d_A^{-1} g d_B`` with ``g`` matching the balanced ``d_A . A`` and ``d_B . B``
    (:func:`balanced_gauge`; an ``init`` ``h`` becomes ``d_A h d_B^{-1}``). ``None`` without ReLU spaces (the
    raw gauge is then the same)."""
    validate_states(spec, state_a, state_b)
    da, db = balanced_gauge(spec, state_a), balanced_gauge(spec, state_b)
    if not da:
        return None
    init = opts["init"]
    res = match_whole(spec, apply(spec, da, state_a), apply(spec, db, state_b),
                      **{**opts, "gauge": "raw",
                         "init": None if init is None else compose(spec, da, compose(spec, init, invert(spec, db)))})
    res.transform = compose(spec, invert(spec, da), compose(spec, res.transform, db))
    res.notes.append("balanced gauge: the distances are those between the balanced A and B")
    return res


def _match_guarded(spec: SymmetrySpec, state_a, state_b, opts: dict) -> WholeMatch:
    """``start="identity"``: the unguarded descent from the identity and the anchored one; the one with the lower
    final distance, with a note comparing them."""
    both = [match_whole(spec, state_a, state_b, **{**opts, "start": st, "gauge": "raw"})
            for st in (_UNGUARDED, "anchored")]
    best = min(both, key=lambda r: r.distances[-1])
    best.notes.append(f"start identity (guarded): from the identity the descent ended at distance "
                      f"{both[0].distances[-1]:.6g}, anchored at {both[1].distances[-1]:.6g}; kept the "
                      + ("identity" if best is both[0] else "anchored") + " one")
    return best


def _check_pair(spec: SymmetrySpec, spec_b: SymmetrySpec | None, state_a, state_b, max_sweeps: int) -> None:
    """At least one sweep, B's spec (if given) describes A's groups, and the states fit the spec."""
    if max_sweeps < 1:
        raise MatchError(f"max_sweeps must be at least 1, got {max_sweeps}")
    if spec_b is not None and spec_b.describe() != spec.describe():
        da, db = spec.describe(), spec_b.describe()
        diff = sorted(set(da) ^ set(db)) or sorted(k for k in da if da[k] != db.get(k))
        raise MatchError(f"the models have different symmetry groups (first difference: {diff[0]!r}: "
                         f"{da.get(diff[0])} in A, {db.get(diff[0])} in B) -- different depth or widths?")
    validate_states(spec, state_a, state_b)


@dataclass
class _Descent:
    """The working state of one block-coordinate descent: the pair, its spaces by step (``units``: step 1,
    ``part.attention``: step 2, ``stream``: step 3), the current ``transform`` (updated by each step), the
    constant cross terms ``free_m`` of the stream spaces' free tensors, the notes and the last attention match."""

    spec: SymmetrySpec
    state_a: Mapping[str, Tensor]
    state_b: Mapping[str, Tensor]
    part: Partition
    units: list[str]
    stream: list[str]
    transform: Transform
    free_m: dict[str, Tensor]
    notes: list[str]
    stage1: bool
    stage2: str
    experts: str
    att: Any = None

    @classmethod
    def begin(cls, spec: SymmetrySpec, state_a, state_b, init: Transform | None, stage1: bool, stage2: str,
              experts: str) -> _Descent:
        """The descent's start: ``init``, or (``None``) step 0 -- each stream space from its free tensors."""
        part = partition(spec)
        notes = [n for n in (spec.spaces[name].note(name) for name in part.orthogonal) if n]
        units, stream = unit_spaces(spec, part)
        free_m: dict[str, Tensor] = {}
        for name in stream:  # the free tensors' cross term is the same in every sweep: computed once
            pairs = _pairs(spec, name, True)
            if pairs:
                free_m[name] = cross(pairs, state_a, state_b)
        run = cls(spec, state_a, state_b, part, units, stream, dict(init) if init is not None else {}, free_m, notes,
                  stage1, stage2, experts)
        if init is None:
            run.init_stream()
        return run

    def init_stream(self) -> None:
        """Step 0: each stream space as the best element on its free tensors (identity without any)."""
        for name in self.stream:
            if name in self.free_m:
                self.transform[name] = _project(self.spec, name, self.free_m[name])
            else:
                self.notes.append(f"{name}: no tensor free of other spaces; initialised at the identity")

    def anchored_units(self) -> tuple[int, bool]:
        """Step 1 as the anchored first sweep (:func:`anchored_step`): ``(spaces solved, partial)``."""
        return anchored_step(self.spec, self.units, self.transform, self.state_a, self.state_b, set(self.transform),
                             self.experts)

    def unit_sweep(self, seq: list[str], tol: float) -> int:
        """Step 1 in the order ``seq`` (:func:`unit_step`): how many unit spaces moved."""
        return unit_step(self.spec, self.units, self.transform, self.state_a, self.state_b, seq, tol, self.experts)

    def solve_attention(self) -> None:
        """Step 2: the attention spaces on B with every other element applied."""
        if self.part.attention:
            cur = apply_subset(self.spec, _without(self.transform, self.part.attention), self.state_b,
                               self.part.attention)
            self.att = attention_step(self.spec, self.part.attention, self.state_a, cur, self.stage1, self.stage2)
            self.transform = {**_without(self.transform, self.part.attention), **self.att.transform}

    def solve_stream(self) -> None:
        """Step 3: each residual-stream space (orthogonal, or a permuted stream) given every other element."""
        for name in self.stream:
            cur = apply_subset(self.spec, _without(self.transform, [name]), self.state_b, [name], only_bound=True)
            el = _solve_space(self.spec, name, self.state_a, cur, constant=self.free_m.get(name))
            if el is not None:
                self.transform[name] = el

    def current_distance(self) -> float:
        """``D(g)`` of the current transform."""
        return distance(self.spec, self.state_a, apply(self.spec, self.transform, self.state_b))


def _descend(run: _Descent, opts: dict, t0: float) -> WholeMatch:
    """Sweeps of steps 1-3 (the whole states in memory) run by the one descent loop
    (:func:`symalign.match.descent.descend`: the stopping rule, the distances, the moved spaces)."""
    d_first = distance(run.spec, run.state_a, run.state_b)
    gen = torch.Generator().manual_seed(int(opts["seed"]))
    anchored = opts["init"] is None and opts["start"] == "anchored"

    def sweep(k: int) -> SweepReport:
        # 1. unit spaces (FF hidden units, experts), each given every other current element
        perm = torch.randperm(len(run.units), generator=gen).tolist() if opts["order"] != "fixed" else None
        partial = False
        if k == 0 and anchored:
            moved, partial = run.anchored_units()
        else:
            moved = run.unit_sweep(run.units if perm is None else [run.units[i] for i in perm], 1e-12 * d_first)
        run.solve_attention()  # 2. attention
        run.solve_stream()  # 3. residual-stream spaces
        return SweepReport(run.current_distance(), moved, initialising=partial)

    out = descend(sweep, max_sweeps=opts["max_sweeps"], rtol=opts["rtol"], unaligned=d_first,
                  progress=opts["progress"])
    return WholeMatch(run.transform, run.spec, out.distances, out.converged, "weight", run.att,
                      time.perf_counter() - t0, run.notes, changes=out.changes,
                      experts=opts["experts"] if run.part.experts else None)


def check_configs(cfg_a, cfg_b, allow_heterogeneous: bool = False) -> None:
    """Clear errors for built-in model pairs that cannot be matched."""
    if cfg_a.family != cfg_b.family:
        raise MatchError(f"model A is a {cfg_a.family} but B is a {cfg_b.family}")
    if cfg_a.n_layers != cfg_b.n_layers:
        raise MatchError(f"the models have different depths ({cfg_a.n_layers} vs {cfg_b.n_layers} layers); "
                         "whole-model matching pairs layer i with layer i")
    if cfg_a.d_ff != cfg_b.d_ff and not allow_heterogeneous:
        raise MatchError(f"FF widths differ ({cfg_a.d_ff} vs {cfg_b.d_ff}); only equal FF widths can be matched "
                         "by permutations")
    if cfg_a.d_model != cfg_b.d_model and not allow_heterogeneous:
        raise MatchError(f"model widths differ ({cfg_a.d_model} vs {cfg_b.d_model}); use "
                         "symalign.match.widths.embed_narrow to embed the narrower model first")
    for k in ("n_heads", "head_dim", "n_kv_heads", "pe", "norm", "pre_norm", "bias", "activation"):
        if getattr(cfg_a, k) != getattr(cfg_b, k):
            raise MatchError(f"the models differ in {k} ({getattr(cfg_a, k)!r} vs {getattr(cfg_b, k)!r})")


def model_states(model_a, model_b) -> tuple[SymmetrySpec, dict[str, Tensor], dict[str, Tensor]]:
    """A's spec and both (detached) state dicts, after checking the configs are compatible."""
    cfg_a, cfg_b = getattr(model_a, "cfg", None), getattr(model_b, "cfg", None)
    if isinstance(cfg_a, ModelConfig) and isinstance(cfg_b, ModelConfig):
        check_configs(cfg_a, cfg_b)
    elif model_a.symmetry_spec().describe() != model_b.symmetry_spec().describe():
        raise MatchError("the models have different symmetry groups (different depth, widths or family)")
    sa = {k: v.detach() for k, v in model_a.state_dict().items()}
    sb = {k: v.detach() for k, v in model_b.state_dict().items()}
    return model_a.symmetry_spec(), sa, sb


def align_whole(model_a, model_b, **kw) -> WholeMatch:
    """Match two *rewritten* built-in models (:func:`symalign.rewrite.rewrite_model`); B is not modified."""
    spec, sa, sb = model_states(model_a, model_b)
    return match_whole(spec, sa, sb, spec_b=model_b.symmetry_spec(), **kw)
