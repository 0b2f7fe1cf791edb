r"""The two-stage, data-free attention matcher: :func:`match_attention`.

Finds ``g`` in the declared symmetry group so that ``g . theta_B`` is close to
``theta_A`` (squared Frobenius distance over every attention tensor the spec
acts on). Per layer: stage 1 (:mod:`~symalign.match.heads`) picks the head
permutation ``pi`` (new head ``i`` of B' = old head ``pi[i]`` of B); stage 2
aligns each K/V block of the re-ordered B over ``GL`` (:mod:`~symalign.match.qk`, for
Q-K and V-O alike) or ``H (+) GL`` under RoPE (:mod:`~symalign.match.rope`),
batched over every block of every layer. The result's ``transform`` maps
``heads.L -> pi``, ``qk.L -> U``, ``vo.L -> B``; on an axis the heads act first
(``T = blockdiag(U) P``), exactly as :func:`symalign.spec.apply` composes them.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

import torch
from torch import Tensor

from symalign.errors import MatchError, SymalignError
from symalign.match.heads import assign_heads, head_cost, objective
from symalign.match.inputs import check_pair, check_spec_fits
from symalign.match.qk import Grams, one_thread, solve_gl
from symalign.match.qknorm import exact_solutions, has_qknorm, relaxed
from symalign.match.rope import solve_rope
from symalign.match.views import AttentionLayer, SpaceSides, block_rows, direct_distance, find_layers, side_gram
from symalign.spec import SymmetrySpec, Transform, act_on, apply, segment_view

STAGE2_MODES = ("none", "orthogonal", "full")


@dataclass
class LayerMatch:
    """Diagnostics of one attention layer (lists are per K/V block unless stated).

    Distances are squared Frobenius distances between A and B over the block's
    stacked rows (Q-K: Q rows incl. biases + K rows; V-O: V rows + O rows):
    ``*_before`` unaligned, ``*_stage1`` after re-ordering only, ``*_after`` final.
    """

    tag: str
    permutation: list[int] | None
    encoding: str  # "GL" or e.g. "H(64,half)+GL(0)"
    stage1_cost: float | None = None  # objective at the chosen permutation
    stage1_cost_identity: float | None = None
    qk_before: list[float] = field(default_factory=list)
    qk_stage1: list[float] = field(default_factory=list)
    qk_after: list[float] = field(default_factory=list)
    vo_before: list[float] = field(default_factory=list)
    vo_stage1: list[float] = field(default_factory=list)
    vo_after: list[float] = field(default_factory=list)
    qk_cond: list[float] = field(default_factory=list)
    vo_cond: list[float] = field(default_factory=list)
    qk_iterations: list[int] = field(default_factory=list)  # GL solver: objective evaluations
    vo_iterations: list[int] = field(default_factory=list)
    qk_fallback: list[bool] = field(default_factory=list)
    vo_fallback: list[bool] = field(default_factory=list)
    qk_converged: list[bool] = field(default_factory=list)
    vo_converged: list[bool] = field(default_factory=list)
    time_s: float = 0.0  # stage 1 + Grams for this layer (stage 2 is batched over layers)


@dataclass
class AttentionMatch:
    """Result of :func:`match_attention`; apply with ``result.apply(state_b)``."""

    transform: Transform
    layers: list[LayerMatch]
    spec: SymmetrySpec = field(repr=False)
    stage1: bool = True
    stage2: str = "full"
    totals: dict[str, float] = field(default_factory=dict)

    @property
    def worst_condition(self) -> float:
        conds = [c for lay in self.layers for c in lay.qk_cond + lay.vo_cond]
        return max(conds) if conds else 1.0

    def apply(self, state_b: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """``g . state_b`` (B'), via :func:`symalign.spec.apply`."""
        return apply(self.spec, self.transform, state_b)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary (no tensors)."""
        return {"stage1": self.stage1, "stage2": self.stage2, "totals": dict(self.totals),
                "worst_condition": self.worst_condition, "layers": [asdict(lay) for lay in self.layers]}


# ----------------------------------------------------------------------------
# validation
# ----------------------------------------------------------------------------


def _validate(spec: SymmetrySpec, layers: list[AttentionLayer], state_a, state_b, spec_b) -> None:
    if spec_b is not None and spec.describe() != spec_b.describe():
        da, db = spec.describe(), spec_b.describe()
        diff = sorted(k for k in set(da) | set(db) if da.get(k) != db.get(k))
        k = diff[0]
        raise MatchError(f"the models have different symmetry specs: space {k!r} is {da.get(k)} in A but "
                         f"{db.get(k)} in B (different head counts, widths or positional encodings?)")
    if not layers:
        raise MatchError("the spec declares no attention layer (no 'qk.*'/'vo.*' spaces)")
    for lay in layers:
        check_pair(lay.tensors, state_a, state_b, context=f"layer {lay.tag!r}: ")
        rope = lay.qk.rope
        if rope is not None and rope.r % 2:
            raise MatchError(f"layer {lay.tag!r}: odd rotated width {rope.r}")
    check_spec_fits(spec, state_a, state_b)


# ----------------------------------------------------------------------------
# per-layer views and Grams
# ----------------------------------------------------------------------------


def _permuted(layer: AttentionLayer, spec: SymmetrySpec, state: Mapping[str, Tensor], pi: Tensor | None) -> dict:
    """The layer's tensors of B with the head permutation applied (heads act first; on their segment
    of a fused tensor)."""
    out = {}
    for t in layer.tensors:
        x = state[t]
        if pi is not None and layer.heads is not None:
            for a in spec.tensors[t]:
                if a.space == layer.heads:
                    x = act_on(layer.heads_group, pi, x, a)
        out[t] = x
    return out


def _grams(s: SpaceSides, state_a, state_b) -> Grams:
    nb, d = s.group.n_blocks, s.group.inner.n
    def rows(st, parts):  # native-dtype views; side_gram converts once
        return [block_rows(p.read(st), p, nb, d, dtype=st[p.tensor].dtype) for p in parts]

    co = side_gram(rows(state_a, s.co), rows(state_b, s.co))
    ct = side_gram(rows(state_a, s.contra), rows(state_b, s.contra))
    return Grams(*co, *ct)


def _identity_distance(g: Grams) -> Tensor:
    eye = torch.eye(g.d, dtype=torch.float64, device=g.co_bb.device).expand(g.n, g.d, g.d)
    return g.objective(eye, eye)


def stage1_precision(layers: list[AttentionLayer], *states: Mapping[str, Tensor]) -> torch.dtype:
    """The weights' own precision for the stage-1 products: float64 if any attention tensor
    is float64, else float32 (half precision is computed in float32)."""
    names = {t for lay in layers for t in lay.tensors}
    f64 = any(st[t].dtype == torch.float64 for st in states for t in names)
    return torch.float64 if f64 else torch.float32


@dataclass
class _Batch:
    """Blocks of several layers solved together in stage 2; ``grams`` is allocated up front
    (before any per-layer temporary, so the retained Grams do not pin freed heap memory)
    and filled layer by layer."""

    grams: Grams
    members: dict[int, slice]  # layer index -> its blocks

    def put(self, li: int, g: Grams) -> None:
        for dst, src in zip(self.grams.fields(), g.fields()):
            dst[self.members[li]] = src


def _batch_key(lay: AttentionLayer, kind: str) -> tuple[str, Any]:
    """Stage-2 batch of a layer's Q-K or V-O blocks: GL by width, RoPE by group, V-O by width."""
    if kind == "qk" and lay.qk.rope is not None:
        return ("qk", lay.qk.rope)
    return (kind, lay.head_dim)


