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
``(a, b)`` the best ``sigma`` is a linear assignment on ``C^u_ab = F^u_A[a] F^u_B[b]^T``
with value ``v_u(a, b)``; so the joint minimiser is the assignment over experts
maximising ``S[a, b] = sum_u v_u(a, b) + <R_A[a], R_B[b]>``, each expert then keeping the
unit matching of its pair.

**Exact, with about ``E`` unit assignments instead of ``E^2``** (``method="exact"``, the
default): branch and bound on upper bounds of the pair values ``v(a, b)``.

* Product-free screen (where :func:`use_gram_screen`: ``2F <= K`` and cheap):
  ``v(a, b) = <P, C_ab> <= ||P||_F ||C_ab||_F = sqrt(F) ||C_ab||_F`` (Cauchy-Schwarz) and
  ``||C_ab||_F^2 = <G_A[a], G_B[b]>``, ``G[e] = F[e]^T F[e]`` the ``K x K`` Gram of expert
  ``e``'s unit set (:func:`_gram_bounds`).
* Otherwise, from each pair's product, a feasible dual of its assignment
  (:func:`dual_bound`): ``u_i + w_j >= C_ij`` gives ``v(a, b) <= sum_i u_i + sum_j w_j``.

Each bound carries a rigorous margin for the rounding of the products and sums. With
``M[a, b]`` the bound plus the router term, repeat: solve the ``E x E`` assignment on
``M``; for each of its pairs still holding a bound, solve the pair's unit assignment and
write its exact value into ``M``. When every pair of the assignment is exact it is
optimal for ``S`` (``M >= S`` everywhere and ``M = S`` on it), so the result is the
all-pairs one whenever that optimum is unique (a tie can only pick another optimum of
equal value); a pair's product is formed exactly as the all-pairs reference forms it,
so its unit assignment is the same too. Cost: the Gram screen ``2 E F K^2`` or the ``E^2``
products ``E^2 F^2 K`` (the floor of any method that looks at every pair's product) with
``O(F^2)`` per dual bound, then one product and assignment per pair that reaches an
assignment on ``M`` (``E`` when the experts differ, as with a planted or nearly aligned
pair; up to ``E^2`` when all experts look alike, as between independent random layers).
``method="all-pairs"`` is the reference: ``E^2`` assignments.

**Approximate** (``method="paired"``, opt-in): the expert pairing is the assignment on a
permutation-invariant lower bound of ``S`` that needs no ``F x F`` product,
``L[a, b] = <R_A[a], R_B[b]> + F sum_u <mean_i F^u_A[a]_i, mean_j F^u_B[b]_j>`` (the mean of
``<F_A[a], sigma F_B[b]>`` over all ``sigma``: at most ``v``); then the ``E`` products and
assignments of the chosen pairs. It recovers a planted element but is not the joint
optimum in general; ``benchmarks/bench_experts.py`` measures how often and by how much
it differs.

Memory: no copy of the layer. Each expert's ``F[e]`` (``F x K``) is formed in float64 from the
state (any float dtype) when a product needs it (:class:`_Features`: one expert of each side at a
time), never the ``(E, F, K)`` features of a side; then one ``F x F`` product at a time plus the
products kept between a pair's bound and its assignment (at most :data:`CACHE_BYTES`), and
``CHUNK_BYTES`` of Gram rows. For a Mixtral-8x7B layer (``F = 14336``, ``K = 3 x 4096``) that is
two experts' ``F x K`` (1.4 GB each) and a 1.6 GB product, where the float64 features of both
sides were 22.5 GB.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal, Mapping

import torch
from torch import Tensor

from symalign.errors import MatchError
from symalign.groups import assign_max
from symalign.spec import SymmetrySpec, Transform, segment_view

Method = Literal["exact", "all-pairs", "paired"]
METHODS: tuple[str, ...] = ("exact", "all-pairs", "paired")
CHUNK_BYTES = 1 << 28  # Gram rows formed together (bytes)
CACHE_BYTES = 1 << 29  # products kept between a pair's bound and its assignment (bytes)
DUAL_ROUNDS = 1  # rounds of dual_bound after the row maxima (a second never tightened it in measurements)


@dataclass
class ExpertStats:
    """What one :func:`match_experts` call did: pairs whose product was formed, unit assignments
    solved, ``E x E`` assignments solved, and seconds in the products (incl. bounds) and the
    unit assignments."""

    products: int = 0
    unit_assignments: int = 0
    expert_assignments: int = 0
    time_products_s: float = 0.0
    time_assignments_s: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)


