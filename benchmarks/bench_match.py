"""Benchmark of the batched two-stage attention matcher vs a plain per-head scipy loop.

Shapes: (i) 12 layers x 12 heads, D=768, d_h=64, plain attention with biases (GPT-2 small);
(ii) 4 layers x 32 heads, D=4096, d_h=128, RoPE (Llama-7B). Random float32 weights,
two independent models. The batched match runs in a fresh subprocess per shape so
that its peak memory (``ru_maxrss`` minus the RSS after the weights exist) is clean.

The loop baseline (``run_loop``) is the straightforward implementation, float64 numpy:

* stage 1: per-head squared norms ``||M_i||^2`` once per head, then a Python loop over
  head pairs for the cross terms ``<M_i^A, M_j^B>`` (the same trace formulas as the
  matcher: four ``d x d`` Gram products per pair), then ``linear_sum_assignment``.
  (Until this revision the loop recomputed both norms inside the pair loop, tripling its
  stage-1 work; that made it unfairly slow and was fixed.)
* stage 2, per head: orthogonal Procrustes (numpy SVD) and ``scipy.optimize.minimize
  (L-BFGS-B)`` on the raw weights for every GL problem (default tolerances: ``factr``
  1e7, i.e. a relative decrease of 2.2e-9), ``minimize_scalar(brent)`` per RoPE plane.

It is timed on layer 0, on a subset of pairs/heads where stated, and extrapolated
linearly (every layer, pair and head is the same amount of work). Its stage 2 runs on
the same head pairs as the batched match's layer 0, so the two objectives (squared
distance after stage 2, summed over the timed heads) are printed side by side.

For reference, two variants are timed too (skip them with ``--quick``): the batched
match with float64 stage-1 products (the loop's precision; the default uses the
weights' float32), and a loop whose stage 2 runs scipy's L-BFGS-B on the ``d x d``
Grams instead of the raw weights (the Gram trick is part of the matcher's method, not
of the plain loop; this shows how much of the speed-up it accounts for).

Both run single-threaded (``OMP_NUM_THREADS=1`` etc., set below before numpy/torch
load) so that the comparison is per core; set ``SYMALIGN_BENCH_THREADS`` to change it.
The machine may be shared: wall and CPU (process) time are both reported, and the load
average before and after each shape.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_match.py [--quick] [--only gpt2|llama]``
(about 10 minutes on a busy 2-core machine).
"""

from __future__ import annotations

import json
import math
import os

_THREADS = os.environ.get("SYMALIGN_BENCH_THREADS", "1")
for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_v] = _THREADS
import resource
import subprocess
import sys
import time

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment, minimize, minimize_scalar

from symalign.groups import rotary_pairs
from symalign.nn.attention import AttentionConfig, attention_spec
from symalign.spec import SymmetrySpec

SHAPES = {
    "gpt2": dict(layers=12, cfg=dict(d_model=768, n_heads=12, bias=True)),
    "llama": dict(layers=4, cfg=dict(d_model=4096, n_heads=32, pe="rope", rope_pairing="half")),
}
# loop timing subsets: (head pairs for stage 1, heads for stage 2); None = all
SUBSETS = {"gpt2": (None, None), "llama": (64, 8)}


def build(shape: str, seed: int):
    s = SHAPES[shape]
    cfg = AttentionConfig(**s["cfg"])
    spec = SymmetrySpec()
    for i in range(s["layers"]):
        spec = spec.merge(attention_spec(cfg, prefix=f"layers.{i}.", tag=str(i)))
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for t, acts in spec.tensors.items():
        D, h, d = cfg.d_model, cfg.n_heads, cfg.head_dim
        if t.endswith("o_proj.weight"):
            shp = (D, h * d)
        elif t.endswith("weight"):
            shp = (h * d, D)
        else:
            shp = (h * d,)
        state[t] = torch.randn(shp, generator=gen) * (1 / math.sqrt(D))
    return cfg, spec, state


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def run_batched(shape: str, stage1_dtype: str | None) -> dict:
    from symalign.match import match_attention

    cfg, spec, sa = build(shape, 0)
    _, _, sb = build(shape, 1)
    weights = sum(v.numel() * v.element_size() for st in (sa, sb) for v in st.values())
    kw = {} if stage1_dtype is None else dict(stage1_dtype=getattr(torch, stage1_dtype))
    before = rss_bytes()
    t, c = time.perf_counter(), time.process_time()
    res = match_attention(spec, sa, sb, **kw)
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    lay0 = res.layers[0]
    its = [i for lay in res.layers for i in lay.qk_iterations + lay.vo_iterations]
    return dict(wall_s=wall, cpu_s=cpu, peak_delta_bytes=peak - before, weights_bytes=weights, totals=res.totals,
                worst_condition=res.worst_condition, max_iterations=max(its), mean_iterations=sum(its) / len(its),
                converged=all(all(lay.qk_converged + lay.vo_converged) for lay in res.layers),
                pi0=lay0.permutation, after0=[q + v for q, v in zip(lay0.qk_after, lay0.vo_after)])


