"""Time the joint expert + unit matching of one mixture-of-experts layer (``symalign.match.experts``).

Usage: ``.venv/bin/python benchmarks/bench_experts.py [--sizes E,F,D[:case+case] ...] [--cases ...]
[--lap-sizes N ...] [--threads N] [--json OUT]``.

Random router ``(E, D)``, ``gate_up_proj`` ``(E, 2F, D)`` and ``down_proj`` ``(E, D, F)`` (A, seed 0).
B is, per case: ``planted``: a random element (expert permutation with the router rows,
per-expert unit permutations) of A plus relative noise 0.1; ``related``: the same with noise 1.0
(as large as the weights); ``independent``: another random layer (seed 3). On the same inputs it
runs the three methods of ``match_experts`` and the floor:

* ``floor``: the ``E^2`` products ``F_A[a] F_B[b]^T`` alone (formed as the exact method forms them);
* ``exact``: bounds on every pair (product-free Gram bounds first where ``use_gram_screen``), then
  products and unit assignments only for pairs that can still win;
* ``all-pairs``: the reference, ``E^2`` unit assignments (skipped above ``--all-pairs-max-f``);
* ``paired``: approximate, experts paired by a permutation-invariant lower bound, ``E`` assignments.

Prints one table row per (size, case): seconds, unit assignments, products formed, ratios ``exact / all-pairs`` and
``exact / floor``, whether ``exact`` equals ``all-pairs`` (both permutations), whether the planted
element is recovered, and whether ``paired`` differs from ``exact`` and by how much (relative
increase of the block's squared distance). ``--json`` writes the rows with provenance and the
table ``layers`` that ``docs/whole-model.md`` renders (``symalign docs``).
"""

from __future__ import annotations

import argparse
import time

import torch

from symalign.atomic import write_json
from symalign.experiments.docs_tables import make_table
from symalign.groups import BlockPermutations, Permutation
from symalign.match.experts import ExpertStats, _unit_features, match_experts, use_gram_screen
from symalign.provenance import provenance
from symalign.spec import SymmetrySpec, apply, invert, sample

NOISE = {"planted": 0.1, "related": 1.0}


