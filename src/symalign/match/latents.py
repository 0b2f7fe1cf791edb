r"""The latents of learned matching: one set of float64 leaf tensors per space, around a start element.

Each space's group owns its parametrisation (:meth:`symalign.groups.Group.latent`, ``soft``,
``soft_act``, ``from_latent``; the maths is in :mod:`symalign.match.learned`'s docstring);
:class:`Latents` keeps the tensors, applies the differentiable near-elements to a state
(fused tensors by their segments) and projects to exact elements at the end.

**Soft permutations** (:class:`Relaxation`, seed 002's doubly stochastic level of the hierarchy):
with ``relax`` given, every permutation part of a space (``S_n``, head permutations, the ``P`` of
``diag(s) P``) uses, instead of the straight-through ``P + Z - sg(Z)``,

* ``"sinkhorn"``: the doubly stochastic ``P_tau = Sinkhorn(exp(Z / tau))``
  (:func:`symalign.groups.sinkhorn`) in the forward pass -- the relaxed model mixes units, so it is
  no symmetry of B; as ``tau -> 0`` ``P_tau`` tends to the Hungarian assignment of ``Z``;
* ``"sinkhorn-st"``: the hard ``P`` in the forward pass with the gradient of ``P_tau``
  (``P + P_tau - sg(P_tau)``).

``tau`` is annealed geometrically, ``tau(s) = tau_0 (tau_1 / tau_0)^(s / steps)``, a pure function of
the step (so a resumed run is the uninterrupted one). The projection at the end is unchanged: the
Hungarian assignment of ``Z`` (:meth:`Latents.project`), which is also the most probable permutation
under ``P_tau`` (``log P_tau = Z / tau + u 1^T + 1 v^T``), so the result is an exact group element.
The other spaces (orthogonal, ``GL``, RoPE planes) keep their parametrisation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch
from torch import Tensor

from symalign.errors import GroupError, MatchError
from symalign.groups import one_hot, sinkhorn
from symalign.spec import SymmetrySpec, Transform, act_on, on_segment


RELAXATIONS = ("sinkhorn", "sinkhorn-st")


@dataclass(frozen=True)
class Relaxation:
    """A soft-permutation relaxation (module docstring): ``kind``, the temperature from ``tau[0]`` at step 0 to
    ``tau[1]`` at ``steps`` (geometric), and the Sinkhorn iterations."""

    kind: str = "sinkhorn"
    tau: tuple[float, float] = (0.1, 0.01)
    steps: int = 1
    iters: int = 30

    def __post_init__(self):
        if self.kind not in RELAXATIONS:
            raise MatchError(f"unknown relaxation {self.kind!r}; use one of {', '.join(RELAXATIONS)} (or none)")
        if not (len(self.tau) == 2 and all(math.isfinite(t) and t > 0 for t in self.tau)):
            raise MatchError(f"the Sinkhorn temperatures must be two positive numbers (start, end), got {self.tau!r}")
        if self.iters < 1:
            raise MatchError(f"Sinkhorn needs at least one iteration, got {self.iters}")

    def tau_at(self, step: int) -> float:
        """``tau_0 (tau_1 / tau_0)^(p)``, ``p = min(1, step / steps)``."""
        p = min(1.0, step / max(1, self.steps))
        return float(self.tau[0] * (self.tau[1] / self.tau[0]) ** p)

    def matrix(self, step: int) -> Callable[[Tensor, Tensor], Tensor]:
        """``relax(perm, z)`` of step ``step`` (what :meth:`symalign.groups.Group.relaxed` takes)."""
        tau = self.tau_at(step)
        if self.kind == "sinkhorn":
            return lambda perm, z: sinkhorn(z / tau, self.iters)

        def st(perm: Tensor, z: Tensor) -> Tensor:
            p = sinkhorn(z / tau, self.iters)
            return one_hot(perm, z.dtype) + p - p.detach()

        return st

    def to_dict(self) -> dict:
        """What a resumed run must share (the annealing depends on ``steps`` even at a constant learning rate)."""
        return {"relax": self.kind, "tau": [float(t) for t in self.tau], "tau_steps": int(self.steps),
                "sinkhorn_iters": int(self.iters)}


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
    def soft(self, relax: Callable[[Tensor, Tensor], Tensor] | None = None) -> dict[str, object]:
        """The differentiable elements of this step (computed once per step); with ``relax``
        (:meth:`Relaxation.matrix`) the permutation parts are relaxed."""
        if relax is None:
            return {s: self.spec.spaces[s].soft(self.latent(s), self.init[s]) for s in self.spaces}
        return {s: self.spec.spaces[s].relaxed(self.latent(s), self.init[s], relax) for s in self.spaces}

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
