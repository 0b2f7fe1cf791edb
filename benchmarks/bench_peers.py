"""symalign vs peer re-basin tools on the same trained weights (scikit-learn digits).

For each row: train two models A, B from different seeds (same data, seeded), align B
to A with symalign (``symalign.trace`` + ``match_whole`` on the traced spec) and with
each installed peer, and measure on the held-out split

* the test-loss barrier of the linear path A -> B' (``symalign.lmc.curve``, 25 points),
  and the unaligned (naive) barrier A -> B;
* the function change ``max |f_B'(x) - f_B(x)| / max |f_B(x)|`` over the test set
  (an exact alignment keeps it at float32 rounding, ~1e-6);
* wall time of the alignment.

Rows: MLPs 64 -> 128^k -> 10 (ReLU, k = 2, 3, 4) and ViTs built from
``nn.TransformerEncoderLayer`` (8x8 digits in 2x2 patches, CLS token, learned positions).

Peers run in their own virtual environment (``--peers-python``, default
``/work/peers-venv/bin/python``) in a subprocess, so they never touch symalign's
environment; a peer that is absent is skipped with a message, and a peer that raises,
times out or changes the function is recorded as such.

    OMP_NUM_THREADS=1 python benchmarks/bench_peers.py --out benchmarks/results/peers.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).resolve()


# -- models (also imported by the peer worker: torch only) ----------------------------------------------------

class DigitsViT(nn.Module):
    def __init__(self, d=32, heads=2, layers=2, d_ff=64, patch=2, classes=10):
        super().__init__()
        self.patch = patch
        n = (8 // patch) ** 2
        self.embed = nn.Linear(patch * patch, d)
        self.cls = nn.Parameter(torch.randn(1, 1, d) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, n + 1, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, heads, d_ff, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        B = x.shape[0]
        p = self.patch
        x = x.reshape(B, 8 // p, p, 8 // p, p).permute(0, 1, 3, 2, 4).reshape(B, -1, p * p)
        x = torch.cat([self.cls.expand(B, -1, -1), self.embed(x)], dim=1) + self.pos
        return self.head(self.norm(self.encoder(x))[:, 0])


def build(kind: str, depth: int) -> nn.Module:
    if kind == "mlp":
        layers: list[nn.Module] = []
        width = 64
        for _ in range(depth):
            layers += [nn.Linear(width, 128), nn.ReLU()]
            width = 128
        return nn.Sequential(*layers, nn.Linear(width, 10))
    return DigitsViT(layers=depth)


def example(kind: str, x: torch.Tensor) -> torch.Tensor:
    return x if kind == "mlp" else x.reshape(-1, 8, 8)


# -- peer worker (runs in the peers' environment) -------------------------------------------------------------

def peer_worker(folder: Path) -> None:
    job = json.loads((folder / "job.json").read_text())
    t0 = time.perf_counter()
    out = {"peer": job["peer"]}
    try:
        if job["peer"] == "rebasin":
            from rebasin import PermutationCoordinateDescent

            a, b = build(job["kind"], job["depth"]), build(job["kind"], job["depth"])
            a.load_state_dict(torch.load(folder / "A.pt", weights_only=True))
            b.load_state_dict(torch.load(folder / "B.pt", weights_only=True))
            x = torch.load(folder / "x.pt", weights_only=True)
            torch.manual_seed(job.get("seed", 0))  # rebasin's sweep order comes from torch's global RNG
            PermutationCoordinateDescent(a, b, x).rebasin()
            torch.save(b.state_dict(), folder / "out.pt")
            out["status"] = "ok"
        else:
            out["status"] = f"unknown peer {job['peer']}"
    except Exception as e:  # noqa: BLE001 -- a peer's failure is a result
        out["status"] = "error"
        out["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
    out["seconds"] = time.perf_counter() - t0
    (folder / "result.json").write_text(json.dumps(out))


def peer_available(python: str, peer: str) -> str | None:
    """None if ``peer`` imports under ``python``, else why not."""
    if not Path(python).exists():
        return f"no peers environment at {python}"
    r = subprocess.run([python, "-c", f"import {peer}"], capture_output=True, text=True, timeout=300)
    return None if r.returncode == 0 else f"{peer} does not import under {python}: {r.stderr.strip()[-200:]}"


def run_peer(python: str, peer: str, kind: str, depth: int, sa, sb, x, timeout: float, seed: int = 0) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        (d / "job.json").write_text(json.dumps({"peer": peer, "kind": kind, "depth": depth, "seed": seed}))
        torch.save(sa, d / "A.pt")
        torch.save(sb, d / "B.pt")
        torch.save(x, d / "x.pt")
        try:
            subprocess.run([python, str(HERE), "--peer-worker", str(d)], capture_output=True, text=True,
                           timeout=timeout, cwd=str(HERE.parent))
        except subprocess.TimeoutExpired:
            return {"peer": peer, "status": "timeout", "seconds": timeout}
        if not (d / "result.json").exists():
            return {"peer": peer, "status": "error", "error": "the worker crashed without a result"}
        res = json.loads((d / "result.json").read_text())
        if res.get("status") == "ok":
            res["state"] = torch.load(d / "out.pt", weights_only=True)
        return res


# -- training and measuring (symalign's environment) ------------------------------------------------------------

def digits(seed: int = 0):
    from sklearn.datasets import load_digits

    ds = load_digits()
    x = torch.tensor(ds.data, dtype=torch.float32) / 16.0
    y = torch.tensor(ds.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    tr, te = perm[:1300], perm[1300:]
    return (x[tr], y[tr]), (x[te], y[te])


def train(kind: str, depth: int, seed: int, data, epochs: int) -> nn.Module:
    torch.manual_seed(seed)
    model = build(kind, depth)
    (x, y), _ = data
    opt = torch.optim.Adam(model.parameters(), lr=1e-3 if kind == "mlp" else 2e-3)
    g = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        for idx in torch.randperm(len(y), generator=g).split(64):
            loss = nn.functional.cross_entropy(model(example(kind, x[idx])), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model.eval()


def measure(model, kind, sa, sb_aligned, sb, test) -> dict:
    from symalign.lmc import curve

    x, y = test
    xe = example(kind, x)

    def batches():
        yield xe, y

    c = curve(model, sa, sb_aligned, batches, points=25)
    with torch.no_grad():
        model.load_state_dict(sb)
        fb = model(xe)
        model.load_state_dict(sb_aligned)
        fp = model(xe)
    change = float((fp - fb).abs().max() / fb.abs().max())
    return {"loss_barrier": c.loss_barrier, "acc_barrier": c.acc_barrier, "function_change": change,
            "loss_a": c.loss[0], "loss_b": c.loss[-1], "acc_a": c.acc[0], "acc_b": c.acc[-1]}


def symalign_align(model, kind, sa, sb, x, seed: int = 0, scales: bool = True,
                   gauge: str = "raw") -> tuple[dict, dict]:
    """B aligned to A by ``match_whole`` on the traced spec (``seed``: its sweep order; ``scales=False``:
    the ReLU units' positive scales dropped from the spec, permutations only, as rebasin matches;
    ``gauge``: match_whole's gauge, ``"balanced"`` to match in the ReLU units' balanced gauge)."""
    import dataclasses

    from symalign.groups import Permutation, PositiveMonomial
    from symalign.match.whole import match_whole
    from symalign.tracing import trace

    t0 = time.perf_counter()
    res = trace(model, example(kind, x[:8]))
    spec = res.spec
    if not scales:
        spec = dataclasses.replace(spec, spaces={k: Permutation(g.n) if isinstance(g, PositiveMonomial) else g
                                                 for k, g in spec.spaces.items()})
    m = match_whole(spec, sa, sb, seed=seed, gauge=gauge)
    out = m.apply(sb)
    info = {"seconds": time.perf_counter() - t0, "sweeps": m.iterations, "converged": m.converged,
            "spaces": spec.describe(), "skipped": [str(s) for s in res.skipped]}
    return out, info


def weight_terms(sa: dict, sb: dict) -> dict:
    """The weight-matching objective, over every parameter: ``distance = sum_t ||A_t - B'_t||^2`` (what
    symalign minimises) and ``inner = sum_t <A_t, B'_t>`` (what rebasin maximises; for permutations
    ``distance = |A|^2 + |B|^2 - 2 inner``, so the two rank permutation solutions alike)."""
    return {"distance": float(sum(float((sa[k].double() - sb[k].double()).pow(2).sum()) for k in sa)),
            "inner": float(sum(float((sa[k].double() * sb[k].double()).sum()) for k in sa))}


def _stats(values: list[float]) -> dict:
    return {"mean": sum(values) / len(values), "min": min(values), "max": max(values), "n": len(values)}


def summarise(pairs: list[dict], peers: list[str]) -> dict:
    """Per-row statistics over the seed pairs: each tool's default run (symalign order seed 0, a peer's
    first run) and its mean over all its runs on a pair; per-pair wins of symalign over each peer."""
    def default(p, tool):
        return p[tool]["runs"][0]

    def ok(r):
        return "loss_barrier" in r and r.get("status", "ok") == "ok"

    out: dict = {"pairs": len(pairs), "naive": _stats([p["naive"]["loss_barrier"] for p in pairs])}
    tools = ["symalign"] + [t for t in ("symalign_perm", "symalign_balanced") if all(t in p for p in pairs)] + peers
    for tool in tools:
        if not all(all(ok(r) for r in p[tool]["runs"]) for p in pairs if tool in p):
            out[tool] = {"status": "; ".join(sorted({str(r.get("status")) for p in pairs
                                                     for r in p.get(tool, {}).get("runs", []) if not ok(r)}))}
            continue
        if not all(tool in p for p in pairs):
            continue
        runs_mean = [sum(r["loss_barrier"] for r in p[tool]["runs"]) / len(p[tool]["runs"]) for p in pairs]
        best = [min(p[tool]["runs"], key=lambda r: r["distance"])["loss_barrier"] for p in pairs]
        out[tool] = {"default": _stats([default(p, tool)["loss_barrier"] for p in pairs]),
                     "all_runs": _stats(runs_mean),
                     "best_by_distance": _stats(best),
                     "distance": _stats([default(p, tool)["distance"] for p in pairs]),
                     "function_change_max": max(r["function_change"] for p in pairs for r in p[tool]["runs"]),
                     "runs_per_pair": len(pairs[0][tool]["runs"])}
    for peer in peers:
        if "default" not in out.get(peer, {}):
            continue
        out[f"wins_vs_{peer}"] = {
            "default": sum(default(p, "symalign")["loss_barrier"] <= default(p, peer)["loss_barrier"] for p in pairs),
            "all_runs": sum(sum(r["loss_barrier"] for r in p["symalign"]["runs"]) / len(p["symalign"]["runs"])
                            <= sum(r["loss_barrier"] for r in p[peer]["runs"]) / len(p[peer]["runs"]) for p in pairs),
            "distance": sum(default(p, "symalign_perm" if "symalign_perm" in p else "symalign")["distance"]
                            <= default(p, peer)["distance"] for p in pairs)}
        if "default" in out.get("symalign_balanced", {}):
            out[f"balanced_wins_vs_{peer}"] = {
                "default": sum(default(p, "symalign_balanced")["loss_barrier"] <= default(p, peer)["loss_barrier"]
                               for p in pairs)}
    return out


def _cell(st: dict | None, key: str = "default") -> str:
    if not st:
        return "-"
    if key not in st:
        return str(st.get("status", "-"))
    v = st[key]
    return f"{v['mean']:.3f} ({v['min']:.3f}-{v['max']:.3f})" if v["n"] > 1 else f"{v['mean']:.3f}"


def peers_table(rows: list[dict], peers: list[str]) -> dict:
    """The docs table: per row, mean (range) over the seed pairs of each tool's test-loss barrier (default
    runs), per-pair wins, each tool's mean over its own runs, the weight distance reached (MLPs: symalign
    on permutations only, rebasin's group) and the largest function change."""
    from symalign.experiments.docs_tables import make_table

    flat = []
    for r in rows:
        s = r["summary"]
        f = {"model": r["model"], "pairs": s["pairs"], "naive": f"{s['naive']['mean']:.3f}",
             "symalign": _cell(s["symalign"]), "symalign_perm": _cell(s.get("symalign_perm"))}
        bal = s.get("symalign_balanced")
        if bal and "default" in bal:
            f["balanced"] = (f"{_cell(bal)}; {bal['all_runs']['mean']:.3f}; {bal['best_by_distance']['mean']:.3f}"
                             + "".join(f"; {s[f'balanced_wins_vs_{p}']['default']} of {s['pairs']}" for p in peers
                                       if f"balanced_wins_vs_{p}" in s))
        for p in peers:
            st, w = s.get(p, {}), s.get(f"wins_vs_{p}")
            f[p] = _cell(st)
            f[p + "_wins"] = f"{w['default']} of {s['pairs']} / {w['all_runs']} of {s['pairs']}" if w else "-"
            f[p + "_all"] = (f"{s['symalign']['all_runs']['mean']:.3f} / {st['all_runs']['mean']:.3f}"
                             if "all_runs" in st else "-")
            f[p + "_best"] = (f"{s['symalign']['best_by_distance']['mean']:.3f} / "
                              f"{st['best_by_distance']['mean']:.3f}" if "best_by_distance" in st else "-")
            d0 = s.get("symalign_perm", s["symalign"])["distance"]["mean"]
            f[p + "_dist"] = (f"{d0:.1f} / {st['distance']['mean']:.1f} ({w['distance']} of {s['pairs']})"
                              if "distance" in st else "-")
            fn = max(s[t]["function_change_max"] for t in ("symalign", "symalign_perm", "symalign_balanced")
                     if "function_change_max" in s.get(t, {}))
            f[p + "_fn"] = (f"{fn:.1e} / {st['function_change_max']:.1e}"
                            if "function_change_max" in st else "-")
        flat.append(f)
    cols = [("model", "model"), ("pairs", "seed pairs"), ("naive", "unaligned"), ("symalign", "symalign")]
    for p in peers:
        cols += [(p, p), (p + "_wins", f"pairs with symalign <= {p}: default runs / means of runs"),
                 (p + "_all", f"mean of all runs: symalign / {p}"),
                 (p + "_best", f"run with the lowest weight distance (restarts): symalign / {p}")]
    cols += [("symalign_perm", "symalign, permutations only")]
    if any("balanced" in f for f in flat):
        cols += [("balanced", "symalign, balanced gauge: default (range); mean of all runs; lowest-distance run"
                  + "".join(f"; pairs <= {p}" for p in peers))]
    for p in peers:
        cols += [(p + "_dist", f"weight distance: symalign (MLPs: permutations only) / {p} (pairs lower)"),
                 (p + "_fn", f"max function change: symalign (every variant) / {p}")]
    return make_table(flat, cols)


