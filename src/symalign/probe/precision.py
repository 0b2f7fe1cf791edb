r"""Compute a module in float64 end to end, whatever it casts to internally.

Why: a Jacobian null direction is found by cancellation, ``J v = sum_j v_j J e_j = 0``.
Many Hugging Face layers compute part of attention in float32 even when their
weights are float64 (eager attention's ``softmax(..., dtype=torch.float32)``,
rotary tables built from ``inv_freq.float()``, ModernBERT's float32 Q/K rotation).
A forward-mode column ``J e_j`` then carries float32 rounding (relative ``~6e-8``)
on every entry, the cancellation stops at ``~1e-8 s_1`` instead of ``~1e-16 s_1``,
and true null directions look like rank. (Reverse mode happens to escape the
softmax case: the rows ``u^T J`` pass the rounded cotangent through the *exact*
float64 map ``dscores/dtheta``, whose null space is untouched; it does not escape
a float32 cast upstream of the scores, such as ModernBERT's.)

:class:`Float64Mode` is a :class:`torch.overrides.TorchFunctionMode`: while it is
active every request for a lower-precision floating dtype made through the torch
API -- a ``dtype=`` keyword (``softmax``, ``arange``, ``zeros``, ...), ``Tensor.to``
with a dtype, ``Tensor.float/half/bfloat16``, ``Tensor.type`` -- asks for float64
instead. The function computed is the same function (same formula, more digits);
the sites it rewrote are recorded in :attr:`Float64Mode.sites` and reported by the
probe. It works under ``torch.func`` transforms (``jvp``, ``vjp``, ``vmap``): they
act below the Python torch-function layer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

LOW_PRECISION = frozenset({torch.float32, torch.float16, torch.bfloat16})
"""Floating dtypes the mode replaces by float64."""

_CAST_METHODS = ("float", "half", "bfloat16")


def _low(x: Any) -> bool:
    return isinstance(x, torch.dtype) and x in LOW_PRECISION


class Float64Mode(TorchFunctionMode):
    """Replace every lower-precision floating dtype requested through torch by float64 (see module doc)."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", repr(func))
        if _low(kwargs.get("dtype")):
            self.sites.add(f"{name}(dtype={str(kwargs['dtype']).replace('torch.', '')})")
            kwargs["dtype"] = torch.float64
        if name in _CAST_METHODS and args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point():
            self.sites.add(f"Tensor.{name}()")
            return args[0].to(torch.float64)
        if name in ("to", "type") and any(_low(a) for a in args[1:]):
            self.sites.add(f"Tensor.{name}({next(str(a) for a in args[1:] if _low(a)).replace('torch.', '')})")
            args = tuple(torch.float64 if _low(a) else a for a in args)
        return func(*args, **kwargs)
