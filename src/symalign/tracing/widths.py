r"""Merging two traced models of different hidden widths: :func:`merge_widths`.

A (wide) and B (narrow) are state dicts of one architecture at two hidden widths (an MLP's hidden layers; the
FF of a Transformer block), ``wide`` and ``narrow`` the two modules (only their architectures are used).

1. Both modules are traced (:func:`symalign.trace`); :func:`symalign.match.widen.split_spec` declares a
   :class:`~symalign.groups.SemiPermutation` for every hidden-unit space whose width differs.
2. B is widened onto A's widths by splitting its units: ``split="matched"`` fits each split to A's units
   (:func:`~symalign.match.widen.matched_split`), ``"uniform"`` copies the first units with equal shares (the
   unmatched baseline). When spaces of equal widths are left (a Transformer's residual stream and attention),
   a matched split first aligns B in them: B is widened uniformly, aligned to A (step 3), and that
   alignment's elements of the equal-width spaces are applied to B (an exact symmetry of B), so the split
   units' rows are compared in A's coordinates. The widened B must compute B's function on the example
   inputs: formed in float64 (relative change ``<= 1e-10``) and in B's dtype (its tolerance, ``1e-5`` for float32), else
   :class:`~symalign.errors.MatchError` (a space whose units meet a norm cannot be split this way).
3. The widened B is aligned to A through the wide model's traced symmetries
   (:func:`symalign.tracing.align.align_states`, whole model, itself checked to keep the function).
4. The merged state is ``w_A A + w_B B'`` per floating tensor (:mod:`symalign.checkpoint.average`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import Tensor, nn

from symalign.align_result import CheckReport
from symalign.checkpoint.average import weighted_average
from symalign.errors import ConfigError, MatchError
from symalign.match.widen import matched_split, split_spec, uniform_split, widen
from symalign.spec import SymmetrySpec, Transform, apply
from symalign.tolerance import FunctionCheck, function_tolerance, relative_change
from symalign.tracing.align import ModuleAlignment, align_states, check_state
from symalign.tracing.api import _to64, flat_tensors, split_inputs, trace

SPLITS = ("matched", "uniform")


@dataclass
class WidthMerge:
    """Result of :func:`merge_widths`: the merged state (A's widths and dtypes), B widened and aligned."""

    state: dict[str, Tensor] = field(repr=False)
    widened: dict[str, Tensor] = field(repr=False)
    aligned: dict[str, Tensor] = field(repr=False)
    split: SymmetrySpec = field(repr=False)
    splits: Transform = field(repr=False)
    widen_check: CheckReport | None = None
    alignment: ModuleAlignment | None = field(default=None, repr=False)
    how: str = "matched"

    def to_dict(self) -> dict[str, Any]:
        return {"split": self.how, "spaces": self.split.describe(),
                "widen_check": self.widen_check.to_dict() if self.widen_check is not None else None,
                "alignment": self.alignment.to_dict() if self.alignment is not None else None}


def _outputs(model: nn.Module, state: Mapping[str, Tensor], args: tuple, kwargs: dict) -> Tensor:
    model.load_state_dict(dict(state))
    with torch.no_grad():
        out = [t.detach().reshape(-1).to(torch.float64) for t in flat_tensors(model(*args, **kwargs))]
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)


