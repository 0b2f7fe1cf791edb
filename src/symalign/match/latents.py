r"""The latents of learned matching: one set of float64 leaf tensors per space, around a start element.

Each space's group owns its parametrisation (:meth:`symalign.groups.Group.latent`, ``soft``,
``soft_act``, ``from_latent``; the maths is in :mod:`symalign.match.learned`'s docstring);
:class:`Latents` keeps the tensors, applies the differentiable near-elements to a state
(fused tensors by their segments) and projects to exact elements at the end.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import Tensor

from symalign.errors import GroupError, MatchError
from symalign.groups import assign_max, straight_through
from symalign.spec import SymmetrySpec, Transform, act_on, on_segment


def proj_perm(z: Tensor) -> tuple[Tensor, Tensor]:
    """``(perm, P_st)``: the Hungarian projection and its straight-through matrix."""
    perm = assign_max(z.detach())
    return perm, straight_through(perm, z)


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