def peer_version(python: str, peer: str) -> str | None:
    r = subprocess.run([python, "-c", f"from importlib.metadata import version; print(version({peer!r}))"],
                       capture_output=True, text=True, timeout=300)
    return r.stdout.strip() if r.returncode == 0 else None


def one_pair(kind: str, depth: int, epochs: int, seeds: tuple[int, int], data, args, peers, missing) -> dict:
    """Train A and B from ``seeds``, align B to A with every tool, measure."""
    t0 = time.perf_counter()
    ma, mb = train(kind, depth, seeds[0], data, epochs), train(kind, depth, seeds[1], data, epochs)
    sa = {k: v.detach().clone() for k, v in ma.state_dict().items()}
    sb = {k: v.detach().clone() for k, v in mb.state_dict().items()}
    pair = {"seeds": list(seeds), "train_s": time.perf_counter() - t0}
    pair["naive"] = {**measure(ma, kind, sa, sb, sb, data[1]), **weight_terms(sa, sb)}
    runs = []
    for order_seed in range(args.symalign_orders):  # the default run is order seed 0
        out, info = symalign_align(ma, kind, sa, sb, data[0][0], seed=order_seed)
        runs.append({**measure(ma, kind, sa, out, sb, data[1]), **weight_terms(sa, out), **info,
                     "order_seed": order_seed})
    pair["symalign"] = {"runs": runs}
    if args.balanced:
        runs = []
        for order_seed in range(args.symalign_orders):
            out, info = symalign_align(ma, kind, sa, sb, data[0][0], seed=order_seed, gauge="balanced")
            runs.append({**measure(ma, kind, sa, out, sb, data[1]), **weight_terms(sa, out), **info,
                         "order_seed": order_seed})
        pair["symalign_balanced"] = {"runs": runs}
    if kind == "mlp":  # the same solver on rebasin's group: permutations only
        out, info = symalign_align(ma, kind, sa, sb, data[0][0], seed=0, scales=False)
        pair["symalign_perm"] = {"runs": [{**measure(ma, kind, sa, out, sb, data[1]), **weight_terms(sa, out),
                                           **info, "order_seed": 0}]}
    for p in peers:
        if missing[p]:
            pair[p] = {"status": "absent", "why": missing[p], "runs": []}
            continue
        runs = []
        for rep in range(args.repeats):  # torch seed ``rep`` before each run: rebasin draws its order from it
            res = run_peer(args.peers_python, p, kind, depth, sa, sb, example(kind, data[0][0][:64]),
                           args.peer_timeout, seed=rep)
            state = res.pop("state", None)
            if state is not None:
                res.update(measure(ma, kind, sa, state, sb, data[1]))
                res.update(weight_terms(sa, state))
                if not res["function_change"] <= 1e-4:
                    res["status"] = "changed the function"
            runs.append(res)
        pair[p] = {"runs": runs}
    return pair