def _plan_batches(layers: list[AttentionLayer], device: torch.device | None = None) -> dict[tuple[str, Any], _Batch]:
    """Stage-2 batches in solve order (Q-K over GL, Q-K under RoPE, V-O), Grams preallocated on ``device``."""
    members: dict[tuple[str, Any], dict[int, slice]] = {}
    for kind in ("qk-gl", "qk-rope", "vo"):
        for li, lay in enumerate(layers):
            if kind[:2] == "qk" and (lay.qk.rope is not None) != (kind == "qk-rope"):
                continue
            m = members.setdefault(_batch_key(lay, kind[:2]), {})
            lo = max((s.stop for s in m.values()), default=0)
            m[li] = slice(lo, lo + lay.n_kv)
    return {key: _Batch(Grams.empty(max(s.stop for s in m.values()), layers[next(iter(m))].head_dim, device), m)
            for key, m in members.items()}


# ----------------------------------------------------------------------------
# the matcher
# ----------------------------------------------------------------------------


def match_attention(spec: SymmetrySpec, state_a: Mapping[str, Tensor], state_b: Mapping[str, Tensor], *,
                    stage1: bool = True, stage2: str = "full", spec_b: SymmetrySpec | None = None,
                    max_iter: int = 500, xtol: float = 1e-14, ftol: float = 1e-9, max_cond: float = 1e6,
                    rope_grid: int = 65, t_cap: float = 20.0,
                    stage1_dtype: torch.dtype | None = None, device: str | torch.device | None = None
                    ) -> AttentionMatch:
    r"""Align B's attention layers to A's through the declared exact symmetries.

    Args:
        spec: the symmetry spec of both models (``heads.*``/``qk.*``/``vo.*`` spaces).
        state_a, state_b: state dicts (any float dtype; stage 2 and all distances are float64).
        stage1: match heads (off: identity permutation).
        stage2: ``"none"``, ``"orthogonal"`` (Procrustes; ``|c| = 1`` planes under RoPE)
            or ``"full"`` (refined over ``GL``; global per-plane optimum over ``H``).
        spec_b: B's own spec, if it may differ (compared via ``describe()``).
        max_iter, xtol, ftol: GL refinement limits (L-BFGS evaluations per block, relative
            step, scipy-style relative decrease; :func:`symalign.match.qk.solve_gl`);
            max_cond: conditioning guard (blocks whose ``cond(U)`` exceeds it fall back to
            the orthogonal solution, with a warning).
        rope_grid, t_cap: RoPE plane solver grid size and ``|log r|`` cap.
        stage1_dtype: precision of stage 1's Gram products; default the weights' own
            (:func:`stage1_precision`; float32 weights give float32 products, with the
            error bound of :mod:`symalign.match.heads`; the cost itself is float64).
        device: compute on this device (``"cpu"``, ``"cuda"``, ``"cuda:N"``, ``"auto"``; :mod:`symalign.device`):
            the spec's tensors are moved there, matched in the same dtypes with TF32 off, and the transform is
            returned on the CPU. ``None``: where the tensors are.

    Returns:
        :class:`AttentionMatch`; ``result.apply(state_b)`` is B', with
        ``||A - B'|| <= ||A - B||`` on every block for ``stage2 != "none"``.

    Raises:
        MatchError: mismatched shapes/specs/encodings, NaN/Inf weights, odd rotated width.
    """
    if stage2 not in STAGE2_MODES:
        raise MatchError(f"unknown stage2={stage2!r}; use one of {', '.join(STAGE2_MODES)}")
    if device is not None:
        from symalign.device import exact_matmul, resolve, to_device

        dev, names = resolve(device), set(spec.tensors)
        with exact_matmul():
            res = match_attention(spec, to_device({k: v for k, v in state_a.items() if k in names}, dev),
                                  to_device({k: v for k, v in state_b.items() if k in names}, dev), stage1=stage1,
                                  stage2=stage2, spec_b=spec_b, max_iter=max_iter, xtol=xtol, ftol=ftol,
                                  max_cond=max_cond, rope_grid=rope_grid, t_cap=t_cap, stage1_dtype=stage1_dtype)
        res.transform = to_device(dict(res.transform), torch.device("cpu"))
        return res
    if has_qknorm(spec):  # signs on Q-K and gain rescalings: solved on top of the relaxed match
        if spec_b is not None and spec_b.describe() != spec.describe():
            raise MatchError("the models have different symmetry specs (QK-norm groups differ)")
        base = match_attention(relaxed(spec), state_a, state_b, stage1=stage1, stage2=stage2, spec_b=None,
                               max_iter=max_iter, xtol=xtol, ftol=ftol, max_cond=max_cond, rope_grid=rope_grid,
                               t_cap=t_cap, stage1_dtype=stage1_dtype)
        transform = exact_solutions(spec, base, state_a, state_b, stage2)
        return AttentionMatch(transform, base.layers, spec, base.stage1, base.stage2, base.totals)
    prep = prepare_attention(spec, state_a, state_b, stage1=stage1, stage2=stage2, spec_b=spec_b,
                             stage1_dtype=stage1_dtype)
    return solve_attention(prep, max_iter=max_iter, xtol=xtol, ftol=ftol, max_cond=max_cond, rope_grid=rope_grid,
                           t_cap=t_cap)


