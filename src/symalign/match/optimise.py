r"""The optimisation loop of learned matching (two models and many): batches, schedule, resume, progress.

A step's batch, ``lambda`` and learning rate are pure functions of the step
(:func:`batch_source`, :func:`lam_at`, :func:`lr_factor`), so an interrupted run resumed from
its checkpoint (:func:`save_resume`, checked by :func:`compare_recipe`) reproduces the
uninterrupted one; :func:`optimise` runs the Adam steps.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Iterable, Union

import numpy as np
import torch
from torch import Tensor

from symalign.atomic import atomic_path
from symalign.errors import MatchError
from symalign.match.objective import Batch


def _check_data(batches, what: str) -> list[Batch]:
    data = list(batches) if batches is not None else []
    if not data:
        raise MatchError(f"{what} needs data: pass a non-empty iterable of (inputs, targets) training batches")
    return data


BatchSource = Union[Iterable[Batch], Callable[[int], Batch], None]
SCHEDULES = ("cosine", "constant")


def batch_source(batches: BatchSource, what: str) -> tuple[Callable[[int], Batch], list[Batch] | None]:
    """``(batch_of_step, fixed)``: a stream ``batch(step)`` is used as it is (``fixed`` is ``None``);
    a finite iterable is listed and cycled (``batch_of_step(s) = fixed[s mod n]``)."""
    if callable(batches):
        return batches, None
    data = _check_data(batches, what)
    return (lambda step: data[step % len(data)]), data



def lr_factor(step: int, steps: int, schedule: str = "cosine", warmup: int = 0) -> float:
    """The learning-rate multiplier of step ``step`` (0-based) of a ``steps``-step run.

    ``(step + 1) / warmup`` during the warm-up, then ``1`` (``"constant"``) or
    ``(1 + cos(pi p)) / 2`` with ``p = (step - warmup) / (steps - warmup)`` (``"cosine"``:
    1 at the end of the warm-up, decaying to 0 at ``steps``).
    """
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    p = (step - warmup) / max(1, steps - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(p, 1.0)))



def check_recipe(schedule: str, warmup: int, steps: int) -> None:
    if schedule not in SCHEDULES:
        raise MatchError(f"unknown learning-rate schedule {schedule!r}; use one of {', '.join(SCHEDULES)}")
    if warmup < 0 or steps < 0:
        raise MatchError(f"steps and warmup must be non-negative, got steps={steps}, warmup={warmup}")



def recipe_of(schedule: str, warmup: int, steps: int, **kw) -> dict:
    """What a resumed run must share with the interrupted one (``steps`` only when the schedule
    depends on it, so a constant-rate run can be extended)."""
    out = dict(kw, schedule=schedule, warmup=int(warmup))
    if schedule != "constant" or warmup:
        out["steps"] = int(steps)
    return out



def compare_recipe(saved: dict | None, recipe: dict, where: str) -> None:
    if saved is None:  # a checkpoint written before recipes were recorded
        return
    diff = {k: (saved.get(k), v) for k, v in recipe.items() if saved.get(k) != v}
    if diff:
        what = ", ".join(f"{k}: {a!r} there, {b!r} now" for k, (a, b) in diff.items())
        raise MatchError(f"{where} was written by a run with other settings ({what}); pass the same settings "
                         "to resume, or delete it to start afresh")



def save_resume(path: Path, payload: dict) -> None:
    """``torch.save`` written atomically."""
    with atomic_path(path) as tmp:
        torch.save(payload, tmp)



def load_resume(path: Path | None) -> dict | None:
    """A resume file :func:`save_resume` wrote (``None`` when there is none): tensors and plain
    containers only, read with ``weights_only=True`` -- a crafted pickle is refused in one line naming
    the file, before anything in it runs (:func:`symalign.io.statedict.load_plain`)."""
    if path is None or not path.exists():
        return None
    from symalign.io.statedict import load_plain

    saved = load_plain(path)
    if not isinstance(saved, dict) or not {"step", "latents", "init", "optim", "losses"} <= set(saved):
        raise MatchError(f"{path}: not a learned-matching resume file; delete it to start afresh")
    return saved



def lam_at(seed: int, step: int, lam: tuple[float, float]) -> float:
    """The ``lambda`` of a step: a pure function of ``(seed, step)``."""
    return float(np.random.default_rng([seed, step]).uniform(lam[0], lam[1]))



class _Bar:
    """A ``rich`` progress bar (or nothing)."""

    def __init__(self, on: bool, label: str, total: int, done: int):
        self.bar = None
        self.label = label
        if on:
            from rich.console import Console
            from rich.progress import Progress

            self.bar = Progress(console=Console(stderr=True), transient=False)  # stdout stays for results
            self.bar.start()
            self.task = self.bar.add_task(label, total=total, completed=done)

    def step(self, loss: float) -> None:
        if self.bar is not None:
            self.bar.update(self.task, advance=1, description=f"{self.label} loss {loss:.4f}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()



def optimise(objective: Callable[[int], Tensor], opt: torch.optim.Optimizer, *, start: int, steps: int, lr: float,
             schedule: str, warmup: int, losses: list[float], save: Callable[[int], None], save_every: int,
             bar: "_Bar", what: str) -> None:
    """Adam steps ``start..steps-1`` on ``objective(step)`` (a scalar loss tensor), shared by
    :func:`learn_matching` and :func:`~symalign.match.learned_many.learn_many`.

    The learning rate of step ``s`` is ``lr * lr_factor(s, steps, schedule, warmup)``; each
    loss is appended to ``losses``; ``save(step)`` runs every ``save_every`` steps and at the
    end (a resumable checkpoint). A non-finite loss raises :class:`MatchError` naming ``what``.
    """
    try:
        for step in range(start, steps):
            for group in opt.param_groups:
                group["lr"] = lr * lr_factor(step, steps, schedule, warmup)
            value = objective(step)
            if not math.isfinite(float(value.detach())):
                raise MatchError(f"{what} diverged (non-finite loss); lower the learning rate")
            opt.zero_grad()
            value.backward()
            opt.step()
            losses.append(float(value.detach()))
            bar.step(losses[-1])
            if (step + 1) % save_every == 0:
                save(step + 1)
    finally:
        bar.close()
    save(max(steps, start))