def expert_units(spec: SymmetrySpec) -> dict[str, tuple[str, ...]]:
    """Expert permutation space -> its coupled :class:`BlockPermutations` unit spaces (empty if none)."""
    out = {}
    for p, blocks in spec.couplings.items():
        units = tuple(b for b in blocks if b in spec.spaces and spec.spaces[b].permutes_within_blocks)
        experts = spec.spaces.get(p)  # S_E (or positive monomials: an int64 permutation is an element of either)
        if units and experts is not None and (experts.is_permutation or experts.scales_units):
            out[p] = units
    return out


class _Features:
    """Each expert's unit rows over the tensors a unit space acts on: ``F[e]`` (``F x K``, float64), each
    tensor's (segment's) unit axis first and the rest flattened, concatenated over the tensors in declaration
    order -- formed for one expert at a time when asked (:meth:`expert`), from views of the state in its own
    dtype. The ``(E, F, K)`` float64 array of all experts is never formed: for a Mixtral-8x7B layer it is
    11 GB a side, where one expert's ``F[e]`` is 1.4 GB."""

    def __init__(self, spec: SymmetrySpec, unit: str, state: Mapping[str, Tensor]):
        self.parts: list[Tensor] = []  # (E, F, ...) views: the expert axis, then the unit axis
        for t, a in spec.tensors_of(unit):
            x = state[t]
            if a.axis % x.dim() == 0:
                raise MatchError(f"space {unit!r} acts on axis 0 of {t!r}, the expert axis")
            y = x if a.segment is None else segment_view(x, a.axis, a.segment)
            self.parts.append(torch.movedim(y, a.axis % x.dim(), 1))
        E, F = self.parts[0].shape[:2]
        self.shape = (int(E), int(F), sum(y[0, 0].numel() for y in self.parts))
        self._last: tuple[int, Tensor] | None = None

    def expert(self, e: int) -> Tensor:
        """``F[e]`` (``F x K``, float64, contiguous); the last one asked is kept (loops over pairs ask the
        same expert of one side many times in a row)."""
        if self._last is None or self._last[0] != e:
            self._last = None
            _, F, K = self.shape
            out = torch.empty(F, K, dtype=torch.float64, device=self.parts[0].device)
            k = 0
            for y in self.parts:  # converted and laid out in one copy per part
                w = y[0, 0].numel()
                out[:, k:k + w].copy_(y[e].reshape(F, w))
                k += w
            self._last = (e, out)
        return self._last[1]

    def row_norms(self) -> Tensor:
        """``(E, F)``: ``||F[e]_i||``."""
        return torch.stack([self.expert(e).norm(dim=1) for e in range(self.shape[0])])

    def sq_norms(self) -> Tensor:
        """``(E,)``: ``||F[e]||_F^2``."""
        return torch.stack([self.expert(e).square().sum() for e in range(self.shape[0])])

    def means(self) -> Tensor:
        """``(E, K)``: the mean unit row of each expert."""
        return torch.stack([self.expert(e).mean(0) for e in range(self.shape[0])])


def dual_bound(c: Tensor, rounds: int = DUAL_ROUNDS, chunk_rows: int = 1024) -> Tensor:
    r"""Upper bounds on ``max_sigma sum_i c[..., i, sigma(i)]`` for a batch of square ``c`` (``(..., n, n)``).

    Weak duality of the assignment: any ``u, w`` with ``u_i + w_j >= c_ij`` for all
    ``i, j`` gives ``sum_i u_i + sum_j w_j >= sum_i c_{i sigma(i)}`` for every ``sigma``.
    Start at ``u_i = max_j c_ij``, ``w = 0`` (the row-maximum bound), then ``rounds``
    times ``w_j = max_i (c_ij - u_i)`` and ``u_i = max_j (c_ij - w_j)``: each is the
    exact minimiser of the dual over one block given the other, so the bound only
    tightens and stays feasible. Rows are processed ``chunk_rows`` at a time (no
    ``n x n`` temporary). Returns ``(...)`` (float64 sums; add a rounding margin for a
    rigorous bound, as :func:`match_experts` does).
    """
    n = c.shape[-2]
    chunks = [slice(i, min(n, i + chunk_rows)) for i in range(0, n, chunk_rows)]
    u = torch.cat([c[..., s, :].amax(-1) for s in chunks], dim=-1)
    w = torch.zeros(c.shape[:-2] + c.shape[-1:], dtype=c.dtype, device=c.device)
    for _ in range(rounds):
        w = torch.stack([(c[..., s, :] - u[..., s, None]).amax(-2) for s in chunks]).amax(0)
        u = torch.cat([(c[..., s, :] - w[..., None, :]).amax(-1) for s in chunks], dim=-1)
    return u.sum(-1) + w.sum(-1)


