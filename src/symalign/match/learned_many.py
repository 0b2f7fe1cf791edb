r"""Dirichlet-sampled learned refinement of a many-model merge (seed 002's M-way learned matching).

Models ``theta_1..theta_M`` (rewritten built-in models of one config) start at their
universe-matching transforms ``T_k`` (:func:`symalign.match.universe.match_universe`:
every model aligned to the evolving reference). Model 1 keeps its transform (the
reference; this removes the common gauge ``T_k -> g T_k`` that no loss can see);
models ``2..M`` get latents ``Z_k`` over every space of the spec, exactly as in
two-model learned matching (:class:`symalign.match.learned.Latents`: Hungarian with
straight-through gradients, Newton-Schulz polar, ``U_wm (I + E)``, RoPE planes).
Each step draws ``w ~ Dirichlet(alpha 1_M)`` (``numpy.random.default_rng([seed,
step])``, so a resumed run draws the same weights) and minimises with Adam

    L( sum_k w_k T_k(Z_k) . theta_k )

on a training batch, with the learning-rate schedule and data handling of two-model
learned matching (:func:`symalign.match.learned.learn_matching`): ``batches`` may be a
stream ``batch(step)`` (a fresh batch every step) or a sequence (cycled), and the rate
decays by a cosine to 0 at ``steps`` after an optional linear warm-up
(:func:`symalign.match.learned.lr_factor`; ``schedule="constant"`` keeps it fixed).
The final transforms are the exact projections of the latents (ill-conditioned ``GL``
blocks fall back to the universe element), so every aligned model computes its own
model's function exactly.

The **merged model** is the uniform average ``mean_k T_k . theta_k``. Guarantee: its
mean loss over the training batches is at most that of the universe-matching merge
-- the refinement keeps the universe transforms when the learned ones do worse there
(``ManyLearned.selected`` says which; with a stream, "the training batches" are its
first ``select_n`` batches unless ``select_batches`` -- held-out data -- are given). The
Dirichlet objective is an average over the simplex, not the uniform merge's loss, so
without this guard it could legitimately be higher at the centre. Write the merge with
:func:`symalign.match.universe.save_merged`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import torch
from torch import Tensor, nn
from torch.func import functional_call

from symalign.errors import MatchError
from symalign.match.latents import Latents
from symalign.match.objective import Batch, LossFn, default_loss, floating, functional_state, mean_loss, restore_ties
from symalign.match.optimise import BatchSource, _Bar, _check_data, batch_source, check_recipe, compare_recipe, \
    load_resume, optimise, recipe_of, save_resume
from symalign.match.universe import UniverseMatch, check_models, mean_state, match_universe
from symalign.spec import SymmetrySpec, Transform, apply


@dataclass
class ManyLearned:
    """Per-model transforms (``aligned[k] = apply(spec, transforms[k], states[k])``), the uniform merge,
    the per-step Dirichlet losses and the merge's training loss before (universe) and after."""

    transforms: list[Transform]
    merged: dict[str, Tensor]
    spec: SymmetrySpec = field(repr=False)
    losses: list[float] = field(default_factory=list)
    start_step: int = 0
    merged_loss_init: float = math.nan
    merged_loss: float = math.nan
    selected: str = "learned"
    fallbacks: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    time_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"method": "learned-many", "models": len(self.transforms), "steps": len(self.losses),
                "start_step": self.start_step, "losses": list(self.losses),
                "merged_loss_init": self.merged_loss_init, "merged_loss": self.merged_loss,
                "selected": self.selected, "fallbacks": list(self.fallbacks), "notes": list(self.notes),
                "time_s": self.time_s}


