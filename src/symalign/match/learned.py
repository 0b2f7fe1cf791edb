r"""Learned matching (seed 002): minimise the task loss of the interpolated model over every space.

Every space of the whole-model spec gets a latent around the weight-matching element
``g_wm``; every forward pass maps the latents to (near-)group elements, and the end of
the run maps them to **exact** elements (``sg`` = stop-gradient, straight-through). Each
group implements its own parametrisation (:meth:`symalign.groups.Group.latent`, ``soft``,
``soft_act``, ``from_latent``); :class:`Latents` only keeps the tensors:

* **permutations** (``ff.i``): ``Z`` (start ``P_wm``); forward ``P + Z - sg(Z)`` with
  ``P = Hungarian(Z)``; final ``Hungarian(Z)``. ReLU units
  (:class:`~symalign.groups.PositiveMonomial`, ``T = diag(s) P``) also learn
  ``log s`` (start ``log s_wm``): ``diag(e^{log s}) P_st`` on covariant axes,
  ``diag(e^{-log s}) P_st`` on contravariant ones; the scales are positive by construction.
* **heads** (``heads.i``, ``S_h`` or ``S_kv wr S_g``): ``Z`` (``h x h``, start ``P_wm``);
  forward ``(P + Z - sg(Z)) (x) I_d`` on query-head axes, and on K/V axes the group-level
  ``P_kv + Z_kv - sg(Z_kv)`` with ``Z_kv[k, l]`` the ``(k, l)`` block sum of ``Z`` over ``g``;
  final: the GQA-aware assignment on ``Z`` (:func:`symalign.match.heads.assign_heads`).
* **orthogonal** (``residual``, ``O(D)`` or a subgroup fixing a subspace): ``R``
  (``k x k``, start ``Q^T O_wm Q``); forward ``I + Q (polar_NS(R) - I) Q^T`` (Newton-Schulz,
  :func:`polar_st`); final ``I + Q (polar(R) - I) Q^T``.
* **``GL(d)`` per block** (``qk.i`` without RoPE, ``vo.i``): ``E`` (start 0);
  ``U = U_wm (I + E)`` in both passes.
* **``H(r) (+) GL(d - r)`` per block** (``qk.i`` under RoPE, partial rotary): per plane
  ``(s_j, phi_j)`` and ``E_rest`` (start 0); ``U = U_wm M`` where plane ``j`` of ``M`` is
  the complex scalar ``e^{s_j + i phi_j}`` and the unrotated block is ``I + E_rest``.

``Q`` is ``I`` for ``O(D)`` and the free basis of a subgroup fixing a subspace
(:class:`symalign.groups.FixingOrthogonal`: a sinusoidal table, or ``1``).
``U_wm M`` is in ``H`` because ``H`` is a group, and ``e^{s + i phi} != 0``, so the RoPE
elements are exact by construction. A ``GL``/``H`` block whose final ``U`` is not finite
or has ``cond(U) > max_cond`` falls back to ``U_wm`` (recorded in
``LearnedMatch.fallbacks``). The per-block elements stay attached to head *positions*:
when a head permutation changes during training, the blocks keep their positions. The projections are exact group
elements, so the returned transform is an exact symmetry whatever the optimisation did.

**Recipe** (the defaults; measured on the F-MNIST ViT ``full`` pairs, ``docs/whole-model.md``
section 6). Step ``s`` samples ``lambda ~ U(0.2, 0.8)`` (from ``numpy.random.default_rng([seed,
s])``, so a resumed run draws the same values) and takes one Adam step (``lr = 1e-2``,
``betas = (0.9, 0.999)``) on ``L((1 - lambda) theta_A + lambda T(Z) . theta_B)`` for one
training batch, with the learning rate ``lr * f(s)``: linear warm-up over ``warmup`` steps
(default none), then cosine decay ``f = (1 + cos(pi p)) / 2``, ``p = (s - warmup) / (steps -
warmup)``, to 0 at ``steps`` (default 6000). Why each part:

* **a fresh batch every step**: ``batches`` may be a *stream*, a callable ``batch(step)``
  (e.g. :class:`symalign.experiments.methods.TrainStream`, consecutive slices of per-epoch
  permutations of the training split); a sequence is cycled. Cycling 40 fixed batches
  stops helping after a few hundred steps (600 steps: the test barrier rose from 0.073 to
  0.083 while the training objective fell);
* **cosine decay**: at a constant rate the latents keep jittering (the validation barrier
  oscillated by +-0.01 between evaluations, and FF permutations kept flipping);
  the decay lets the continuous latents settle, and the final projection is then within
  noise of the run's best validation point (checked every 100 steps), so no snapshot is selected;
* **lambda in [0.2, 0.8]**, not seed 002's ``[0.4, 0.6]``: the barrier is a supremum over
  ``t in [0, 1]``, and with ``[0.4, 0.6]`` the curve's peak moved outside the trained range
  (to ``t ~ 0.65``, test barrier 0.042 vs 0.037 with ``[0.2, 0.8]`` at 1000 steps); ``[0, 1]``
  wastes steps on the ends, where the loss cannot change (0.049);
* **many steps**: the test barrier falls roughly linearly in ``log(steps)`` (sinusoidal pair: 200
  steps 0.071, 1000: 0.037, 3000: 0.024, 6000: 0.015; RoPE pair 3000: 0.023, 6000: 0.013),
  with no sign of overfitting on held-out training and validation batches.

The **objective** reported and compared is ``J(T) = mean_{lambda, batches} L(...)``
over ``eval_points`` evenly spaced ``lambda`` in the ``lambda`` range on the
``select_batches`` (held-out data such as the validation split; default: the training
sequence, or the stream's first ``select_n`` batches). The result is the learned
transform if ``J`` is at most ``J(g_wm)``, else the weight-matching one
(``LearnedMatch.selected`` says which): learned matching never returns a transform
worse than its initialisation on those batches.

Progress is shown with ``rich``; ``checkpoint=PATH`` saves latents, the initial
transform, optimiser state, losses and the recipe every ``save_every`` steps (atomically)
and resumes from them: the batch, ``lambda`` and learning rate of a step are pure functions of
the step, so an interrupted and resumed run reproduces the uninterrupted one. Resuming with
another recipe (learning rate, schedule, ``lambda`` range, seed, and ``steps`` when the
schedule depends on it) raises :class:`~symalign.errors.MatchError`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence, Union

import numpy as np
import torch
from torch import Tensor, nn
from torch.func import functional_call

from symalign.atomic import atomic_path
from symalign.errors import GroupError, MatchError
from symalign.groups import one_hot, polar_st, straight_through  # noqa: F401  (re-exported)
from symalign.match.ff import assign
from symalign.match.distance import distance
from symalign.match.whole import WholeMatch, align_whole
from symalign.spec import SymmetrySpec, Transform, act_on, apply, on_segment

Batch = tuple[Tensor, Tensor]
LossFn = Callable[[Tensor, Tensor], Tensor]


@dataclass
class LearnedMatch(WholeMatch):
    """:class:`WholeMatch` plus the per-step interpolated losses, the resume point, the objective
    ``J`` of the weight-matching start and of the result, which of the two was kept, and fallbacks."""

    losses: list[float] = field(default_factory=list)
    start_step: int = 0
    objective_init: float | None = None
    objective: float | None = None
    selected: str = "learned"
    fallbacks: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = super().to_dict()
        d.update(steps=len(self.losses), start_step=self.start_step, losses=list(self.losses),
                 objective_init=self.objective_init, objective=self.objective, selected=self.selected,
                 fallbacks=list(self.fallbacks))
        return d


# ----------------------------------------------------------------------------
# projections
# ----------------------------------------------------------------------------


def proj_perm(z: Tensor) -> tuple[Tensor, Tensor]:
    """``(perm, P_st)``: the Hungarian projection and its straight-through matrix."""
    perm = assign(z.detach())
    return perm, straight_through(perm, z)


# ----------------------------------------------------------------------------
# latents of every space
# ----------------------------------------------------------------------------


class Latents:
    """Learnable latents for ``spaces`` of ``spec`` around ``init`` (see the module docstring).

    Each space's group owns its parametrisation (:meth:`~symalign.groups.Group.latent`,
    :meth:`~symalign.groups.Group.soft`, :meth:`~symalign.groups.Group.soft_act`,
    :meth:`~symalign.groups.Group.from_latent`); this class only keeps the tensors. The other
    spaces stay at their ``init`` element. ``params`` maps a latent name (``space`` or
    ``space:part``) to its float64 leaf tensor.
    """

    def __init__(self, spec: SymmetrySpec, init: Mapping[str, Tensor], spaces: Sequence[str] | None = None):
        self.spec = spec
        self.init: Transform = {k: v for k, v in init.items() if k in spec.spaces}
        self.spaces = list(spec.spaces if spaces is None else spaces)
        self.params: dict[str, Tensor] = {}
        self.parts: dict[str, list[str]] = {}
        for s in self.spaces:
            if s not in spec.spaces:
                raise MatchError(f"space {s!r} is not declared by the spec")
            g = spec.spaces[s]
            el = self.init.get(s, g.identity())
            try:
                latent = g.latent(el)
            except GroupError:
                raise MatchError(f"space {s!r} ({g.describe()}) is not supported by learned matching") from None
            self.parts[s] = list(latent)
            self.params.update({s + k: v for k, v in latent.items()})
            self.init[s] = el
        for p in self.params.values():
            p.requires_grad_(True)

    def parameters(self) -> list[Tensor]:
        return list(self.params.values())

    def latent(self, s: str, detach: bool = False) -> dict[str, Tensor]:
        """Space ``s``'s latent tensors by suffix (as its group's methods take them)."""
        return {k: (self.params[s + k].detach() if detach else self.params[s + k]) for k in self.parts[s]}

    # -- training forward -----------------------------------------------------
    def soft(self) -> dict[str, object]:
        """The differentiable elements of this step (computed once per step)."""
        return {s: self.spec.spaces[s].soft(self.latent(s), self.init[s]) for s in self.spaces}

    def soft_apply(self, state: Mapping[str, Tensor], soft: dict[str, object] | None = None) -> dict[str, Tensor]:
        """``T(Z) . state`` (differentiable in the latents; fixed spaces act exactly, in spec order; an
        action with a segment acts on that slice of a fused tensor only)."""
        soft = self.soft() if soft is None else soft
        out = dict(state)
        for t, acts in self.spec.tensors.items():
            x = state[t]
            for a in acts:
                g = self.spec.spaces[a.space]
                if a.space in soft:
                    x = on_segment(x, a, lambda y, axis, a=a, g=g: g.soft_act(soft[a.space], y, axis, a.variance,
                                                                                a.rep))
                elif a.space in self.init:
                    x = act_on(g, self.init[a.space], x, a)
            out[t] = x
        return out

    # -- exact projection -----------------------------------------------------
    def project(self, max_cond: float = 1e6) -> tuple[Transform, list[str]]:
        """The exact group elements of the current latents, and the per-block fallbacks."""
        out: Transform = dict(self.init)
        fallbacks: list[str] = []
        for s in self.spaces:
            g = self.spec.spaces[s]
            out[s], bad = g.from_latent(self.latent(s, detach=True), self.init[s], max_cond)
            for i, cond in bad:
                fallbacks.append(f"{s} block {i}: cond {cond:.3g} > {max_cond:g}; kept the weight-matching element")
            if not g.contains(out[s]):
                raise MatchError(f"learned matching produced an element outside {g.describe()} for {s!r}; "
                                 "this is a bug")
        return out, fallbacks

    def state_dict(self) -> dict[str, Tensor]:
        return {k: v.detach().clone() for k, v in self.params.items()}

    def load_state_dict(self, saved: Mapping[str, Tensor], where: str = "checkpoint") -> None:
        if set(saved) != set(self.params):
            raise MatchError(f"{where} holds latents for other spaces; delete it to start afresh")
        with torch.no_grad():
            for k, v in saved.items():
                self.params[k].copy_(v)


# ----------------------------------------------------------------------------
# objective and the training loop
# ----------------------------------------------------------------------------


def default_loss(logits: Tensor, y: Tensor) -> Tensor:
    """Mean cross-entropy (classification ``(B, C)``/``(B,)`` or LM ``(B, T, V)``/``(B, T)``)."""
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def tied_names(model: nn.Module) -> list[list[str]]:
    """The groups of parameter names that share one parameter (e.g. ``[tok_emb.weight, head.weight]``)."""
    names_of: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    return [names for names in names_of.values() if len(names) > 1]


def functional_state(model: nn.Module, spec: SymmetrySpec) -> dict[str, Tensor]:
    """The model's ``state_dict`` (detached) with each tied parameter once, as ``functional_call``
    needs it (it refuses two values for tied names, e.g. a head tied to the token embedding): of
    the names sharing one parameter, the one the spec labels is kept (else the first)."""
    state = {k: v.detach() for k, v in model.state_dict().items()}
    labelled = set(spec.tensors)
    for names in tied_names(model):
        keep = next((n for n in names if n in labelled), names[0])
        for n in names:
            if n != keep:
                state.pop(n, None)
    return state


def restore_ties(model: nn.Module, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``state`` with the tied names :func:`functional_state` dropped filled in again (same tensor),
    so that it loads with ``model.load_state_dict``."""
    out = dict(state)
    for names in tied_names(model):
        present = next((n for n in names if n in out), None)
        if present is not None:
            for n in names:
                out.setdefault(n, out[present])
    return out


