r"""Weight matching of a mixture-of-experts layer: experts and the FF units inside each, jointly and exactly.

A spec declares the ``E`` experts of a layer as a :class:`~symalign.groups.Permutation`
space ``X`` (role ``experts``) acting on axis 0 of every per-expert tensor (router rows,
stacked expert weights) and, coupled to it, one or more
:class:`~symalign.groups.BlockPermutations` spaces ``U`` (``(S_F)^E``: the units of each
expert) acting on a unit axis of the stacked tensors. The pair acts as
``W'[e] = sigma_e W[pi(e)]`` (:func:`expert_units` finds the pairs in a spec).

Given ``A`` and ``B`` with every other space already applied, the squared distance
over the tensors ``X`` and ``U`` act on splits per expert slot:

    D(pi, sigma) = const - 2 sum_e [ sum_u <F^u_A[e], sigma^u_e F^u_B[pi(e)]> + <R_A[e], R_B[pi(e)]> ]

with ``F^u[e]`` (``F x K``) expert ``e``'s unit rows of every tensor ``u`` acts on (each
segment's unit axis first, the rest flattened, concatenated over the tensors) and
``R[e]`` its rows of the tensors only ``X`` acts on (the router). For a fixed pair
``(a, b)`` the best ``sigma`` is a linear assignment on ``F^u_A[a] F^u_B[b]^T`` with value
``v_u(a, b)``; so the joint minimiser is the assignment over experts maximising
``S[a, b] = sum_u v_u(a, b) + <R_A[a], R_B[b]>``, each expert then keeping the unit
matching of its pair. :func:`match_experts` returns that exact block minimiser: ``E^2``
unit assignments of size ``F`` and one of size ``E`` (cost ``O(E^2 F^2 K)`` products plus
``E^2`` assignments ``O(F^3)``, memory ``O(F^2)`` beyond the features: instant for tiny models, heavy for
full-size ones).
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import Tensor

from symalign.errors import MatchError
from symalign.groups import BlockPermutations, Permutation, assign_max
from symalign.spec import SymmetrySpec, Transform, segment_view


def expert_units(spec: SymmetrySpec) -> dict[str, tuple[str, ...]]:
    """Expert permutation space -> its coupled :class:`BlockPermutations` unit spaces (empty if none)."""
    out = {}
    for p, blocks in spec.couplings.items():
        units = tuple(b for b in blocks if isinstance(spec.spaces.get(b), BlockPermutations))
        if units and isinstance(spec.spaces.get(p), Permutation):
            out[p] = units
    return out


def _unit_features(spec: SymmetrySpec, unit: str, state: Mapping[str, Tensor]) -> Tensor:
    """``(E, F, K)``: each expert's unit rows over the tensors ``unit`` acts on."""
    parts = []
    for t, a in spec.tensors_of(unit):
        x = state[t]
        if a.axis % x.dim() == 0:
            raise MatchError(f"space {unit!r} acts on axis 0 of {t!r}, the expert axis")
        y = x if a.segment is None else segment_view(x, a.axis, a.segment)
        y = torch.movedim(y.to(torch.float64), a.axis % x.dim(), 1)
        parts.append(y.reshape(y.shape[0], y.shape[1], -1))
    return torch.cat(parts, dim=2)


def match_experts(spec: SymmetrySpec, experts: str, units: tuple[str, ...], state_a: Mapping[str, Tensor],
                  state_b: Mapping[str, Tensor]) -> Transform:
    """The exact joint minimiser over ``experts`` and its coupled ``units`` (module docstring).

    ``state_b``: B with every other space applied to the tensors these spaces act on.
    Returns ``{experts: pi, unit: sigma (E, F), ...}``.
    """
    E = spec.spaces[experts].n
    unit_set = set(units)
    router = []  # tensors only the expert permutation (of these spaces) acts on
    for t, a in spec.tensors_of(experts):
        if a.axis % state_a[t].dim() != 0:
            raise MatchError(f"expert space {experts!r} must act on axis 0 of {t!r}")
        if not any(b.space in unit_set for b in spec.tensors[t]):
            router.append(t)
    for u in units:
        for t, _ in spec.tensors_of(u):
            if not any(b.space == experts for b in spec.tensors[t]):
                raise MatchError(f"unit space {u!r} acts on {t!r}, which its expert space {experts!r} does not permute")
    score = torch.zeros(E, E, dtype=torch.float64)
    for t in router:
        ra, rb = (st[t].to(torch.float64).reshape(E, -1) for st in (state_a, state_b))
        score += ra @ rb.T
    best: dict[str, list[list[Tensor]]] = {}
    for u in units:
        fa, fb = _unit_features(spec, u, state_a), _unit_features(spec, u, state_b)
        perms: list[list[Tensor]] = []
        for a in range(E):
            row = []
            for b in range(E):  # one (F, F) cross matrix at a time: memory O(F^2)
                cross = fa[a] @ fb[b].T
                p = assign_max(cross)
                score[a, b] += cross.gather(1, p.view(-1, 1)).sum()
                row.append(p)
            perms.append(row)
        best[u] = perms
    pi = assign_max(score)
    out: Transform = {experts: pi}
    for u in units:
        out[u] = torch.stack([best[u][e][int(pi[e])] for e in range(E)])
    return out


__all__ = ["expert_units", "match_experts"]
