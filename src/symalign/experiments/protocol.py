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
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.func import functional_call

from symalign import lmc
from symalign.atomic import write_json as write_json_atomic
from symalign.errors import ConfigError, SymalignError
from symalign.experiments.config import ExperimentConfig
from symalign.spec import ATTENTION_ROLES, SymmetrySpec, apply
from symalign.tolerance import function_tolerance


def scope_layers(scope: str, n_layers: int) -> list[int]:
    """Attention layers a scope re-initialises (and so the layers to align)."""
    return [0] if scope in ("first-attention", "first-block") else list(range(n_layers))


ATTENTION_KINDS = ATTENTION_ROLES  # the older name


def scope_spaces(spec: SymmetrySpec, scope: str, n_layers: int) -> list[str]:
    """The spaces to align for a scope: what the scope re-initialised and nothing else.

    ``first-attention``/``all-attention``: the attention spaces of those layers;
    ``first-block``: attention and FF hidden units of block 0; ``full``: every space
    (residual stream included where the architecture has it).
    """
    if scope == "full":
        return list(spec.spaces)
    layers = scope_layers(scope, n_layers)
    roles = ATTENTION_ROLES + (("ff",) if scope == "first-block" else ())
    return spec.select(role=roles, layer=layers)


def attention_spec(model: nn.Module, layers: list[int]) -> SymmetrySpec:
    """The model's spec restricted to the attention spaces (heads, Q-K, V-O) of ``layers``."""
    spec = model.symmetry_spec()
    return spec.restrict(spec.select(role=ATTENTION_ROLES, layer=layers))


def alignment_models(model_a: nn.Module, model_b: nn.Module, scope: str) -> tuple[nn.Module, nn.Module, list[str]]:
    """The parametrisation in which to align, and notes.

    For the ``full`` scope the models are first rewritten (LayerNorm -> gainless norm,
    gains folded, writers centred: :mod:`symalign.rewrite`) so that the residual stream
    has its ``O(D)`` symmetry -- the same functions in other coordinates; interpolation
    then happens in those coordinates, as in seed 002. ``hf:`` models are rewritten by
    :func:`symalign.families.hfmodel.prepare` (:meth:`~symalign.models.hf.HFModel.rewritten_model`).
    Other scopes keep the models.
    """
    if scope != "full":
        return model_a, model_b, []
    from symalign.models.hf import HFModel

    if isinstance(model_a, HFModel):
        arch_a, notes = model_a.rewritten_model()
        arch_b, _ = model_b.rewritten_model()
        return arch_a.eval(), arch_b.eval(), notes
    from symalign.rewrite import plan, rewrite_model

    try:
        p = plan(model_a.cfg)
    except SymalignError as exc:  # e.g. post-LN: keep the model's own (permutation) residual symmetry
        return model_a, model_b, [f"no rewrite ({exc}); residual stream matched by permutation"]
    if p.residual:
        notes = []
    elif p.residual_dims:
        notes = [f"residual stream aligned by rotations of a {p.residual_dims}-dimensional subspace only: {p.reason}"]
    else:
        notes = [f"residual stream not aligned: {p.reason}"]
    return rewrite_model(model_a).eval(), rewrite_model(model_b).eval(), notes


def match_scope(spec: SymmetrySpec, sa: dict, sb: dict, stage1: bool, stage2: str):
    """Attention-only spaces: the two-stage matcher (which reads fused Q|K|V tensors such as GPT-2's
    ``c_attn`` by their segments); otherwise whole-model weight matching."""
    from symalign.match import match_attention
    from symalign.match.whole import match_whole

    if all(spec.role(s) in ATTENTION_ROLES for s in spec.spaces):
        return match_attention(spec, sa, sb, stage1=stage1, stage2=stage2)
    return match_whole(spec, sa, sb, stage1=stage1, stage2=stage2, max_iter=10)


def _finished(run_dir: Path, steps: int) -> bool:
    from symalign.checkpoint import has_checkpoint, load_checkpoint

    return has_checkpoint(run_dir) and int(load_checkpoint(run_dir, verify=False).meta.get("step", -1)) >= steps