# ----------------------------------------------------------------------------
# the plain per-head loop (baseline)
# ----------------------------------------------------------------------------


def heads_paper(state, prefix, cfg):
    """Per-head paper-layout numpy matrices (float64): Q~, K (centred, no bias), V~, O, and raw K~."""
    h, d = cfg.n_heads, cfg.head_dim
    names = ["q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"]
    names += ["q_proj.bias", "k_proj.bias", "v_proj.bias"] if cfg.bias else []
    full = {n: state[prefix + n].double().numpy() for n in names}  # converted once
    get = full.__getitem__
    out = []
    for i in range(h):
        sl = slice(i * d, (i + 1) * d)
        q = get("q_proj.weight")[sl].T
        k = get("k_proj.weight")[sl].T
        v = get("v_proj.weight")[sl].T
        if cfg.bias:
            q = np.vstack([q, get("q_proj.bias")[sl][None]])
            v = np.vstack([v, get("v_proj.bias")[sl][None]])
            kfull = np.vstack([k, get("k_proj.bias")[sl][None]])
        else:
            kfull = k
        kc = k - k.mean(0, keepdims=True)
        if cfg.pe == "rope" and cfg.bias:
            kc = np.vstack([kc, get("k_proj.bias")[sl][None]])
        out.append({n: np.ascontiguousarray(m) for n, m in
                    dict(q=q, kc=kc, k=kfull, v=v, o=get("o_proj.weight")[:, sl]).items()})
    return out


SIDE_PAIRS = (("q", "kc"), ("v", "o"))


def clock() -> np.ndarray:
    return np.array([time.perf_counter(), time.process_time()])


def loop_stage1(ha, hb, pairs=None):
    """Stage-1 costs by a loop over head pairs.

    Returns (pi, pairs done, [wall, CPU] of the norms, [wall, CPU] of the pairs done).
    """
    h = len(ha)
    t = clock()
    norm = [[sum(np.sum((m[x].T @ m[x]) * (m[y].T @ m[y])) for x, y in SIDE_PAIRS) for m in hs] for hs in (ha, hb)]
    t_norms = clock() - t
    cost = np.zeros((h, h))
    todo = [(i, j) for i in range(h) for j in range(h)]
    if pairs is not None:
        todo = todo[:pairs]
    t = clock()
    for i, j in todo:
        a, b = ha[i], hb[j]
        cross = sum(np.sum((a[x].T @ b[x]) * (a[y].T @ b[y])) for x, y in SIDE_PAIRS)
        cost[i, j] = norm[0][i] + norm[1][j] - 2 * cross
    pi = linear_sum_assignment(cost)[1]
    return pi, len(todo), t_norms, clock() - t


def loop_gl(xa, xb, ya, yb):
    """Procrustes + scipy L-BFGS on the raw weights for one head; returns (U, objective, iterations)."""
    w, _, zt = np.linalg.svd(xb.T @ xa + yb.T @ ya)
    u0 = (w @ zt).T
    d = u0.shape[0]

    def fg(x):
        u = x.reshape(d, d)
        v = np.linalg.inv(u)
        r1 = xa - xb @ u.T
        r2 = ya - yb @ v
        f = np.sum(r1 * r1) + np.sum(r2 * r2)
        gu = -2 * r1.T @ xb
        gv = -2 * yb.T @ r2
        return f, (gu - v.T @ gv @ v.T).ravel()

    res = minimize(fg, u0.ravel(), jac=True, method="L-BFGS-B", options=dict(maxiter=500, gtol=1e-10))
    return res.x.reshape(d, d), float(res.fun), res.nit


