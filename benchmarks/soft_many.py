r"""Soft (Sinkhorn) against hard learned matching on seed pairs, and the many-model barrier over the simplex.

On independently trained models of one config (``full`` scope: two trainings from scratch; the docs
use the digits RoPE ViT of ``configs/vit-digits-rope.toml``, trained by ``--train SEED...`` into
``--runs``), everything evaluated on the first ``--items`` examples of the **test** split:

1. **Pairs** (``--pairs i,j ...``, indices into the models): B aligned to A in rewritten
   coordinates by :func:`symalign.experiments.methods.align_methods` with ``weight`` (whole-model weight
   matching), ``learned`` (straight-through Hungarian) and ``sinkhorn`` (soft permutations,
   ``relax="sinkhorn"``, ``tau`` annealed from ``--tau`` start to end, projected to the Hungarian
   assignment); both learned methods start at weight matching and run ``--learned-steps`` steps on a
   fresh training batch each (:class:`~symalign.experiments.methods.TrainStream`), choosing between
   their result and weight matching on validation batches. Reported: the loss barrier (nats) of the
   25-point curve and its ratio to the naive barrier.
2. **Sets** (``--sets i,j,k ...``): the barrier over the simplex (:mod:`symalign.lmc_simplex`:
   ``B(w) = L(sum_k w_k theta_k) - sum_k w_k L_k``, ``w ~ Dirichlet(1_M)``, ``--draws`` draws, the
   same draws for every method of a set) of the models ``naive`` (rewritten, unaligned), ``weight``
   (universe matching, :func:`symalign.match.universe.match_universe`, 3 rounds) and ``learned``
   (:func:`symalign.match.learned_many.learn_many` from the universe result, ``--many-steps`` steps,
   Dirichlet ``--many-alpha``). Every aligned model is checked to compute its own model's function.

Writes ``--out`` (a result file: provenance, ``pairs``, ``sets`` and the tables that ``symalign docs``
renders) atomically. Single-threaded by default (``SYMALIGN_BENCH_THREADS``)::

    nice -n 10 python benchmarks/soft_many.py --train 1 2 3 4 5 6 7 8 9 --runs runs/soft \
        --pairs 0,1 2,3 4,5 --sets 0,1,2 3,4,5 6,7,8 --sets 0,1,2,3 4,5,6,7 \
        --learned-steps 600 --many-steps 300 --out results/soft-many.json
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

_THREADS = os.environ.get("SYMALIGN_BENCH_THREADS", "1")
for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, _THREADS)

import numpy as np  # noqa: E402
import torch  # noqa: E402

CONFIG = "configs/vit-digits-rope.toml"


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _state(m) -> dict:
    return {k: v.detach() for k, v in m.state_dict().items()}


def train_models(seeds: list[int], runs: str, config: str) -> list[str]:
    """Train (or reuse) one model per seed with ``config``'s model and training recipe."""
    from symalign.experiments.config import load_experiment_config
    from symalign.train import TrainConfig, train

    cfg = load_experiment_config(config)
    out = []
    for s in seeds:
        path = f"{runs}/{cfg.name}-seed{s}"
        if not os.path.exists(f"{path}/latest"):
            _log(f"training {path}")
            train(dict(cfg.model), cfg.data, TrainConfig(**{**cfg.train, "seed": s}), path, threads=1,
                  progress=False)
        out.append(path)
    return out


def pair_experiment(a, b, ds, test, val, *, steps: int, tau: tuple[float, float], seed: int) -> dict:
    from symalign import lmc
    from symalign.experiments.methods import TrainStream, align_methods
    from symalign.rewrite import rewrite_model

    ra, rb = rewrite_model(a).eval(), rewrite_model(b).eval()
    batches = lambda: iter(test)  # noqa: E731
    naive = lmc.curve(ra, lmc.full_state(ra), lmc.full_state(rb), batches)
    res = align_methods(ra, rb, test, "classification", methods=("weight", "learned", "sinkhorn"),
                        learned_steps=steps, seed=seed, train_batches=TrainStream(ds, 64, seed), val_batches=val,
                        naive=naive, learned_options={"tau": tau})
    out = {"naive": naive.to_dict()}
    for k, e in res.items():
        m = e["match"]
        out[k] = {"loss_barrier": e["loss_barrier"], "acc_barrier": e["acc_barrier"],
                  "ratio_percent": e["loss_barrier_ratio_percent"], "function_change": e["function_change"],
                  "seconds": e["seconds"], "curve": e["curve"],
                  **{f: m.get(f) for f in ("selected", "objective_init", "objective", "relax") if f in m}}
    return out