def _train(cfg: ExperimentConfig, seed: int, out: Path, init: dict | None, progress: bool) -> Path:
    from symalign.checkpoint import has_checkpoint
    from symalign.train import TrainConfig, train

    tc = TrainConfig(**{**cfg.train, "seed": seed})
    if not _finished(out, tc.steps):
        train(cfg.model | {"family": cfg.model.get("family", "gpt")}, cfg.data, tc, out,
              data_options=cfg.data_options, resume=has_checkpoint(out), init=init, progress=progress)
    return out


def relative_output_change(model: nn.Module, state: dict[str, Tensor], state_b: dict[str, Tensor], x: Tensor,
                           model_b: nn.Module | None = None) -> float:
    """``||f(x) - f_B(x)|| / ||f_B(x)||``: the aligned B (``model`` with ``state``, possibly in
    rewritten coordinates) against B itself (``model_b`` with ``state_b``; default ``model``)."""
    with torch.no_grad():
        yb = lmc._logits(functional_call(model_b or model, state_b, (x,))).double()
        y2 = lmc._logits(functional_call(model, state, (x,))).double()
    return float((y2 - yb).norm() / yb.norm().clamp_min(1e-30))


def curve_runner(batches: list, task: str, points: int, device: str = "cpu"
                 ) -> Callable[[nn.Module, dict, dict], lmc.Curve]:
    """``run(model, state_a, state_b)``: :func:`symalign.lmc.curve` on ``device`` (``protocol.device``).

    On the CPU the model and states are used as they are; on a GPU a copy of the model, the
    two states and the batches are moved there (the caller's tensors stay on the CPU, where
    matching and the function check run).
    """
    from symalign.train import resolve_device

    dev = resolve_device(device)
    if dev.type == "cpu":
        return lambda model, a, b: lmc.curve(model, a, b, lambda: batches, task, points)
    on_dev = [(x.to(dev), y.to(dev)) for x, y in batches]

    def run(model: nn.Module, a: dict, b: dict) -> lmc.Curve:
        m = copy.deepcopy(model).to(dev)
        return lmc.curve(m, {k: v.to(dev) for k, v in a.items()}, {k: v.to(dev) for k, v in b.items()},
                         lambda: on_dev, task, points)

    return run


