r"""Merging ReLU MLPs of different hidden widths: matched against unmatched (uniform) splitting.

For each seed pair, two ReLU MLPs ``64 -> h -> h -> 10`` are trained on sklearn's 8x8 digits
(:func:`symalign.data.images.load_digits_arrays`, pixels flattened): A at the wide width ``--wide`` (seed
``2k + 1``), B at the narrow width ``--narrow`` (seed ``2k + 2``), each ``--epochs`` epochs of Adam (``--lr``,
batches of 64). B is widened onto A's widths by splitting its units (:class:`symalign.groups.SemiPermutation`;
the widened B is checked to compute B's function, float64 and float32) and, for each method:

* ``matched`` / ``uniform``: the split fitted to A's units (:func:`symalign.match.widen.matched_split`) or the
  first units copied with equal shares (:func:`symalign.match.widen.uniform_split`);
* then weight-matched to A through the wide model's traced symmetries (positive monomials of the ReLU units,
  :func:`symalign.tracing.align.align_states`), or learned matching from that start
  (:func:`symalign.match.learned.learn_matching`, ``--learned-steps`` steps of its recipe on training batches,
  kept only if better than the weight matching on the validation split), or not aligned.

Reported on the test split (25 % of the images, 449): the loss barrier of the linear path from A to the widened
(aligned) B (:attr:`symalign.lmc.Curve.loss_barrier`, ``--points`` points), and the loss and accuracy of the
merged model (the path's midpoint, :func:`symalign.tracing.widths.merge_widths`), mean and sample standard
deviation over the pairs. Writes a result file (JSON, atomically) whose tables docs/whole-model.md shows::

    nice -n 10 python benchmarks/merge_widths.py --pairs 5 --out results/merge-widths.json

``--model vit`` runs the same on configs/vit-digits-rope.toml's ViT with ReLU FF units whose ``d_ff`` differ
(``--wide``/``--narrow``; images not flattened; e.g. ``--epochs 20 --lr 3e-3 --learned-steps 0``); no result of
it is published yet.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from symalign.atomic import write_json  # noqa: E402
from symalign.checkpoint.average import weighted_average  # noqa: E402
from symalign.data.images import load_digits_arrays  # noqa: E402
from symalign.experiments.docs_tables import make_table  # noqa: E402
from symalign.lmc import curve, evaluate  # noqa: E402
from symalign.provenance import provenance  # noqa: E402
from symalign.tracing.widths import merge_widths  # noqa: E402

METHODS = (("matched", "weight"), ("uniform", "weight"), ("matched", "learned"), ("uniform", "learned"),
           ("matched", "none"), ("uniform", "none"))
ALIGNMENTS = {"weight": "weight-matched", "learned": "learned matching", "none": "not aligned"}


VIT = {"family": "vit", "pe": "rope", "d_model": 32, "n_layers": 2, "n_heads": 4, "patch_size": 2, "pooling": "cls",
       "image_size": 8, "channels": 1, "n_classes": 10, "activation": "relu"}
"""``--model vit``: configs/vit-digits-rope.toml's ViT with ReLU FF units, its FF width ``d_ff`` varied."""


def make(kind: str, width: int, seed: int = 0) -> nn.Module:
    """The benchmark's model at hidden width ``width``: the MLP ``64 -> h -> h -> 10`` or the ViT with
    ``d_ff = width``."""
    if kind == "vit":
        from symalign.models import build_model

        return build_model({**VIT, "d_ff": width}, seed)
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