def floating(state: Mapping[str, Tensor]) -> list[str]:
    return [k for k, v in state.items() if v.is_floating_point()]


def mix_states(states: Sequence[Mapping[str, Tensor]], weights: Sequence[float]) -> dict[str, Tensor]:
    """``sum_k w_k theta_k`` over floating tensors (others from the first state); differentiable."""
    out = {}
    for k, v in states[0].items():
        out[k] = sum(w * s[k] for w, s in zip(weights, states)) if v.is_floating_point() else v
    return out


@torch.no_grad()
def mean_loss(model: nn.Module, state: Mapping[str, Tensor], data: Sequence[Batch], loss: LossFn) -> float:
    """Mean over ``data`` of ``loss(model_state(x), y)``."""
    return float(sum(float(loss(functional_call(model, dict(state), (x,)), y)) for x, y in data) / len(data))


LAM = (0.2, 0.8)  # the default lambda range (module docstring: why not seed 002's (0.4, 0.6))


def interpolated_objective(model: nn.Module, state_a: Mapping[str, Tensor], state_b: Mapping[str, Tensor],
                           data: Sequence[Batch], loss: LossFn | None = None, lam: tuple[float, float] = LAM,
                           points: int = 5) -> float:
    """``J = mean_{lambda, batches} L((1 - lambda) A + lambda B)`` on ``points`` evenly spaced ``lambda``."""
    loss = loss or default_loss
    lams = np.linspace(lam[0], lam[1], points) if points > 1 else [0.5 * (lam[0] + lam[1])]
    return float(np.mean([mean_loss(model, mix_states([state_a, state_b], [1 - t, t]), data, loss) for t in lams]))


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