def align_and_measure(cfg: ExperimentConfig, dir_a: Path, dir_b: Path, scope: str,
                      progress: Callable[[str], None] | None = None, bars: bool = False) -> dict:
    """Match B to A for every variant and measure naive and aligned curves (one scope);
    ``progress`` receives status lines, ``bars`` shows the learned variant's progress bar."""
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
    layers = scope_layers(scope, model_a.cfg.n_layers)
    arch_a, arch_b, notes = alignment_models(model_a, model_b, scope)  # same functions as A, B
    ra, rb = lmc.full_state(arch_a), lmc.full_state(arch_b)
    full_spec = arch_a.symmetry_spec()
    spec = full_spec.restrict(scope_spaces(full_spec, scope, model_a.cfg.n_layers))
    t0 = time.perf_counter()
    naive, naive_original = naive_curves(curve, model_a, arch_a, (sa, sb), (ra, rb))
    out: dict[str, Any] = {
        "scope": scope, "family": model_a.cfg.family, "pe": model_a.cfg.pe, "data": ds.name,
        "eval_split": p.eval_split,
        "endpoints": {"A": {"loss": naive.loss[0], "acc": naive.acc[0]},
                      "B": {"loss": naive.loss[-1], "acc": naive.acc[-1]}},
        "naive": naive.to_dict(), "variants": {}, "layers_aligned": layers,
        "spaces_aligned": spec.describe(), "notes": notes,
    }
    if naive_original is not None:
        out["naive_original_coordinates"] = naive_original.to_dict()
    variants = [(True, v) for v in p.variants] + ([(False, "full")] if p.stage1_ablation else [])
    first_match = None
    done: dict[tuple[bool, str], Any] = {}
    for stage1, stage2 in variants:
        key = stage2 if stage1 else f"{stage2}-no-stage1"
        if progress:
            progress(f"{scope}: aligning ({key})")
        if stage2 == "learned":
            start = done.get((True, "full")) or match_scope(spec, ra, rb, True, "full")
            m = learned_variant(cfg, ds, spec, arch_a, arch_b, start, bars,
                                checkpoint=Path(dir_a).parent / "learned-stage2.pt")
        else:
            m = match_scope(spec, ra, rb, stage1, stage2)
        done[(stage1, stage2)] = m
        first_match = first_match or m
        rb2 = {**rb, **apply(spec, m.transform, rb)}
        change = relative_output_change(arch_a, rb2, sb, batches[0][0], model_b)
        tol = function_tolerance(next(iter(sb.values())).dtype)
        if change > tol:
            raise SymalignError(f"alignment changed model B's function (relative change {change:.2e} > {tol:g}); "
                                "this is a bug -- please report it with the config")
        aligned = curve(arch_a, ra, rb2)
        out["variants"][key] = {
            "curve": aligned.to_dict(), "function_change": change,
            "loss_barrier_ratio_percent": lmc.barrier_ratio(aligned.loss_barrier, naive.loss_barrier),
            "acc_barrier_ratio_percent": lmc.barrier_ratio(aligned.acc_barrier, naive.acc_barrier),
            "match": m.to_dict(),
        }
        del rb2
    if scope == "full" and p.methods:
        out["methods"] = seed002_methods(cfg, ds, arch_a, arch_b, batches, naive, progress,
                                         checkpoint=Path(dir_a).parent / "learned-matching.pt")
    # stage-1 metrics of the chosen head permutations, on B with the other spaces (residual, FF) aligned
    attn_spaces = spec.select(role=ATTENTION_ROLES)
    other = [x for x in spec.spaces if x not in attn_spaces]
    rb_ctx = {**rb, **apply(spec.restrict(other), {k: v for k, v in first_match.transform.items() if k in other}, rb)}
    out["stage1"] = stage1_metrics(spec.restrict(attn_spaces), ra, rb_ctx, first_match.transform)
    out["seconds"] = time.perf_counter() - t0
    return out


def naive_curves(curve: Callable[[nn.Module, dict, dict], lmc.Curve], model_a: nn.Module, arch_a: nn.Module,
                 states: tuple[dict, dict], rewritten: tuple[dict, dict]) -> tuple[lmc.Curve, lmc.Curve | None]:
    """The naive curve ``(1 - t) theta_A + t theta_B`` in the coordinates the aligned curves use, and
    (when the models were rewritten for alignment, the ``full`` scope) the one in their own coordinates.

    Interpolation is not invariant under the rewrite (gains folded into weights, writers centred),
    so a barrier ratio compares like with like only when both curves interpolate in the same
    coordinates: the first curve (``rewritten`` states on ``arch_a``) is the one the ratios use;
    the second (``states`` on ``model_a``; ``None`` when ``arch_a is model_a``) is reported beside it.
    """
    if arch_a is model_a:
        return curve(model_a, *states), None
    return curve(arch_a, *rewritten), curve(model_a, *states)


