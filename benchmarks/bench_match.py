"""Benchmark of the batched two-stage attention matcher vs a plain per-head scipy loop.

Shapes: (i) 12 layers x 12 heads, D=768, d_h=64, plain attention with biases (GPT-2 small);
(ii) 4 layers x 32 heads, D=4096, d_h=128, RoPE (Llama-7B). Random float32 weights,
two independent models. The batched match runs in a fresh subprocess per shape so
that its peak memory (``ru_maxrss`` minus the RSS after the weights exist) is clean.

The loop baseline (``loop_match``) is the straightforward implementation: a Python
loop over head pairs for the stage-1 cost (numpy, the same trace formulas), and per
head orthogonal Procrustes (numpy SVD) + ``scipy.optimize.minimize(L-BFGS-B)`` on the
raw weights for every GL problem, ``minimize_scalar(brent)`` per RoPE plane. It is
timed on one layer, and on a subset of pairs/heads where stated, and extrapolated
linearly (every layer, pair and head is the same amount of work).

Both run single-threaded (``OMP_NUM_THREADS=1`` etc., set below before numpy/torch
load) so that the comparison is per core and not distorted by thread contention on a
shared machine; set ``SYMALIGN_BENCH_THREADS`` to change it.

Run: ``.venv/bin/python benchmarks/bench_match.py`` (several minutes).
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


def run_batched(shape: str) -> dict:
    from symalign.match import match_attention

    cfg, spec, sa = build(shape, 0)
    _, _, sb = build(shape, 1)
    weights = sum(v.numel() * v.element_size() for st in (sa, sb) for v in st.values())
    before = rss_bytes()
    t = time.perf_counter()
    res = match_attention(spec, sa, sb)
    wall = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return dict(wall_s=wall, peak_delta_bytes=peak - before, weights_bytes=weights, totals=res.totals,
                worst_condition=res.worst_condition,
                max_iterations=max(max(lay.qk_iterations + lay.vo_iterations) for lay in res.layers))


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


def loop_stage1(ha, hb, pairs=None):
    h = len(ha)
    cost = np.zeros((h, h))
    todo = [(i, j) for i in range(h) for j in range(h)]
    if pairs is not None:
        todo = todo[:pairs]
    for i, j in todo:
        a, b = ha[i], hb[j]
        c = 0.0
        for x, y in (("q", "kc"), ("v", "o")):
            na = np.sum((a[x].T @ a[x]) * (a[y].T @ a[y]))
            nb = np.sum((b[x].T @ b[x]) * (b[y].T @ b[y]))
            cross = np.sum((a[x].T @ b[x]) * (a[y].T @ b[y]))
            c += na + nb - 2 * cross
        cost[i, j] = c
    return linear_sum_assignment(cost)[1], len(todo)


def loop_gl(xa, xb, ya, yb):
    """Procrustes + scipy L-BFGS on the raw weights for one head."""
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
    return res.x.reshape(d, d), res.nit


def loop_rope(xa, xb, ya, yb, r):
    j0, j1 = (t.numpy() for t in rotary_pairs(r, "half"))
    for a0, a1 in zip(j0, j1):
        z = lambda m: m[:, a0] + 1j * m[:, a1]  # noqa: E731
        al, be = np.vdot(z(xa), z(xb)), np.vdot(z(ya), z(yb))
        p, q = np.vdot(z(xb), z(xb)).real, np.vdot(z(yb), z(yb)).real
        minimize_scalar(lambda t: p * math.exp(2 * t) + q * math.exp(-2 * t)
                        - 2 * abs(al * math.exp(t) + be * math.exp(-t)), bracket=(-1, 1), method="brent")


def run_loop(shape: str, pair_subset: int | None, head_subset: int | None) -> dict:
    cfg, spec, sa = build(shape, 0)
    _, _, sb = build(shape, 1)
    L = SHAPES[shape]["layers"]
    h = cfg.n_heads
    ha, hb = heads_paper(sa, "layers.0.", cfg), heads_paper(sb, "layers.0.", cfg)
    t = time.perf_counter()
    pi, done = loop_stage1(ha, hb, pair_subset)
    t1 = (time.perf_counter() - t) * (h * h / done)
    if pair_subset is not None:
        pi = np.arange(h)
    heads = range(h if head_subset is None else head_subset)
    t = time.perf_counter()
    nits = []
    for i in heads:
        a, b = ha[i], hb[pi[i]]
        if cfg.pe == "rope":
            loop_rope(a["q"], b["q"], a["k"], b["k"], cfg.rotary_dims)
        else:
            nits.append(loop_gl(a["q"], b["q"], a["k"], b["k"])[1])
        nits.append(loop_gl(a["v"], b["v"], a["o"], b["o"])[1])
    t2 = (time.perf_counter() - t) * (h / len(heads))
    return dict(stage1_s_per_layer=t1, stage2_s_per_layer=t2, extrapolated_total_s=(t1 + t2) * L,
                pairs_timed=done, heads_timed=len(heads), lbfgs_iterations=nits)


def main() -> None:
    torch.set_num_threads(int(_THREADS))
    if len(sys.argv) > 2 and sys.argv[1] == "--batched":
        print(json.dumps(run_batched(sys.argv[2])))
        return
    subsets = {"gpt2": (None, None), "llama": (64, 4)}
    only = sys.argv[sys.argv.index("--only") + 1:] if "--only" in sys.argv else list(SHAPES)
    for shape in only:
        out = subprocess.run([sys.executable, __file__, "--batched", shape], capture_output=True, text=True)
        if out.returncode:
            print(out.stderr)
            raise SystemExit(1)
        b = json.loads(out.stdout.strip().splitlines()[-1])
        lp = run_loop(shape, *subsets[shape])
        s = SHAPES[shape]
        print(f"== {shape}: {s['layers']} layers, {s['cfg']}")
        print(f"batched two-stage match: {b['wall_s']:.1f} s "
              f"(stage 1 {b['totals']['time_stage1_s']:.1f} s, stage 2 {b['totals']['time_stage2_s']:.1f} s), "
              f"max solver iterations {b['max_iterations']}, worst cond {b['worst_condition']:.3g}")
        print(f"peak memory delta {b['peak_delta_bytes'] / 2**20:.0f} MiB; attention weights of both models "
              f"{b['weights_bytes'] / 2**20:.0f} MiB; ratio {b['peak_delta_bytes'] / b['weights_bytes']:.2f} (goal < 2)")
        print(f"distance before {b['totals']['distance_before']:.4g}, after stage 1 "
              f"{b['totals']['distance_stage1']:.4g}, after {b['totals']['distance_after']:.4g}")
        print(f"per-head scipy loop (timed on layer 0: {lp['pairs_timed']} head pairs, {lp['heads_timed']} heads; "
              f"extrapolated): stage 1 {lp['stage1_s_per_layer']:.1f} s/layer, stage 2 "
              f"{lp['stage2_s_per_layer']:.1f} s/layer, total {lp['extrapolated_total_s']:.1f} s")
        print(f"speed-up batched vs loop: {lp['extrapolated_total_s'] / b['wall_s']:.1f}x", flush=True)


if __name__ == "__main__":
    main()