def resummarise(path: Path) -> None:
    """Rewrite the summaries and the table of a results file from its stored runs."""
    from symalign.atomic import write_json
    from symalign.provenance import provenance

    res = json.loads(path.read_text())
    peers = [p for p in res["meta"].get("peers", {"rebasin": {}}) if res["meta"].get("peers", {}).get(p, {}).get("version")]
    for row in res["rows"]:
        row["summary"] = summarise(row["pairs"], peers)
    res["tables"] = {"barriers": peers_table(res["rows"], peers)}
    res["provenance"]["resummarised"] = {k: v for k, v in provenance(threads=1).items() if k in ("commit", "command", "date")}
    write_json(path, res)
    print(f"rewrote the summaries and the table of {path}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(HERE.parent.parent / "results" / "peers.json"),
                    help="JSON results file (default: the repository's results/peers.json, rendered into docs/results.md)")
    ap.add_argument("--peers-python", default="/work/peers-venv/bin/python",
                    help="python of the environment the peers are installed in")
    ap.add_argument("--mlp-depths", default="2,3,4", help="hidden layers of the MLP rows")
    ap.add_argument("--vit-depths", default="2", help="encoder layers of the ViT rows ('' for none)")
    ap.add_argument("--mlp-epochs", type=int, default=30)
    ap.add_argument("--vit-epochs", type=int, default=40)
    ap.add_argument("--peer-timeout", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=0, help="data split seed; pair k trains A, B from seeds "
                    "seed + 2k + 1, seed + 2k + 2")
    ap.add_argument("--pairs", type=int, default=5, help="independently trained seed pairs per row")
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs of each peer on each pair, torch seed 0..N-1 before each (its run-to-run spread; "
                         "the default run is the first)")
    ap.add_argument("--symalign-orders", type=int, default=3,
                    help="sweep-order seeds 0..N-1 of symalign's match_whole (its spread; the default run is "
                         "seed 0, match_whole's default)")
    ap.add_argument("--balanced", action=argparse.BooleanOptionalAction, default=True,
                    help="also run symalign with gauge='balanced' (same order seeds)")
    ap.add_argument("--resummarise", action="store_true",
                    help="recompute the summaries and the docs table of --out from its stored runs (no training "
                         "or aligning); the provenance records the commit and command of both")
    ap.add_argument("--peer-worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.peer_worker:
        peer_worker(Path(args.peer_worker))
        return
    if args.resummarise:
        resummarise(Path(args.out))
        return
    for name in ("repeats", "symalign_orders", "pairs"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    from symalign.atomic import write_json
    from symalign.provenance import provenance

    torch.set_num_threads(1)
    data = digits(args.seed)
    peers = ["rebasin"]
    missing = {p: peer_available(args.peers_python, p) for p in peers}
    for p, why in missing.items():
        if why:
            print(f"skipping peer {p}: {why}", file=sys.stderr)
    rows = []
    jobs = [("mlp", int(k), args.mlp_epochs) for k in args.mlp_depths.split(",") if k] + \
           [("vit", int(k), args.vit_epochs) for k in args.vit_depths.split(",") if k]
    for kind, depth, epochs in jobs:
        pairs = []
        for k in range(args.pairs):
            seeds = (args.seed + 2 * k + 1, args.seed + 2 * k + 2)
            pair = one_pair(kind, depth, epochs, seeds, data, args, peers, missing)
            pairs.append(pair)
            cells = [f"{kind}-{depth} seeds {seeds}: naive {pair['naive']['loss_barrier']:.3f}",
                     "symalign " + " / ".join(f"{x['loss_barrier']:.3f}" for x in pair["symalign"]["runs"])]
            if "symalign_perm" in pair:
                cells.append(f"symalign perm. only {pair['symalign_perm']['runs'][0]['loss_barrier']:.3f}")
            for p in peers:
                cells.append(f"{p} " + (" / ".join(f"{x['loss_barrier']:.3f}" if "loss_barrier" in x
                                                  else str(x.get("status")) for x in pair[p]["runs"])
                                        or pair[p]["status"]))
            print("; ".join(cells), flush=True)
        rows.append({"model": f"{kind}-{depth}", "test_items": len(data[1][1]), "pairs": pairs,
                     "summary": summarise(pairs, [p for p in peers if not missing[p]])})
    meta = {"torch": torch.__version__, "data": "scikit-learn digits, 1300 train / 497 test, seed "
            f"{args.seed}", "points": 25, "threads": 1,
            "peers": {p: {"python": args.peers_python, "version": None if missing[p] else
                          peer_version(args.peers_python, p)} for p in peers}}
    write_json(args.out, {"meta": meta, "rows": rows, "provenance": provenance(threads=1, seed_pairs=args.pairs),
                          "tables": {"barriers": peers_table(rows, [p for p in peers if not missing[p]])}})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