def learn_many(models: Sequence[nn.Module], batches: BatchSource, *, steps: int = 50, lr: float = 1e-2,
               schedule: str = "cosine", warmup: int = 0, alpha: float = 0.1, init: UniverseMatch | None = None,
               rounds: int = 3, loss: LossFn | None = None, spaces: Sequence[str] | None = None,
               select_batches: Iterable[Batch] | None = None, select_n: int = 8,
               checkpoint: str | Path | None = None, save_every: int = 10,
               progress: bool = False, seed: int = 0, max_cond: float = 1e6, **match_kw) -> ManyLearned:
    """Dirichlet-sampled learned refinement of ``models`` (>= 2, one config; see the module docstring).

    Args:
        batches: **training** ``(inputs, targets)`` batches: a stream ``batch(step)`` or a
            non-empty iterable (cycled).
        steps, lr, schedule, warmup: Adam steps, peak learning rate, ``"cosine"`` or ``"constant"``,
            warm-up steps (:func:`symalign.match.learned.lr_factor`).
        alpha: Dirichlet concentration. The default 0.1 is seed 002's: most draws sit near a
            vertex or an edge of the simplex, so the objective covers the whole segment between
            models; ``alpha=1`` is uniform on the simplex (this module's default before
            2026-12; the universe-widths rows in docs/whole-model.md ran with it).
        select_batches: held-out batches on which the merge is compared with the universe merge
            (default: the training sequence, or the first ``select_n`` batches of a stream).
        init: a universe-matching result (default: ``match_universe(models, rounds=rounds, **match_kw)``).
        loss: ``loss(logits, targets)`` (default: mean cross-entropy); spaces: the spaces to learn.
        checkpoint, save_every: resume file (latents, initial transforms, Adam state, losses, recipe).

    Raises:
        MatchError: no data, an unknown schedule, fewer than two models, incompatible configs,
        a checkpoint for other models, spaces or another recipe, divergence.
    """
    t0 = time.perf_counter()
    batch_of, fixed = batch_source(batches, "learned many-model matching")
    check_recipe(schedule, warmup, steps)
    check_models(models)
    if alpha <= 0:
        raise MatchError(f"the Dirichlet concentration must be positive, got alpha={alpha}")
    loss_fn = loss or default_loss
    m_count = len(models)
    ckpt = Path(checkpoint) if checkpoint is not None else None
    saved = load_resume(ckpt)
    if saved is not None and len(saved["init"]) != m_count:
        raise MatchError(f"{ckpt} was written for {len(saved['init'])} models, not {m_count}; "
                         "delete it to start afresh")
    if init is None and saved is None:
        init = match_universe(models, rounds=rounds, **match_kw)
    spec = models[0].symmetry_spec()
    start: list[Transform] = saved["init"] if saved is not None else list(init.transforms)  # type: ignore[union-attr]
    states = [functional_state(m, spec) for m in models]
    ref = apply(spec, start[0], states[0])  # model 1: the reference, kept fixed
    lats = [Latents(spec, start[k], spaces) for k in range(1, m_count)]
    opt = torch.optim.Adam([p for lat in lats for p in lat.parameters()], lr=lr)
    recipe = recipe_of(schedule, warmup, steps, lr=float(lr), alpha=float(alpha), seed=int(seed),
                       stream=fixed is None)
    losses: list[float] = []
    first = 0
    if saved is not None:
        for k, lat in enumerate(lats):
            lat.load_state_dict(saved["latents"][k], str(ckpt))
        compare_recipe(saved.get("recipe"), recipe, str(ckpt))
        opt.load_state_dict(saved["optim"])
        losses, first = list(saved["losses"]), int(saved["step"])

    def save(step: int) -> None:
        if ckpt is not None:
            save_resume(ckpt, {"step": step, "latents": [lat.state_dict() for lat in lats], "init": start,
                                   "optim": opt.state_dict(), "losses": losses, "recipe": recipe})

    keys = set(floating(ref))
    model = models[0]
    def objective(step: int) -> Tensor:  # L(sum_k w_k T_k(Z_k) . theta_k), w ~ Dirichlet(alpha 1_M)
        w = np.random.default_rng([seed, step]).dirichlet(np.full(m_count, float(alpha)))
        aligned = [ref] + [lat.soft_apply(st) for lat, st in zip(lats, states[1:])]
        theta = {k: (sum(float(wk) * a[k] for wk, a in zip(w, aligned)) if k in keys else ref[k]) for k in ref}
        x, y = batch_of(step)
        return loss_fn(functional_call(model, theta, (x,)), y)

    optimise(objective, opt, start=first, steps=steps, lr=lr, schedule=schedule, warmup=warmup, losses=losses,
             save=save, save_every=save_every, bar=_Bar(progress, "learned merge", steps, first),
             what="learned many-model matching")
    transforms = [dict(start[0])]
    fallbacks: list[str] = []
    for k, lat in enumerate(lats, start=2):
        t, fb = lat.project(max_cond)
        transforms.append(t)
        fallbacks += [f"model {k}: {f}" for f in fb]
    merged_init = mean_state([apply(spec, t, st) for t, st in zip(start, states)])
    merged = mean_state([apply(spec, t, st) for t, st in zip(transforms, states)])
    if select_batches is not None:
        judge = _check_data(select_batches, "the selection of learned many-model matching")
    else:
        judge = fixed if fixed is not None else [batch_of(s) for s in range(max(1, select_n))]
    loss_init, loss_new = mean_loss(model, merged_init, judge, loss_fn), mean_loss(model, merged, judge, loss_fn)
    notes = [f"{m_count} models; model 1 is the reference; Dirichlet alpha={alpha}"]
    selected = "learned"
    if not loss_new <= loss_init:
        transforms, merged, loss_new, selected = [dict(t) for t in start], merged_init, loss_init, "universe"
        notes.append("the learned merge's loss on the selection batches is above the universe merge's: "
                     "kept the universe transforms")
    return ManyLearned(transforms, restore_ties(model, merged), spec, losses, first, loss_init, loss_new, selected,
                       fallbacks, notes + fallbacks, time.perf_counter() - t0)

