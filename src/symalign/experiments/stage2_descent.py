r"""Stage 2 refined the paper's way: plain gradient descent from the Procrustes start, barrier along the way.

The paper's stage 2 starts every ``GL`` block (Q-K without RoPE, V-O always) at the
orthogonal (Procrustes) solution and refines it by gradient descent on the weight distance

    D(U) = ||X_A - X_B U^T||_F^2 + ||Y_A - Y_B U^{-1}||_F^2

(covariant rows ``X``, contravariant rows ``Y`` of the block; summed over every block of the
scope); the matcher's default (``stage2="full"``) minimises the same ``D`` with batched L-BFGS.
Under RoPE the Q-K group is the plane group, solved per plane to its global optimum (the
paper's Brent step); it is held at that solution here, so the descent refines the ``GL``
blocks only.

:func:`descent_path` fixes the head permutations chosen by stage 1, starts at the orthogonal
solution and takes ``max(checkpoints)`` plain steps ``U <- U - (eta / L_s) grad_U D`` for each
relative rate ``eta``, where ``L_s = 2 sum_t sigma_max(B_t)^2`` over the tensors ``t`` that space
``s`` acts on (``sigma_max`` along the acted axis: an upper bound on the curvature of ``D`` in
``U`` at an orthogonal ``U``, so ``eta < 1`` is a stable step near the start). At each
checkpoint it records ``D`` and the loss barrier of the linear path from A to ``g . B``
(:func:`symalign.lmc.curve`); ``none``, ``orthogonal`` and ``full`` (L-BFGS) are recorded as
references. Every point is an exact symmetry of B (each ``U`` stays invertible; a step that
makes a block singular or the distance non-finite stops that rate's path).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Mapping, Sequence

import torch
from torch import Tensor, nn

from symalign import lmc
from symalign.arch.fused import split_segments
from symalign.match import match_attention
from symalign.spec import SymmetrySpec, apply

Batch = tuple[Tensor, Tensor]


@dataclass
class DescentPoint:
    """One point: a variant (``none``/``orthogonal``/``full``/``gd``), its rate and steps (``gd``)."""

    variant: str
    eta: float | None
    steps: int | None
    distance: float
    loss_barrier: float
    acc_barrier: float

    def to_dict(self) -> dict:
        return asdict(self)


def _match(spec: SymmetrySpec, sa, sb, stage2: str):
    view_spec, (va, vb) = split_segments(spec, sa, sb)
    return match_attention(view_spec, va, vb, stage1=True, stage2=stage2)


def weight_distance(spec: SymmetrySpec, state_a: Mapping[str, Tensor], state_b: Mapping[str, Tensor]) -> Tensor:
    """``sum_t ||A_t - B_t||_F^2`` over the tensors ``spec`` acts on (float64, differentiable)."""
    return sum(((state_a[t].double() - state_b[t].double()) ** 2).sum() for t in spec.tensors)


def gl_spaces(spec: SymmetrySpec) -> list[str]:
    """The spaces of ``spec`` whose blocks are ``GL`` (descended); the others are held."""
    return [s for s, g in spec.spaces.items() if g.head_block is not None and g.head_block.block_matcher == "gl"]


def curvature(spec: SymmetrySpec, space: str, state_b: Mapping[str, Tensor]) -> float:
    """``L_s = 2 sum_t sigma_max(B_t)^2`` over the tensors ``space`` acts on (along the acted axis)."""
    total = 0.0
    for t, acts in spec.tensors.items():
        for a in acts:
            if a.space == space:
                x = torch.movedim(state_b[t].double(), a.axis, 0)
                x = x.reshape(x.shape[0], -1)
                total += float(torch.linalg.matrix_norm(x, ord=2)) ** 2
    return 2.0 * total


def descent_path(model: nn.Module, spec: SymmetrySpec, state_a: Mapping[str, Tensor], state_b: Mapping[str, Tensor],
                 batches: Sequence[Batch] | Callable[[], Iterable[Batch]], task: str = "classification",
                 points: int = 25, etas: Sequence[float] = (0.1, 0.5), checkpoints: Sequence[int] = (0, 10, 100, 1000),
                 progress: Callable[[str], None] | None = None) -> list[DescentPoint]:
    """Barrier and weight distance along plain gradient descent from the orthogonal start (module docstring).

    Args:
        model: the architecture (its own weights are not used).
        spec: the attention spec of the scope (heads, Q-K, V-O spaces).
        state_a, state_b: full state dicts.
        batches, task, points: the curves (:func:`symalign.lmc.curve`).
        etas: relative rates (``eta / L_s`` per space).
        checkpoints: step counts at which the barrier is measured.

    Returns:
        The reference points (``none``, ``orthogonal``, ``full``) then, per rate, one ``gd``
        point per checkpoint.
    """
    get = batches if callable(batches) else (lambda: batches)
    say = progress or (lambda s: None)

    def point(variant: str, eta, steps, transform: Mapping[str, Tensor]) -> DescentPoint:
        sb2 = apply(spec, transform, state_b)
        c = lmc.curve(model, state_a, sb2, get, task, points)
        return DescentPoint(variant, eta, steps, float(weight_distance(spec, state_a, sb2)), c.loss_barrier,
                            c.acc_barrier)

    out = []
    refs = {}
    for variant in ("none", "orthogonal", "full"):
        say(f"reference {variant}")
        refs[variant] = _match(spec, state_a, state_b, variant).transform
        out.append(point(variant, None, None, refs[variant]))
    descend = gl_spaces(spec)
    held = {s: v for s, v in refs["full"].items() if s not in descend}  # heads; RoPE Q-K at its plane optimum
    sb_held = apply(spec.restrict(list(held)), held, state_b)
    gl_spec = spec.restrict(descend)
    rate = {s: 1.0 / curvature(gl_spec, s, sb_held) for s in descend}
    sa = {t: state_a[t].double() for t in gl_spec.tensors}
    sbh = {t: sb_held[t].double() for t in gl_spec.tensors}
    start = None  # the step-0 point is the same for every rate
    for eta in etas:
        u = {s: refs["orthogonal"][s].double().clone().requires_grad_(True) for s in descend}
        step = 0
        for target in sorted(set(checkpoints)):
            ok = True
            while step < target:
                d = weight_distance(gl_spec, sa, apply(gl_spec, u, sbh))
                grads = torch.autograd.grad(d, list(u.values()))
                if not torch.isfinite(d) or not all(torch.isfinite(g).all() for g in grads):
                    ok = False
                    break
                with torch.no_grad():
                    for (s, p), g in zip(u.items(), grads):
                        p -= eta * rate[s] * g
                step += 1
            if not ok:
                break
            say(f"eta {eta}: {step} steps")
            if step == 0 and start is not None:
                out.append(DescentPoint("gd", eta, 0, start.distance, start.loss_barrier, start.acc_barrier))
                continue
            out.append(point("gd", eta, step, {**held, **{s: p.detach() for s, p in u.items()}}))
            start = out[-1] if step == 0 else start
    return out