def set_experiment(models, ds, test, val, *, steps: int, alpha: float, draws: int, seed: int) -> dict:
    from symalign.experiments.metrics import relative_output_change
    from symalign.lmc_simplex import simplex_barrier
    from symalign.match.learned_many import learn_many
    from symalign.match.universe import match_universe
    from symalign.experiments.methods import TrainStream
    from symalign.rewrite import rewrite_model
    from symalign.spec import apply
    from symalign.tolerance import function_tolerance

    rw = [rewrite_model(m).eval() for m in models]
    arch, spec = rw[0], rw[0].symmetry_spec()
    states = [_state(r) for r in rw]
    batches = lambda: iter(test)  # noqa: E731
    x = test[0][0][:64]
    tol = function_tolerance(next(iter(states[0].values())).dtype)

    def aligned(transforms, what):
        out = [{**s, **apply(spec, t, s)} for t, s in zip(transforms, states)]
        worst = max(relative_output_change(arch, o, s, x) for o, s in zip(out, states))
        if not worst <= tol:
            raise SystemExit(f"{what}: an aligned model changed its function ({worst:.2e}); a bug")
        return out, worst

    res: dict = {"naive": simplex_barrier(arch, states, batches, draws=draws, seed=seed).to_dict()}
    t0 = time.perf_counter()
    uni = match_universe(rw, rounds=3)
    al, ch = aligned(uni.transforms, "universe matching")
    res["weight"] = {**simplex_barrier(arch, al, batches, draws=draws, seed=seed).to_dict(), "function_change": ch,
                     "seconds": time.perf_counter() - t0}
    t0 = time.perf_counter()
    lm = learn_many(rw, TrainStream(ds, 64, seed), steps=steps, init=uni, alpha=alpha, select_batches=val, seed=seed)
    al, ch = aligned(lm.transforms, "learn_many")
    res["learned"] = {**simplex_barrier(arch, al, batches, draws=draws, seed=seed).to_dict(), "function_change": ch,
                      "seconds": time.perf_counter() - t0, "selected": lm.selected}
    return res


def _ms(xs: list[float], fmt: str = ".4f") -> str:
    sd = float(np.std(xs, ddof=1)) if len(xs) > 1 else float("nan")
    return f"{np.mean(xs):{fmt}} ± {sd:{fmt}}"


