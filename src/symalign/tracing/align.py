r"""Align two state dicts of any traceable module: :func:`align_states`.

1. :func:`symalign.trace` derives the module's exact spec (checked in float64).
2. ``scope="model"``: :func:`symalign.match.whole.match_whole` over every traced space
   (residual stream, hidden units, attention); ``scope="attention"``: the attention
   spaces only, with :func:`symalign.match.match_attention` (fused projections cut into
   their segments).
3. ``B' = g . B``. Before anything is returned, B' must compute B's function on the
   example inputs: in float64 (``B'`` formed from B in float64, relative change
   ``<= max(1e-10, the trace's precision floor)``) and in B's own dtype (its entry of
   the tolerance table, :mod:`symalign.tolerance`: ``1e-5`` for float32). Otherwise
   :class:`~symalign.errors.MatchError` is raised.

The result's :attr:`ModuleAlignment.coverage` says how much of the model was aligned: the
fraction of parameter entries moved and the parts left unchanged (what the trace skipped,
and with ``scope="attention"`` the other spaces). ``strict=True`` refuses
(:class:`~symalign.errors.MatchError`, before matching) when any part is left.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import Tensor, nn

from symalign.errors import CheckpointError, ConfigError, MatchError
from symalign.spec import ATTENTION_ROLES, apply
from symalign.align_result import CheckReport
from symalign.tolerance import TOLERANCE, FunctionCheck, function_tolerance, relative_change
from symalign.tracing.api import Coverage, TraceResult, _to64, coverage_of, flat_tensors, split_inputs, trace

SCOPES = ("model", "attention")


@dataclass
class ModuleAlignment:
    """Result of :func:`align_states`: ``state`` is B aligned to A (B's dtypes)."""

    state: dict[str, Tensor] = field(repr=False)
    trace: TraceResult = field(repr=False)
    match: Any = field(repr=False)
    distance_before: float = 0.0
    distance_after: float = 0.0
    verify: CheckReport | None = None
    time_s: float = 0.0
    coverage: Coverage | None = None  # the aligned fraction of the parameters and the parts left unchanged

    def to_dict(self) -> dict[str, Any]:
        return {"distance": {"before": {"total": self.distance_before}, "after": {"total": self.distance_after}},
                "check": self.verify.to_dict() if self.verify is not None else None, "trace": self.trace.to_dict(),
                "coverage": self.coverage.to_dict() if self.coverage is not None else None,
                "match": self.match.to_dict() if hasattr(self.match, "to_dict") else None, "time_s": self.time_s}


def check_state(model: nn.Module, state: Mapping[str, Tensor], who: str) -> dict[str, Tensor]:
    """``state`` as a dict of tensors with exactly the model's keys and shapes (else :class:`CheckpointError`)."""
    if not isinstance(state, Mapping) or not all(isinstance(v, Tensor) for v in state.values()):
        raise CheckpointError(f"{who} is not a state dict (a mapping of names to tensors); save it with "
                              "torch.save(model.state_dict(), path)")
    want = model.state_dict()
    missing, extra = sorted(set(want) - set(state)), sorted(set(state) - set(want))
    if missing or extra:
        what = f"lacks {missing[:3]}" if missing else f"has unexpected {extra[:3]}"
        raise CheckpointError(f"{who} does not fit the module: it {what} (was it saved from this factory's model?)")
    for k, v in want.items():
        if tuple(state[k].shape) != tuple(v.shape):
            raise CheckpointError(f"{who}: tensor {k!r} has shape {tuple(state[k].shape)}, the module expects "
                                  f"{tuple(v.shape)}")
        if state[k].is_floating_point() and not bool(torch.isfinite(state[k]).all()):
            raise CheckpointError(f"{who}: tensor {k!r} has NaN or infinite entries")
    return {k: v.detach() for k, v in state.items()}


def _outputs(model: nn.Module, state, args, kwargs) -> list[Tensor]:
    model.load_state_dict(state)
    with torch.no_grad():
        return [t.detach().clone() for t in flat_tensors(model(*args, **kwargs))]


def align_states(model: nn.Module, state_a: Mapping[str, Tensor], state_b: Mapping[str, Tensor], example_inputs,
                 example_kwargs: dict | None = None, *, scope: str = "model", stage1: bool = True,
                 stage2: str = "full", max_sweeps: int = 20, traced: TraceResult | None = None,
                 strict: bool = False, device: str | torch.device | None = None) -> ModuleAlignment:
    """Align ``state_b`` to ``state_a`` through the traced exact symmetries of ``model`` (module docstring).

    ``model`` is only used as the architecture (its own weights are not read or changed).
    ``strict``: refuse (:class:`~symalign.errors.MatchError`) when any part would be left unchanged;
    ``device``: where the matching computes (:func:`symalign.match.whole.match_whole`'s ``device``).
    """
    from symalign.match.distance import relative_distance
    from symalign.match.whole import attention_step, match_whole

    t0 = time.perf_counter()
    if scope not in SCOPES:
        raise ConfigError(f"unknown scope {scope!r}; use one of {', '.join(SCOPES)}")
    sa = check_state(model, state_a, "checkpoint A")
    sb = check_state(model, state_b, "checkpoint B")
    res = traced if traced is not None else trace(model, example_inputs, example_kwargs)
    spec = res.spec
    if scope == "attention":
        keep = spec.select(ATTENTION_ROLES)
        if not keep:
            raise MatchError("the traced module has no attention layer to align; use --scope model "
                             f"(traced spaces: {', '.join(spec.spaces) or 'none'})")
        spec = spec.restrict(keep)
    dropped = [k for k in res.spec.spaces if k not in spec.spaces]
    cover = coverage_of(spec, sa, res.skipped, [f"spaces outside --scope {scope}: {', '.join(dropped)}"]
                        if dropped else [])
    if strict and cover.left:
        raise MatchError(f"strict: {len(cover.left)} part(s) of the model would be left unchanged ("
                         + "; ".join(cover.left[:2]) + (" ..." if len(cover.left) > 2 else "")
                         + "); drop strict to align the rest")
    if not spec.spaces:
        raise MatchError("the traced module has no symmetry to align (every part was skipped: "
                         + "; ".join(str(s) for s in res.skipped[:3]) + ")")
    before = relative_distance(sa, sb, spec.tensors)
    if scope == "attention":
        match = attention_step(spec, list(spec.spaces), sa, sb, stage1, stage2)
    else:
        match = match_whole(spec, sa, sb, stage1=stage1, stage2=stage2, max_sweeps=max_sweeps, device=device)
    transform = match.transform
    out = apply(spec, transform, sb)
    after = relative_distance(sa, out, spec.tensors)
    verify = verify_function(model, spec, transform, sb, out, example_inputs, example_kwargs,
                             floor=res.tolerance)
    return ModuleAlignment(out, res, match, before, after, verify, time.perf_counter() - t0, cover)


def _change(model: nn.Module, state, args, kwargs, ref: list[Tensor]) -> tuple[float, float]:
    """``(||y - y_ref|| / ||y_ref||, max |y - y_ref|)`` over all of the model's output tensors."""
    out = _outputs(model, state, args, kwargs)
    flat = lambda ts: torch.cat([t.reshape(-1).to(torch.float64) for t in ts]) if ts else torch.zeros(0)  # noqa: E731
    return relative_change(flat(ref), flat(out))


def verify_function(model: nn.Module, spec, transform, state_b, aligned, example_inputs, example_kwargs=None,
                    floor: float = TOLERANCE[torch.float64]) -> CheckReport:
    """B' must compute B's function: formed in float64 (unrounded, ``<= floor``) and as stored in B's dtype
    (:func:`symalign.tolerance.function_tolerance`); else :class:`MatchError`. Returns both checks."""
    args, kwargs = split_inputs(example_inputs, example_kwargs)
    m64 = copy.deepcopy(model).to(torch.float64).eval()
    b64 = {k: v.to(torch.float64) if v.is_floating_point() else v for k, v in state_b.items()}
    a64, k64 = _to64(args), _to64(kwargs)
    ref = _outputs(m64, b64, a64, k64)
    exact = FunctionCheck.of(*_change(m64, apply(spec, transform, b64), a64, k64, ref), torch.float64,
                             function_tolerance(torch.float64, floor=floor), stored=False)
    dtype = next((v.dtype for v in state_b.values() if v.is_floating_point()), torch.float32)
    native = copy.deepcopy(model).to(dtype).eval()
    cast = tuple(x.to(dtype) if isinstance(x, Tensor) and x.is_floating_point() else x for x in args)
    kw_n = {k: v.to(dtype) if isinstance(v, Tensor) and v.is_floating_point() else v for k, v in kwargs.items()}
    ref_n = _outputs(native, dict(state_b), cast, kw_n)
    stored = FunctionCheck.of(*_change(native, dict(aligned), cast, kw_n, ref_n), dtype,
                              function_tolerance(dtype, floor=floor))
    if not (exact.passed and stored.passed):
        raise MatchError(f"the aligned B changes B's function by {exact.rel:.1e} (float64, > {exact.tolerance:g}) / "
                         f"{stored.rel:.1e} ({stored.dtype}, tolerance {stored.tolerance:g}); refusing it -- this is "
                         "a bug in the tracer or the matcher, please report it")
    return CheckReport.whole(stored, exact=exact)
