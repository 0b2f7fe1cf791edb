"""The mixture-of-experts matcher (``symalign.match.experts``): exact joint optimum with few unit assignments.

* ``dual_bound`` is an upper bound on the assignment value (checked against scipy's optimum)
  and at least as tight as the row-maximum bound;
* on random layers without any planted structure, ``method="exact"`` returns the same
  permutations as the all-pairs reference, and both reach the brute-force optimum over every
  ``(pi, sigma)`` (tiny layers, two unit spaces);
* a planted element (plus noise) is recovered exactly by every method, ``exact`` with ``E``
  unit assignments instead of ``E^2`` (and, where the Gram screen applies, ``E`` products).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.optimize import linear_sum_assignment

from symalign.errors import MatchError
from symalign.groups import BlockPermutations, Permutation
from symalign.match.experts import ExpertStats, dual_bound, match_experts, use_gram_screen
from symalign.spec import SymmetrySpec, apply, invert, sample


def layer(E, F, D, seed, two_units=False):
    """A router, a stacked ``gate_up`` (both halves one unit space) and ``down``; with ``two_units`` a second
    unit space of width ``F`` on an extra stacked tensor."""
    g = torch.Generator().manual_seed(seed)
    state = {"gate": torch.randn(E, D, generator=g, dtype=torch.float64),
             "gate_up": torch.randn(E, 2 * F, D, generator=g, dtype=torch.float64),
             "down": torch.randn(E, D, F, generator=g, dtype=torch.float64)}
    if two_units:
        state["extra"] = torch.randn(E, F, D, generator=g, dtype=torch.float64)
    spec = SymmetrySpec()
    spec.add_space("experts", Permutation(E), "experts", 0)
    spec.add_space("units", BlockPermutations(E, F), "ff", 0)
    units = ["units"]
    if two_units:
        spec.add_space("units2", BlockPermutations(E, F), "ff", 0)
        units.append("units2")
    for t in state:
        spec.act_on(t, "experts", 0)
    spec.act_on("gate_up", "units", 1, "co", None, (0, F))
    spec.act_on("gate_up", "units", 1, "co", None, (F, F))
    spec.act_on("down", "units", 2, "contra")
    if two_units:
        spec.act_on("extra", "units2", 1)
    spec.couple("experts", *units)
    return spec, state, tuple(units)


def distance(spec, t, a, b):
    got = apply(spec, t, b)
    return float(sum(((a[k] - got[k]) ** 2).sum() for k in a))


def test_dual_bound_bounds_the_assignment_and_beats_row_maxima():
    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 5, 40, 300):
        c = torch.randn(3, n, n, generator=g, dtype=torch.float64)
        for k in range(3):
            r, col = linear_sum_assignment(c[k].numpy(), maximize=True)
            opt = float(c[k].numpy()[r, col].sum())
            rowmax = float(c[k].amax(1).sum())
            got = dual_bound(c[k], chunk_rows=7)  # several row chunks
            assert opt - 1e-9 <= float(got) <= rowmax + 1e-9
            assert float(dual_bound(c)[k]) == pytest.approx(float(got), abs=1e-9)  # batched = one at a time
        if n >= 40:
            assert float(dual_bound(c[0])) < float(c[0].amax(1).sum()) - 1e-6  # strictly tighter here
    assert float(dual_bound(c[0], rounds=0)) == pytest.approx(float(c[0].amax(1).sum()))


@pytest.mark.parametrize("E,F,D", [(3, 4, 3), (5, 6, 4), (8, 16, 6), (12, 8, 5), (32, 8, 6)])
@pytest.mark.slow
def test_exact_equals_all_pairs_on_unrelated_layers(E, F, D):
    for seed in range(4):
        spec, a, units = layer(E, F, D, 0)
        _, b, _ = layer(E, F, D, 10 + seed)
        ref = match_experts(spec, "experts", units, a, b, method="all-pairs")
        st = ExpertStats()
        got = match_experts(spec, "experts", units, a, b, stats=st)
        for k in ref:
            assert torch.equal(got[k], ref[k]), (seed, k)
        assert st.unit_assignments <= E * E
        paired = match_experts(spec, "experts", units, a, b, method="paired")
        assert distance(spec, paired, a, b) >= distance(spec, got, a, b) - 1e-9


def test_exact_is_the_brute_force_optimum_with_two_unit_spaces():
    E, F = 3, 2
    for seed in range(3):
        spec, a, units = layer(E, F, 3, 0, two_units=True)
        _, b, _ = layer(E, F, 3, 20 + seed, two_units=True)
        perms = [torch.tensor(p) for p in itertools.permutations(range(F))]
        best = min(distance(spec, {"experts": torch.tensor(pi), "units": torch.stack(s1), "units2": torch.stack(s2)},
                            a, b)
                   for pi in itertools.permutations(range(E))
                   for s1 in itertools.product(perms, repeat=E) for s2 in itertools.product(perms, repeat=E))
        for method in ("exact", "all-pairs"):
            assert distance(spec, match_experts(spec, "experts", units, a, b, method=method), a, b) == \
                pytest.approx(best, rel=1e-12)


@pytest.mark.parametrize("method", ["exact", "all-pairs", "paired"])
@pytest.mark.parametrize("E,F,D", [(8, 24, 10), (32, 8, 8)])
def test_planted_element_is_recovered_exactly(method, E, F, D):
    spec, a, units = layer(E, F, D, 0)
    for seed in (1, 2):
        t = sample(spec, seed)
        g = torch.Generator().manual_seed(seed)
        b = {k: v + 0.1 * torch.randn(v.shape, generator=g, dtype=torch.float64) for k, v in apply(spec, t, a).items()}
        st = ExpertStats()
        got = match_experts(spec, "experts", units, a, b, method=method, stats=st)
        inv = invert(spec, t)
        assert not torch.equal(t["experts"], torch.arange(E))
        for k in got:
            assert torch.equal(got[k], inv[k]), (seed, k)
        assert st.unit_assignments == (E * E if method == "all-pairs" else E)
        if method == "exact":  # (32, 8, 8): screened by the Gram bound, products only for the E winners
            assert st.products == (E if use_gram_screen(E, F, 3 * D) else E * E)


def test_unknown_method_is_refused():
    spec, a, units = layer(3, 2, 2, 0)
    with pytest.raises(MatchError, match="unknown expert matching method 'fast'"):
        match_experts(spec, "experts", units, a, a, method="fast")
