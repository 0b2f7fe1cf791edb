"""symalign vs peer re-basin tools on the same trained weights (scikit-learn digits): the benchmark set.

For each row: train two models A, B from different seeds (same data, seeded), align B
to A with symalign (``symalign.trace`` + ``match_whole`` on the traced spec; every variant
of :data:`VARIANTS`, the ``symalign`` column being the one that is ``match_whole``'s default)
and with each installed peer's default run, and measure on the held-out split

* the test-loss barrier of the linear path A -> B' (``symalign.jobs.module_curve``, 25
  points; BatchNorm statistics recomputed on the training split at every point where the
  model has BatchNorm), the unaligned (naive) barrier A -> B, and, for the unaligned pair
  and the default runs, the barrier with REPAIR;
* the function change ``max |f_B'(x) - f_B(x)| / max |f_B(x)|`` over the test set, in eval
  mode as stored (an exact alignment keeps it at float32 rounding, ~1e-6) and after a
  BatchNorm reset of both (a peer that only keeps the function once the statistics are
  recomputed is recorded as such);
* the weight distance reached and the wall time of the alignment (symalign: trace and
  match; rebasin: its tracing and descent), one thread.

Rows (``--rows``): ReLU MLPs 64 -> 128^k -> 10 (``mlp-k``), LayerNorm+GELU MLPs
(``lnmlp-k``), a VGG (conv-ReLU x2, pool, twice; flatten; two Linear layers), a narrow
torchvision-style ResNet (BasicBlocks with BatchNorm and 1x1 projection shortcuts, widths
16/32/64) and ViTs built from ``nn.TransformerEncoderLayer`` (``vit-k``: 8x8 digits in 2x2
patches, CLS token, learned positions); 5 seed pairs each. The results file is rewritten
after every pair, so a stopped run keeps what it measured.

Peers run in their own virtual environment (``--peers-python``, default
``/work/peers-venv/bin/python``) in a subprocess, so they never touch symalign's
environment; a peer that is absent is skipped with a message, and a peer that raises,
times out or changes the function is recorded as such.

    OMP_NUM_THREADS=1 python benchmarks/bench_peers.py --out results/peers.json
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


class BasicBlock(nn.Module):
    """torchvision's BasicBlock: conv-BN-ReLU-conv-BN plus the identity or a 1x1-conv-BN projection."""

    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + identity)


class ResNet(nn.Module):
    """A narrow torchvision-style ResNet (stem, three stages of one BasicBlock, widths 16/32/64, pooled head)."""

    def __init__(self, widths=(16, 32, 64), classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, widths[0], 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        blocks, cin = [], widths[0]
        for i, w in enumerate(widths):
            blocks.append(BasicBlock(cin, w, 1 if i == 0 else 2))
            cin = w
        self.layer1, self.layer2, self.layer3 = blocks
        self.fc = nn.Linear(widths[-1], classes)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


class VGG(nn.Module):
    """(conv-ReLU x2, max pool) twice, flatten (a 2x2 map per channel), two Linear layers."""

    def __init__(self, c=(16, 32), hidden=64, classes=10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, c[0], 3, padding=1), nn.ReLU(), nn.Conv2d(c[0], c[0], 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(c[0], c[1], 3, padding=1), nn.ReLU(), nn.Conv2d(c[1], c[1], 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2))
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(c[1] * 4, hidden), nn.ReLU(),
                                        nn.Linear(hidden, classes))

    def forward(self, x):
        return self.classifier(self.features(x))


KINDS = ("mlp", "lnmlp", "vgg", "resnet", "vit")
WIDTH = 128


def build(kind: str, depth: int) -> nn.Module:
    """``mlp``: 64 -> 128^depth -> 10 with ReLU; ``lnmlp``: each hidden layer Linear -> LayerNorm -> GELU;
    ``vgg``, ``resnet`` (depth ignored); ``vit``: ``depth`` encoder layers."""
    if kind in ("mlp", "lnmlp"):
        layers: list[nn.Module] = []
        width = 64
        for _ in range(depth):
            layers += [nn.Linear(width, WIDTH), nn.ReLU()] if kind == "mlp" else \
                [nn.Linear(width, WIDTH), nn.LayerNorm(WIDTH), nn.GELU()]
            width = WIDTH
        return nn.Sequential(*layers, nn.Linear(width, 10))
    if kind == "vgg":
        return VGG()
    if kind == "resnet":
        return ResNet()
    return DigitsViT(layers=depth)


