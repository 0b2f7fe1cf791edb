r"""``symalign align --scope attention``: the one attention engine, :func:`align_attention`, over any source and sink.

Attention layers have independent symmetry spaces (``heads.i``, ``qk.i``, ``vo.i``),
so matching layer ``i`` needs only the attention tensors of layer ``i`` of A and B.
The sources are checkpoints opened lazily (streamed: one layer of each model in memory at a time) or resident
(:class:`~symalign.checkpoint.lazy.ResidentCheckpoint`; in memory the layers are matched in units of about
:data:`symalign.pipeline.IN_MEMORY_BLOCK_PARAMS` parameters, :func:`attention_units`); the sink is a
:class:`~symalign.io.shards.ShardWriter` (streamed) or a :class:`~symalign.stream.sink.StateSink` (in memory).
For each layer (unit), in order:

1. read A's and B's attention tensors of the layer (as stored), converted to the working
   dtype (float64; float32 when one model's layer exceeds :data:`FLOAT64_MAX_LAYER_PARAMS`)
   whatever the stored dtype (bfloat16, float16, float32);
2. match them (:func:`symalign.match.match_attention` on the layer's sub-spec, fused
   Q|K|V tensors cut into their segments) and apply the transform exactly;
3. check the layer's function through the family's own code
   (:class:`~symalign.stream.layercheck.LayerChecker`): the exact (working-dtype)
   aligned layer must reproduce B's layer output within the tolerance of the check's
   and the working dtype (``1e-10`` relative in float64), and the layer as stored
   (rounded to B's dtype) within the tolerance of that dtype
   (:mod:`symalign.tolerance`);
   -- streamed only; in memory the caller checks the whole model instead;
4. round to B's dtype and put the tensors into the sink (OUT's shards when streamed).

Overlap (same results, same order of every floating-point operation on a layer): step 2
is split at its stage-2 solve (:func:`~symalign.match.api.prepare_attention`, then
:func:`~symalign.match.api.solve_attention`). Layer ``i``'s solve runs on a worker thread
(one intra-op thread, :func:`~symalign.match.qk.one_thread`) while the main thread reads
layer ``i + 1`` and forms its head assignment and Gram products; then layer ``i`` is
transformed, checked and handed to a writer thread, which also copies B's other tensors
of the layer while the next layer is computed. Meanwhile layer ``i`` is kept only as
stored (its working-dtype copies are made again, exactly, when it is finished), so the
overlap adds one layer's attention tensors in B's dtype to the memory.
Every other tensor of B is copied byte for byte. OUT is committed only when every
layer passed; on any error nothing is left behind.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import torch

from symalign.errors import ConfigError
from symalign.align_result import AlignResult, CheckReport, PhaseClock, new_result
from symalign.stream.layercheck import LayerChecker, layer_prefix
from symalign.stream.memory import bound_heap, peak_rss, release
from symalign.stream.progress import progress_bar
from symalign.tolerance import dtype_name, function_tolerance
from symalign.checkpoint.lazy import LazyCheckpoint, ResidentCheckpoint, check_same_architecture, open_checkpoint
from symalign.io.prefetch import Gate, read_ahead
from symalign.io.shards import ShardWriter
from symalign.stream.sink import TensorSink

if TYPE_CHECKING:
    from symalign.match.api import AttentionMatch

Source = LazyCheckpoint | ResidentCheckpoint  # what the engine reads: a lazy (streamed) or resident checkpoint

FLOAT64_MAX_LAYER_PARAMS = 150_000_000


def work_dtype(n_params: int) -> torch.dtype:
    return torch.float64 if n_params <= FLOAT64_MAX_LAYER_PARAMS else torch.float32


def n_layers(spec) -> int:
    """Attention layers of the spec (by the spaces' roles, see :meth:`SymmetrySpec.select`)."""
    return len(spec.layers(("heads", "qk", "vo")))


NOT_ATTENTION = ("ff", "residual", "experts")  # roles of the spaces the attention scope leaves alone


def layer_of(spec, i: int) -> list[str]:
    """Layer ``i``'s attention spaces (heads, Q-K, V-O and any other per-layer attention space,
    e.g. QK-norm gain scales); FF and residual spaces are not the attention scope's."""
    return [s for s in spec.select(layer=i) if spec.role(s) not in NOT_ATTENTION]


def sq(x: torch.Tensor) -> float:
    return float(x.double().pow(2).sum())


def sq_dist(x: torch.Tensor, y: torch.Tensor | None = None, chunk: int = 1 << 20) -> float:
    """``||x - y||^2`` (``||x||^2`` without ``y``) in float64, in chunks of ``chunk`` values through one
    reused buffer (no tensor-sized temporary: the layer's three distances cost no allocation)."""
    xf = x.reshape(-1)
    yf = None if y is None else y.reshape(-1)
    buf = torch.empty(min(chunk, xf.numel()), dtype=torch.float64)
    total = 0.0
    for lo in range(0, xf.numel(), chunk):
        k = min(chunk, xf.numel() - lo)
        d = buf[:k]
        if yf is None:
            d.copy_(xf[lo:lo + k])
        else:
            torch.sub(xf[lo:lo + k].double(), yf[lo:lo + k].double(), out=d)
        total += float(torch.dot(d, d))
    return total


def stored_tolerance(dtype: torch.dtype, check: torch.dtype, floor: float = 0.0) -> float:
    """Bound on a layer's output change as stored in ``dtype``, checked in ``check``."""
    return function_tolerance(dtype, check, floor=floor)


def exact_tolerance(work: torch.dtype, check: torch.dtype, floor: float = 0.0) -> float:
    """Bound on a layer's output change with the unrounded transform (computed in ``work``)."""
    return function_tolerance(work, check, floor=floor)


def open_pair(a_dir: Path, b_dir: Path) -> tuple[LazyCheckpoint, LazyCheckpoint]:
    a = open_checkpoint(a_dir)
    b = open_checkpoint(b_dir)
    check_same_architecture(a, b)
    return a, b


def attention_units(spec, sizes: Mapping[str, int], block_params: int = 0) -> list[tuple[list[int], list[str]]]:
    """The units the engine matches one at a time, as ``(layers, spaces)``: consecutive layers grouped while
    their attention tensors hold at most ``block_params`` parameters (``sizes``: name -> numel; ``0``: one layer
    per unit, the streamed residency). Layers are independent, so any grouping finds the same element. A family
    whose attention spaces are not all per layer (T5: one head permutation per stack, ``layer None``) is one unit
    of every attention space, listing no layer: its layers cannot be separated."""
    L = n_layers(spec)
    shared = [s for s in spec.spaces if spec.layer(s) is None and spec.role(s) not in NOT_ATTENTION]
    if shared:  # no per-layer unit: the layers' own tensors are not copied or checked one layer at a time
        return [([], [s for s in spec.spaces if spec.role(s) not in NOT_ATTENTION])]
    units: list[tuple[list[int], list[str]]] = []
    size = 0
    for i in range(L):
        spaces = layer_of(spec, i)
        n = sum(sizes[t] for t in spec.restrict(spaces).tensors)
        if not units or size + n > block_params:
            units.append(([], []))
            size = 0
        units[-1][0].append(i)
        units[-1][1].extend(spaces)
        size += n
    return units


@dataclass
class AttentionRun:
    """What :func:`align_attention` found: the spec, the working dtype, per unit the relative distances before and
    after (over its attention tensors) and the squared sums behind them, the per-layer matcher diagnostics, the
    layer checks (if asked), the summed timings and (if asked) the group element."""

    spec: Any
    dtype: torch.dtype
    stage1: bool
    stage2: str
    per_before: list[float] = field(default_factory=list)
    per_after: list[float] = field(default_factory=list)
    num: dict[str, float] = field(default_factory=lambda: {"before": 0.0, "after": 0.0, "norm": 0.0})
    layers: list[dict] = field(default_factory=list)
    checks: list = field(default_factory=list)
    totals: dict[str, float] = field(default_factory=dict)
    transform: dict[str, torch.Tensor] = field(default_factory=dict)

    def rel(self, key: str) -> float:
        x = self.num[key]
        return (x / self.num["norm"]) ** 0.5 if self.num["norm"] else x ** 0.5

    def match(self) -> dict[str, Any]:
        """The matcher's JSON summary (as :meth:`symalign.match.api.AttentionMatch.to_dict`)."""
        conds = [c for lay in self.layers for c in lay.get("qk_cond", []) + lay.get("vo_cond", [])]
        return {"stage1": self.stage1, "stage2": self.stage2, "totals": dict(self.totals),
                "worst_condition": max(conds) if conds else 1.0, "layers": self.layers}

    def record_unit(self, before: float, after: float, norm: float) -> None:
        """Add one unit's ``||A - B||^2``, ``||A - B'||^2`` and ``||A||^2`` (over its attention tensors) to the
        sums, and its relative distances ``sqrt(before / norm)``, ``sqrt(after / norm)`` to the per-unit lists."""
        self.num["before"] += before
        self.num["after"] += after
        self.num["norm"] += norm
        self.per_before.append((before / norm) ** 0.5 if norm else before ** 0.5)
        self.per_after.append((after / norm) ** 0.5 if norm else after ** 0.5)

    def record_match(self, res: AttentionMatch, keep_transform: bool) -> None:
        """Add one unit's matcher diagnostics (its layers, summed totals) and, if ``keep_transform``, its element."""
        self.layers.extend(res.to_dict()["layers"])
        if keep_transform:
            self.transform.update(res.transform)
        for k, v in res.totals.items():
            self.totals[k] = self.totals.get(k, 0.0) + v


def align_attention(a: Source, b: Source, sink: TensorSink, *, stage2: str = "full", stage1: bool = True,
                    progress: bool = True, return_transform: bool = False, clock: PhaseClock | None = None,
                    device: torch.device | None = None, check_layers: bool = True, block_params: int = 0,
                    out_name: str = "OUT", label: str = "align (attention, streamed)") -> AttentionRun:
    """B's attention aligned to A's, unit by unit (:func:`attention_units`), into ``sink`` (module docstring).

    ``a``, ``b``: tensor sources with config and family -- :class:`~symalign.checkpoint.lazy.LazyCheckpoint`
    (streamed) or :class:`~symalign.checkpoint.lazy.ResidentCheckpoint` (in memory); ``sink``: a
    :class:`~symalign.stream.sink.TensorSink` (:class:`~symalign.io.shards.ShardWriter` or
    :class:`~symalign.stream.sink.StateSink`), which receives every tensor of B (aligned or copied).
    ``check_layers``: check each layer through the family's code before it goes to the sink (the streamed
    check; an in-memory caller checks the whole model instead); ``block_params``: the residency (units of up to
    that many attention parameters; ``0``: one layer). ``return_transform``: keep the group element found;
    ``clock``: sums the time of each phase over the units; ``device``: where each unit is matched
    (:func:`symalign.match.match_attention`'s ``device``; ``None`` or the CPU: the overlapped CPU path above).
    Reading, the function checks and writing stay on the CPU. The caller owns the sink (stages, commits or
    aborts it)."""
    clock = clock or PhaseClock()
    on_device = device is not None and torch.device(device).type != "cpu"
    t_prep = time.perf_counter()
    plan = _Plan.of(b, block_params, check_layers)
    run = AttentionRun(plan.spec, plan.dtype, stage1, stage2)
    checks = _LayerChecks.of(b, plan) if check_layers and plan.n_layers else None
    clock.since("prepare", t_prep)
    engine = _Engine(a, b, sink, plan, run, checks, clock, device=device, on_device=on_device,
                     return_transform=return_transform, out_name=out_name)
    try:
        engine.run_units(progress, label)
    finally:
        engine.close()
    return run


@dataclass
class _Plan:
    """What :func:`align_attention` does with B, fixed before the first read: B's spec, its number of attention
    layers, the units ``(layers, spaces)`` (:func:`attention_units`), each unit's attention tensors
    (``names_of[u]``, in its sub-spec's order) and each layer's (``own[i]``), the largest layer's attention
    parameters (``layer_params``) and the working dtype they imply (:func:`work_dtype`: by the largest layer,
    whatever the grouping, so every residency computes alike)."""

    spec: Any
    n_layers: int
    units: list[tuple[list[int], list[str]]]
    names_of: list[list[str]]
    own: list[list[str]]
    layer_params: int
    dtype: torch.dtype

    @classmethod
    def of(cls, b: Source, block_params: int, check_layers: bool) -> _Plan:
        """B's plan in units of up to ``block_params`` attention parameters (``0``: one layer). Refuses
        (:class:`~symalign.errors.ConfigError`) a per-layer check of a family whose attention layers share a
        space (one unit listing no layer)."""
        spec = b.adapter.spec(b.config, b.keys)
        L = n_layers(spec)
        sizes = {n: t.numel for n, t in b.tensors.items()}
        units = attention_units(spec, sizes, block_params)
        names_of = [list(spec.restrict(spaces).tensors) for _, spaces in units]
        own = [list(spec.restrict(layer_of(spec, i)).tensors) for i in range(L)]  # layer i's attention tensors
        if check_layers and units and not units[0][0]:
            raise ConfigError(getattr(b.adapter, "no_stream", None) or f"{b.adapter.family}'s attention layers "
                              "share a space: they cannot be checked one at a time; align without --stream")
        layer_params = max((sum(sizes[n] for n in names) for names in own), default=0)
        return cls(spec, L, units, names_of, own, layer_params, work_dtype(layer_params))


@dataclass
class _LayerChecks:
    """The streamed per-layer check (module docstring, step 3): a one-layer model of B's family
    (:class:`~symalign.stream.layercheck.LayerChecker`, FF shrunk) and the two tolerances -- of the layer as
    stored (B's dtype, ``tol``) and of the exact aligned layer (the working dtype, ``exact_tol``)."""

    checker: LayerChecker
    tol: float
    exact_tol: float

    @classmethod
    def of(cls, b: Source, plan: _Plan) -> _LayerChecks:
        """The checker of B's layers (sized for its largest attention layer) and its tolerances."""
        layer0 = layer_prefix(plan.own[0][0], 0)
        checker = LayerChecker(b.config, b.adapter, layer0, shrink_ff=True, layer_params=plan.layer_params * 2)
        return cls(checker, stored_tolerance(b.dtype, checker.dtype, b.adapter.precision_floor),
                   exact_tolerance(plan.dtype, checker.dtype, b.adapter.precision_floor))


def unit_distances(names: list[str], la: Mapping[str, torch.Tensor], lb: Mapping[str, torch.Tensor],
                   out: Mapping[str, torch.Tensor]) -> tuple[float, float, float]:
    """``(||A - B||^2, ||A - B'||^2, ||A||^2)`` over the tensors ``names`` of a unit (``la``, ``lb``: A's and B's
    working-dtype copies, ``out``: B aligned), each summed tensor by tensor in float64 (:func:`sq_dist`)."""
    return (sum(sq_dist(la[n], lb[n]) for n in names), sum(sq_dist(la[n], out[n]) for n in names),
            sum(sq_dist(la[n]) for n in names))


class _Engine:
    """One run of :func:`align_attention` (module docstring): the pair, the sink, the :class:`_Plan`, what is
    found so far (``run``), the layer checks (``None``: none), the stage-2 worker thread (``pool``), the writer
    thread (``io``, the only thread using ``sink``) with its pending writes, and B's tensors already given to the
    writer (``done``)."""

    def __init__(self, a: Source, b: Source, sink: TensorSink, plan: _Plan, run: AttentionRun,
                 checks: _LayerChecks | None, clock: PhaseClock, *, device: torch.device | None, on_device: bool,
                 return_transform: bool, out_name: str):
        self.a, self.b, self.sink, self.plan, self.run, self.checks, self.clock = a, b, sink, plan, run, checks, clock
        self.device, self.on_device = device, on_device
        self.return_transform, self.out_name = return_transform, out_name
        self.shapes = {n: t.shape for n, t in b.tensors.items()}
        self.done: set[str] = set()
        self.s1dtype = torch.float32 if b.dtype != torch.float64 else None  # stage 1's products
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="symalign-stage2")
        self.io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="symalign-write")
        self.writes: deque[Future] = deque()

    def close(self) -> None:
        """Stop both threads (work not started is cancelled, running work waited for)."""
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.io.shutdown(wait=True, cancel_futures=True)

    def read_pair(self, names: list[str]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """A's and B's tensors ``names`` as stored: every read of the matching goes through here."""
        return self.a.read(names), self.b.read(names)

    def run_units(self, progress: bool, label: str) -> None:
        """Every unit in order, overlapped (module docstring): unit ``i + 1`` is read (once unit ``i``'s stage-1
        peak is past: the gate) and begun while unit ``i``'s stage 2 runs on the worker, then unit ``i`` is
        finished; at the end B's remaining tensors are copied. Each unit is kept only as stored in between."""
        a, b, plan = self.a, self.b, self.plan
        total_bytes = sum(a.tensors[n].nbytes for names in plan.names_of for n in names) + b.nbytes
        waiting: deque[_Pending] = deque()
        with progress_bar(total_bytes, label, progress) as bar:
            ahead = Gate()  # unit i + 1 is read while unit i - 1 is finished (after unit i's stage-1 peak)
            pairs = read_ahead(self.read_pair, plan.names_of, self.device, lambda: self.clock("read"), gate=ahead)
            for (layers, spaces), names in zip(plan.units, plan.names_of):
                raw_a, raw_b = next(pairs)  # not in the zip: its reused result tuple would hold the pair
                bar.update(a.bytes_read + b.bytes_read,
                           f"layer {layers[-1] + 1 if layers else plan.n_layers}/{plan.n_layers}")
                sub = plan.spec.restrict(spaces)
                waiting.append(_Pending(layers, names, sub, raw_a, raw_b, self.begin(sub, names, raw_a, raw_b)))
                del raw_a, raw_b
                if len(waiting) > 1:
                    ahead.open()
                    self.finish(waiting.popleft())
            while waiting:
                self.finish(waiting.popleft())
            self.copy_rest(bar)

    def begin(self, sub: Any, names: list[str], raw_a: Mapping[str, torch.Tensor],
              raw_b: Mapping[str, torch.Tensor]) -> Future:
        """A unit's match begun (steps 1-2): A's and B's tensors ``names`` (as stored) converted to the working
        dtype, fused Q|K|V cut into segments, then :meth:`solve`. The working copies are dropped here: the unit
        is kept only as stored until :meth:`finish`."""
        from symalign.arch.fused import split_segments

        dt = self.plan.dtype
        with self.clock("read"):  # as stored: kept (small) until the unit is finished
            la, lb = {n: raw_a[n].to(dt) for n in names}, {n: raw_b[n].to(dt) for n in names}
        with self.clock("match"):
            view_spec, (va, vb) = split_segments(sub, la, lb)
            solved = self.solve(view_spec, va, vb)
            del va, vb, la, lb
        return solved

    def solve(self, view_spec: Any, va: Mapping[str, torch.Tensor], vb: Mapping[str, torch.Tensor]) -> Future:
        """The unit's :class:`~symalign.match.api.AttentionMatch` to come. Solved here in one piece when the
        spec has QK-norm (no prepared form) or a device matches it; else stage 1 and the Grams here and stage 2
        on the worker thread, overlapping the next unit."""
        from symalign.match import match_attention
        from symalign.match.api import prepare_attention, solve_attention
        from symalign.match.qknorm import has_qknorm

        stage1, stage2 = self.run.stage1, self.run.stage2
        if has_qknorm(view_spec) or self.on_device:
            solved: Future = Future()
            solved.set_result(match_attention(view_spec, va, vb, stage1=stage1, stage2=stage2,
                                              stage1_dtype=self.s1dtype,
                                              device=self.device if self.on_device else None))
            return solved
        prep = prepare_attention(view_spec, va, vb, stage1=stage1, stage2=stage2, stage1_dtype=self.s1dtype)
        return self.pool.submit(solve_attention, prep)

    def finish(self, p: _Pending) -> None:
        """Unit ``p`` finished (steps 2-4): stage 2's result, the transform applied, the layer checks, the
        writing and the diagnostics; then the heap's free memory is returned to the system."""
        with self.clock("match"):
            res = p.solved.result()
        out, stored = self.transform(p, res.transform)
        self.check(p, out, stored)
        self.write(p, stored)
        self.run.record_match(res, self.return_transform)
        release()

    def transform(self, p: _Pending, element: Mapping[str, torch.Tensor]
                  ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """``(out, stored)``: B's unit ``p`` with ``element`` applied exactly (``out``, working dtype, on the
        working-dtype copies made again from the stored tensors: the very values matched) and rounded to B's
        dtypes (``stored``); the unit's distances go to ``run``."""
        from symalign.spec import apply

        names, dt = p.names, self.plan.dtype
        with self.clock("read"):
            la, lb = {n: p.raw_a[n].to(dt) for n in names}, {n: p.raw_b[n].to(dt) for n in names}
        with self.clock("match"):
            out = apply(p.sub, element, lb)
        self.run.record_unit(*unit_distances(names, la, lb, out))
        del la
        stored = {n: out[n].to(self.b.tensors[n].dtype) for n in names}
        return out, stored

    def check(self, p: _Pending, out: Mapping[str, torch.Tensor], stored: Mapping[str, torch.Tensor]) -> None:
        """Each layer of unit ``p`` run through the family's code with B's other tensors of the layer (nothing
        without layer checks): the exact aligned layer (``out``) and the layer as stored (``stored``) must give B's
        layer output within their tolerances, else :class:`~symalign.errors.SymalignError` names the layer."""
        if self.checks is None:
            return
        b, checker = self.b, self.checks.checker
        for i in p.layers:
            extra = [n for n in checker.wanted(_layer_keys(b, self.plan.own[i][0], i), self.shapes, i)
                     if n not in p.names]
            with self.clock("read"):
                ref = {**p.raw_b, **b.read(extra)}  # B's layer as stored, with the other tensors the check loads
            with self.clock("verify"):
                exact = checker.check(ref, {**ref, **out}, i, self.checks.exact_tol, stored=False)
                kept = checker.check(ref, {**ref, **stored}, i, self.checks.tol)
                self.run.checks.extend([exact, kept])
                for c in (exact, kept):
                    c.require(f"refusing to write {self.out_name}: aligned layer {i} changes B's layer output",
                              f"the {b.adapter.family} adapter or the matcher")

    def write(self, p: _Pending, stored: Mapping[str, torch.Tensor]) -> None:
        """Unit ``p`` handed to the writer thread: its aligned tensors as stored, then B's other tensors of its
        layers (copied). The previous unit's writes are waited for first, so at most one unit's tensors wait for
        the sink whatever its speed (a merge's sink takes them as fast as it averages them); a failed write (or
        a NaN in a copied tensor) stops the run here."""
        with self.clock("write"):
            while self.writes:
                self.writes.popleft().result()
            for n in p.names:
                self.writes.append(self.io.submit(self.sink.put, n, stored[n]))
                self.done.add(n)
            for i in p.layers:
                for n in _layer_keys(self.b, self.plan.own[i][0], i):
                    if n not in self.done:
                        self.writes.append(self.io.submit(self.sink.copy, n))
                        self.done.add(n)

    def copy_rest(self, bar: Any) -> None:
        """B's tensors no unit gave to the writer, copied as they are; then every write waited for."""
        a, b = self.a, self.b
        bar.update(a.bytes_read + b.bytes_read, "copying the other tensors")
        with self.clock("write"):
            for n in b.keys:
                if n not in self.done:
                    self.writes.append(self.io.submit(self.sink.copy, n))
            while self.writes:
                self.writes.popleft().result()
        bar.update(a.bytes_read + b.bytes_read, "done")


def attention_result(run: AttentionRun, a: Source, b: Source, sink: TensorSink,
                     return_transform: bool = False) -> AlignResult:
    """The :class:`~symalign.align_result.AlignResult` of a streamed :func:`align_attention` run (no ``out``,
    ``a`` or ``b`` path: the caller names them)."""
    match = run.match()
    del match["worst_condition"]  # the streamed JSON as before
    totals = run.totals
    res = new_result(b, run.spec, "streamed", {"total": run.rel("before"), "per_layer": run.per_before},
                     {"total": run.rel("after"), "per_layer": run.per_after}, 1, True,
                     CheckReport.per_layer(run.checks), match=match,
                     stream={"passes": 1, "work_dtype": dtype_name(run.dtype),
                             "bytes_read": a.bytes_read + b.bytes_read,
                             "bytes_written": sink.bytes_written, "shards": len(b.shards),
                             "time_grams_s": totals.get("time_stage1_s", 0.0) + totals.get("time_grams_s", 0.0),
                             "peak_rss_bytes": peak_rss(),
                             "check": "per layer, through a one-layer model of the family"},
                     transform=run.transform if return_transform else None)
    res.scope, res.stage1, res.stage2 = "attention", run.stage1, run.stage2
    return res


def run_stream_attention(a_dir: Path, b_dir: Path, out_dir: Path, stage2: str = "full", stage1: bool = True,
                         force: bool = False, progress: bool = True, return_transform: bool = False,
                         clock: PhaseClock | None = None, device: torch.device | None = None) -> AlignResult:
    """Align B's attention to A's layer by layer and write OUT (see the module docstring): both checkpoints
    opened lazily, :func:`align_attention` one layer at a time into a :class:`~symalign.io.shards.ShardWriter`,
    OUT committed only when every layer passed its check.

    ``return_transform``: keep the group element found (space -> tensor) in ``transform``;
    ``clock``: sums the time of each phase over the layers (:func:`symalign.pipeline.align`);
    ``device``: where each layer is matched (:func:`align_attention`).
    """
    from symalign.io.folder import check_output_dir, commit

    clock = clock or PhaseClock()
    bound_heap()
    out_path = check_output_dir(out_dir, [a_dir, b_dir], force)
    with clock("read"):
        a, b = open_pair(a_dir, b_dir)
    writer = ShardWriter(out_path, b)
    try:
        run = align_attention(a, b, writer, stage2=stage2, stage1=stage1, progress=progress,
                              return_transform=return_transform, clock=clock, device=device, out_name=str(out_path))
        with clock("write"):
            tmp = writer.stage(marker={"command": "align", "scope": "attention", "folded": False, "streamed": True,
                                       "a": str(Path(a_dir).resolve()), "b": str(Path(b_dir).resolve())})
            commit(tmp, out_path)
    except BaseException:
        writer.abort()
        raise
    res = attention_result(run, a, b, writer, return_transform)
    res.a, res.b, res.out = str(a_dir), str(b_dir), str(out_path)
    res.timings = clock.timings()
    return res


@dataclass
class _Pending:
    """A unit (its layers) between its stage-2 submission and its writing: its spec, its tensors as stored
    (A's and B's, kept in the stored dtype until then) and the stage-2 result to come."""

    layers: list[int]
    names: list[str]
    sub: object
    raw_a: dict[str, torch.Tensor]
    raw_b: dict[str, torch.Tensor]
    solved: Future


def _layer_keys(ck: Any, probe: str, i: int) -> list[str]:
    """Every tensor name of layer ``i`` (same prefix as ``probe``)."""
    p = layer_prefix(probe, i)
    return [n for n in ck.keys if n.startswith(p)]
