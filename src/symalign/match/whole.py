r"""Whole-model weight matching (seed 002): residual ``O``, FF permutations, attention.

Given a :class:`~symalign.spec.SymmetrySpec` with

* attention spaces ``heads.i``/``qk.i``/``vo.i`` (matched by
  :func:`symalign.match.match_attention`),
* permutation spaces not coupled to per-head blocks (``ff.i``; also a permuted
  ``residual`` when only ``S_D`` is exact) -- :mod:`symalign.match.ff`,
* orthogonal spaces (``residual`` = ``O(D)`` after the RMSNorm rewrite, or the
  centred ``O_1(D)`` for a LayerNorm stream) -- :mod:`symalign.match.residual`,

find ``g`` with ``g . theta_B`` close to ``theta_A`` in the squared Frobenius
distance summed over every tensor the spec labels, by block-coordinate descent:

0. initialise the residual space from the tensors no other space acts on
   (embeddings, positions, CLS token, head, output biases): those are comparable
   before anything else is aligned;
1. each unit permutation space (``ff.*``) by a linear assignment given the others
   (ReLU units, :class:`~symalign.groups.PositiveMonomial`: assignment and positive
   per-unit scales alternately, :func:`symalign.match.ff.match_monomial`);
2. the attention spaces by :func:`match_attention` on ``B`` with the residual and FF
   elements applied (actions on different axes commute);
3. each residual-stream space (orthogonal: Procrustes; a permuted stream: linear
   assignment) given the current others;

and repeat 1-3 until the total distance falls by less than ``rtol`` (relative to
the initial distance). Steps 1 and 3 are exact minimisers of their block; step 2
is the attention matcher's (exact on planted pairs). The per-iteration distances
are recorded in :attr:`WholeMatch.distances`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

from torch import Tensor

from symalign.errors import MatchError
from symalign.groups import HeadPermutation, Orthogonal, PerHead, Permutation, PositiveMonomial
from symalign.match.api import match_attention
from symalign.match.distance import distance
from symalign.match.ff import assign, match_monomial
from symalign.match.inputs import check_pair, check_spec_fits
from symalign.match.residual import FixingOrthogonal, cross, procrustes
from symalign.spec import SymmetrySpec, Transform, apply


@dataclass
class Partition:
    """The spaces of a spec by role."""

    attention: list[str]
    permutations: list[str]
    orthogonal: list[str]


def partition(spec: SymmetrySpec) -> Partition:
    """Split the spaces into attention / permutation / orthogonal (anything else: :class:`MatchError`)."""
    coupled = {b for bs in spec.couplings.values() for b in bs} | set(spec.couplings)
    att, perm, orth = [], [], []
    for name, g in spec.spaces.items():
        if name in coupled or isinstance(g, (HeadPermutation, PerHead)):
            att.append(name)
        elif isinstance(g, Permutation):
            perm.append(name)
        elif isinstance(g, Orthogonal):
            orth.append(name)
        else:
            raise MatchError(f"space {name!r} ({g.describe()}) is not supported by whole-model matching "
                             "(expected attention, permutation or orthogonal spaces)")
    return Partition(att, perm, orth)


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
    g = spec.spaces[space]
    return assign(m) if isinstance(g, Permutation) else procrustes(m, g)  # type: ignore[arg-type]


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


def restricted_note(name: str, group: FixingOrthogonal) -> str:
    """Diagnostics line for a residual space restricted to rotations fixing a subspace."""
    return (f"{name}: {group.describe()}: rotations act on a {group.k}-dimensional subspace only "
            f"({group.n - group.k} of {group.n} dimensions fixed; fixed vectors move by <= {group.error:.1e} relative)")


def attention_step(spec: SymmetrySpec, names: list[str], state_a, state_b, stage1: bool = True,
                   stage2: str = "full"):
    """:func:`match_attention` on the attention sub-spec (fused segments split into virtual tensors)."""
    from symalign.arch.fused import split_segments

    sub = spec.restrict(names)
    view_spec, (va, vb) = split_segments(sub, state_a, state_b)
    return match_attention(view_spec, va, vb, stage1=stage1, stage2=stage2)


@dataclass
class WholeMatch:
    """Result of :func:`match_whole`; ``apply(state_b)`` is B aligned to A.

    ``distances[0]`` is the unaligned distance, ``distances[k]`` the distance after
    iteration ``k`` (squared Frobenius, summed over the labelled tensors).
    """

    transform: Transform
    spec: SymmetrySpec = field(repr=False)
    distances: list[float]
    converged: bool
    method: str = "weight"
    attention: Any = field(default=None, repr=False)
    time_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def iterations(self) -> int:
        return len(self.distances) - 1

    def apply(self, state_b: Mapping[str, Tensor]) -> dict[str, Tensor]:
        return apply(self.spec, self.transform, state_b)

    def to_dict(self) -> dict[str, Any]:
        d0 = self.distances[0] if self.distances else float("nan")
        return {"method": self.method, "iterations": self.iterations, "converged": self.converged,
                "distances": list(self.distances),
                "relative_distance_after": math.sqrt(self.distances[-1] / d0) if d0 else 0.0,
                "spaces": self.spec.describe(), "time_s": self.time_s, "notes": list(self.notes),
                "attention": self.attention.to_dict() if self.attention is not None else None}


def match_whole(spec: SymmetrySpec, state_a: Mapping[str, Tensor], state_b: Mapping[str, Tensor], *,
                max_iter: int = 20, rtol: float = 1e-6, stage1: bool = True, stage2: str = "full",
                init: Transform | None = None, spec_b: SymmetrySpec | None = None) -> WholeMatch:
    """Align every declared space of B to A by alternating minimisation (see the module docstring).

    Args:
        spec: the symmetry spec (e.g. :func:`symalign.rewrite.whole_spec`).
        state_a, state_b: state dicts with the tensors the spec labels.
        max_iter: maximum number of sweeps; rtol: stop when a sweep lowers the distance by
            less than ``rtol * distances[0]``.
        stage1, stage2: passed to :func:`match_attention`.
        init: a starting transform (skips the residual initialisation).
        spec_b: B's spec; must describe the same groups.

    Raises:
        MatchError: different specs, shapes (depth/width), NaN weights, unsupported spaces.
    """
    t0 = time.perf_counter()
    if spec_b is not None and spec_b.describe() != spec.describe():
        da, db = spec.describe(), spec_b.describe()
        diff = sorted(set(da) ^ set(db)) or sorted(k for k in da if da[k] != db.get(k))
        raise MatchError(f"the models have different symmetry groups (first difference: {diff[0]!r}: "
                         f"{da.get(diff[0])} in A, {db.get(diff[0])} in B) -- different depth or widths?")
    validate_states(spec, state_a, state_b)
    part = partition(spec)
    transform: Transform = dict(init) if init is not None else {}
    notes: list[str] = [restricted_note(name, spec.spaces[name]) for name in part.orthogonal
                        if isinstance(spec.spaces[name], FixingOrthogonal)]
    stream = part.orthogonal + [p for p in part.permutations if spec.role(p) == "residual"]
    free_m: dict[str, Tensor] = {}
    for name in stream:  # the free tensors' cross term is the same in every sweep: computed once
        pairs = _pairs(spec, name, True)
        if pairs:
            free_m[name] = cross(pairs, state_a, state_b)
    if init is None:
        for name in stream:
            if name in free_m:
                transform[name] = _project(spec, name, free_m[name])
            else:
                notes.append(f"{name}: no tensor free of other spaces; initialised at the identity")
    d_first = distance(spec, state_a, state_b)
    distances = [d_first]
    att = None
    converged = False
    units = [p for p in part.permutations if p not in stream]
    for _ in range(max_iter):
        # 1. unit permutations (FF hidden units)
        if units:
            cur = apply_subset(spec, _without(transform, units), state_b, units)
            for name in units:
                g = spec.spaces[name]
                el = (match_monomial(_pairs(spec, name), state_a, cur, g.n) if isinstance(g, PositiveMonomial)
                      else _solve_space(spec, name, state_a, cur))  # ReLU: permutation + positive scales
                if el is not None:
                    transform[name] = el
        # 2. attention
        if part.attention:
            cur = apply_subset(spec, _without(transform, part.attention), state_b, part.attention)
            att = attention_step(spec, part.attention, state_a, cur, stage1, stage2)
            transform = {**_without(transform, part.attention), **att.transform}
        # 3. residual-stream spaces (orthogonal, or a permuted stream)
        if stream:
            cur = apply_subset(spec, _without(transform, stream), state_b, stream, only_bound=True)
            for name in stream:
                transform[name] = _solve_space(spec, name, state_a, cur, constant=free_m.get(name))
        d = distance(spec, state_a, apply(spec, transform, state_b))
        if not math.isfinite(d):
            raise MatchError("whole-model matching produced a non-finite distance; check the inputs")
        distances.append(d)
        if distances[-2] - d <= rtol * d_first or d <= 1e-20 * d_first:
            converged = True
            break
    return WholeMatch(transform, spec, distances, converged, "weight", att, time.perf_counter() - t0, notes)


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
    if cfg_a is not None and cfg_b is not None:
        check_configs(cfg_a, cfg_b)
    sa = {k: v.detach() for k, v in model_a.state_dict().items()}
    sb = {k: v.detach() for k, v in model_b.state_dict().items()}
    return model_a.symmetry_spec(), sa, sb


def align_whole(model_a, model_b, **kw) -> WholeMatch:
    """Match two *rewritten* built-in models (:func:`symalign.rewrite.rewrite_model`); B is not modified."""
    spec, sa, sb = model_states(model_a, model_b)
    return match_whole(spec, sa, sb, spec_b=model_b.symmetry_spec(), **kw)