def learned_variant(cfg: ExperimentConfig, ds, spec: SymmetrySpec, arch_a: nn.Module, arch_b: nn.Module,
                    start, progress: bool = False, checkpoint: Path | None = None):
    """Stage-2 variant ``learned``: the ``full`` two-stage result ``start`` refined by learned matching
    (:func:`symalign.match.learned.learn_matching`) over the scope's spaces only.

    Same group, same exactness (every projected element is a symmetry); the objective is the
    training loss of the interpolated model ``L((1 - lambda) theta_A + lambda T . theta_B)``,
    ``lambda ~ U(protocol.learned_lambda)``, one fresh training batch of
    ``protocol.method_batch_size`` per step for ``protocol.learned_steps`` steps; the result is
    kept only if its objective on the validation split is at most ``start``'s (else ``start``).
    Resumable from ``checkpoint``. Returns a :class:`~symalign.match.learned.LearnedMatch`.
    """
    from symalign.data import eval_batches
    from symalign.experiments.methods import TrainStream
    from symalign.match.distance import distance
    from symalign.match.learned import learn_matching
    from symalign.match.whole import WholeMatch

    p = cfg.protocol
    context = int(cfg.train.get("context", 128))
    sa, sb = lmc.full_state(arch_a), lmc.full_state(arch_b)
    distances = [distance(spec, sa, sb), distance(spec, sa, apply(spec, start.transform, sb))]
    init = WholeMatch(dict(start.transform), spec, distances, True, "weight", getattr(start, "attention", start))
    stream = TrainStream(ds, p.method_batch_size, seed=p.seeds[0], context=context)
    val = list(eval_batches(ds, "val", 256, context, p.eval_items))
    return learn_matching(arch_a, arch_b, stream, steps=p.learned_steps, lam=tuple(p.learned_lambda), init=init,
                          select_batches=val, checkpoint=checkpoint, progress=progress, seed=p.seeds[0])


def seed002_methods(cfg: ExperimentConfig, ds, arch_a: nn.Module, arch_b: nn.Module, batches: list,
                    naive: lmc.Curve, progress: Callable[[str], None] | None = None,
                    checkpoint: Path | None = None) -> dict[str, dict]:
    """Seed 002's table for the ``full`` scope: weight / activation / learned matching of the two
    (rewritten) models (:func:`symalign.experiments.methods.align_methods`), each with its curve on
    the same test batches as the variants. Activation statistics and learned matching use the
    **training** split (a fresh batch per learned step, :class:`~symalign.experiments.methods.TrainStream`);
    learned matching picks between its result and weight matching on validation batches, and
    checkpoints to ``checkpoint`` (resumed from it when the run is interrupted)."""
    from symalign.data import eval_batches
    from symalign.experiments.methods import TrainStream, align_methods

    p = cfg.protocol
    context = int(cfg.train.get("context", 128))
    stream = TrainStream(ds, p.method_batch_size, seed=cfg.protocol.seeds[0], context=context)
    val = list(eval_batches(ds, "val", 256, context, p.eval_items))
    res = align_methods(arch_a, arch_b, batches, ds.task, methods=p.methods, points=p.points,
                        learned_steps=p.learned_steps, seed=p.seeds[0], train_batches=stream, val_batches=val,
                        naive=naive, progress=progress, learned_options={"lam": tuple(p.learned_lambda)},
                        learned_checkpoint=None if checkpoint is None else str(checkpoint))
    return {k: {kk: vv for kk, vv in v.items() if kk != "state"} for k, v in res.items()}


def stage1_metrics(spec: SymmetrySpec, state_a: dict, state_b: dict, transform: dict) -> list[dict]:
    """Per layer: the stage-1 objective of the chosen head permutation, of the identity, and
    (``h <= 8``) its rank among all admissible permutations and ``Lhat`` (the paper's metrics)."""
    from symalign.match.heads import best_and_identity, head_cost, lhat, objective, permutation_rank
    from symalign.match.views import find_layers

    rows = []
    for layer in find_layers(spec, state_a):
        space = layer.heads
        if space is None or space not in transform:
            continue
        group = spec.spaces[space]
        cost = head_cost(layer, state_a, state_b)
        pi = transform[space]
        entry = {"layer": layer.tag, "objective": objective(cost, pi),
                 "identity_objective": objective(cost, torch.arange(group.n_heads))}
        if group.n_heads <= 8:
            best, ident = best_and_identity(cost, group)
            entry.update(rank=permutation_rank(cost, pi, group), n_permutations=group.order(), best_objective=best,
                         lhat=lhat(entry["objective"], best, ident))
        rows.append(entry)
    return rows