@dataclass
class PreparedAttention:
    """Stage 1 and the stage-2 Gram matrices of :func:`match_attention`, before the stage-2 solve
    (:func:`prepare_attention`); holds no weight tensor, only ``d x d`` Grams and the diagnostics."""

    spec: SymmetrySpec
    layers: list
    transform: Transform
    diags: list
    batches: dict
    stage1: bool
    stage2: str
    t0: float
    t_stage1: float
    t_grams: float


def prepare_attention(spec: SymmetrySpec, state_a: Mapping[str, Tensor], state_b: Mapping[str, Tensor], *,
                      stage1: bool = True, stage2: str = "full", spec_b: SymmetrySpec | None = None,
                      stage1_dtype: torch.dtype | None = None) -> PreparedAttention:
    """The first half of :func:`match_attention` (same arguments; not for QK-norm specs): the head
    assignment and every block's Gram matrices. The weights are not needed after it returns, so a
    caller may free them while :func:`solve_attention` runs (the streamed scope overlaps the solve of
    one layer with the next layer's reading and Gram products)."""
    if stage2 not in STAGE2_MODES:
        raise MatchError(f"unknown stage2={stage2!r}; use one of {', '.join(STAGE2_MODES)}")
    if has_qknorm(spec):
        raise MatchError("internal error: prepare_attention does not take QK-norm specs; call match_attention")
    try:
        layers = find_layers(spec, state_a)
    except SymalignError as e:
        raise MatchError(str(e)) from e
    _validate(spec, layers, state_a, state_b, spec_b)
    s1dtype = stage1_precision(layers, state_a, state_b) if stage1_dtype is None else stage1_dtype
    t0 = time.perf_counter()
    transform: Transform = {}
    diags: list[LayerMatch] = []
    batches = _plan_batches(layers, next(iter(state_b.values())).device)  # where the tensors are
    t_stage1 = t_grams = 0.0
    costs: dict[int, Tensor] = {}
    pis: dict[str, Tensor] = {}
    if stage1:
        ts = time.perf_counter()
        costs, pis = _assign_head_spaces(spec, layers, state_a, state_b, s1dtype)
        t_stage1 += time.perf_counter() - ts
    for li, lay in enumerate(layers):
        tl = time.perf_counter()
        rope = lay.qk.rope
        diag = LayerMatch(lay.tag, None, rope.describe() if rope is not None else "GL")
        pi = None
        if lay.heads is not None:
            hg = lay.heads_group
            if stage1:
                pi = pis[lay.heads]
                diag.stage1_cost = objective(costs[li], pi)
                diag.stage1_cost_identity = float(costs[li].diagonal().sum())
            else:
                pi = hg.identity()
            transform[lay.heads] = pi
            diag.permutation = [int(i) for i in pi]
        tg = time.perf_counter()
        diag.qk_before = direct_distance(lay.qk, state_a, state_b).tolist()
        diag.vo_before = direct_distance(lay.vo, state_a, state_b).tolist()
        sb = _permuted(lay, spec, state_b, pi) if pi is not None and not torch.equal(
            pi, torch.arange(pi.numel(), device=pi.device)) else state_b
        for kind, side in (("qk", lay.qk), ("vo", lay.vo)):
            g = _grams(side, state_a, sb)
            batches[_batch_key(lay, kind)].put(li, g)
            setattr(diag, f"{kind}_stage1", _identity_distance(g).tolist())
        del sb
        t_grams += time.perf_counter() - tg
        diag.time_s = time.perf_counter() - tl
        diags.append(diag)
    return PreparedAttention(spec, layers, transform, diags, batches, stage1, stage2, t0, t_stage1, t_grams)