def _block(spec: SymmetrySpec, experts: str, units: tuple[str, ...], state_a, state_b):
    """Check the declaration; return the router score ``<R_A[a], R_B[b]>`` and each unit space's features."""
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
    score = torch.zeros(E, E, dtype=torch.float64, device=state_a[spec.tensors_of(experts)[0][0]].device)
    for t in router:
        ra, rb = (st[t].to(torch.float64).reshape(E, -1) for st in (state_a, state_b))
        score += ra @ rb.T
    feats = [(_Features(spec, u, state_a), _Features(spec, u, state_b)) for u in units]
    return score, feats


class _Products:
    """The cross products ``C_ab = F_A[a] F_B[b]^T`` of one unit space, formed as the all-pairs reference forms
    them (so a unit assignment sees the same numbers), kept between a pair's bound and its assignment while
    they fit in ``budget`` bytes (else formed again: at most one extra product per assigned pair)."""

    def __init__(self, fa: _Features, fb: _Features, stats: ExpertStats, budget: int = CACHE_BYTES):
        self.fa, self.fb, self.stats, self.budget = fa, fb, stats, budget
        self.kept: dict[tuple[int, int], Tensor] = {}
        E, F, K = fa.shape
        eps = torch.finfo(torch.float64).eps
        # |fl(C_ij) - C_ij| <= K eps |x_i| |y_j| (dot products), and the dual's subtractions and sums add
        # O(F eps) relative: margin = 2 (K + F + 4) eps sum_i |x_i| max_j |y_j| covers both.
        self.margin = 2 * (K + F + 4) * eps * fa.row_norms().sum(1)[:, None] * fb.row_norms().amax(1)[None, :]

    def cross(self, a: int, b: int, keep: bool = False) -> Tensor:
        c = self.kept.pop((a, b), None)
        if c is None:
            t0 = time.perf_counter()
            c = self.fa.expert(a) @ self.fb.expert(b).T
            self.stats.products += 1
            self.stats.time_products_s += time.perf_counter() - t0
        if keep and c.numel() * c.element_size() * (len(self.kept) + 1) <= self.budget:
            self.kept[a, b] = c
        return c

    def bound(self, a: int, b: int, keep: bool = False) -> Tensor:
        """A rigorous upper bound on the pair's assignment value (:func:`dual_bound` plus the margin)."""
        c = self.cross(a, b, keep)
        t0 = time.perf_counter()
        out = dual_bound(c) + self.margin[a, b]
        self.stats.time_products_s += time.perf_counter() - t0
        return out

    def assign(self, a: int, b: int) -> tuple[Tensor, Tensor]:
        """The pair's unit assignment and its value."""
        c = self.cross(a, b)
        t0 = time.perf_counter()
        p = assign_max(c)
        self.stats.time_assignments_s += time.perf_counter() - t0
        self.stats.unit_assignments += 1
        return p, c.gather(1, p.view(-1, 1)).sum()


def _all_pairs(score: Tensor, feats, stats: ExpertStats):
    E = score.shape[0]
    best = []
    for fa, fb in feats:
        prod = _Products(fa, fb, stats)
        perms = {}
        for a in range(E):
            for b in range(E):  # one (F, F) cross matrix at a time: memory O(F^2)
                perms[a, b], val = prod.assign(a, b)
                score[a, b] += val
        best.append(perms)
    stats.expert_assignments += 1
    return assign_max(score), best