def summary_row(name: str, res: dict) -> dict:
    """One line of the summary table for a scope's results."""
    row = {"experiment": name, "family": res["family"], "data": res["data"], "pe": res["pe"],
           "scope": res["scope"],
           **({"eval_split": res["eval_split"]} if res.get("eval_split", "test") != "test" else {}),
           "acc_A": res["endpoints"]["A"]["acc"], "acc_B": res["endpoints"]["B"]["acc"],
           "naive_loss_barrier": res["naive"]["loss_barrier"], "naive_acc_barrier": res["naive"]["acc_barrier"]}
    for key, v in res["variants"].items():
        row[f"{key}_loss_barrier"] = v["curve"]["loss_barrier"]
        row[f"{key}_acc_barrier"] = v["curve"]["acc_barrier"]
        row[f"{key}_ratio_percent"] = v["loss_barrier_ratio_percent"]
    for key, v in res.get("methods", {}).items():
        row[f"{key}-matching_loss_barrier"] = v["curve"]["loss_barrier"]
        row[f"{key}-matching_acc_barrier"] = v["curve"]["acc_barrier"]
        row[f"{key}-matching_ratio_percent"] = v["loss_barrier_ratio_percent"]
    return row


def check_inputs(cfg: ExperimentConfig) -> None:
    """Everything that can be checked before training: the dataset loads, the model config fits
    it (:func:`symalign.train.fit_config`: family/task, vocabulary, positions, classes, image
    shape), and an ``hf:`` family supports every scope asked for."""
    from symalign.data import load_dataset
    from symalign.models.hf import check_model_section, is_hf_family
    from symalign.train import fit_config

    family = cfg.model.get("family", "gpt")
    if is_hf_family(family):
        check_model_section(cfg.model, cfg.protocol.scopes)
    ds = load_dataset(cfg.data, **cfg.data_options)
    fit_config(cfg.model | {"family": family}, ds, int(cfg.train.get("context", 128)))


def check_reusable(done: dict, seeds: list[int], scope_dir: Path, eval_split: str) -> None:
    """A finished scope may only be reused for the seed pair and the evaluation split it was run
    with (older results without ``"seeds"``: the pair whose checkpoints lie beside them; without
    ``"eval_split"``: the test split)."""
    have = done.get("seeds")
    same = list(have) == list(seeds) if have is not None else all((scope_dir / f"seed{s}").is_dir() for s in seeds)
    if not same:
        raise ConfigError(f"{scope_dir / 'results.json'} holds the seed pair {have or 'of another run'}, not {seeds}; "
                          "give a second seed pair its own runs directory (--out)")
    split = done.get("eval_split", "test")
    if split != eval_split:
        raise ConfigError(f"{scope_dir / 'results.json'} was measured on the {split} split, not {eval_split}; "
                          "give each evaluation split its own runs directory (--out)")


# What the checkpoints of a run depend on: a run directory recorded with other values is stale.
TRAINING_KEYS = ("name", "data", "data_options", "model", "train")
TRAINING_PROTOCOL_KEYS = ("base_seed", "freeze")


def config_diff(old: Any, new: Any, prefix: str = "") -> list[str]:
    """The differing leaves of two JSON-like configs, as ``"model.d_model 16 -> 32"``."""
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for k in sorted(set(old) | set(new), key=str):
            out += config_diff(old.get(k), new.get(k), f"{prefix}{k}.")
        return out
    return [] if old == new else [f"{prefix.rstrip('.')} {old!r} -> {new!r}"]


def _training_part(d: dict) -> dict:
    proto = d.get("protocol") or {}
    return {**{k: d.get(k) for k in TRAINING_KEYS}, "protocol": {k: proto.get(k) for k in TRAINING_PROTOCOL_KEYS}}


def _result_part(d: dict) -> dict:
    """The config less ``protocol.scopes``, with the protocol's defaults filled in (``to_dict``
    leaves out optional settings at their defaults)."""
    from dataclasses import asdict

    from symalign.experiments.config import Protocol

    proto = {**asdict(Protocol()), **(d.get("protocol") or {})}
    return {**d, "protocol": {k: v for k, v in proto.items() if k != "scopes"}}


