r"""What ``symalign align`` returns and prints: one result for every scope and every path.

:class:`AlignResult` is built by the align pipeline (:func:`symalign.pipeline.align`) for
``--scope attention`` and ``--scope model``, in memory or streamed, and by ``--module``;
``symalign align --json`` prints :meth:`AlignResult.to_dict`. Its JSON keys:

* ``a``, ``b``, ``out``: the input and output paths; ``scope`` (``attention`` | ``model``);
  ``path`` (``in-memory`` | ``streamed`` | ``module``); ``family``, ``architecture``;
  ``dtype`` (B's stored dtype); ``stage1``, ``stage2``.
* ``group``: ``{"dim", "spaces": {space: group}}``, the symmetry group aligned over.
* ``distance``: ``{"before": {"total", "per_layer"?}, "after": {...}}``, the relative distance
  ``||A - g.B|| / ||A||`` over the aligned tensors, before and after.
* ``sweeps`` (passes over the model: 1 for the attention scope), ``max_sweeps``, ``converged``.
* ``check``: the function check of OUT (:class:`CheckReport`): ``kind`` (``whole`` | ``per-layer``),
  the worst ``rel`` / ``max_abs`` with its ``dtype``, ``tolerance`` and ``passed``; ``exact``: the same
  for the unrounded transform where it is checked separately (streamed, ``--module``), else ``null``;
  ``layers``: every per-layer check (streamed), else ``[]``.
* ``timings``: ``{"read_s", "prepare_s", "match_s", "verify_s", "write_s", "total_s"}`` (seconds; a
  streamed run interleaves the phases layer by layer and each is summed over the layers).
* ``threads``, ``provenance`` (:func:`symalign.provenance.provenance`), ``notes``, ``folded``
  (OUT's weights are in folded form: ``--scope model``), ``untied_head``, ``reference`` (``{"path",
  "check"}`` of ``--write-reference``, else ``null``), ``match`` (the solver's own report), ``stream``
  (streaming statistics: passes, bytes read and written, peak RSS; ``null`` in memory), ``memory`` (host peak
  RSS, device peak bytes -- ``null`` off CUDA -- and the ``--max-device-memory`` cap:
  :func:`symalign.device.peak_memory`, :func:`symalign.device.cap_memory`).
* ``coverage`` (``--module``; else ``null``): ``{"aligned", "total", "fraction", "unchanged", "left",
  "summary"}``, the parameter entries in tensors that the aligned spaces move, the tensors left as they
  are, and the parts left unchanged other than the model's output axes
  (:class:`symalign.tracing.api.Coverage`).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator, Sequence

from symalign.tolerance import FunctionCheck, dtype_name

PHASES = ("read", "prepare", "match", "verify", "write")


@dataclass
class Timings:
    """Seconds spent per phase of the pipeline, and in all."""

    read_s: float = 0.0
    prepare_s: float = 0.0
    match_s: float = 0.0
    verify_s: float = 0.0
    write_s: float = 0.0
    total_s: float = 0.0


class PhaseClock:
    """Accumulates wall time per phase (``with clock("match"): ...``; phases may repeat, e.g. per layer)."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.spent = {p: 0.0 for p in PHASES}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        if phase not in self.spent:
            raise ValueError(f"unknown phase {phase!r}; one of {', '.join(PHASES)}")
        t = time.perf_counter()
        try:
            yield
        finally:
            self.spent[phase] += time.perf_counter() - t

    def since(self, phase: str, t: float) -> None:
        """Count the time since ``t`` (a ``time.perf_counter()`` value) to ``phase``."""
        if phase not in self.spent:
            raise ValueError(f"unknown phase {phase!r}; one of {', '.join(PHASES)}")
        self.spent[phase] += time.perf_counter() - t

    def timings(self) -> Timings:
        return Timings(**{f"{p}_s": v for p, v in self.spent.items()}, total_s=time.perf_counter() - self.t0)


@dataclass
class CheckReport:
    """The function check of an output: the worst check (as stored), the unrounded one where
    separate (``exact``), and every per-layer check (``layers``, streamed)."""

    kind: str
    dtype: str
    rel: float
    max_abs: float
    tolerance: float
    passed: bool
    exact: FunctionCheck | None = None
    layers: list[FunctionCheck] = field(default_factory=list)

    @classmethod
    def whole(cls, check: FunctionCheck, exact: FunctionCheck | None = None) -> "CheckReport":
        return cls("whole", check.dtype, check.rel, check.max_abs, check.tolerance, check.passed, exact)

    @classmethod
    def per_layer(cls, checks: Sequence[FunctionCheck]) -> "CheckReport":
        """Worst stored and worst unrounded check over the layers (an empty model passes trivially)."""
        stored = [c for c in checks if c.stored]
        exact = [c for c in checks if not c.stored]
        worst = max(stored, key=lambda c: c.rel / c.tolerance if c.tolerance else c.rel, default=None)
        if worst is None:
            return cls("per-layer", "float64", 0.0, 0.0, 0.0, True, None, list(checks))
        ex = max(exact, key=lambda c: c.rel / c.tolerance if c.tolerance else c.rel, default=None)
        return cls("per-layer", worst.dtype, max(c.rel for c in stored), max(c.max_abs for c in stored),
                   worst.tolerance, all(c.passed for c in checks), ex, list(checks))

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "dtype": self.dtype, "rel": self.rel, "max_abs": self.max_abs,
                "tolerance": self.tolerance, "passed": self.passed,
                "exact": self.exact.to_dict() if self.exact is not None else None,
                "layers": [c.to_dict() for c in self.layers]}


@dataclass
class AlignResult:
    """The result of one alignment (see the module docstring for the JSON form)."""

    a: str
    b: str
    out: str
    scope: str
    path: str
    family: str
    architecture: str
    dtype: str
    stage1: bool
    stage2: str
    group: dict[str, Any]
    distance: dict[str, dict[str, Any]]
    sweeps: int
    converged: bool
    check: CheckReport
    max_sweeps: int | None = None
    timings: Timings = field(default_factory=Timings)
    threads: int = 1
    provenance: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    folded: bool = False
    untied_head: bool = False
    reference: dict[str, Any] | None = None
    match: dict[str, Any] = field(default_factory=dict)
    stream: dict[str, Any] | None = None
    coverage: dict[str, Any] | None = None
    memory: dict[str, Any] | None = None  # peak RSS and device bytes (symalign.device.peak_memory), the cap
    transform: dict[str, Any] | None = field(default=None, repr=False)  # the group element (not in the JSON)

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in ("check", "timings", "transform")}
        d["check"] = self.check.to_dict()
        d["timings"] = asdict(self.timings)
        return d


def new_result(b: Any, spec: Any, path: str, before: dict, after: dict, sweeps: int, converged: bool,
               check: CheckReport, **kw: Any) -> AlignResult:
    """An :class:`AlignResult` with an engine's fields (:func:`symalign.pipeline.finish` adds the shared ones)."""
    return AlignResult(a="", b="", out="", scope="", path=path, family=b.adapter.family,
                       architecture=b.config.model_type, dtype=dtype_name(b.dtype), stage1=True, stage2="",
                       group={"dim": spec.dim, "spaces": spec.describe()},
                       distance={"before": before, "after": after}, sweeps=sweeps, converged=converged,
                       check=check, **kw)
