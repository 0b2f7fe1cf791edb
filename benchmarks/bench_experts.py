"""Time the joint expert + unit matching of one mixture-of-experts layer (``symalign.match.experts``).

Usage: ``.venv/bin/python benchmarks/bench_experts.py [--sizes E,F,D ...] [--threads N]``.
Random router ``(E, D)``, ``gate_up_proj`` ``(E, 2F, D)`` and ``down_proj`` ``(E, D, F)``; B is a planted
element (expert permutation and per-expert unit permutations) of A plus relative noise 0.1, so the
solver works on a non-trivial cost. Prints the wall time, the number of unit assignments (``E^2``) and
whether the planted permutations were recovered.
"""

from __future__ import annotations

import argparse
import time

import torch

from symalign.groups import BlockPermutations, Permutation
from symalign.match.experts import match_experts
from symalign.spec import SymmetrySpec, apply, invert, sample


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="*", default=["8,256,256", "8,1024,512", "32,256,256", "64,128,256"])
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print("| E | F | D | unit assignments | seconds | planted recovered |")
    print("|---|---|---|---|---|---|")
    for size in args.sizes:
        E, F, D = (int(v) for v in size.split(","))
        spec, a = layer(E, F, D)
        t = sample(spec, 1)
        b = apply(spec, t, a)
        g = torch.Generator().manual_seed(2)
        b = {k: v + 0.1 * torch.randn(v.shape, generator=g, dtype=torch.float64) for k, v in b.items()}
        t0 = time.perf_counter()
        got = match_experts(spec, "experts", ("units",), a, b)
        dt = time.perf_counter() - t0
        inv = invert(spec, t)
        ok = all(torch.equal(got[k], inv[k]) for k in ("experts", "units"))
        print(f"| {E} | {F} | {D} | {E * E} | {dt:.2f} | {ok} |")


if __name__ == "__main__":
    main()