def loop_gl_grams(xa, xb, ya, yb):
    """The same problem as :func:`loop_gl`, but scipy's L-BFGS-B evaluates it from ``d x d`` Grams."""
    gab, gbb, haa_t = xa.T @ xb, xb.T @ xb, float(np.sum(ya * ya))
    hab, hbb, gaa_t = ya.T @ yb, yb.T @ yb, float(np.sum(xa * xa))
    w, _, zt = np.linalg.svd(gab.T + hab.T)
    u0 = (w @ zt).T
    d = u0.shape[0]

    def fg(x):
        u = x.reshape(d, d)
        v = np.linalg.inv(u)
        ug, hv = u @ gbb, hbb @ v
        f = gaa_t - 2 * np.sum(gab * u) + np.sum(ug * u) + haa_t - 2 * np.sum(hab.T * v) + np.sum(v * hv)
        gv = 2 * (hv - hab.T)
        return f, (2 * (ug - gab) - v.T @ gv @ v.T).ravel()

    res = minimize(fg, u0.ravel(), jac=True, method="L-BFGS-B", options=dict(maxiter=500, gtol=1e-10))
    return res.x.reshape(d, d), float(res.fun), res.nit


def loop_rope(xa, xb, ya, yb, r):
    """Brent per RoPE plane; returns the summed plane objectives."""
    j0, j1 = (t.numpy() for t in rotary_pairs(r, "half"))
    total = 0.0
    for a0, a1 in zip(j0, j1):
        z = lambda m: m[:, a0] + 1j * m[:, a1]  # noqa: E731
        al, be = np.vdot(z(xa), z(xb)), np.vdot(z(ya), z(yb))
        p, q = np.vdot(z(xb), z(xb)).real, np.vdot(z(yb), z(yb)).real
        res = minimize_scalar(lambda t: p * math.exp(2 * t) + q * math.exp(-2 * t)
                              - 2 * abs(al * math.exp(t) + be * math.exp(-t)), bracket=(-1, 1), method="brent")
        total += np.vdot(z(xa), z(xa)).real + np.vdot(z(ya), z(ya)).real + float(res.fun)
    return total


def run_loop(shape: str, pair_subset: int | None, head_subset: int | None, pi_batched: list[int],
             gl=loop_gl) -> dict:
    cfg, spec, sa = build(shape, 0)
    _, _, sb = build(shape, 1)
    L = SHAPES[shape]["layers"]
    h = cfg.n_heads
    t = clock()
    ha, hb = heads_paper(sa, "layers.0.", cfg), heads_paper(sb, "layers.0.", cfg)  # float64 per-head views
    t_prep = clock() - t
    pi, done, t_norms, t_pairs = loop_stage1(ha, hb, pair_subset)
    t1, c1 = t_prep + t_norms + t_pairs * (h * h / done)  # [wall, CPU] per layer
    if pair_subset is not None:  # stage 1 incomplete: run stage 2 on the batched match's pairs (same problems)
        pi = np.asarray(pi_batched)
    heads = range(h if head_subset is None else head_subset)
    t, c = time.perf_counter(), time.process_time()
    nits, objective = [], []
    for i in heads:
        a, b = ha[i], hb[pi[i]]
        if cfg.pe == "rope":
            fq = loop_rope(a["q"], b["q"], a["k"], b["k"], cfg.rotary_dims)
        else:
            _, fq, it = gl(a["q"], b["q"], a["k"], b["k"])
            nits.append(it)
        _, fv, it = gl(a["v"], b["v"], a["o"], b["o"])
        nits.append(it)
        objective.append(fq + fv)
    t2 = (time.perf_counter() - t) * (h / len(heads))
    c2 = (time.process_time() - c) * (h / len(heads))
    return dict(stage1_s_per_layer=t1, stage2_s_per_layer=t2, extrapolated_total_s=(t1 + t2) * L,
                extrapolated_cpu_s=(c1 + c2) * L, pairs_timed=done, heads_timed=len(heads),
                lbfgs_iterations=nits, objective=objective, same_pi=bool(np.array_equal(pi, pi_batched)))


def batched(shape: str, dtype: str | None = None) -> dict:
    args = [sys.executable, __file__, "--batched", shape] + ([dtype] if dtype else [])
    out = subprocess.run(args, capture_output=True, text=True)
    if out.returncode:
        print(out.stderr)
        raise SystemExit(1)
    return json.loads(out.stdout.strip().splitlines()[-1])


