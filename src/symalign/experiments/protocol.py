r"""The re-initialisation protocol of the ICML 2026 paper, end to end.

For a config (family, dataset, positional encoding) and each scope:

1. train a base model (seed ``base_seed``) -- skipped for the ``full`` scope;
2. make models A and B by re-initialising the scope of the base with the two
   ``seeds`` (``full``: train A and B from scratch) and train both (optionally
   with everything outside the scope frozen);
3. align B to A with the two-stage matcher on the attention layers of the scope
   (every stage-2 variant asked for, and stage 1 off as an ablation), check that
   the aligned B' computes B's function, and
   (variant ``learned``) refine the ``full`` result on training data by learned matching
   restricted to the scope's spaces (:func:`learned_variant`), and
4. record the naive (A -> B) and aligned (A -> B') LMC curves, barriers, barrier
   ratios and the stage-1 metrics (rank of the chosen head permutation among all
   ``h!``, ``Lhat``).

Each step is skipped when its output exists (finished checkpoints, a scope's
``results.json``), so an interrupted experiment resumes where it stopped; JSON
files are written atomically.

This module is the orchestration; the pieces it calls live in
:mod:`~symalign.experiments.dispatch` (scopes, coordinates, matchers),
:mod:`~symalign.experiments.checks` (what is checked before training or reuse) and
:mod:`~symalign.experiments.metrics` (function check, curves, stage-1 metrics, summary
rows); their names are re-exported here.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from symalign import lmc
from symalign.arithmetic import describe
from symalign.atomic import write_json as write_json_atomic
from symalign.errors import SymalignError
from symalign.experiments.checks import (ARITHMETIC_FILE, TRAINING_KEYS, TRAINING_PROTOCOL_KEYS, check_inputs,
                                         check_recorded, check_reusable, config_diff, discard_run)
from symalign.experiments.config import ExperimentConfig
from symalign.experiments.dispatch import (ATTENTION_KINDS, alignment_models, attention_spec, learned_variant,
                                           match_scope, scope_layers, scope_spaces, seed002_methods)
from symalign.experiments.metrics import (curve_runner, naive_curves, relative_output_change, stage1_metrics,
                                          summary_row)
from symalign.spec import ATTENTION_ROLES, apply
from symalign.tolerance import function_tolerance

__all__ = ["ATTENTION_KINDS", "TRAINING_KEYS", "TRAINING_PROTOCOL_KEYS", "align_and_measure", "alignment_models",
           "attention_spec", "check_inputs", "check_recorded", "check_reusable", "config_diff", "curve_runner",
           "discard_run", "learned_variant", "match_scope", "naive_curves", "relative_output_change",
           "run_experiment", "scope_layers", "scope_spaces", "seed002_methods", "stage1_metrics", "summary_row",
           "write_json_atomic"]


def _finished(run_dir: Path, steps: int) -> bool:
    from symalign.checkpoint import has_checkpoint, load_run

    return has_checkpoint(run_dir) and int(load_run(run_dir, verify=False).meta.get("step", -1)) >= steps



def _train(cfg: ExperimentConfig, seed: int, out: Path, init: dict | None, progress: bool,
           device: str = "auto") -> Path:
    from symalign.checkpoint import has_checkpoint
    from symalign.train import TrainConfig, train

    tc = TrainConfig(**{**cfg.train, "seed": seed})
    if not _finished(out, tc.steps):
        train(cfg.model | {"family": cfg.model.get("family", "gpt")}, cfg.data, tc, out,
              data_options=cfg.data_options, resume=has_checkpoint(out), init=init, progress=progress, device=device)
    return out



def align_and_measure(cfg: ExperimentConfig, dir_a: Path, dir_b: Path, scope: str,
                      progress: Callable[[str], None] | None = None, bars: bool = False) -> dict:
    """Match B to A for every variant and measure naive and aligned curves (one scope);
    ``progress`` receives status lines, ``bars`` shows the learned variant's progress bar."""
    run = _prepare_scope(cfg, dir_a, dir_b, scope)
    p, ds, spec, model_a = cfg.protocol, run.ds, run.spec, run.model_a
    t0 = time.perf_counter()
    naive, naive_original = naive_curves(run.curve, model_a, run.arch_a, (run.sa, run.sb), (run.ra, run.rb))
    out: dict[str, Any] = {
        "scope": scope, "family": model_a.cfg.family, "pe": model_a.cfg.pe, "data": ds.name,
        "eval_split": p.eval_split,
        "endpoints": {"A": {"loss": naive.loss[0], "acc": naive.acc[0]},
                      "B": {"loss": naive.loss[-1], "acc": naive.acc[-1]}},
        "naive": naive.to_dict(), "variants": {}, "layers_aligned": scope_layers(scope, model_a.cfg.n_layers),
        "spaces_aligned": spec.describe(), "notes": run.notes,
    }
    if naive_original is not None:
        out["naive_original_coordinates"] = naive_original.to_dict()
    first_match = _align_variants(run, scope, naive, out["variants"], progress, bars)
    if scope == "full" and p.methods:
        out["methods"] = seed002_methods(cfg, ds, run.arch_a, run.arch_b, run.batches, naive, progress,
                                         checkpoint=Path(dir_a).parent / "learned-matching.pt")
    out["stage1"] = _stage1_of(run, first_match)
    out["seconds"] = time.perf_counter() - t0
    return out


