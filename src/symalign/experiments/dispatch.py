r"""What the protocol aligns for a scope, in which coordinates, and with which matcher.

* :func:`scope_layers` / :func:`scope_spaces` / :func:`attention_spec`: the layers and spec
  spaces a re-initialisation scope covers (read from the spec's roles and layers);
* :func:`alignment_models`: the parametrisation to align in (the ``full`` scope rewrites
  the models so that the residual stream has its ``O(D)`` symmetry);
* :func:`match_scope`: the two-stage attention matcher for attention-only spaces, else
  whole-model weight matching;
* :func:`learned_variant` (stage-2 variant ``learned``) and :func:`seed002_methods`
  (``protocol.methods``: weight / activation / learned matching of the ``full`` scope).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from torch import nn

from symalign import lmc
from symalign.errors import SymalignError
from symalign.experiments.config import ExperimentConfig
from symalign.spec import ATTENTION_ROLES, SymmetrySpec, apply


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
    :func:`symalign.families.prepare` (:meth:`~symalign.models.hf.HFModel.rewritten_model`).
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
    from symalign.match.whole import PROTOCOL_SETTINGS, match_whole

    if all(spec.role(s) in ATTENTION_ROLES for s in spec.spaces):
        return match_attention(spec, sa, sb, stage1=stage1, stage2=stage2)
    return match_whole(spec, sa, sb, stage1=stage1, stage2=stage2, max_sweeps=10, **PROTOCOL_SETTINGS)


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