def solve_attention(prep: PreparedAttention, *, max_iter: int = 500, xtol: float = 1e-14, ftol: float = 1e-9,
                    max_cond: float = 1e6, rope_grid: int = 65, t_cap: float = 20.0) -> AttentionMatch:
    """The second half of :func:`match_attention`: the stage-2 solves of every batch (one intra-op
    thread, :func:`~symalign.match.qk.one_thread`) and the result."""
    spec, layers, transform, diags, batches = prep.spec, prep.layers, prep.transform, prep.diags, prep.batches
    stage1, stage2, t0, t_stage1, t_grams = prep.stage1, prep.stage2, prep.t0, prep.t_stage1, prep.t_grams
    ts2 = time.perf_counter()
    kw = dict(max_iter=max_iter, xtol=xtol, ftol=ftol, max_cond=max_cond)
    for (kind, what), batch in batches.items():
        with one_thread():  # d x d blocks: faster on one thread (see one_thread)
            if kind == "vo":
                sol = solve_gl(batch.grams, stage2, label="V-O", **kw)  # V-O: the same GL problem
            elif isinstance(what, int):
                sol = solve_gl(batch.grams, stage2, label="Q-K", **kw)
            else:  # RoPE layers sharing a group (same width, pairing and rotary dims)
                sol = solve_rope(batch.grams, what, stage2, label="Q-K (RoPE)", grid=rope_grid, t_cap=t_cap, **kw)
        for li, sl in batch.members.items():
            lay, dg = layers[li], diags[li]
            transform[lay.qk.name if kind == "qk" else lay.vo.name] = sol.u[sl].clone()
            setattr(dg, f"{kind}_after", sol.objective[sl].tolist())
            setattr(dg, f"{kind}_cond", sol.cond[sl].tolist())
            setattr(dg, f"{kind}_iterations", [int(i) for i in sol.iterations[sl]])
            setattr(dg, f"{kind}_fallback", [bool(b) for b in sol.fallback[sl]])
            setattr(dg, f"{kind}_converged", [bool(b) for b in sol.converged[sl]])
    t_stage2 = time.perf_counter() - ts2
    totals = {
        "distance_before": sum(sum(d.qk_before) + sum(d.vo_before) for d in diags),
        "distance_stage1": sum(sum(d.qk_stage1) + sum(d.vo_stage1) for d in diags),
        "distance_after": sum(sum(d.qk_after) + sum(d.vo_after) for d in diags),
        "time_stage1_s": t_stage1,
        "time_grams_s": t_grams,
        "time_stage2_s": t_stage2,
        "time_total_s": time.perf_counter() - t0,
    }
    if not all(math.isfinite(v) for v in totals.values()):
        raise MatchError("the match produced non-finite distances; check the inputs for extreme values")
    return AttentionMatch(transform, diags, spec, stage1, stage2, totals)


