r"""Stage 1 judged the paper's way: the chosen head permutation ranked by the loss barrier.

The paper's stage-1 ablation ranks the head assignment that stage 1 chooses among all
``h!`` permutations (24 for four heads) and reports

    Lhat = 100 (L_method - L_top1) / (L_naive - L_top1),

where ``L`` is the **loss barrier** of the aligned pair: ``L_method`` with the chosen
permutation, ``L_top1`` with the best of the ``h!``, ``L_naive`` without alignment. The
rank and ``Lhat`` that :func:`symalign.experiments.protocol.stage1_metrics` reports are taken
on the stage-1 assignment cost, where the chosen permutation is rank 1 with ``Lhat = 0`` by
construction (it is that cost's exact minimiser); here every permutation is judged by what
it leads to.

For one attention layer ``l`` of a scope, with every other layer of the scope aligned by the
matcher's own choice (:func:`symalign.match.match_attention`, stage 1 on):

1. for each permutation ``pi`` of the layer's heads (each element of the head group: under
   GQA only those mapping K/V groups onto K/V groups), re-order B's heads by ``pi``,
2. run stage 2 for that layer alone (``stage2``, default ``"full"``: GL refinement, the
   plane solver under RoPE) on the re-ordered B,
3. measure the loss barrier of the linear path ``(1 - t) theta_A + t theta_B'`` at ``points``
   evenly spaced ``t`` (:func:`symalign.lmc.curve`).

``rank = 1 + #{pi : L(pi) < L(chosen)}`` (ties count in the chosen permutation's favour,
with a relative tolerance of ``1e-9``). Each permutation also records the layer's weight
distance after stage 2 (squared Frobenius distance over its attention tensors, as
:class:`~symalign.match.api.LayerMatch` defines it) and its stage-1 assignment cost, and each
layer the Pearson correlations of those with the barrier across the ``h!`` permutations.

Cost: ``h!`` stage-2 solves and curves per layer (``h <= 8`` is enforced: ``8! = 40320``).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from symalign import lmc
from symalign.arch.fused import split_segments
from symalign.errors import MatchError
from symalign.match import match_attention
from symalign.match.heads import head_cost, objective
from symalign.match.views import find_layers
from symalign.spec import SymmetrySpec, apply

Batch = tuple[Tensor, Tensor]


def pearson(x: Sequence[float], y: Sequence[float]) -> float:
    """Pearson correlation of two equal-length sequences (``nan`` when either is constant)."""
    a, b = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    a, b = a - a.mean(), b - b.mean()
    den = math.sqrt(float((a * a).sum()) * float((b * b).sum()))
    return float("nan") if den == 0.0 else float((a * b).sum()) / den


@dataclass
class PermutationBarrier:
    """One head permutation of a layer, followed by stage 2 for that layer."""

    permutation: list[int]
    loss_barrier: float
    acc_barrier: float
    distance: float  # the layer's squared attention weight distance to A after stage 2
    stage1_cost: float  # the stage-1 assignment cost of the permutation


@dataclass
class LayerRank:
    """The chosen permutation of one layer ranked among all of them by the loss barrier.

    ``lhat`` is the paper's ``100 (L_chosen - L_best) / (L_naive - L_best)``; ``lhat_identity``
    uses the identity permutation (with stage 2) instead of the naive pair in the denominator
    (``nan`` when the denominator is not positive).
    """

    layer: str
    heads_space: str
    chosen: list[int]
    rank: int
    n_permutations: int
    chosen_barrier: float
    best_barrier: float
    best_permutation: list[int]
    identity_barrier: float
    naive_barrier: float
    lhat: float
    lhat_identity: float
    distance_barrier_correlation: float
    cost_barrier_correlation: float
    chosen_is_distance_minimum: bool
    permutations: list[PermutationBarrier] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _lhat(chosen: float, best: float, ref: float) -> float:
    den = ref - best
    return 100.0 * (chosen - best) / den if den > 0 and math.isfinite(den) else float("nan")


def _match(spec: SymmetrySpec, sa: Mapping[str, Tensor], sb: Mapping[str, Tensor], stage1: bool, stage2: str):
    view_spec, (va, vb) = split_segments(spec, sa, sb)
    return match_attention(view_spec, va, vb, stage1=stage1, stage2=stage2)


def rank_heads_by_barrier(model: nn.Module, spec: SymmetrySpec, state_a: Mapping[str, Tensor],
                          state_b: Mapping[str, Tensor], batches: Sequence[Batch] | Callable[[], Iterable[Batch]],
                          task: str = "classification", points: int = 25, stage2: str = "full",
                          layers: Sequence[str] | None = None,
                          progress: Callable[[str], None] | None = None) -> list[LayerRank]:
    """Rank the matcher's head permutation of each attention layer by the loss barrier (module docstring).

    Args:
        model: the architecture of both models (its own weights are not used).
        spec: the attention spec of the scope (``heads.*``/``qk.*``/``vo.*`` spaces of the
            layers to align; e.g. :func:`symalign.experiments.protocol.attention_spec`).
        state_a, state_b: full state dicts of A and B (every tensor ``model`` needs).
        batches: the evaluation batches of the curves.
        task, points: :func:`symalign.lmc.curve`.
        stage2: the stage-2 mode run after each permutation (``"full"``: the paper's).
        layers: the heads spaces to rank (default every layer of ``spec`` with a heads space).

    Returns:
        One :class:`LayerRank` per ranked layer.

    Raises:
        MatchError: a spec without attention layers, a layer with more than 8 heads, an unknown layer.
    """
    get = batches if callable(batches) else (lambda: batches)
    say = progress or (lambda s: None)

    def curve(sb2: Mapping[str, Tensor]) -> lmc.Curve:
        return lmc.curve(model, state_a, sb2, get, task, points)

    view_spec, va, found, want = _layers_to_rank(spec, state_a, layers)
    chosen_match = _match(spec, state_a, state_b, True, stage2)
    naive_barrier = curve(state_b).loss_barrier
    out = []
    for lay in found:
        if lay.heads not in want:
            continue
        group = view_spec.spaces[lay.heads]
        if group.n_heads > 8:
            raise MatchError(f"layer {lay.tag!r} has {group.n_heads} heads; ranking all h! permutations "
                             "is limited to h <= 8")
        rows = _permutation_barriers(spec, lay, group, chosen_match, state_a, state_b, va, stage2, curve, say)
        chosen = [int(j) for j in chosen_match.transform[lay.heads]]
        out.append(_layer_rank(lay, group.n_heads, chosen, rows, naive_barrier))
    return out


def _layers_to_rank(spec: SymmetrySpec, state_a: Mapping[str, Tensor],
                    layers: Sequence[str] | None) -> tuple[SymmetrySpec, Any, list, list[str]]:
    """The per-segment view of ``spec`` and of A, the attention layers with a heads space, and the heads spaces
    to rank (``layers``, default all of them); a spec without such a layer, or an unknown name, is refused."""
    view_spec, (va,) = split_segments(spec, state_a)
    found = [lay for lay in find_layers(view_spec, va) if lay.heads is not None]
    if not found:
        raise MatchError("the spec has no attention layer with a heads space to rank")
    names = [lay.heads for lay in found]
    want = list(layers) if layers is not None else names
    unknown = [w for w in want if w not in names]
    if unknown:
        raise MatchError(f"unknown heads space(s) {unknown}; the spec has {', '.join(names)}")
    return view_spec, va, found, want


def _permutation_barriers(spec: SymmetrySpec, lay, group, chosen_match, state_a: Mapping[str, Tensor],
                          state_b: Mapping[str, Tensor], va, stage2: str, curve: Callable, say: Callable
                          ) -> list[PermutationBarrier]:
    """Steps 1-3 of the module docstring for one layer: with every other layer of the scope aligned by the
    matcher's choice, each permutation ``pi`` of the head group applied to B's heads, stage 2 run for the layer
    alone, and the curve's barriers, the layer's distance after stage 2 and ``pi``'s stage-1 cost recorded."""
    own = [lay.heads, lay.qk.name, lay.vo.name]
    others = [s for s in spec.spaces if s not in own and s in chosen_match.transform]
    sb_ctx = apply(spec.restrict(others), {s: chosen_match.transform[s] for s in others}, state_b) \
        if others else dict(state_b)
    layer_spec = spec.restrict([s for s in own if s in spec.spaces])
    heads_spec = spec.restrict([lay.heads])
    _, (vctx,) = split_segments(spec, sb_ctx)
    cost = head_cost(lay, va, vctx)
    perms = [torch.as_tensor(p, dtype=torch.int64) for p in itertools.permutations(range(group.n_heads))]
    perms = [p for p in perms if group.contains(p)]
    rows = []
    for i, pi in enumerate(perms):
        say(f"{lay.tag}: permutation {i + 1}/{len(perms)}")
        sb_pi = apply(heads_spec, {lay.heads: pi}, sb_ctx)
        m = _match(layer_spec, state_a, sb_pi, False, stage2)
        sb2 = apply(layer_spec, {k: v for k, v in m.transform.items() if k != lay.heads}, sb_pi)
        c = curve(sb2)
        rows.append(PermutationBarrier([int(j) for j in pi], c.loss_barrier, c.acc_barrier,
                                       float(m.totals["distance_after"]), objective(cost, pi)))
    return rows


def _layer_rank(lay, n_heads: int, chosen: list[int], rows: list[PermutationBarrier],
                naive_barrier: float) -> LayerRank:
    """The chosen permutation's rank among ``rows`` by loss barrier (ties, to a relative ``1e-9``, in its
    favour), ``Lhat`` against the naive and the identity barriers, and the distance/cost-barrier correlations."""
    by_perm = {tuple(r.permutation): r for r in rows}
    mine = by_perm[tuple(chosen)]
    barriers = np.array([r.loss_barrier for r in rows])
    tol = 1e-9 * max(float(np.abs(barriers).max()), 1e-300)
    best = rows[int(barriers.argmin())]
    ident = by_perm[tuple(range(n_heads))]
    dists = np.array([r.distance for r in rows])
    return LayerRank(
        layer=lay.tag, heads_space=lay.heads, chosen=chosen,
        rank=int((barriers < mine.loss_barrier - tol).sum()) + 1, n_permutations=len(rows),
        chosen_barrier=mine.loss_barrier, best_barrier=best.loss_barrier, best_permutation=best.permutation,
        identity_barrier=ident.loss_barrier, naive_barrier=naive_barrier,
        lhat=_lhat(mine.loss_barrier, best.loss_barrier, naive_barrier),
        lhat_identity=_lhat(mine.loss_barrier, best.loss_barrier, ident.loss_barrier),
        distance_barrier_correlation=pearson(dists, barriers),
        cost_barrier_correlation=pearson([r.stage1_cost for r in rows], barriers),
        chosen_is_distance_minimum=bool(mine.distance <= dists.min() + 1e-9 * dists.max()),
        permutations=rows)