def layer(E: int, F: int, D: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    state = {"gate": torch.randn(E, D, generator=g, dtype=torch.float64),
             "gate_up": torch.randn(E, 2 * F, D, generator=g, dtype=torch.float64),
             "down": torch.randn(E, D, F, generator=g, dtype=torch.float64)}
    spec = SymmetrySpec()
    spec.add_space("experts", Permutation(E), "experts", 0)
    spec.add_space("units", BlockPermutations(E, F), "ff", 0)
    for t in state:
        spec.act_on(t, "experts", 0)
    spec.act_on("gate_up", "units", 1, "co", None, (0, F))
    spec.act_on("gate_up", "units", 1, "co", None, (F, F))
    spec.act_on("down", "units", 2, "contra")
    spec.couple("experts", "units")
    return spec, state


def pair(spec, a, case: str, E: int, F: int, D: int):
    """B for ``case`` and the planted element (``None`` for ``independent``)."""
    if case == "independent":
        return layer(E, F, D, seed=3)[1], None
    t = sample(spec, 1)
    b = apply(spec, t, a)
    g = torch.Generator().manual_seed(2)
    return {k: v + NOISE[case] * torch.randn(v.shape, generator=g, dtype=torch.float64) for k, v in b.items()}, t


def floor_s(spec, a, b) -> float:
    """Seconds for the ``E^2`` products ``F_A[a] F_B[b]^T`` alone (formed as ``match_experts`` forms them)."""
    fa, fb = _unit_features(spec, "units", a), _unit_features(spec, "units", b)
    E = fa.shape[0]
    t0 = time.perf_counter()
    for i in range(E):
        for j in range(E):
            c = fa[i] @ fb[j].T
            del c
    return time.perf_counter() - t0


def distance(spec, t, a, b) -> float:
    got = apply(spec, t, b)
    return float(sum(((a[k] - got[k]) ** 2).sum() for k in a))


def run(spec, a, b, method: str):
    st = ExpertStats()
    t0 = time.perf_counter()
    got = match_experts(spec, "experts", ("units",), a, b, method=method, stats=st)
    return got, time.perf_counter() - t0, st


def same(x, y) -> bool:
    return all(torch.equal(x[k], y[k]) for k in ("experts", "units"))


def lap_time(n: int, K: int = 256) -> dict:
    """One unit assignment of size ``n`` alone (``assign_max``, as the dense FF step does): the cost
    ``X (P X + 0.1 noise)^T`` of a planted unit permutation."""
    from symalign.groups import assign_max

    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, K, generator=g, dtype=torch.float64)
    p = torch.randperm(n, generator=g)
    y = x[p] + 0.1 * torch.randn(n, K, generator=g, dtype=torch.float64)
    t0 = time.perf_counter()
    c = x @ y.T
    t1 = time.perf_counter()
    q = assign_max(c)
    t2 = time.perf_counter()
    return {"n": n, "K": K, "product_s": t1 - t0, "assignment_s": t2 - t1,
            "recovered": bool(torch.equal(p[q], torch.arange(n)))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="*", default=["8,256,256", "8,1024,512", "32,256,256", "64,128,256",
                                                   "64,256,512", "8,4096,512"])
    ap.add_argument("--cases", nargs="*", default=["planted", "related", "independent"],
                    help="cases for every size without its own (a size E,F,D:planted+related names its cases)")
    ap.add_argument("--all-pairs-max-f", type=int, default=4096, help="skip the all-pairs reference above this F")
    ap.add_argument("--lap-sizes", nargs="*", type=int, default=[],
                    help="also time one planted unit assignment of each size")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None, help="write the rows (with provenance) here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    print("| E | F | D | case | floor s | exact s | LAPs | products | all-pairs s | LAPs | exact/all-pairs "
          "| exact/floor | exact == all-pairs | planted recovered | paired s | paired differs "
          "| paired distance excess |")
    print("|" + "---|" * 17)
    for size in args.sizes:
        size, _, only = size.partition(":")
        E, F, D = (int(v) for v in size.split(","))
        spec, a = layer(E, F, D)
        for case in (only.split("+") if only else args.cases):
            b, planted = pair(spec, a, case, E, F, D)
            fl = floor_s(spec, a, b)
            ex, t_ex, st_ex = run(spec, a, b, "exact")
            ref = run(spec, a, b, "all-pairs") if F <= args.all_pairs_max_f else None
            pa, t_pa, st_pa = run(spec, a, b, "paired")
            d_ex, d_pa = distance(spec, ex, a, b), distance(spec, pa, a, b)
            row = {"E": E, "F": F, "D": D, "case": case, "floor_s": fl, "exact_s": t_ex,
                   "exact_unit_assignments": st_ex.unit_assignments,
                   "exact_expert_assignments": st_ex.expert_assignments, "exact_products": st_ex.products,
                   "gram_screen": use_gram_screen(E, F, 3 * D), "exact_gram_s": st_ex.extra.get("time_gram_s"),
                   "exact_products_s": st_ex.time_products_s, "exact_assignments_s": st_ex.time_assignments_s,
                   "exact_over_floor": t_ex / fl,
                   "planted_recovered": None if planted is None else same(ex, invert(spec, planted)),
                   "paired_s": t_pa, "paired_differs": not same(pa, ex),
                   "paired_experts_differ": not torch.equal(pa["experts"], ex["experts"]),
                   "paired_distance_excess": (d_pa - d_ex) / d_ex}
            if ref is not None:
                row.update({"all_pairs_s": ref[1], "all_pairs_unit_assignments": ref[2].unit_assignments,
                            "exact_over_all_pairs": t_ex / ref[1], "exact_equals_all_pairs": same(ex, ref[0])})
            rows.append(row)

            def f(k, fmt="{:.2f}"):
                return "-" if row.get(k) is None else fmt.format(row[k])

            print(f"| {E} | {F} | {D} | {case} | {fl:.2f} | {t_ex:.2f} | {st_ex.unit_assignments} | "
                  f"{st_ex.products}{' (Gram screen)' if row['gram_screen'] else ''} | "
                  f"{f('all_pairs_s')} | {f('all_pairs_unit_assignments', '{}')} | "
                  f"{f('exact_over_all_pairs', '{:.3f}')} | {row['exact_over_floor']:.2f} | "
                  f"{f('exact_equals_all_pairs', '{}')} | "
                  f"{f('planted_recovered', '{}')} | {t_pa:.2f} | {row['paired_differs']} | "
                  f"{row['paired_distance_excess']:.2e} |", flush=True)
    laps = [lap_time(n) for n in args.lap_sizes]
    if laps:
        print("\n| n | product s (K = 256) | unit assignment s (planted) | recovered |\n|---|---|---|---|")
        for r in laps:
            print(f"| {r['n']} | {r['product_s']:.2f} | {r['assignment_s']:.2f} | {r['recovered']} |", flush=True)
    if args.json:
        table = make_table(rows, [("E", "E"), ("F", "F"), ("D", "D"), ("case", "B"), ("floor_s", "floor s", ".2f"),
                                  ("exact_s", "exact s", ".2f"), ("exact_unit_assignments", "assignments"),
                                  ("gram_screen", "Gram screen"), ("all_pairs_s", "all-pairs s", ".2f"),
                                  ("all_pairs_unit_assignments", "assignments"),
                                  ("exact_over_all_pairs", "exact / all-pairs", ".2f"),
                                  ("exact_over_floor", "exact / floor", ".2f"),
                                  ("exact_equals_all_pairs", "same as all-pairs"),
                                  ("planted_recovered", "planted recovered"), ("paired_s", "paired s", ".2f"),
                                  ("paired_differs", "paired differs"),
                                  ("paired_distance_excess", "paired distance excess", ".1e")])
        write_json(args.json, {"provenance": provenance(threads=args.threads), "rows": rows, "lap": laps,
                               "tables": {"layers": table}})


if __name__ == "__main__":
    main()