def _stale(what: Path, diff: list[str]) -> ConfigError:
    shown = "; ".join(diff[:3]) + (f"; and {len(diff) - 3} more" if len(diff) > 3 else "")
    return ConfigError(f"{what} was recorded with a different config ({shown}); use another --out, or --fresh "
                       "to discard the old run and start over")


def check_recorded(cfg: ExperimentConfig, root: Path) -> None:
    """Refuse to reuse a run directory whose checkpoints or results were made with another config.

    ``root/config.json`` must agree with ``cfg`` on everything the checkpoints depend on
    (:data:`TRAINING_KEYS`, ``protocol.base_seed``/``freeze``); each existing
    ``root/<scope>/results.json`` on the whole config except ``protocol.scopes`` (results
    written before configs were recorded in them: the seed pair and evaluation split,
    :func:`check_reusable`).
    """
    new = cfg.to_dict()
    recorded = root / "config.json"
    if recorded.is_file():
        try:
            old = json.loads(recorded.read_text())
        except ValueError:
            old = {}
        diff = config_diff(_training_part(old), _training_part(new))
        if diff:
            raise _stale(root, diff)
    for scope in cfg.protocol.scopes:
        res_path = root / scope / "results.json"
        if not res_path.is_file():
            continue
        done = json.loads(res_path.read_text())
        check_reusable(done, cfg.protocol.seeds, root / scope, cfg.protocol.eval_split)
        if "config" in done:
            diff = config_diff(_result_part(done["config"]), _result_part(new))
            if diff:
                raise _stale(res_path, diff)


def discard_run(root: Path) -> None:
    """``--fresh``: remove a previous run directory -- only one symalign wrote (it holds ``config.json``
    with a ``protocol`` section), never an arbitrary folder."""
    import shutil

    if not root.exists():
        return
    try:
        ok = root.is_dir() and "protocol" in json.loads((root / "config.json").read_text())
    except (OSError, ValueError):
        ok = False
    if not ok:
        raise ConfigError(f"{root} is not a symalign experiment run (no config.json with a protocol); "
                          "remove it yourself or use another --out")
    shutil.rmtree(root)


def run_experiment(cfg: ExperimentConfig, out_dir: str | Path, progress: bool = True,
                   log: Callable[[str], None] | None = None, fresh: bool = False) -> list[dict]:
    """Run (or resume) every scope of ``cfg`` under ``out_dir/cfg.name``; returns the per-scope results.

    A run directory recorded with another config is refused (:func:`check_recorded`) unless
    ``fresh``, which discards it first. Every result records the torch thread count
    (``"threads"``): float reductions, and so the trained weights and barriers, depend on it.
    """
    from symalign.experiments.report import plot_curves, write_summary

    check_inputs(cfg)
    root = Path(out_dir) / cfg.name
    if fresh:
        discard_run(root)
    check_recorded(cfg, root)
    root.mkdir(parents=True, exist_ok=True)
    write_json_atomic(root / "config.json", cfg.to_dict())
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
        dirs = []
        for seed in p.seeds:
            if scope == "full":
                init = None
            else:
                if base is None:
                    say("training the base model")
                    base = _train(cfg, p.base_seed, root / "base", None, progress)
                init = {"base": str(base), "scope": scope, "seed": seed, "freeze": p.freeze}
            say(f"{scope}: training seed {seed}")
            dirs.append(_train(cfg, seed, root / scope / f"seed{seed}", init, progress))
        res = align_and_measure(cfg, dirs[0], dirs[1], scope, progress=say, bars=progress)
        res["experiment"] = cfg.name
        res["seeds"] = list(p.seeds)
        res["threads"] = torch.get_num_threads()
        res["config"] = cfg.to_dict()
        plot_curves(res, root / scope / "curves.png")
        write_json_atomic(res_path, res)
        results.append(res)
    write_summary(Path(out_dir))
    return results