@dataclass
class _ScopeRun:
    """One scope's inputs: the config and A's folder, the dataset and its evaluation batches, the curve runner,
    A and B as trained and their full states, A and B in the alignment format (same functions) and their
    states, the scope's spec and the notes on the format."""

    cfg: ExperimentConfig
    dir_a: Path
    ds: Any
    batches: list
    curve: Callable
    model_a: Any
    model_b: Any
    sa: dict
    sb: dict
    arch_a: Any
    arch_b: Any
    ra: dict
    rb: dict
    spec: Any
    notes: list


def _prepare_scope(cfg: ExperimentConfig, dir_a: Path, dir_b: Path, scope: str) -> _ScopeRun:
    """Load A and B (evaluation mode), the dataset and its evaluation batches, rewrite both in the alignment
    format of ``scope`` and restrict the spec to the scope's spaces."""
    from symalign.checkpoint import load_model
    from symalign.data import eval_batches, load_dataset
    model_a, _ = load_model(dir_a)
    model_b, _ = load_model(dir_b)
    model_a.eval()
    model_b.eval()
    ds = load_dataset(cfg.data, **cfg.data_options)
    p = cfg.protocol
    context = int(cfg.train.get("context", 128))
    batches = list(eval_batches(ds, p.eval_split, 256, context, p.eval_items))
    curve = curve_runner(batches, ds.task, p.points, p.device)
    sa, sb = lmc.full_state(model_a), lmc.full_state(model_b)
    arch_a, arch_b, notes = alignment_models(model_a, model_b, scope)  # same functions as A, B
    ra, rb = lmc.full_state(arch_a), lmc.full_state(arch_b)
    full_spec = arch_a.symmetry_spec()
    spec = full_spec.restrict(scope_spaces(full_spec, scope, model_a.cfg.n_layers))
    return _ScopeRun(cfg, dir_a, ds, batches, curve, model_a, model_b, sa, sb, arch_a, arch_b, ra, rb, spec, notes)


def _align_variants(run: _ScopeRun, scope: str, naive: lmc.Curve, variants: dict,
                    progress: Callable[[str], None] | None, bars: bool) -> Any:
    """Match B to A for every stage-2 variant of the protocol (stage 1 on; and ``full`` without stage 1 for the
    ablation; ``learned`` starts from the ``full`` match) and record each in ``variants``; returns the first
    match."""
    p = run.cfg.protocol
    todo = [(True, v) for v in p.variants] + ([(False, "full")] if p.stage1_ablation else [])
    first_match = None
    done: dict[tuple[bool, str], Any] = {}
    for stage1, stage2 in todo:
        key = stage2 if stage1 else f"{stage2}-no-stage1"
        if progress:
            progress(f"{scope}: aligning ({key})")
        if stage2 == "learned":
            start = done.get((True, "full")) or match_scope(run.spec, run.ra, run.rb, True, "full")
            m = learned_variant(run.cfg, run.ds, run.spec, run.arch_a, run.arch_b, start, bars,
                                checkpoint=Path(run.dir_a).parent / "learned-stage2.pt")
        else:
            m = match_scope(run.spec, run.ra, run.rb, stage1, stage2)
        done[(stage1, stage2)] = m
        first_match = first_match or m
        variants[key] = _measure_variant(run, m, naive)
    return first_match


def _measure_variant(run: _ScopeRun, m, naive: lmc.Curve) -> dict:
    """B aligned by ``m``: its relative output change against B (above the dtype's function tolerance: an error,
    a bug), the aligned curve and its barrier ratios against the naive curve, and the match."""
    rb2 = {**run.rb, **apply(run.spec, m.transform, run.rb)}
    change = relative_output_change(run.arch_a, rb2, run.sb, run.batches[0][0], run.model_b)
    tol = function_tolerance(next(iter(run.sb.values())).dtype)
    if change > tol:
        raise SymalignError(f"alignment changed model B's function (relative change {change:.2e} > {tol:g}); "
                            "this is a bug -- please report it with the config")
    aligned = run.curve(run.arch_a, run.ra, rb2)
    return {
        "curve": aligned.to_dict(), "function_change": change,
        "loss_barrier_ratio_percent": lmc.barrier_ratio(aligned.loss_barrier, naive.loss_barrier),
        "acc_barrier_ratio_percent": lmc.barrier_ratio(aligned.acc_barrier, naive.acc_barrier),
        "match": m.to_dict(),
    }