def tables(res: dict) -> dict:
    from symalign.experiments.docs_tables import make_table

    prow, methods = [], ("weight", "learned", "sinkhorn")
    for p in res["pair_results"]:
        row = {"pair": p["name"], "naive": p["naive"]["loss_barrier"]}
        for k in methods:
            row[k] = p[k]["loss_barrier"]
            row[f"{k}_pct"] = p[k]["ratio_percent"]
        row["kept"] = " / ".join(str(p[k].get("selected")) for k in ("learned", "sinkhorn"))
        prow.append(row)
    cols = [("pair", "seeds (A-B)"), ("naive", "naive", ".3f")]
    for k, h in zip(methods, ("weight", "learned (hard)", "learned (Sinkhorn)")):
        cols += [(k, f"{h}", ".4f"), (f"{k}_pct", "%", ".1f")]
    cols.append(("kept", "kept (hard / Sinkhorn)"))
    pairs = res["pair_results"]
    summary = [{"method": k, "pairs": len(pairs), "barrier": _ms([p[k]["loss_barrier"] for p in pairs]),
                "ratio": _ms([p[k]["ratio_percent"] for p in pairs], ".1f"),
                "seconds": _ms([p[k]["seconds"] for p in pairs], ".0f")} for k in ("weight", "learned", "sinkhorn")]
    srow, ssum = [], []
    for s in res["set_results"]:
        for k in ("naive", "weight", "learned"):
            srow.append({"models": s["name"], "n": s["n"], "method": k, "max": s[k]["max_barrier"],
                         "mean": s[k]["mean_barrier"], "acc": 100 * s[k]["max_acc_barrier"],
                         "draws": len(s[k]["barriers"])})
    for n in sorted({s["n"] for s in res["set_results"]}):
        sets = [s for s in res["set_results"] if s["n"] == n]
        for k in ("naive", "weight", "learned"):
            ssum.append({"n": n, "method": k, "sets": len(sets), "max": _ms([s[k]["max_barrier"] for s in sets]),
                         "mean": _ms([s[k]["mean_barrier"] for s in sets])})
    out: dict = {}
    if prow:
        out["soft_pairs"] = make_table(prow, cols)
        out["soft_summary"] = make_table(summary, [("method", "method"), ("pairs", "pairs"),
                                                   ("barrier", "loss barrier (mean ± std)"),
                                                   ("ratio", "% of naive (mean ± std)"), ("seconds", "seconds")])
    if srow:
        out["simplex_sets"] = make_table(srow, [("models", "models (seeds)"), ("n", "N"), ("method", "alignment"),
                                                ("max", "max barrier", ".4f"), ("mean", "mean barrier", ".4f"),
                                                ("acc", "max acc barrier (points)", ".1f"), ("draws", "draws")])
        out["simplex_summary"] = make_table(ssum, [("n", "N"), ("method", "alignment"), ("sets", "model sets"),
                                                   ("max", "max barrier (mean ± std)"),
                                                   ("mean", "mean barrier (mean ± std)")])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=CONFIG, help="experiment config whose model and training recipe to use")
    p.add_argument("--train", nargs="+", type=int, required=True, help="training seeds (trained if missing)")
    p.add_argument("--runs", default="runs/soft", help="where the trained models live")
    p.add_argument("--pairs", nargs="*", default=[], help="pairs of model indices, e.g. 0,1 2,3")
    p.add_argument("--sets", nargs="*", action="extend", default=[], help="sets of model indices, e.g. 0,1,2")
    p.add_argument("--items", type=int, default=2000, help="test examples")
    p.add_argument("--learned-steps", type=int, default=600)
    p.add_argument("--tau", nargs=2, type=float, default=[0.1, 0.01], help="Sinkhorn temperature: start end")
    p.add_argument("--many-steps", type=int, default=300)
    p.add_argument("--many-alpha", type=float, default=1.0, help="learn_many's Dirichlet concentration")
    p.add_argument("--draws", type=int, default=16, help="Dirichlet draws of the simplex barrier")
    p.add_argument("--seed", type=int, default=0, help="training-stream and draw seed")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    torch.set_num_threads(int(_THREADS))

    from symalign.atomic import write_json
    from symalign.checkpoint import load_model
    from symalign.data import eval_batches, load_dataset
    from symalign.provenance import provenance

    t0 = time.perf_counter()
    paths = train_models(a.train, a.runs, a.config)
    models = [load_model(q)[0].eval() for q in paths]
    ds = load_dataset(load_model(paths[0])[1].meta["data"]["name"])
    test = list(eval_batches(ds, "test", 500, max_items=a.items))
    val = list(eval_batches(ds, "val", 256))[:4]
    seeds = lambda idx: "-".join(str(a.train[i]) for i in idx)  # noqa: E731
    res: dict = {"config": a.config, "items": sum(len(y) for _, y in test), "args": vars(a),
                 "pair_results": [], "set_results": []}
    for spec in a.pairs:
        i, j = (int(t) for t in spec.split(","))
        _log(f"pair {seeds((i, j))}")
        r = pair_experiment(models[i], models[j], ds, test, val, steps=a.learned_steps, tau=tuple(a.tau),
                            seed=a.seed)
        res["pair_results"].append({"name": seeds((i, j)), **r})
    for spec in a.sets:
        idx = [int(t) for t in spec.split(",")]
        _log(f"set {seeds(idx)}")
        r = set_experiment([models[i] for i in idx], ds, test, val, steps=a.many_steps, alpha=a.many_alpha,
                           draws=a.draws, seed=a.seed)
        res["set_results"].append({"name": seeds(idx), "n": len(idx), **r})
    res["seconds"] = time.perf_counter() - t0
    command = "nice -n 10 python benchmarks/soft_many.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    n_sets = {str(n): sum(1 for s in res["set_results"] if s["n"] == n) for n in {s["n"] for s in res["set_results"]}}
    out = {"provenance": provenance(command, threads=torch.get_num_threads(), seed_pairs=len(res["pair_results"])),
           "pairs": len(res["pair_results"]), "sets": n_sets, **res, "tables": tables(res)}
    write_json(a.out, out)
    for name, t in out["tables"].items():
        print(name)
        for row in t["rows"]:
            print("  ", {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()})
    _log(f"wrote {a.out} ({res['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
