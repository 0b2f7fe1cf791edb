r"""Universe merge of three models and a width-heterogeneous pair, measured on held-out data.

Two experiments on trained classifiers (built-in models; the docs use the Fashion-MNIST
RoPE ViTs of ``configs/vit-fmnist-rope.toml``), everything evaluated on the first
``--items`` examples of the **test** split (:func:`symalign.data.eval_batches`):

1. **Universe merge** of ``--same`` models (>= 2, one config; the docs use three D=64 models):

   * each model's own test loss / accuracy;
   * ``vanilla``: the uniform average of the models as trained, no alignment;
   * ``vanilla-rewritten``: the uniform average of the rewritten models (the
     coordinates every alignment below lives in), no alignment;
   * ``universe``: :func:`symalign.match.universe.match_universe` (whole-model weight
     matching to an evolving mean, ``--rounds`` rounds); merged = ``mean_k T_k . theta_k``;
   * ``learned-many`` (``--learned-steps > 0``): :func:`symalign.match.learned_many.learn_many`
     from the universe result, a fresh training-split batch every step
     (:class:`symalign.experiments.methods.TrainStream`), the merge compared with the
     universe merge on ``--select-batches`` **validation** batches (never test).

   Every aligned model is checked to compute its own model's function (relative logit change).

2. **Width pair** (``--wide`` A, ``--narrow`` B with ``D_B < D_A``; equal depth, FF width,
   heads and ``head_dim``): B is rewritten and embedded exactly into width ``D_A``
   (:func:`symalign.match.widths.match_widths`: writers scaled by ``sqrt(D_A / D_B)``, readers
   by its inverse, the same norm ``eps``), then aligned to the rewritten A by whole-model
   weight matching. Reported: the relative logit change of the embedded B and of the
   aligned embedded B against B itself, the same for the curve's B end (A's architecture
   running the aligned embedded B: ``endpoint_change``), and the naive (A -> embedded B)
   and weight-matched (A -> aligned embedded B) curves (:func:`symalign.lmc.curve`,
   ``--points`` points) with their loss and accuracy barriers.

Writes ``--out`` (JSON, atomically) and prints tables. Single-threaded by default
(``SYMALIGN_BENCH_THREADS``). Run (docs/whole-model.md sections 7 and 8)::

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/universe_widths.py \
        --same runs/results/vit-fmnist-rope/full/seed1 runs/results/vit-fmnist-rope/full/seed2 \
               runs/widths-universe/d64-seed3 \
        --wide runs/widths-universe/d96-seed4 --narrow runs/results/vit-fmnist-rope/full/seed1 \
        --learned-steps 300 --out runs/widths-universe/results.json

``--tiny`` runs both experiments on tiny random ViTs (a self-check of the script, no
checkpoints needed).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

_THREADS = os.environ.get("SYMALIGN_BENCH_THREADS", "1")
for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, _THREADS)

import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _state(model: nn.Module) -> dict[str, Tensor]:
    return {k: v.detach() for k, v in model.state_dict().items()}


def _logit_change(model: nn.Module, state: dict, ref_model: nn.Module, ref_state: dict, x: Tensor) -> float:
    """``||f(x) - f_ref(x)|| / ||f_ref(x)||`` (float64 norms)."""
    from symalign.experiments.protocol import relative_output_change

    return relative_output_change(model, state, ref_state, x, ref_model)


def _eval(model: nn.Module, state: dict, batches) -> dict:
    from symalign import lmc

    model.eval()
    loss, acc = lmc.evaluate(model, state, batches)
    return {"loss": loss, "acc": acc}


def universe_experiment(models: list[nn.Module], batches, probe_x: Tensor, *, rounds: int, learned_steps: int,
                        learned_lr: float, train_stream=None, select_batches=None, alpha: float = 0.1) -> dict:
    """Section 1 of the module docstring; ``models`` are the trained (not rewritten) models."""
    from symalign.match.universe import match_universe, mean_state
    from symalign.rewrite import rewrite_model

    out: dict = {"models": []}
    for m in models:
        out["models"].append(_eval(m, _state(m), batches))
    out["vanilla"] = _eval(models[0], mean_state([_state(m) for m in models]), batches)
    rw = [rewrite_model(m).eval() for m in models]
    states = [_state(r) for r in rw]
    arch = rw[0]
    out["rewrite_change"] = max(_logit_change(r, s, m, _state(m), probe_x) for r, s, m in zip(rw, states, models))
    out["vanilla-rewritten"] = _eval(arch, mean_state(states), batches)
    _log("universe matching ...")
    uni = match_universe(rw, rounds=rounds)
    spec = arch.symmetry_spec()
    from symalign.spec import apply

    out["universe"] = {**_eval(arch, uni.merged, batches), **uni.to_dict(),
                       "function_change": max(_logit_change(arch, apply(spec, t, s), m, _state(m), probe_x)
                                              for t, s, m in zip(uni.transforms, states, models))}
    if learned_steps > 0:
        from symalign.match.learned_many import learn_many

        _log(f"learned-many refinement, {learned_steps} steps ...")
        res = learn_many(rw, train_stream, steps=learned_steps, lr=learned_lr, init=uni,
                         select_batches=select_batches, alpha=alpha)
        d = res.to_dict()
        d.pop("losses")
        out["learned-many"] = {**_eval(arch, res.merged, batches), **d,
                               "first_losses": res.losses[:5], "last_losses": res.losses[-5:],
                               "function_change": max(_logit_change(arch, apply(spec, t, s), m, _state(m), probe_x)
                                                      for t, s, m in zip(res.transforms, states, models))}
    return out


def width_experiment(wide: nn.Module, narrow: nn.Module, batches, probe_x: Tensor, *, points: int) -> dict:
    """Section 2 of the module docstring; ``wide`` (A) and ``narrow`` (B) are trained models."""
    from symalign import lmc
    from symalign.errors import MatchError
    from symalign.match.widths import embed_wider, match_widths
    from symalign.rewrite import rewrite_model

    a = rewrite_model(wide).eval()
    b = rewrite_model(narrow).eval()
    _log("width matching ...")
    t0 = time.perf_counter()
    res, emb = match_widths(a, b)
    secs = time.perf_counter() - t0
    emb.eval()
    sa, se = _state(a), _state(emb)
    # the embedded B (and its alignment) run in A's architecture: the same width and norm eps
    if emb.cfg.norm_eps != a.cfg.norm_eps:
        raise MatchError(f"A's norm eps {a.cfg.norm_eps} is not B's {b.cfg.norm_eps}; "
                         "the curve needs models trained with one norm_eps")
    aligned = res.apply(se)
    sn = _state(narrow)
    out = {
        "d_model": [wide.cfg.d_model, narrow.cfg.d_model],
        "A": _eval(wide, _state(wide), batches), "B": _eval(narrow, sn, batches),
        "embed_change": _logit_change(emb, se, narrow, sn, probe_x),
        "aligned_change": _logit_change(emb, res.apply(se), narrow, sn, probe_x),
        "endpoint_change": _logit_change(a, aligned, narrow, sn, probe_x),
        "match": {**res.to_dict(), "seconds": secs},
    }
    # The embedding alone in float64 (embedded B against rewritten B, no float32 rounding of
    # the rewrite or of the forward pass): exact up to float64 round-off.
    b64 = copy.deepcopy(b).double()
    e64 = embed_wider(b64, a.cfg.d_model)
    x64 = probe_x.double() if probe_x.is_floating_point() else probe_x
    out["embed_change_float64"] = _logit_change(e64, _state(e64), b64, _state(b64), x64)
    del b64, e64
    _log("naive curve ...")
    naive = lmc.curve(a, sa, se, batches, points=points)
    _log("weight-matched curve ...")
    weight = lmc.curve(a, sa, aligned, batches, points=points)
    out["naive"], out["weight"] = naive.to_dict(), weight.to_dict()
    out["loss_barrier_ratio_percent"] = lmc.barrier_ratio(weight.loss_barrier, naive.loss_barrier)
    return out


def _tables(res: dict) -> str:
    lines = []
    if "universe" in res:
        u = res["universe"]
        lines += ["", "| model | test loss | test acc |", "|---|---|---|"]
        for i, m in enumerate(u["models"]):
            lines.append(f"| {u['names'][i]} | {m['loss']:.4f} | {100 * m['acc']:.2f} % |")
        for key in ("vanilla", "vanilla-rewritten", "universe", "learned-many"):
            if key in u:
                lines.append(f"| merge: {key} | {u[key]['loss']:.4f} | {100 * u[key]['acc']:.2f} % |")
        lines.append(f"rewrite logit change {u['rewrite_change']:.2e}; aligned models' logit change: universe "
                     f"{u['universe']['function_change']:.2e}"
                     + (f", learned {u['learned-many']['function_change']:.2e} (selected "
                        f"{u['learned-many']['selected']})" if "learned-many" in u else ""))
    if "widths" in res:
        w = res["widths"]
        lines += ["", f"width pair D={w['d_model'][0]} (A) vs D={w['d_model'][1]} (B embedded)",
                  "| curve | loss barrier | acc barrier | midpoint loss | midpoint acc |", "|---|---|---|---|---|"]
        for key in ("naive", "weight"):
            c = w[key]
            mid = len(c["t"]) // 2
            lines.append(f"| {key} | {c['loss_barrier']:.4f} | {100 * c['acc_barrier']:.2f} % | "
                         f"{c['loss'][mid]:.4f} | {100 * c['acc'][mid]:.2f} % |")
        lines.append(f"A: {w['A']['loss']:.4f} / {100 * w['A']['acc']:.2f} %, B: {w['B']['loss']:.4f} / "
                     f"{100 * w['B']['acc']:.2f} %; embedded-B logit change {w['embed_change']:.2e} "
                     f"(float64 {w['embed_change_float64']:.2e}), aligned {w['aligned_change']:.2e}, "
                     f"curve endpoint (A's architecture) {w['endpoint_change']:.2e}; barrier ratio "
                     f"{w['loss_barrier_ratio_percent']:.1f} %")
    return "\n".join(lines)


def _tiny_models():
    """Tiny random ViTs on the synthetic image data: three of width 16, one of width 24."""
    from symalign.data import load_dataset
    from symalign.models import build_model
    from symalign.train import fit_config

    ds = load_dataset("synthetic")
    base = dict(family="vit", pe="rope", n_layers=2, n_heads=2, head_dim=8, d_ff=32, patch_size=4)
    same = [build_model(fit_config({**base, "d_model": 16}, ds, 128), seed=s).eval() for s in (1, 2, 3)]
    wide = build_model(fit_config({**base, "d_model": 24}, ds, 128), seed=4).eval()
    return ds, same, wide, same[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--same", nargs="*", default=[], help="checkpoints of one config to merge (>= 2)")
    p.add_argument("--wide", help="checkpoint A of the width pair (wider)")
    p.add_argument("--narrow", help="checkpoint B of the width pair (narrower)")
    p.add_argument("--tiny", action="store_true", help="self-check on tiny random ViTs (synthetic data)")
    p.add_argument("--items", type=int, default=2000, help="test examples (the protocol's 2000)")
    p.add_argument("--points", type=int, default=25, help="points per interpolation curve")
    p.add_argument("--rounds", type=int, default=3, help="universe-matching rounds")
    p.add_argument("--learned-steps", type=int, default=0, help="learn_many steps (0: skip)")
    p.add_argument("--learned-lr", type=float, default=1e-2)
    p.add_argument("--alpha", type=float, default=0.1,
                   help="Dirichlet concentration of learn_many (seed 002: 0.1; 1 = uniform on the simplex)")
    p.add_argument("--batch-size", type=int, default=128, help="training batch size of learn_many")
    p.add_argument("--select-batches", type=int, default=8, help="validation batches for learn_many's selection")
    p.add_argument("--seed", type=int, default=12345, help="training-stream seed of learn_many")
    p.add_argument("--out", required=True, help="JSON result path (written atomically)")
    args = p.parse_args(argv)
    torch.set_num_threads(int(_THREADS))

    from symalign.atomic import write_json
    from symalign.checkpoint import load_model
    from symalign.data import eval_batches, load_dataset
    from symalign.errors import ConfigError
    from symalign.experiments.methods import TrainStream

    t0 = time.perf_counter()
    if args.tiny:
        ds, same, wide, narrow = _tiny_models()
        names = ["tiny-1", "tiny-2", "tiny-3"]
        data_name = "synthetic"
    else:
        if len(args.same) < 2 and not (args.wide and args.narrow):
            raise ConfigError("give --same with >= 2 checkpoints and/or --wide and --narrow (or --tiny)")
        load = lambda path: load_model(path)[0].eval()  # noqa: E731
        same = [load(s) for s in args.same]
        wide = load(args.wide) if args.wide else None
        narrow = load(args.narrow) if args.narrow else None
        names = list(args.same)
        first = load_model(args.same[0] if args.same else args.wide)[1]
        data_name = first.meta["data"]["name"]
        ds = load_dataset(data_name)
    test = list(eval_batches(ds, "test", 500, max_items=args.items))
    batches = lambda: iter(test)  # noqa: E731
    probe_x = test[0][0][:64]
    res: dict = {"data": data_name, "items": sum(len(y) for _, y in test), "points": args.points,
                 "threads": torch.get_num_threads(), "args": vars(args)}
    if len(same) >= 2:
        stream = TrainStream(ds, args.batch_size, args.seed)
        val = list(eval_batches(ds, "val", args.batch_size))[:args.select_batches]
        res["universe"] = {"names": names, **universe_experiment(
            same, batches, probe_x, rounds=args.rounds, learned_steps=args.learned_steps,
            learned_lr=args.learned_lr, train_stream=stream, select_batches=val,
            alpha=args.alpha)}
    if wide is not None and narrow is not None:
        res["widths"] = {"wide": args.wide or "tiny-wide", "narrow": args.narrow or "tiny-1",
                         **width_experiment(wide, narrow, batches, probe_x, points=args.points)}
    res["seconds"] = time.perf_counter() - t0
    write_json(args.out, res)
    print(_tables(res))
    print(f"\nwrote {args.out} ({res['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