def _assign_head_spaces(spec: SymmetrySpec, layers: list[AttentionLayer], state_a, state_b,
                        dtype: torch.dtype) -> tuple[dict[int, Tensor], dict[str, Tensor]]:
    """Stage 1 for every head space: ``(cost per layer, permutation per head space)``.

    A head space shared by several layers (T5: one permutation per stack) is assigned once,
    on the sum of its layers' costs plus :func:`table_cost` of the other tensors it permutes
    (T5's relative position bias table): the objective is the sum of the distances it
    governs, each invariant under stage 2, so the joint assignment is its exact minimiser
    over the shared permutation (planted pairs: zero at the planted one).
    """
    costs: dict[int, Tensor] = {}
    members: dict[str, list[int]] = {}
    for li, lay in enumerate(layers):
        if lay.heads is not None:
            costs[li] = head_cost(lay, state_a, state_b, dtype=dtype)
            members.setdefault(lay.heads, []).append(li)
    pis = {}
    for name, lis in members.items():
        total = sum((costs[li] for li in lis[1:]), costs[lis[0]].clone())
        own = {t for li in lis for t in layers[li].tensors}
        total += table_cost(spec, name, [(t, a) for t, a in spec.tensors_of(name) if t not in own], state_a, state_b,
                            total.device)
        pis[name] = assign_heads(total, layers[lis[0]].heads_group)
    return costs, pis


def table_cost(spec: SymmetrySpec, space: str, parts, state_a, state_b, device: torch.device | None = None) -> Tensor:
    """``C[i, j] = ||X_A[head i] - X_B[head j]||^2`` summed over ``parts`` (tensor, action) that head
    space ``space`` permutes but no per-head group transforms (e.g. a per-head bias table), ``(h, h)``
    float64, on ``device`` (default: that of the tensors). A K/V-head axis under GQA is counted once per K/V head
    (``/ g`` per query head)."""
    hg = spec.spaces[space]
    h = hg.n_heads
    if device is None and parts:
        device = state_a[parts[0][0]].device
    cost = torch.zeros(h, h, dtype=torch.float64, device=device)
    for t, a in parts:
        xs = []
        for st in (state_a, state_b):
            x = st[t] if a.segment is None else segment_view(st[t], a.axis, a.segment)
            xs.append(torch.movedim(x, a.axis, 0).to(torch.float64))
        units = hg.kv if a.rep == "kv" else h
        xa, xb = (x.reshape(units, -1) for x in xs)
        c = (xa * xa).sum(1)[:, None] + (xb * xb).sum(1)[None, :] - 2 * xa @ xb.T
        if units != h:
            idx = torch.arange(h, device=c.device) // hg.group_size
            c = c[idx][:, idx] / hg.group_size
        cost += c
    return cost.clamp_min(0.0)


def align_models(model_a, model_b, **kw) -> AttentionMatch:
    """Match two modules exposing ``symmetry_spec()``; B is not modified.

    Apply with ``model_b.load_state_dict(result.apply(model_b.state_dict()))``.
    """
    for who, m in (("A", model_a), ("B", model_b)):
        if not hasattr(m, "symmetry_spec"):
            raise MatchError(f"model {who} ({type(m).__name__}) has no symmetry_spec() method")
    spec_a, spec_b = model_a.symmetry_spec(), model_b.symmetry_spec()
    sa = {k: v.detach() for k, v in model_a.state_dict().items()}  # state_dict tensors are detached
    sb = {k: v.detach() for k, v in model_b.state_dict().items()}
    return match_attention(spec_a, sa, sb, spec_b=spec_b, **kw)