def save_checkpoint(path: Path, payload: dict) -> None:
    """``torch.save`` written atomically."""
    with atomic_path(path) as tmp:
        torch.save(payload, tmp)


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


def learn_matching(model_a: nn.Module, model_b: nn.Module, batches: BatchSource, *,
                   steps: int = 6000, lr: float = 1e-2, lam: tuple[float, float] = LAM,
                   schedule: str = "cosine", warmup: int = 0, betas: tuple[float, float] = (0.9, 0.999),
                   init: WholeMatch | None = None, loss: LossFn | None = None, spaces: Sequence[str] | None = None,
                   select_batches: Iterable[Batch] | None = None, select_n: int = 8,
                   checkpoint: str | Path | None = None, save_every: int = 10, progress: bool = False,
                   seed: int = 0, max_cond: float = 1e6, eval_points: int = 5) -> LearnedMatch:
    """Learned matching of two rewritten built-in models over every space (see the module docstring).

    Args:
        batches: **training** ``(inputs, targets)`` batches: a stream ``batch(step)`` (a fresh
            batch every step, the recommended use) or a non-empty iterable (cycled).
        steps, lr, schedule, warmup, betas: Adam steps, peak learning rate, ``"cosine"`` (decay
            to 0 at ``steps``) or ``"constant"``, linear warm-up steps, Adam's betas.
        lam: the ``lambda`` range.
        init: a weight-matching result (default: :func:`align_whole`); its elements start the latents.
        loss: ``loss(logits, targets)`` (default: mean cross-entropy).
        spaces: the spaces to learn (default: every space of the spec); the others keep ``init``.
        select_batches: held-out batches (e.g. the validation split) on which the objective ``J``
            chooses between the learned and the weight-matching transform; default: the
            training sequence, or the first ``select_n`` batches of a stream.
        checkpoint, save_every: resume file (latents, initial transform, Adam state, losses, recipe).
        max_cond: conditioning guard for the ``GL``/``H`` blocks.
        eval_points: ``lambda`` points of the objective ``J``.

    Raises:
        MatchError: no data, an unknown schedule, unsupported spaces, a checkpoint for other
        spaces or another recipe, divergence.
    """
    t0 = time.perf_counter()
    batch_of, fixed = batch_source(batches, "learned matching")
    check_recipe(schedule, warmup, steps)
    loss_fn = loss or default_loss
    ckpt = Path(checkpoint) if checkpoint is not None else None
    saved = torch.load(ckpt, weights_only=False) if ckpt is not None and ckpt.exists() else None
    if init is None and saved is None:
        init = align_whole(model_a, model_b)
    spec = init.spec if init is not None else model_a.symmetry_spec()
    start_transform = saved["init"] if saved is not None else init.transform  # type: ignore[union-attr]
    sa, sb = functional_state(model_a, spec), functional_state(model_b, spec)
    lat = Latents(spec, start_transform, spaces)
    opt = torch.optim.Adam(lat.parameters(), lr=lr, betas=tuple(betas))
    recipe = recipe_of(schedule, warmup, steps, lr=float(lr), lam=[float(lam[0]), float(lam[1])],
                       betas=[float(b) for b in betas], seed=int(seed), stream=fixed is None)
    losses: list[float] = []
    start = 0
    if saved is not None:
        lat.load_state_dict(saved["latents"], str(ckpt))
        compare_recipe(saved.get("recipe"), recipe, str(ckpt))
        opt.load_state_dict(saved["optim"])
        losses, start = list(saved["losses"]), int(saved["step"])

    def save(step: int) -> None:
        if ckpt is not None:
            save_checkpoint(ckpt, {"step": step, "latents": lat.state_dict(), "init": start_transform,
                                   "optim": opt.state_dict(), "losses": losses, "recipe": recipe})

    keys = floating(sa)
    def objective(step: int) -> Tensor:  # L((1 - t) theta_A + t T(Z) . theta_B), t ~ U(lam)
        sbz = lat.soft_apply(sb)
        t = lam_at(seed, step, lam)
        theta = {k: (1 - t) * sa[k] + t * sbz[k] if k in keys else sa[k] for k in sa}
        x, y = batch_of(step)
        return loss_fn(functional_call(model_a, theta, (x,)), y)

    optimise(objective, opt, start=start, steps=steps, lr=lr, schedule=schedule, warmup=warmup, losses=losses,
             save=save, save_every=save_every, bar=_Bar(progress, "learned matching", steps, start),
             what="learned matching")
    transform, fallbacks = lat.project(max_cond)
    if select_batches is not None:
        judge = _check_data(select_batches, "the selection of learned matching")
    else:
        judge = fixed if fixed is not None else [batch_of(s) for s in range(max(1, select_n))]
    j_init = interpolated_objective(model_a, sa, apply(spec, start_transform, sb), judge, loss_fn, lam, eval_points)
    j = interpolated_objective(model_a, sa, apply(spec, transform, sb), judge, loss_fn, lam, eval_points)
    selected = "learned"
    notes = [f"initialised from weight matching; learned spaces: {len(lat.spaces)} of {len(spec.spaces)}; "
             f"{'a fresh batch every step' if fixed is None else f'{len(fixed)} batches cycled'}, {schedule} "
             f"learning rate {lr:g}, lambda ~ U({lam[0]:g}, {lam[1]:g})"]
    where = "the held-out selection batches" if select_batches is not None else "the training batches"
    if not j <= j_init:
        transform, selected = dict(start_transform), "weight"
        notes.append(f"the learned objective {j:.6g} is above weight matching's {j_init:.6g} on {where}: "
                     "kept the weight-matching transform")
        j = j_init
    d = [distance(spec, sa, sb), distance(spec, sa, apply(spec, transform, sb))]
    return LearnedMatch(transform, spec, d, True, "learned", init.attention if init is not None else None,
                        time.perf_counter() - t0, notes + fallbacks, losses, start, j_init, j, selected, fallbacks)