def _gram_bounds(fa: _Features, fb: _Features) -> Tensor:
    r"""``(E, E)``: ``sqrt(F) ||F_A[a] F_B[b]^T||_F`` plus a rounding margin, an upper bound on each pair's
    unit-assignment value that needs no ``F x F`` product.

    ``v(a, b) = <P, C_ab> <= ||P||_F ||C_ab||_F = sqrt(F) ||C_ab||_F`` (Cauchy-Schwarz, ``P`` a permutation
    matrix), and ``||X Y^T||_F^2 = <X^T X, Y^T Y>``: the ``K x K`` Grams of the unit sets, formed
    ``chunk`` rows at a time, each expert's ``F[e]`` formed again for each chunk (memory ``O(E chunk K)``
    and one expert's ``F x K``; cost ``2 E F K^2 + E^2 K^2``).
    """
    E, F, K = fa.shape
    chunk = max(1, CHUNK_BYTES // (2 * E * K * 8))
    sq = torch.zeros(E, E, dtype=torch.float64, device=fa.parts[0].device)
    for r0 in range(0, K, chunk):
        r = slice(r0, min(K, r0 + chunk))
        ga, gb = (_gram_rows(x, r) for x in (fa, fb))  # rows r of each Gram, (E, |r| K)
        sq += ga @ gb.T
        del ga, gb
    eps = torch.finfo(torch.float64).eps
    na, nb = fa.sq_norms(), fb.sq_norms()  # ||X||_F^2 ||Y||_F^2 >= |<G_X, G_Y>| terms
    err = 4 * (F + K + 4) * eps * na[:, None] * nb[None, :]
    return F ** 0.5 * (sq.clamp_min(0) + err).sqrt()


def _gram_rows(x: _Features, r: slice) -> Tensor:
    """``(E, |r| K)``: rows ``r`` of each expert's Gram ``F[e]^T F[e]``, flattened."""
    E, _, K = x.shape
    out = torch.empty(E, (r.stop - r.start) * K, dtype=torch.float64, device=x.parts[0].device)
    for e in range(E):
        xe = x.expert(e)
        out[e] = (xe[:, r].T @ xe).reshape(-1)
    return out


def use_gram_screen(E: int, F: int, K: int) -> bool:
    """Whether :func:`match_experts` screens pairs by :func:`_gram_bounds` first: only where it can prune and
    costs at most half the ``E^2`` products (``2 E F K^2 <= E^2 F^2 K / 2``). For unit rows of similar
    size, a matched pair's value is ``~ F K s^2`` and an unrelated pair's bound ``~ F K s^2 sqrt(F / K)``
    times ``sqrt(1 + noise^2)`` for B = permuted A plus relative noise: ``2 F <= K`` keeps the screen
    useful up to noise as large as the weights (measured: ``benchmarks/bench_experts.py``)."""
    return 2 * F <= K and 4 * K <= E * F


def _exact(score: Tensor, feats, stats: ExpertStats):
    E = score.shape[0]
    prods = [_Products(fa, fb, stats) for fa, fb in feats]
    F, K = feats[0][0].shape[1], sum(fa.shape[2] for fa, _ in feats)
    gram = use_gram_screen(E, F, K) and len({fa.shape[1] for fa, _ in feats}) == 1
    if gram:  # product-free bounds; a pair reaching an assignment gets its product and its unit assignment
        # (here F < K: the product, F^2 K, costs more than the assignment, so no dual bound in between)
        t0 = time.perf_counter()
        m = score + sum(_gram_bounds(fa, fb) for fa, fb in feats)
        stats.extra["time_gram_s"] = time.perf_counter() - t0
    else:  # every pair's dual bound (E^2 products); a pair reaching an assignment gets its unit assignment
        m = score.clone()
        for a in range(E):
            for b in range(E):
                m[a, b] += sum(p.bound(a, b, keep=True) for p in prods)
    exact = torch.zeros(E, E, dtype=torch.bool)
    best: list[dict] = [{} for _ in feats]
    while True:
        pi = assign_max(m)
        stats.expert_assignments += 1
        todo = [(a, int(pi[a])) for a in range(E) if not exact[a, int(pi[a])]]
        if not todo:
            return pi, best
        for a, b in todo:
            val = score[a, b].clone()
            for k, p in enumerate(prods):
                best[k][a, b], v = p.assign(a, b)
                val += v
            m[a, b], exact[a, b] = val, True


def _paired(score: Tensor, feats, stats: ExpertStats):
    E = score.shape[0]
    low = score.clone()
    for fa, fb in feats:
        low += fa.shape[1] * (fa.means() @ fb.means().T)
    pi = assign_max(low)
    stats.expert_assignments += 1
    best: list[dict] = [{} for _ in feats]
    for k, (fa, fb) in enumerate(feats):
        prod = _Products(fa, fb, stats)
        for a in range(E):
            best[k][a, int(pi[a])], _ = prod.assign(a, int(pi[a]))
    return pi, best


def match_experts(spec: SymmetrySpec, experts: str, units: tuple[str, ...], state_a: Mapping[str, Tensor],
                  state_b: Mapping[str, Tensor], method: Method = "exact",
                  stats: ExpertStats | None = None) -> Transform:
    """The joint minimiser over ``experts`` and its coupled ``units`` (module docstring).

    ``state_b``: B with every other space applied to the tensors these spaces act on.
    ``method``: ``"exact"`` (bounds, then only the unit assignments that can still win: the
    all-pairs result), ``"all-pairs"`` (every pair's assignment; the reference) or ``"paired"``
    (approximate: experts paired by a permutation-invariant lower bound, ``E`` assignments).
    ``stats``: filled with what was computed when given.
    Returns ``{experts: pi, unit: sigma (E, F), ...}``.
    """
    if method not in METHODS:
        raise MatchError(f"unknown expert matching method {method!r}; use one of {', '.join(METHODS)}")
    stats = stats if stats is not None else ExpertStats()
    score, feats = _block(spec, experts, units, state_a, state_b)
    solve = {"exact": _exact, "all-pairs": _all_pairs, "paired": _paired}[method]
    pi, best = solve(score, feats, stats)
    out: Transform = {experts: pi}
    for u, perms in zip(units, best):
        out[u] = torch.stack([perms[e, int(pi[e])] for e in range(len(pi))])
    return out


__all__ = ["ExpertStats", "METHODS", "dual_bound", "expert_units", "match_experts"]