def parse_args(argv: list[str] | None = None):
    import argparse

    ap = argparse.ArgumentParser(description="Batched two-stage attention matcher vs a per-head scipy loop "
                                             "(GPT-2-small and Llama-7B attention shapes; about 10 minutes).")
    ap.add_argument("--only", nargs="+", choices=list(SHAPES), default=list(SHAPES), help="Shapes to run.")
    ap.add_argument("--quick", action="store_true", help="Skip the float64 and Gram-based loop variants.")
    ap.add_argument("--batched", nargs="+", metavar="ARG", help=argparse.SUPPRESS)  # internal: one subprocess
    return ap.parse_args(argv)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(int(_THREADS))
    if args.batched:
        print(json.dumps(run_batched(args.batched[0], args.batched[1] if len(args.batched) > 1 else None)))
        return
    only = args.only
    for shape in only:
        s = SHAPES[shape]
        print(f"== {shape}: {s['layers']} layers, {s['cfg']}  (load average before: {load()})", flush=True)
        b = batched(shape)
        lp = run_loop(shape, *SUBSETS[shape], b["pi0"])
        tot = b["totals"]
        print(f"batched two-stage match: wall {b['wall_s']:.1f} s, CPU {b['cpu_s']:.1f} s (stage 1 "
              f"{tot['time_stage1_s']:.1f} s, Grams {tot['time_grams_s']:.1f} s, "
              f"stage 2 {tot['time_stage2_s']:.1f} s); L-BFGS evaluations per block mean "
              f"{b['mean_iterations']:.0f} max {b['max_iterations']}, all converged {b['converged']}, "
              f"worst cond {b['worst_condition']:.3g}")
        print(f"peak memory delta {b['peak_delta_bytes'] / 2**20:.0f} MiB; attention weights of both models "
              f"{b['weights_bytes'] / 2**20:.0f} MiB; ratio {b['peak_delta_bytes'] / b['weights_bytes']:.2f} "
              "(goal < 2)")
        print(f"distance before {tot['distance_before']:.6g}, after stage 1 {tot['distance_stage1']:.6g}, "
              f"after {tot['distance_after']:.10g}")
        print(f"per-head scipy loop (timed on layer 0: {lp['pairs_timed']} head pairs, {lp['heads_timed']} heads; "
              f"extrapolated): stage 1 {lp['stage1_s_per_layer']:.1f} s/layer, stage 2 "
              f"{lp['stage2_s_per_layer']:.1f} s/layer, total wall {lp['extrapolated_total_s']:.1f} s, "
              f"CPU {lp['extrapolated_cpu_s']:.1f} s")
        k = lp["heads_timed"]
        fb, fl = sum(b["after0"][:k]), sum(lp["objective"])
        print(f"objective on the timed heads of layer 0 (same head pairs: {lp['same_pi']}): batched {fb:.10g}, "
              f"loop {fl:.10g}, (batched - loop) / loop = {(fb - fl) / fl:.2e}")
        print(f"speed-up batched vs loop: {lp['extrapolated_total_s'] / b['wall_s']:.1f}x wall, "
              f"{lp['extrapolated_cpu_s'] / b['cpu_s']:.1f}x CPU", flush=True)
        if not args.quick:
            b64 = batched(shape, "float64")
            print(f"  with float64 stage-1 products: wall {b64['wall_s']:.1f} s, CPU {b64['cpu_s']:.1f} s "
                  f"(stage 1 {b64['totals']['time_stage1_s']:.1f} s), same permutation of layer 0: "
                  f"{b64['pi0'] == b['pi0']}, distance after {b64['totals']['distance_after']:.10g}; speed-up "
                  f"{lp['extrapolated_total_s'] / b64['wall_s']:.1f}x wall, "
                  f"{lp['extrapolated_cpu_s'] / b64['cpu_s']:.1f}x CPU", flush=True)
        if not args.quick:
            lg = run_loop(shape, *SUBSETS[shape], b["pi0"], gl=loop_gl_grams)
            fg = sum(lg["objective"])
            print(f"  loop with Gram-based scipy L-BFGS-B: stage 2 {lg['stage2_s_per_layer']:.1f} s/layer, total wall "
                  f"{lg['extrapolated_total_s']:.1f} s, CPU {lg['extrapolated_cpu_s']:.1f} s, objective {fg:.10g}; "
                  f"speed-up {lg['extrapolated_total_s'] / b['wall_s']:.1f}x wall, "
                  f"{lg['extrapolated_cpu_s'] / b['cpu_s']:.1f}x CPU", flush=True)
        print(f"(load average after: {load()})", flush=True)


if __name__ == "__main__":
    main()
