r"""The one table of function-check tolerances, and the result of a function check.

Every transform symalign writes is an exact symmetry, so an aligned model B' must
compute B's function up to rounding. Every function check -- ``align`` (whole model,
or layer by layer when streamed), ``merge``'s folded references, the tracer, the
experiment protocol -- measures

    ``rel = ||f_{B'}(x) - f_B(x)|| / ||f_B(x)||``

on a batch ``x`` and accepts B' when ``rel <= function_tolerance(dtypes..., floor=...)``:
the largest :data:`TOLERANCE` of the dtypes involved (the dtype B and B' are stored
in, the dtype the check computes in), raised to a *precision floor* where the model
itself computes in lower precision than its weights.

The table, per dtype (``u = eps / 2`` its unit roundoff):

* ``float64``: ``1e-10``. Forming ``g . B`` costs a few ``u ~ 1.1e-16`` per entry;
  through a forward pass of a few layers (softmax, norms, products of ``D x D``
  matrices) the output moves by ``1e-14``--``1e-12`` on the models of the tests; ``1e-10``
  leaves two orders of margin and still exposes any wrong transform (a wrong head
  permutation or a non-symmetry changes the output by ``1e-2``--``1``).
* ``float32``: ``1e-5``. Storing ``g . B`` in float32 rounds each weight by up to
  ``u = 6e-8``; the output then moves by ``u`` times the network's amplification
  (a few hundred at most for the depths and norms seen): ``1e-7``--``1e-6``.
* ``bfloat16`` and ``float16``: ``8 eps`` (``16 u``): ``6.25e-2`` and ``7.8e-3``.
  Here the rounding of the stored weights dominates everything else; ``16 u``
  bounds a per-weight relative error ``u`` amplified at most 16-fold, which covers
  the shallow models symalign checks layer by layer (the streamed check runs one
  layer at a time) and the small whole models of the tests.

Floors, for models that compute in float32 whatever their weights' dtype, so that
even a float64 check resolves only float32 rounding of the *activations*:

* :data:`FLOAT32_COMPUTE_FLOOR` (``1e-6``): transformers' RMSNorm and QK-norm
  normalise in float32, GPT-J computes its attention scores in float32 (the families'
  ``precision_floor``);
* :data:`FLOAT32_ROTARY_FLOOR` (``1e-5``): ModernBERT's rotary embedding is computed in
  float32 and its cos/sin errors scale with the position.

Thresholds of other kinds (solver convergence, group membership, nullity thresholds
of the probe) are not function checks and are not here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from symalign.errors import SymalignError

TOLERANCE: dict[torch.dtype, float] = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.bfloat16: 8 * torch.finfo(torch.bfloat16).eps,  # 6.25e-2
    torch.float16: 8 * torch.finfo(torch.float16).eps,  # 7.8e-3
}
FLOAT32_COMPUTE_FLOOR = 1e-6
FLOAT32_ROTARY_FLOOR = 1e-5


def tolerance(dtype: torch.dtype) -> float:
    """:data:`TOLERANCE` of ``dtype`` (a dtype not in the table -- an integer one -- gets float32's)."""
    return TOLERANCE.get(dtype, TOLERANCE[torch.float32])


def function_tolerance(*dtypes: torch.dtype, floor: float = 0.0) -> float:
    """``max(tolerance(d) for d in dtypes)``, raised to ``floor`` (module docstring)."""
    return max([tolerance(d) for d in dtypes] + [floor])


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def relative_change(ref: torch.Tensor, new: torch.Tensor) -> tuple[float, float]:
    """``(||new - ref|| / ||ref||, max |new - ref|)`` in float64 (``(inf, inf)`` if either is not finite;
    the absolute norm when ``ref`` is zero)."""
    ref, new = ref.to(torch.float64), new.to(torch.float64)
    if not (torch.isfinite(ref).all() and torch.isfinite(new).all()):
        return float("inf"), float("inf")
    diff = new - ref
    den, num = float(ref.norm()), float(diff.norm())
    return (num / den if den > 0 else num), (float(diff.abs().max()) if diff.numel() else 0.0)


@dataclass
class FunctionCheck:
    """One function check: B' against B, computed in ``dtype``.

    ``rel``: relative output change (module docstring); ``max_abs``: largest absolute
    change of an output entry; ``tolerance``: the bound ``rel`` had to meet; ``passed``.
    ``layer``: the layer checked (streamed checks), ``None`` for the whole model;
    ``stored``: whether B' was checked as stored (rounded to B's dtype) or unrounded.
    """

    dtype: str
    rel: float
    max_abs: float
    tolerance: float
    passed: bool
    layer: int | None = None
    stored: bool = True

    @classmethod
    def of(cls, rel: float, max_abs: float, dtype: torch.dtype, tol: float, layer: int | None = None,
           stored: bool = True) -> "FunctionCheck":
        return cls(dtype_name(dtype), float(rel), float(max_abs), float(tol), bool(rel <= tol), layer, stored)

    def require(self, what: str, culprit: str) -> None:
        """Raise :class:`SymalignError` (``what: rel > tol; a bug in culprit``) unless the check passed."""
        if not self.passed:
            where = f" (layer {self.layer})" if self.layer is not None else ""
            kind = "as stored" if self.stored else "unrounded"
            raise SymalignError(f"{what}{where} by {self.rel:.2e} relative ({kind}, {self.dtype} check; > "
                                f"{self.tolerance:g}); this is a bug in {culprit}, please report it")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def all_finite(x: torch.Tensor) -> bool:
    """``isfinite(x).all()``; a finite sum proves it without a full boolean mask (an overflowing sum of
    finite entries falls back to the mask)."""
    return bool(torch.isfinite(x.sum())) or bool(torch.isfinite(x).all())