def _stage1_of(run: _ScopeRun, first_match) -> dict:
    """Stage-1 metrics of the chosen head permutations, on B with the other spaces (residual, FF) aligned."""
    spec, rb = run.spec, run.rb
    attn_spaces = spec.select(role=ATTENTION_ROLES)
    other = [x for x in spec.spaces if x not in attn_spaces]
    rb_ctx = {**rb, **apply(spec.restrict(other), {k: v for k, v in first_match.transform.items() if k in other}, rb)}
    return stage1_metrics(spec.restrict(attn_spaces), run.ra, rb_ctx, first_match.transform)


def run_experiment(cfg: ExperimentConfig, out_dir: str | Path, progress: bool = True,
                   log: Callable[[str], None] | None = None, fresh: bool = False,
                   device: str | None = None) -> list[dict]:
    """Run (or resume) every scope of ``cfg`` under ``out_dir/cfg.name``; returns the per-scope results.

    ``device`` (``--device``): train and evaluate there (``"cpu"``, ``"cuda"``, ``"auto"``); it becomes the
    config's ``protocol.device``, so a run folder made on another device is refused like any other change.
    ``None``: training picks CUDA where it exists (``auto``) and the curves run on ``protocol.device``.

    A run directory recorded with another config is refused (:func:`check_recorded`) unless
    ``fresh``, which discards it first. Every result records the torch thread count
    (``"threads"``): float reductions, and so the trained weights and barriers, depend on it.
    """
    from symalign.experiments.report import write_summary

    if device is not None:
        from symalign.experiments.config import Protocol

        cfg.protocol = Protocol(**{**vars(cfg.protocol), "device": device})  # validated and recorded
    train_device = device or "auto"
    root = _prepare_root(cfg, out_dir, fresh)
    say = log or (lambda s: None)
    p = cfg.protocol
    base = None
    results = []
    for scope in p.scopes:
        res_path = root / scope / "results.json"
        if res_path.exists():
            done = json.loads(res_path.read_text())
            say(f"{scope}: results exist (same config), reusing them")
            results.append(done)
            continue
        dirs, base = _train_seeds(cfg, root, scope, base, progress, train_device, say)
        res = align_and_measure(cfg, dirs[0], dirs[1], scope, progress=say, bars=progress)
        _record_scope(cfg, root, scope, res)
        results.append(res)
    write_summary(Path(out_dir))
    return results


def _prepare_root(cfg: ExperimentConfig, out_dir: str | Path, fresh: bool) -> Path:
    """Check the inputs and the run folder ``out_dir/cfg.name`` (discarded first with ``fresh``; one recorded
    with another config is refused), create it and record the config and the arithmetic mode."""
    check_inputs(cfg)
    root = Path(out_dir) / cfg.name
    if fresh:
        discard_run(root)
    check_recorded(cfg, root)
    root.mkdir(parents=True, exist_ok=True)
    write_json_atomic(root / "config.json", cfg.to_dict())
    write_json_atomic(root / ARITHMETIC_FILE, {"mode": describe()["mode"]})
    return root


def _train_seeds(cfg: ExperimentConfig, root: Path, scope: str, base: Path | None, progress: bool,
                 train_device: str, say: Callable[[str], None]) -> tuple[list[Path], Path | None]:
    """Train (or resume) the models of ``scope``, one per seed: from scratch for ``full``, else re-initialised
    in the scope from the base model (trained first when not yet). Returns their folders and the base's."""
    p = cfg.protocol
    dirs = []
    for seed in p.seeds:
        if scope == "full":
            init = None
        else:
            if base is None:
                say("training the base model")
                base = _train(cfg, p.base_seed, root / "base", None, progress, train_device)
            init = {"base": str(base), "scope": scope, "seed": seed, "freeze": p.freeze}
        say(f"{scope}: training seed {seed}")
        dirs.append(_train(cfg, seed, root / scope / f"seed{seed}", init, progress, train_device))
    return dirs, base


def _record_scope(cfg: ExperimentConfig, root: Path, scope: str, res: dict) -> None:
    """Complete a scope's result (experiment, seeds, threads, arithmetic, config) and write its curves plot
    and ``results.json``."""
    from symalign.experiments.report import plot_curves

    res["experiment"] = cfg.name
    res["seeds"] = list(cfg.protocol.seeds)
    res["threads"] = torch.get_num_threads()
    res["arithmetic"] = describe()
    res["config"] = cfg.to_dict()
    plot_curves(res, root / scope / "curves.png")
    write_json_atomic(root / scope / "results.json", res)