def example(kind: str, x: torch.Tensor) -> torch.Tensor:
    """The model's input for flat digits ``x`` (N, 64)."""
    if kind in ("mlp", "lnmlp"):
        return x
    return x.reshape(-1, 8, 8) if kind == "vit" else x.reshape(-1, 1, 8, 8)


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
            t0 = time.perf_counter()  # the alignment alone: rebasin's tracing and its descent
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


LR = {"mlp": 1e-3, "lnmlp": 1e-3, "vgg": 1e-3, "resnet": 1e-3, "vit": 2e-3}


def train(kind: str, depth: int, seed: int, data, epochs: int) -> nn.Module:
    torch.manual_seed(seed)
    model = build(kind, depth)
    (x, y), _ = data
    opt = torch.optim.Adam(model.parameters(), lr=LR[kind])
    g = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(epochs):
        for idx in torch.randperm(len(y), generator=g).split(64):
            loss = nn.functional.cross_entropy(model(example(kind, x[idx])), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model.eval()


def _batches(kind, split, size: int = 325):
    x, y = split

    def gen():
        for lo in range(0, len(y), size):
            yield example(kind, x[lo:lo + size]), y[lo:lo + size]
    return gen


def curve_of(model, kind, sa, sb, data, repair: bool = False):
    """The 25-point test-loss curve A -> B (``symalign.jobs.module_curve``: BatchNorm statistics recomputed on
    the training split at every point where the model has BatchNorm; ``repair``: REPAIR as well)."""
    from symalign.jobs.module_curve import module_curve

    return module_curve(model, sa, sb, _batches(kind, data[1]), _batches(kind, data[0]), points=25, repair=repair)


def function_change(model, kind, sb, sb_aligned, data) -> dict:
    """``max |f_B'(x) - f_B(x)| / max |f_B(x)|`` on the test set in eval mode as stored (no BatchNorm reset), and
    with both models' BatchNorm statistics recomputed on the training split (``after_reset``; equal without
    BatchNorm)."""
    from symalign.jobs.module_curve import has_batchnorm, reset_batchnorm

    xe = example(kind, data[1][0])
    out = {}
    for label, reset in (("as_stored", False), ("after_reset", True)):
        if reset and not has_batchnorm(model):
            out[label] = out["as_stored"]
            continue
        ys = []
        for st in (sb, sb_aligned):
            model.load_state_dict(st)
            if reset:
                reset_batchnorm(model, _batches(kind, data[0]))
            with torch.no_grad():
                ys.append(model.eval()(xe))
        out[label] = float((ys[1] - ys[0]).abs().max() / ys[0].abs().max())
    return out


def measure(model, kind, sa, sb_aligned, sb, data, repair: bool = False) -> dict:
    c = curve_of(model, kind, sa, sb_aligned, data)
    fc = function_change(model, kind, sb, sb_aligned, data)
    res = {"loss_barrier": c.curve.loss_barrier, "acc_barrier": c.curve.acc_barrier, "bn_reset": c.bn_reset,
           "function_change": fc["as_stored"], "function_change_after_reset": fc["after_reset"],
           "loss_a": c.curve.loss[0], "loss_b": c.curve.loss[-1], "acc_a": c.curve.acc[0], "acc_b": c.curve.acc[-1]}
    if repair:
        res["repair_loss_barrier"] = curve_of(model, kind, sa, sb_aligned, data, repair=True).curve.loss_barrier
    return res


VARIANTS = {  # name -> (match_whole keyword arguments, keep the ReLU scales); run where they differ (has_scales)
    "raw": ({"gauge": "raw", "start": "anchored"}, True),
    "balanced": ({"gauge": "balanced", "start": "anchored"}, True),
    "identity": ({"gauge": "raw", "start": "identity"}, True),
    "perm": ({"gauge": "raw", "start": "anchored"}, False),
    "raw-rtol-1e-6": ({"gauge": "raw", "start": "anchored", "rtol": 1e-6}, True),  # the default before issue 32
}
SCALED_ONLY = ("balanced", "perm")  # the same as "raw" without ReLU scale spaces


def default_variant(has_scales: bool) -> str:
    """The variant that is ``match_whole``'s default call (its signature's defaults, read now: a results file
    resummarised after a default changed names the new default's runs)."""
    import inspect

    from symalign.match.whole import match_whole

    sig = inspect.signature(match_whole).parameters
    want = {k: sig[k].default for k in ("gauge", "start", "rtol")}
    for name, (kw, scales) in VARIANTS.items():
        got = {k: kw.get(k, want[k]) for k in want}
        if scales and (got == want or (not has_scales and got["start"] == want["start"]
                                       and got["rtol"] == want["rtol"] and name not in SCALED_ONLY)):
            return name
    raise SystemExit(f"no benchmark variant is match_whole's default {want}; add it to VARIANTS")


def symalign_align(model, kind, sa, sb, x, variant: str, seed: int = 0) -> tuple[dict, dict]:
    """B aligned to A by ``match_whole`` on the traced spec with the variant's options (``perm``: the ReLU
    units' positive scales dropped from the spec, permutations only, as rebasin matches)."""
    import dataclasses

    from symalign.groups import Permutation, PositiveMonomial
    from symalign.match.whole import match_whole
    from symalign.tracing import trace

    kw, scales = VARIANTS[variant]
    t0 = time.perf_counter()
    res = trace(model, example(kind, x[:8]))
    spec = res.spec
    if not scales:
        spec = dataclasses.replace(spec, spaces={k: Permutation(g.n) if isinstance(g, PositiveMonomial) else g
                                                 for k, g in spec.spaces.items()})
    m = match_whole(spec, sa, sb, seed=seed, **kw)
    out = m.apply(sb)
    info = {"seconds": time.perf_counter() - t0, "sweeps": m.iterations, "converged": m.converged,
            "distances": m.distances, "notes": m.notes, "skipped": [str(s) for s in res.skipped]}
    return out, info


def has_scale_spaces(model, kind, x) -> bool:
    from symalign.groups import PositiveMonomial
    from symalign.tracing import trace

    return any(isinstance(g, PositiveMonomial) for g in trace(model, example(kind, x[:8])).spec.spaces.values())


def weight_terms(sa: dict, sb: dict) -> dict:
    """The weight-matching objective over every floating tensor: ``distance = sum_t ||A_t - B'_t||^2``."""
    return {"distance": float(sum(float((sa[k].double() - sb[k].double()).pow(2).sum()) for k in sa
                                  if sa[k].is_floating_point()))}


def _stats(values: list[float]) -> dict:
    return {"mean": sum(values) / len(values), "min": min(values), "max": max(values), "n": len(values)}


def summarise(pairs: list[dict], peers: list[str]) -> dict:
    """Per-row statistics over the seed pairs: each symalign variant, ``symalign`` = the variant that is
    match_whole's default now; each peer's default run (its first); per-pair comparisons and time ratios."""
    scaled = pairs[0].get("has_scales", True)
    out: dict = {"pairs": len(pairs), "naive": _stats([p["naive"]["loss_barrier"] for p in pairs]),
                 "default_variant": default_variant(scaled)}
    if all("repair_loss_barrier" in p["naive"] for p in pairs):
        out["naive_repair"] = _stats([p["naive"]["repair_loss_barrier"] for p in pairs])
    tools = [f"symalign_{v}" for v in VARIANTS if all(f"symalign_{v}" in p for p in pairs)] + peers
    for tool in tools:
        runs = [p[tool]["runs"][0] for p in pairs if p.get(tool, {}).get("runs")]
        broken = sum(r.get("status") == "changed the function" for r in runs)
        if tool in peers:  # a run that changed B's function has no barrier between A and B: left out
            runs = [r for r in runs if r.get("status") != "changed the function"]
        if not runs or len(runs) + (broken if tool in peers else 0) < len(pairs) \
                or not all("loss_barrier" in r for r in runs):
            why = sorted({str(r.get("status")) for r in runs if "loss_barrier" not in r})
            out[tool] = {"status": "; ".join(why) or (f"changed the function on {broken} of {len(pairs)} pairs"
                                                      if broken else "absent"), "changed_function": broken}
            continue
        st = {"default": _stats([r["loss_barrier"] for r in runs]), "distance": _stats([r["distance"] for r in runs]),
              "seconds": _stats([r["seconds"] for r in runs]),
              "function_change_max": max(r["function_change"] for r in runs),
              "function_change_after_reset_max": max(r["function_change_after_reset"] for r in runs),
              "changed_function": broken, "valid": len(runs)}
        if all("repair_loss_barrier" in r for r in runs):
            st["repair"] = _stats([r["repair_loss_barrier"] for r in runs])
        if all("converged" in r for r in runs):
            st["converged"] = sum(bool(r["converged"]) for r in runs)
            st["sweeps"] = _stats([r["sweeps"] for r in runs])
        out[tool] = st
    out["symalign"] = out.get(f"symalign_{out['default_variant']}", {"status": "absent"})
    for peer in peers:
        if "default" not in out["symalign"] or not all(p.get(peer, {}).get("runs") for p in pairs):
            continue
        both = [(p, p[f"symalign_{out['default_variant']}"]["runs"][0], p[peer]["runs"][0]) for p in pairs]
        timed = [(a, b) for _, a, b in both if "seconds" in b and b.get("status") in ("ok", "changed the function")]
        valid = [(p, a, b) for p, a, b in both if "loss_barrier" in b and b.get("status") == "ok"]
        changed = sum(b.get("status") == "changed the function" for _, _, b in both)
        vs = {"valid": len(valid), "changed_function": changed,
              "time_ratio": _stats([a["seconds"] / b["seconds"] for a, b in timed]) if timed else None}
        if valid:  # compared on the pairs where the peer kept the function
            vs.update(at_or_below=sum(a["loss_barrier"] <= b["loss_barrier"] for _, a, b in valid),
                      mean_at_or_below=sum(a["loss_barrier"] for _, a, _ in valid)
                      <= sum(b["loss_barrier"] for _, _, b in valid),
                      **{f"{v}_at_or_below": sum(p[f"symalign_{v}"]["runs"][0]["loss_barrier"] <= b["loss_barrier"]
                                                 for p, _, b in valid)
                         for v in VARIANTS if all(f"symalign_{v}" in p for p in pairs)})
        out[f"vs_{peer}"] = vs
    return out


def _mean(st: dict | None, key: str = "default", fmt: str = ".3f") -> str:
    if not st:
        return "-"
    if key not in st:
        return str(st.get("status", "-"))
    return format(st[key]["mean"], fmt)


def peers_table(rows: list[dict], peers: list[str]) -> dict:
    """The docs table: per row, the mean over the seed pairs of the test-loss barrier of the unaligned pair,
    symalign's default, rebasin's default run, pairs at or below, time ratio, the other variants, REPAIR."""
    from symalign.experiments.docs_tables import make_table

    flat = []
    for r in rows:
        s = r["summary"]
        n = s["pairs"]
        f = {"model": r["model"], "pairs": n, "naive": f"{s['naive']['mean']:.3f}", "default": s["default_variant"],
             "symalign": _mean(s["symalign"])}
        for v in VARIANTS:
            f[v] = _mean(s.get(f"symalign_{v}"))
        for p in peers:
            st, w = s.get(p, {}), s.get(f"vs_{p}") or {}
            f[p] = _mean(st)
            if st.get("changed_function") and "default" in st:
                f[p] += f" ({st['changed_function']} of {n} changed the function)"
            f[p + "_wins"] = (f"{w['at_or_below']} of {w['valid']}" if "at_or_below" in w else "-") + (
                f" ({w['changed_function']} n/a)" if w.get("changed_function") else "")
            f[p + "_var_wins"] = " / ".join(f"{w.get(f'{v}_at_or_below', '-')}" for v in VARIANTS) if w else "-"
            secs = [pp[p]["runs"][0]["seconds"] for pp in r["pairs"] if "seconds" in pp.get(p, {}).get("runs", [{}])[0]]
            f[p + "_time"] = (f"{s['symalign']['seconds']['mean']:.2f} / {sum(secs) / len(secs):.2f} s "
                              f"({w['time_ratio']['mean']:.1f}x)") if w.get("time_ratio") and secs else "-"
            f[p + "_dist"] = (f"{s['symalign']['distance']['mean']:.1f} / {st['distance']['mean']:.1f}"
                              if "distance" in st and "distance" in s["symalign"] else "-")
        sym = s["symalign"]
        f["sweeps"] = (f"{sym['sweeps']['mean']:.1f}; {sym['converged']} of {n}" if "sweeps" in sym else "-")
        f["repair"] = " / ".join([_mean(s.get("naive_repair") and {"default": s["naive_repair"]}),
                                  _mean(sym, "repair")] + [_mean(s.get(p), "repair") for p in peers])
        fns = [s[t]["function_change_max"] for t in s if t.startswith("symalign_") and "function_change_max" in s[t]]
        f["fn"] = f"{max(fns):.1e}" if fns else "-"
        flat.append(f)
    cols = [("model", "model"), ("pairs", "seed pairs"), ("naive", "unaligned"),
            ("symalign", "symalign (default)")]
    for p in peers:
        cols += [(p, p), (p + "_wins", f"pairs symalign <= {p}"), (p + "_time", f"time: symalign / {p} (ratio)")]
    cols += [("default", "default variant"), ("sweeps", "sweeps; converged")]
    cols += [(v, f"variant {v}") for v in VARIANTS]
    for p in peers:
        cols += [(p + "_var_wins", f"pairs <= {p}: " + " / ".join(VARIANTS)),
                 (p + "_dist", f"weight distance: symalign / {p}")]
    cols += [("repair", "with REPAIR: unaligned / symalign / " + " / ".join(peers)),
             ("fn", "max function change, symalign (eval, as stored)")]
    return make_table(flat, cols)


def peer_version(python: str, peer: str) -> str | None:
    r = subprocess.run([python, "-c", f"from importlib.metadata import version; print(version({peer!r}))"],
                       capture_output=True, text=True, timeout=300)
    return r.stdout.strip() if r.returncode == 0 else None


def one_pair(kind: str, depth: int, epochs: int, seeds: tuple[int, int], data, args, peers, missing) -> dict:
    """Train A and B from ``seeds``, align B to A with every symalign variant and every peer, measure."""
    t0 = time.perf_counter()
    ma, mb = train(kind, depth, seeds[0], data, epochs), train(kind, depth, seeds[1], data, epochs)
    sa = {k: v.detach().clone() for k, v in ma.state_dict().items()}
    sb = {k: v.detach().clone() for k, v in mb.state_dict().items()}
    scaled = has_scale_spaces(ma, kind, data[0][0])
    pair = {"seeds": list(seeds), "train_s": time.perf_counter() - t0, "has_scales": scaled}
    pair["naive"] = {**measure(ma, kind, sa, sb, sb, data, repair=args.repair), **weight_terms(sa, sb)}
    default = default_variant(scaled)
    for v in VARIANTS:
        if v in SCALED_ONLY and not scaled:
            continue
        out, info = symalign_align(ma, kind, sa, sb, data[0][0], v)
        rec = {**measure(ma, kind, sa, out, sb, data, repair=args.repair and v == default), **weight_terms(sa, out),
               **info, "variant": v}
        if not rec["function_change"] <= 1e-4:
            rec["status"] = "changed the function"
        pair[f"symalign_{v}"] = {"runs": [rec]}
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
                res.update(measure(ma, kind, sa, state, sb, data, repair=args.repair and rep == 0))
                res.update(weight_terms(sa, state))
                if not res["function_change_after_reset"] <= 1e-4:
                    res["status"] = "changed the function"
            runs.append(res)
        pair[p] = {"runs": runs}
    return pair


def _peers_of(meta: dict) -> list[str]:
    return [p for p, v in meta.get("peers", {}).items() if v.get("version")]


def resummarise(path: Path) -> None:
    """Rewrite the summaries and the table of a results file from its stored runs (the ``symalign`` column is
    the variant that is match_whole's default now)."""
    from symalign.atomic import write_json
    from symalign.provenance import provenance

    res = json.loads(path.read_text())
    peers = _peers_of(res["meta"])
    for row in res["rows"]:
        row["summary"] = summarise(row["pairs"], peers)
    res["tables"] = {"barriers": peers_table(res["rows"], peers)}
    res["provenance"]["resummarised"] = {k: v for k, v in provenance(threads=1).items()
                                         if k in ("commit", "command", "date")}
    write_json(path, res)
    print(f"rewrote the summaries and the table of {path}")


EPOCHS = {"mlp": 30, "lnmlp": 30, "vgg": 20, "resnet": 15, "vit": 40}


def parse_rows(text: str) -> list[tuple[str, int]]:
    """``"mlp-2,lnmlp-4,vgg,resnet,vit-2"`` -> ``[("mlp", 2), ...]`` (depth 0 where the model has none)."""
    out = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        kind, _, depth = item.partition("-")
        if kind not in KINDS or (kind in ("mlp", "lnmlp", "vit") and not depth.isdigit()):
            raise SystemExit(f"bad row {item!r}: use mlp-K, lnmlp-K, vit-K, vgg or resnet")
        out.append((kind, int(depth) if depth else 0))
    return out


def row_name(kind: str, depth: int) -> str:
    return f"{kind}-{depth}" if kind in ("mlp", "lnmlp", "vit") else kind


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(HERE.parent.parent / "results" / "peers.json"),
                    help="JSON results file (default: the repository's results/peers.json, rendered into "
                         "docs/results.md); rewritten after every pair, so a stopped run keeps what it measured")
    ap.add_argument("--peers-python", default="/work/peers-venv/bin/python",
                    help="python of the environment the peers are installed in")
    ap.add_argument("--rows", default="mlp-2,mlp-4,mlp-6,mlp-8,lnmlp-2,lnmlp-4,lnmlp-6,lnmlp-8,vgg,resnet,vit-2",
                    help="rows: mlp-K / lnmlp-K (K hidden layers of 128, ReLU / LayerNorm+GELU), vgg, resnet, vit-K")
    ap.add_argument("--peer-timeout", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=0, help="data split seed; pair k trains A, B from seeds "
                    "seed + 2k + 1, seed + 2k + 2")
    ap.add_argument("--pairs", type=int, default=5, help="independently trained seed pairs per row")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of each peer on each pair, torch seed 0..N-1 before each (the default run is the "
                         "first)")
    ap.add_argument("--repair", action=argparse.BooleanOptionalAction, default=True,
                    help="also measure the curves of the unaligned pair and of the default runs with REPAIR")
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
    for name in ("repeats", "pairs"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    jobs = parse_rows(args.rows)
    from symalign.atomic import write_json
    from symalign.provenance import provenance

    torch.set_num_threads(1)
    data = digits(args.seed)
    peers = ["rebasin"]
    missing = {p: peer_available(args.peers_python, p) for p in peers}
    for p, why in missing.items():
        if why:
            print(f"skipping peer {p}: {why}", file=sys.stderr)
    live = [p for p in peers if not missing[p]]
    meta = {"torch": torch.__version__, "data": "scikit-learn digits, 1300 train / 497 test, seed "
            f"{args.seed}", "points": 25, "threads": 1, "epochs": EPOCHS, "lr": LR, "width": WIDTH,
            "variants": {k: {"options": kw, "scales": sc} for k, (kw, sc) in VARIANTS.items()},
            "peers": {p: {"python": args.peers_python, "version": None if missing[p] else
                          peer_version(args.peers_python, p)} for p in peers}}
    prov = provenance(threads=1, seed_pairs=args.pairs)
    rows: list[dict] = []
    for kind, depth in jobs:
        row = {"model": row_name(kind, depth), "test_items": len(data[1][1]), "pairs": []}
        rows.append(row)
        for k in range(args.pairs):
            seeds = (args.seed + 2 * k + 1, args.seed + 2 * k + 2)
            pair = one_pair(kind, depth, EPOCHS[kind], seeds, data, args, peers, missing)
            row["pairs"].append(pair)
            row["summary"] = summarise(row["pairs"], live)
            cells = [f"{row['model']} seeds {seeds}: naive {pair['naive']['loss_barrier']:.3f}"]
            cells += [f"{v} {pair[f'symalign_{v}']['runs'][0]['loss_barrier']:.3f} "
                      f"({pair[f'symalign_{v}']['runs'][0]['seconds']:.2f}s, "
                      f"{pair[f'symalign_{v}']['runs'][0]['sweeps']} sw)" for v in VARIANTS if f"symalign_{v}" in pair]
            for p in peers:
                cells.append(f"{p} " + (" / ".join(f"{x['loss_barrier']:.3f} ({x['seconds']:.2f}s)"
                                                  if "loss_barrier" in x else str(x.get("status"))
                                                  for x in pair[p]["runs"]) or pair[p]["status"]))
            print("; ".join(cells), flush=True)
            done = [r for r in rows if r["pairs"]]
            write_json(args.out, {"meta": meta, "rows": done, "provenance": prov,  # after every pair
                                  "tables": {"barriers": peers_table(done, live)}})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