def train(kind: str, width: int, seed: int, data: dict, epochs: int, lr: float) -> nn.Module:
    torch.manual_seed(seed)
    model = make(kind, width, seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    x, y = data["x_train"], data["y_train"]
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        for idx in torch.randperm(len(y), generator=gen).split(64):
            opt.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    return model.eval()


def learned(kind: str, a: nn.Module, res, data: dict, steps: int, wide: int) -> tuple[dict, float]:
    """Learned matching (:func:`symalign.match.learned.learn_matching`, its recipe, ``steps`` steps) of the widened
    B to A, started from the weight matching: a fresh training batch of 64 every step (consecutive slices of
    per-epoch permutations), chosen against the weight matching on the validation split. Returns the aligned
    state and its relative logit change against the widened B on the test split (float32)."""
    from symalign.match.learned import learn_matching
    from symalign.spec import apply

    x, y, n = data["x_train"], data["y_train"], len(data["y_train"])

    def batch(step: int):
        epoch, i = divmod(step * 64, n)
        idx = torch.randperm(n, generator=torch.Generator().manual_seed(epoch))[i:i + 64]
        return x[idx], y[idx]

    wb = make(kind, wide)
    wb.load_state_dict(res.widened)
    lm = learn_matching(a, wb, batch, steps=steps, init=res.alignment.match,
                        select_batches=[(data["x_val"], data["y_val"])])
    out = apply(lm.spec, lm.transform, res.widened)
    with torch.no_grad():
        ref = wb(data["x_test"])
        wb.load_state_dict(out)
        change = float((wb(data["x_test"]) - ref).norm() / ref.norm())
    if change > 1e-5:
        raise SystemExit(f"learned matching changed the widened B's function by {change:.1e}")
    return out, change


def run_pair(k: int, args, data: dict) -> list[dict]:
    t0 = time.perf_counter()
    a = train(args.model, args.wide, 2 * k + 1, data, args.epochs, args.lr)
    b = train(args.model, args.narrow, 2 * k + 2, data, args.epochs, args.lr)
    sa = {n: v.detach() for n, v in a.state_dict().items()}
    sb = {n: v.detach() for n, v in b.state_dict().items()}
    test = [(data["x_test"], data["y_test"])]
    batches = lambda: test  # noqa: E731
    la, acc_a = evaluate(a, sa, batches)
    lb, acc_b = evaluate(b, sb, batches)
    rows = []
    for split, aligned in methods(args):
        res = merge_widths(make(args.model, args.wide), make(args.model, args.narrow), sa, sb, data["x_train"][:64],
                           split=split, align=aligned != "none")
        final, merged, change = res.aligned, res.state, None
        if aligned == "learned":
            final, change = learned(args.model, a, res, data, args.learned_steps, args.wide)
            merged = {n: weighted_average([sa[n], final[n]], [0.5, 0.5], sa[n].dtype) for n in sa}
        c = curve(make(args.model, args.wide), sa, final, batches, points=args.points)
        lm, acc_m = evaluate(make(args.model, args.wide), merged, batches)
        rows.append({"pair": k, "seeds": f"{2 * k + 1},{2 * k + 2}", "split": split, "aligned": aligned,
                     "method": f"{split} split, {ALIGNMENTS[aligned]}",
                     "loss_a": la, "loss_b": lb, "acc_a": acc_a, "acc_b": acc_b,
                     "widened_change_f64": res.widen_check.exact.rel, "widened_change_f32": res.widen_check.rel,
                     "learned_change_f32": change, "loss_barrier": c.loss_barrier, "merged_loss": lm,
                     "merged_acc": acc_m})
    print(f"pair {k}: {time.perf_counter() - t0:.1f}s; " + "; ".join(
        f"{r['method']}: barrier {r['loss_barrier']:.3f}" for r in rows), file=sys.stderr)
    return rows


def methods(args) -> tuple[tuple[str, str], ...]:
    """:data:`METHODS`, without learned matching when ``--learned-steps 0``."""
    return tuple(m for m in METHODS if args.learned_steps > 0 or m[1] != "learned")


def summary(rows: list[dict]) -> list[dict]:
    out = []
    for split, aligned in METHODS:
        sel = [r for r in rows if r["split"] == split and r["aligned"] == aligned]
        if not sel:
            continue
        row: dict = {"method": sel[0]["method"], "pairs": len(sel)}
        for key in ("loss_a", "loss_b", "loss_barrier", "merged_loss", "merged_acc"):
            vals = [r[key] for r in sel]
            row[key], row[key + "_std"] = statistics.mean(vals), statistics.stdev(vals) if len(vals) > 1 else None
        out.append(row)
    return out


def differences(rows: list[dict]) -> list[dict]:
    """Per alignment: the paired difference matched - uniform of the barrier and of the merged loss (mean, sample
    std) and the pairs where the matched split's barrier is lower."""
    out = []
    for aligned in ALIGNMENTS:
        by = {(r["pair"], r["split"]): r for r in rows if r["aligned"] == aligned}
        if not by:
            continue
        pairs = sorted({p for p, _ in by})
        db = [by[p, "matched"]["loss_barrier"] - by[p, "uniform"]["loss_barrier"] for p in pairs]
        dl = [by[p, "matched"]["merged_loss"] - by[p, "uniform"]["merged_loss"] for p in pairs]
        sd = (lambda v: statistics.stdev(v) if len(v) > 1 else None)  # noqa: E731
        out.append({"alignment": ALIGNMENTS[aligned], "barrier_diff": statistics.mean(db),
                    "barrier_diff_std": sd(db), "loss_diff": statistics.mean(dl), "loss_diff_std": sd(dl),
                    "matched_lower": f"{sum(d < 0 for d in db)} of {len(db)}", "pairs": len(db)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("mlp", "vit"), default="mlp")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--wide", type=int, default=96)
    ap.add_argument("--narrow", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--points", type=int, default=11)
    ap.add_argument("--learned-steps", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if args.pairs < 1 or not 0 < args.narrow < args.wide:
        ap.error("need --pairs >= 1 and 0 < --narrow < --wide")
    torch.set_num_threads(args.threads)
    arrays = load_digits_arrays(seed=0, test_fraction=0.25)
    flat = args.model == "mlp"
    data = {k: torch.as_tensor(v).reshape(len(v), -1) if k.startswith("x") and flat else torch.as_tensor(v)
            for k, v in arrays.items()}
    h = "h" if flat else "d_ff"
    rows = [r for k in range(args.pairs) for r in run_pair(k, args, data)]
    summ = summary(rows)
    tables = {
        "summary": make_table(summ, [("method", "method"), ("loss_a", f"loss A ({h}={args.wide})", ".3f"),
                                     ("loss_b", f"loss B ({h}={args.narrow})", ".3f"),
                                     ("loss_barrier", "loss barrier", ".3f"),
                                     ("loss_barrier_std", "± std", ".3f"), ("merged_loss", "merged loss", ".3f"),
                                     ("merged_loss_std", "± std", ".3f"), ("merged_acc", "merged accuracy", ".3f"),
                                     ("merged_acc_std", "± std", ".3f"), ("pairs", "pairs")]),
        "difference": make_table(differences(rows), [
            ("alignment", "then"), ("barrier_diff", "barrier: matched - uniform", "+.3f"),
            ("barrier_diff_std", "± std", ".3f"), ("loss_diff", "merged loss: matched - uniform", "+.3f"),
            ("loss_diff_std", "± std", ".3f"), ("matched_lower", "pairs with a lower barrier matched"),
            ("pairs", "pairs")]),
        "pairs": make_table([r for r in rows if r["aligned"] == "weight"],
                            [("seeds", "seeds"), ("split", "split"), ("loss_a", f"loss A ({h}={args.wide})", ".3f"),
                             ("loss_b", f"loss B ({h}={args.narrow})", ".3f"), ("loss_barrier", "loss barrier", ".3f"),
                             ("merged_loss", "merged loss", ".3f"), ("merged_acc", "merged accuracy", ".3f"),
                             ("widened_change_f32", "widened B: change (float32)", ".1e")]),
    }
    command = ["python", "benchmarks/merge_widths.py", *sys.argv[1:]]
    write_json(args.out, {"provenance": provenance(command, args.threads, args.pairs),
                          "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                          "data": "sklearn digits 8x8" + (", flattened" if flat else "") + "; seeded split 65/10/25 "
                                  "(load_digits_arrays(0, 0.25))", "model": args.model,
                          "summary": summ, "rows": rows, "tables": tables})
    for r in summ:
        print(f"{r['method']:34s} barrier {r['loss_barrier']:.3f} ± {r['loss_barrier_std'] or 0:.3f}   merged "
              f"loss {r['merged_loss']:.3f} ± {r['merged_loss_std'] or 0:.3f}   acc {r['merged_acc']:.3f}")


if __name__ == "__main__":
    main()