def check_widened(narrow: nn.Module, wide: nn.Module, split: SymmetrySpec, splits: Transform,
                  state_b: Mapping[str, Tensor], widened: Mapping[str, Tensor], example_inputs,
                  example_kwargs: dict | None = None, pre: tuple[SymmetrySpec, Transform] | None = None
                  ) -> CheckReport:
    """The widened B must compute B's function: formed in float64 and as stored in B's dtype (module
    docstring); else :class:`MatchError`. ``pre``: the equal-width alignment applied to B before the split."""
    args, kwargs = split_inputs(example_inputs, example_kwargs)
    a64, k64 = _to64(args), _to64(kwargs)
    b64 = {k: v.to(torch.float64) if v.is_floating_point() else v for k, v in state_b.items()}
    n64, w64 = copy.deepcopy(narrow).to(torch.float64).eval(), copy.deepcopy(wide).to(torch.float64).eval()
    ref = _outputs(n64, b64, a64, k64)
    moved = b64 if pre is None else apply(pre[0], pre[1], b64)
    exact = FunctionCheck.of(*relative_change(ref, _outputs(w64, widen(split, splits, moved), a64, k64)),
                             torch.float64, function_tolerance(torch.float64), stored=False)
    dtype = next((v.dtype for v in state_b.values() if v.is_floating_point()), torch.float32)
    cast = tuple(x.to(dtype) if isinstance(x, Tensor) and x.is_floating_point() else x for x in args)
    kw = {k: v.to(dtype) if isinstance(v, Tensor) and v.is_floating_point() else v for k, v in kwargs.items()}
    ref_n = _outputs(copy.deepcopy(narrow).to(dtype).eval(), state_b, cast, kw)
    stored = FunctionCheck.of(*relative_change(ref_n, _outputs(copy.deepcopy(wide).to(dtype).eval(), widened,
                                                               cast, kw)), dtype, function_tolerance(dtype))
    if not (exact.passed and stored.passed):
        raise MatchError(f"splitting B's units changes its function by {exact.rel:.1e} (float64, > "
                         f"{exact.tolerance:g}) / {stored.rel:.1e} ({stored.dtype}); the split spaces ("
                         + ", ".join(split.spaces) + ") are not elementwise (a norm over the units?)")
    return CheckReport.whole(stored, exact=exact)


def merge_widths(wide: nn.Module, narrow: nn.Module, state_a: Mapping[str, Tensor], state_b: Mapping[str, Tensor],
                 example_inputs, example_kwargs: dict | None = None, *, split: str = "matched", align: bool = True,
                 weights: tuple[float, float] = (0.5, 0.5), max_sweeps: int = 20,
                 device: str | torch.device | None = None) -> WidthMerge:
    """Widen B (``narrow``'s state) onto A's widths, align it to A and average (module docstring).

    ``split``: ``"matched"`` or ``"uniform"``; ``align=False`` averages the widened B as it is; ``weights``:
    ``(w_A, w_B)``, summing to one; ``device``: where the alignment computes."""
    if split not in SPLITS:
        raise ConfigError(f"unknown split {split!r}; use one of {', '.join(SPLITS)}")
    sa = check_state(wide, state_a, "checkpoint A")
    sb = check_state(narrow, state_b, "checkpoint B")
    traced_wide = trace(wide, example_inputs, example_kwargs)
    traced_narrow = trace(narrow, example_inputs, example_kwargs)
    spl = split_spec(traced_narrow.spec, traced_wide.spec)
    same = [k for k in traced_narrow.spec.spaces if k not in spl.spaces]
    pre = None
    moved = sb
    if split == "matched" and same:  # align B in the equal-width spaces first (module docstring)
        first = align_states(wide, sa, widen(spl, uniform_split(spl), sb), example_inputs, example_kwargs,
                             max_sweeps=max_sweeps, traced=traced_wide, device=device)
        pre = (traced_narrow.spec.restrict(same), {k: first.match.transform[k] for k in same
                                                   if k in first.match.transform})
        moved = apply(pre[0], pre[1], sb)
    splits = matched_split(spl, traced_narrow.spec, sa, moved, aligned=same if pre else ()) \
        if split == "matched" else uniform_split(spl)
    widened = widen(spl, splits, moved)
    check = check_widened(narrow, wide, spl, splits, sb, widened, example_inputs, example_kwargs, pre)
    alignment = None
    aligned = widened
    if align:
        alignment = align_states(wide, sa, widened, example_inputs, example_kwargs, max_sweeps=max_sweeps,
                                 traced=traced_wide, device=device)
        aligned = alignment.state
    merged = {k: weighted_average([v, aligned[k]], list(weights), v.dtype) if v.is_floating_point() else v
              for k, v in sa.items()}
    return WidthMerge(merged, widened, aligned, spl, splits, check, alignment, split)
