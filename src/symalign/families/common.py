r"""Shared pieces of the Hugging Face whole-model specs: the result type, float64 copies, and the fold.

**Folding a LayerNorm into its readers.** ``LN(x) = g * n(x) + b`` with
``n(x) = C x / sqrt(mean((C x)^2) + eps)`` (``C = I - 1 1^T / D``). A reader
``y = W LN(x) + c`` equals ``(W diag(g)) n(x) + (c + W b)``. So the gain is folded
into the reader's input columns and the bias into its bias, and the norm is left
with ``g = 1, b = 0`` (same module, same ``eps``). When some reader has no bias,
``b`` stays in the norm as ``b / g`` (``W diag(g) (n + b / g) = W (g * n + b)``, a zero
gain is refused) and rotates with the stream, covariantly. A ``Conv2d`` reader with
a ``1 x 1`` kernel and no padding (ViT's masked-image decoder) is a linear map on
the channel axis and folds the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import Tensor

from symalign.errors import MatchError
from symalign.groups import Permutation, PositiveMonomial
from symalign.spec import SymmetrySpec

RESIDUAL = "residual"


@dataclass
class Prepared:
    """A checkpoint's (exactly) rewritten state, its whole-model spec, and what changed in its format."""

    state: dict[str, Tensor]
    spec: SymmetrySpec
    untied: bool = False
    notes: list[str] = field(default_factory=list)


def to_f64(state: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, torch.dtype]]:
    """Float64 copies (floating tensors only) and the original dtypes."""
    return ({k: (v.to(torch.float64) if v.is_floating_point() else v) for k, v in state.items()},
            {k: v.dtype for k, v in state.items()})


def back(s: dict[str, Tensor], dtypes: dict[str, torch.dtype], default: torch.dtype) -> dict[str, Tensor]:
    return {k: v.to(dtypes.get(k, default)).contiguous() for k, v in s.items()}


def copy_spec(att: SymmetrySpec) -> SymmetrySpec:
    return SymmetrySpec(dict(att.spaces), {k: list(v) for k, v in att.tensors.items()}, dict(att.couplings),
                        dict(att.info))


def ff_group(act: Any, d_ff: int) -> Permutation:
    """``S_{d_ff}``; for ReLU the positive monomials ``S_{d_ff} x R_{>0}^{d_ff}`` (``relu(s z) = s relu(z)``)."""
    return PositiveMonomial(d_ff) if act == "relu" else Permutation(d_ff)


def act_if(spec: SymmetrySpec, s: Mapping[str, Tensor], tensor: str, space: str, axis: int,
           variance: str = "co", segment: tuple[int, int] | None = None) -> None:
    """``spec.act_on`` for an optional tensor (biases, heads): skipped when ``s`` lacks it."""
    if tensor in s:
        spec.act_on(tensor, space, axis, variance, None, segment)  # type: ignore[arg-type]


def _as_linear(w: Tensor, name: str) -> Tensor:
    """``(out, in)`` view of a Linear weight or a ``1 x 1`` Conv2d weight."""
    if w.dim() == 2:
        return w
    if w.dim() == 4 and w.shape[2:] == (1, 1):
        return w[:, :, 0, 0]
    raise MatchError(f"cannot fold a norm into {name!r} of shape {tuple(w.shape)} (expected a Linear or 1x1 conv)")


def on_device_of(x: Tensor, w: Tensor) -> Tensor:
    """``x`` as a meta placeholder when ``w`` is one (else ``x``): a fold of a real gain or bias into a
    reader given only as a placeholder (its shape) yields a placeholder, not an error. This lets the
    streamed engines prepare one real tensor of a layer at a time (:class:`symalign.stream.fold.Preparer`):
    every result that depends on a placeholder is a placeholder, every other result is exact."""
    return x.to(w.device) if w.is_meta and not x.is_meta else x


def meet(w: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """``(w, g)`` on one device: both placeholders if either is (:func:`on_device_of`)."""
    return on_device_of(w, g), on_device_of(g, w)


def fold_layernorm(s: dict[str, Tensor], norm: str, readers: list[str]) -> bool:
    """Fold ``norm.weight``/``norm.bias`` into the readers (``nn.Linear``-layout ``W``, ``(out, in)``); in place.

    Returns True when the norm keeps a bias (some reader has none): then
    ``norm.bias = b / g`` and the caller declares it covariant on the stream.
    """
    g = s[norm + ".weight"]
    b = s.get(norm + ".bias")
    keep_bias = b is not None and any(r + ".bias" not in s for r in readers)
    if keep_bias and not g.is_meta and bool((g == 0).any()):
        raise MatchError(f"--scope model: {norm} has a zero gain and a reader without bias; its bias cannot be "
                         "kept exactly behind a unit gain")
    for r in readers:
        w = s[r + ".weight"]
        if b is not None and not keep_bias:
            c, wb = meet(s[r + ".bias"], w)
            wb, bb = meet(wb, b)
            s[r + ".bias"] = on_device_of(c, wb) + _as_linear(wb, r) @ bb
        shape = [1] * w.dim()
        shape[1] = -1
        wg, gg = meet(w, g)
        s[r + ".weight"] = wg * gg.view(shape)
    s[norm + ".weight"] = torch.ones_like(g)
    if b is not None:
        s[norm + ".bias"] = (lambda bb, gg: bb / gg)(*meet(b, g)) if keep_bias else torch.zeros_like(b)
    return keep_bias


def headless_note(arch: str | None, family: str, known: list[str]) -> str:
    """Why a checkpoint gets no residual space."""
    if arch is None or arch not in known:
        return (f"residual stream not aligned: {family} head {arch!r} is not mapped (mapped: {', '.join(known)}); "
                "FF units and attention only (exact whatever the head)")
    return (f"residual stream not aligned: {arch} outputs the stream itself (no head reads it), so a residual "
            "transform would change the output; FF units and attention only")
