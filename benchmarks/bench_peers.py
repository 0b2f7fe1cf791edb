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


def run_peer(python: str, peer: str, kind: str, depth: int, sa, sb, x, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        (d / "job.json").write_text(json.dumps({"peer": peer, "kind": kind, "depth": depth}))
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


def symalign_align(model, kind, sa, sb, x, seed: int = 0) -> tuple[dict, dict]:
    """B aligned to A by ``match_whole`` on the traced spec (``seed``: its sweep order)."""
    from symalign.match.whole import match_whole
    from symalign.tracing import trace

    t0 = time.perf_counter()
    res = trace(model, example(kind, x[:8]))
    m = match_whole(res.spec, sa, sb, seed=seed)
    out = m.apply(sb)
    info = {"seconds": time.perf_counter() - t0, "sweeps": m.iterations, "converged": m.converged,
            "spaces": res.spec.describe(), "skipped": [str(s) for s in res.skipped]}
    return out, info


def peers_table(rows: list[dict], peers: list[str]) -> dict:
    """The docs table: endpoints, unaligned / symalign / peer test-loss barriers, function changes."""
    from symalign.experiments.docs_tables import make_table

    flat = []
    for r in rows:
        f = {"model": r["model"], "acc": f"{100 * r['naive']['acc_a']:.1f} / {100 * r['naive']['acc_b']:.1f} %",
             "naive": r["naive"]["loss_barrier"], "symalign": r["symalign"]["loss_barrier"],
             "symalign_fn": r["symalign"]["function_change"],
             "symalign_runs": " / ".join(f"{x['loss_barrier']:.3f}" for x in r["symalign"].get("runs", [r["symalign"]]))}
        for p in peers:
            f[p] = r[p].get("loss_barrier", r[p].get("status"))
            f[p + "_fn"] = r[p].get("function_change")
            f[p + "_runs"] = " / ".join(f"{x['loss_barrier']:.3f}" if "loss_barrier" in x else str(x.get("status"))
                                        for x in r[p].get("runs", [r[p]]))
        flat.append(f)
    cols = [("model", "model"), ("acc", "test acc A / B"), ("naive", "unaligned", ".3f"),
            ("symalign", "symalign", ".3f"), ("symalign_runs", "symalign (all order seeds)", ""),
            ("symalign_fn", "function change symalign", ".1e")]
    for p in peers:
        cols += [(p, p, ".3f" if all(isinstance(f[p], float) for f in flat) else ""),
                 (p + "_fn", f"function change {p}", ".1e"), (p + "_runs", f"{p} (all runs)", "")]
    return make_table(flat, cols)


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
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=2,
                    help="runs of each peer on the same weights (its run-to-run spread; the table's peer column "
                         "is the first run, the 'all runs' column lists every run)")
    ap.add_argument("--symalign-orders", type=int, default=3,
                    help="sweep-order seeds 0..N-1 of symalign's match_whole (its spread; the table's symalign "
                         "column is seed 0, the default, the 'all order seeds' column lists every one)")
    ap.add_argument("--peer-worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.symalign_orders < 1:
        ap.error(f"--symalign-orders must be at least 1, got {args.symalign_orders}")
    if args.peer_worker:
        peer_worker(Path(args.peer_worker))
        return
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
        t0 = time.perf_counter()
        ma, mb = train(kind, depth, args.seed + 1, data, epochs), train(kind, depth, args.seed + 2, data, epochs)
        sa = {k: v.detach().clone() for k, v in ma.state_dict().items()}
        sb = {k: v.detach().clone() for k, v in mb.state_dict().items()}
        row = {"model": f"{kind}-{depth}", "train_s": time.perf_counter() - t0, "test_items": len(data[1][1])}
        row["naive"] = measure(ma, kind, sa, sb, sb, data[1])
        runs = []
        for order_seed in range(args.symalign_orders):  # the table's column is order seed 0, the default
            out, info = symalign_align(ma, kind, sa, sb, data[0][0], seed=order_seed)
            runs.append({**measure(ma, kind, sa, out, sb, data[1]), **info, "order_seed": order_seed})
        row["symalign"] = {**runs[0], "runs": runs}
        for p in peers:
            if missing[p]:
                row[p] = {"status": "absent", "why": missing[p]}
                continue
            runs = []
            for _ in range(args.repeats):  # the same inputs every time: the spread is the peer's own
                res = run_peer(args.peers_python, p, kind, depth, sa, sb, example(kind, data[0][0][:64]),
                               args.peer_timeout)
                state = res.pop("state", None)
                if state is not None:
                    res.update(measure(ma, kind, sa, state, sb, data[1]))
                    if not res["function_change"] <= 1e-4:
                        res["status"] = "changed the function"
                runs.append(res)
            row[p] = {**runs[0], "runs": runs}
        rows.append(row)
        cells = [f"{row['model']}: naive {row['naive']['loss_barrier']:.3f}",
                 f"symalign {row['symalign']['loss_barrier']:.3f} (fn {row['symalign']['function_change']:.1e})",
                 "symalign all order seeds " + " / ".join(f"{x['loss_barrier']:.3f}" for x in row["symalign"]["runs"])]
        for p in peers:
            r = row[p]
            cells.append(f"{p} {r['loss_barrier']:.3f} (fn {r['function_change']:.1e})" if "loss_barrier" in r
                         else f"{p} {r['status']}")
            cells.append(f"{p} all runs " + " / ".join(f"{x['loss_barrier']:.3f}" if "loss_barrier" in x
                                                      else str(x.get("status")) for x in r.get("runs", [r])))
        print("; ".join(cells), flush=True)
    meta = {"torch": torch.__version__, "data": "scikit-learn digits, 1300 train / 497 test, seed "
            f"{args.seed}", "points": 25, "threads": 1}
    write_json(args.out, {"meta": meta, "rows": rows, "provenance": provenance(threads=1, seed_pairs=1),
                          "tables": {"barriers": peers_table(rows, peers)}})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
