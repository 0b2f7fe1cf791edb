r"""Learned matching (seed 002): minimise the task loss of the interpolated model.

Continuous latents ``Z_ff.i`` (``d_ff x d_ff``) and ``Z_residual`` (``D x D``) are
projected onto their groups on every forward pass:

* ``P = ProjPerm(Z)`` -- the permutation matrix maximising ``<P, Z>`` (Hungarian),
  with a straight-through gradient ``P_st = P + Z - stopgrad(Z)``;
* ``O = ProjOrth(Z) = polar(Z)`` (differentiable: Newton-Schulz in the training
  forward pass, see :func:`polar_st`; SVD for the final projection).

With ``theta_B'(Z) = T(Z) . theta_B`` (the attention elements are kept at the
weight-matching solution), each step samples ``lambda ~ U(0.4, 0.6)`` and
minimises ``L((1 - lambda) theta_A + lambda theta_B'(Z))`` on a data batch with
Adam. The latents start at the weight-matching solution (``Z = P_wm``,
``Z = O_wm``). The returned transform is the projection of the final latents, so
it is an exact symmetry whatever the optimisation did. Progress is shown with
``rich``; ``checkpoint=PATH`` saves latents, optimiser and step every
``save_every`` steps and resumes from it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import torch
from torch import Tensor, nn
from torch.func import functional_call

from symalign.errors import MatchError
from symalign.groups import Orthogonal, Permutation
from symalign.match.ff import assign
from symalign.match.residual import polar
from symalign.match.whole import WholeMatch, align_whole, distance, partition
from symalign.spec import SymmetrySpec, Transform, apply


@dataclass
class LearnedMatch(WholeMatch):
    """:class:`WholeMatch` plus the per-step interpolated losses and the resume point."""

    losses: list[float] = field(default_factory=list)
    start_step: int = 0


def proj_perm(z: Tensor) -> tuple[Tensor, Tensor]:
    """``(perm, P_st)``: the Hungarian projection and its straight-through matrix."""
    perm = assign(z.detach())
    hard = torch.zeros_like(z)
    hard[torch.arange(z.shape[0]), perm] = 1.0
    return perm, hard + z - z.detach()


def dense_apply(spec: SymmetrySpec, mats: dict[str, Tensor], state: dict[str, Tensor]) -> dict[str, Tensor]:
    """``T . state`` for dense orthogonal/permutation matrices ``T`` (differentiable; ``T^{-T} = T``)."""
    out = dict(state)
    for t, acts in spec.tensors.items():
        x = state[t]
        for a in acts:
            if a.space not in mats:
                continue
            if a.segment is not None:
                raise MatchError("learned matching does not support segmented (fused) tensors")
            axis = a.axis % x.dim()
            xd = torch.movedim(x, axis, 0)
            shape = xd.shape
            xd = (mats[a.space].to(x.dtype) @ xd.reshape(shape[0], -1)).reshape(shape)
            x = torch.movedim(xd, 0, axis)
        out[t] = x
    return out


def _default_loss(logits: Tensor, y: Tensor) -> Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def learn_matching(model_a: nn.Module, model_b: nn.Module, batches: Iterable[tuple[Tensor, Tensor]] | None, *,
                   steps: int = 50, lr: float = 1e-2, lam: tuple[float, float] = (0.4, 0.6),
                   init: WholeMatch | None = None, loss: Callable[[Tensor, Tensor], Tensor] | None = None,
                   checkpoint: str | Path | None = None, save_every: int = 10, progress: bool = False,
                   seed: int = 0) -> LearnedMatch:
    """Learned matching of two rewritten built-in models (see the module docstring).

    ``batches``: a non-empty iterable of ``(inputs, targets)``, cycled. ``init``: a
    weight-matching result (computed with :func:`align_whole` when omitted).
    Raises :class:`MatchError` without data.
    """
    t0 = time.perf_counter()
    data = list(batches) if batches is not None else []
    if not data:
        raise MatchError("learned matching needs data: pass an iterable of (inputs, targets) batches")
    loss_fn = loss or _default_loss
    if init is None:
        init = align_whole(model_a, model_b)
    spec = init.spec
    part = partition(spec)
    latent_spaces = [s for s in part.permutations + part.orthogonal]
    for s in latent_spaces:
        if not isinstance(spec.spaces[s], (Permutation, Orthogonal)):
            raise MatchError(f"space {s!r}: learned matching supports permutation and orthogonal spaces")
    sa = {k: v.detach() for k, v in model_a.state_dict().items()}
    sb = {k: v.detach() for k, v in model_b.state_dict().items()}
    fixed = {k: v for k, v in init.transform.items() if k in part.attention}
    b0 = apply(spec, fixed, sb)  # attention elements kept at the weight-matching solution
    latents: dict[str, Tensor] = {}
    for s in latent_spaces:
        g = spec.spaces[s]
        el = init.transform.get(s, g.identity())
        z = g.matrix(el) if isinstance(g, Permutation) else el.to(torch.float64)
        latents[s] = z.clone().to(torch.float64).requires_grad_(True)
    opt = torch.optim.Adam(list(latents.values()), lr=lr)
    losses: list[float] = []
    start = 0
    ckpt = Path(checkpoint) if checkpoint is not None else None
    if ckpt is not None and ckpt.exists():
        saved = torch.load(ckpt, weights_only=False)
        if set(saved["latents"]) != set(latents):
            raise MatchError(f"{ckpt} holds latents for other spaces; delete it to start afresh")
        with torch.no_grad():
            for s, z in saved["latents"].items():
                latents[s].copy_(z)
        opt.load_state_dict(saved["optim"])
        losses, start = list(saved["losses"]), int(saved["step"])
    gen = torch.Generator().manual_seed(seed + start)

    def save(step: int) -> None:
        if ckpt is None:
            return
        tmp = ckpt.with_suffix(ckpt.suffix + ".tmp")
        torch.save({"step": step, "latents": {s: z.detach() for s, z in latents.items()},
                    "optim": opt.state_dict(), "losses": losses}, tmp)
        tmp.replace(ckpt)

    keys = [k for k in sa if sa[k].is_floating_point()]
    bar = None
    if progress:
        from rich.progress import Progress

        bar = Progress(transient=False)
        bar.start()
        task = bar.add_task("learned matching", total=steps, completed=start)
    try:
        for step in range(start, steps):
            mats = {}
            for s, z in latents.items():
                mats[s] = proj_perm(z)[1] if isinstance(spec.spaces[s], Permutation) else polar_st(z)
            sbz = dense_apply(spec, mats, b0)
            lam_t = lam[0] + (lam[1] - lam[0]) * float(torch.rand((), generator=gen, dtype=torch.float64))
            theta = {k: (1 - lam_t) * sa[k] + lam_t * sbz[k] if k in keys else sa[k] for k in sa}
            x, y = data[step % len(data)]
            value = loss_fn(functional_call(model_a, theta, (x,)), y)
            opt.zero_grad()
            value.backward()
            opt.step()
            losses.append(float(value.detach()))
            if not math.isfinite(losses[-1]):
                raise MatchError("learned matching diverged (non-finite loss); lower the learning rate")
            if bar is not None:
                bar.update(task, advance=1, description=f"learned matching loss {losses[-1]:.4f}")
            if (step + 1) % save_every == 0:
                save(step + 1)
    finally:
        if bar is not None:
            bar.stop()
    save(steps)
    transform: Transform = dict(fixed)
    for s, z in latents.items():
        transform[s] = assign(z.detach()) if isinstance(spec.spaces[s], Permutation) else polar(z.detach())
    d = [distance(spec, sa, sb), distance(spec, sa, apply(spec, transform, sb))]
    return LearnedMatch(transform, spec, d, True, "learned", init.attention, time.perf_counter() - t0,
                        [f"initialised from weight matching ({init.iterations} iterations)"], losses, start)


def polar_st(z: Tensor, iters: int = 30) -> Tensor:
    """Differentiable polar factor of ``z`` by Newton-Schulz: ``X <- X (3 I - X^T X) / 2``.

    ``z`` is first scaled by its (detached) spectral norm so every singular value is in
    ``(0, 1]``, where the iteration converges to ``U V^T``. Unlike the SVD's backward,
    whose ``1 / (s_i^2 - s_j^2)`` terms are infinite at an orthogonal ``z`` (all ``s = 1``,
    exactly the weight-matching initialisation), its gradient is finite.
    """
    x = z / torch.linalg.matrix_norm(z.detach(), 2).clamp_min(1e-300)
    eye = torch.eye(z.shape[-1], dtype=z.dtype)
    for _ in range(iters):
        x = 0.5 * x @ (3 * eye - x.T @ x)
    return x
