r"""LMC curves of two Hugging Face checkpoints: one engine over two tensor sources.

``symalign interpolate`` evaluates ``theta(t) = lerp(A, B, t) = A + t (B - A)`` (``torch.lerp`` in the model's
dtype, as :func:`symalign.lmc.interpolate`) at evenly spaced ``t``, as the checkpoints are meant to be used: the
checkpoint's head decides the objective (causal LM, masked LM, sequence or image classification) and its
tokenizer / image processor how the data is read (:mod:`symalign.evaluate`).

One engine (:func:`curve`): a single resident model of A's architecture; for each point every tensor of the
sources is written into the model's tensor of that name as ``lerp(a, b, t)`` in row chunks of at most
:data:`CHUNK_ELEMENTS` values (:class:`LinePath`; A at ``t = 0`` and B at ``t = 1`` bit for bit), then the model is
evaluated with its own weights. ``lerp`` is elementwise, so chunks change nothing. What differs is only where A
and B come from (:func:`open_pair`):

* in memory: :class:`~symalign.io.tensors.StateTensors` of both models' parameters and buffers (``--scope model``:
  both rewritten exactly in the whole-model format first, :func:`load_rewritten`);
* streamed (``--stream``): :class:`~symalign.checkpoint.lazy.LazyCheckpoint` of both folders, read lazily --
  one model plus two row chunks in memory. Tensors the checkpoint lacks (tied weights, buffers such as rotary
  frequencies) are the model's own and equal in A and B (``lerp(x, x, t) = x``).

Both give bit-identical points, hence metrics.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from symalign import lmc
from symalign.arithmetic import describe
from symalign.device import describe as device_of
from symalign.errors import CheckpointError, ConfigError, MatchError, SymalignError
from symalign.evaluate import (EvalOptions, EvalSet, build_eval, check_same_vocabulary, check_tokenizers,
                               evaluate_model)
from symalign.evaluate.run import Metrics
from symalign.io.tensors import StateTensors, TensorSource

CHUNK_ELEMENTS = 1 << 22

__all__ = ["CHUNK_ELEMENTS", "LinePath", "Pair", "check_evaluable", "curve", "load_hf_model", "load_rewritten",
           "open_pair"]


def _quiet_from_pretrained(cls: Any, *args: Any, **kwargs: Any) -> nn.Module:
    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # no "Loading weights" bars or load reports in symalign's output
    logging.disable_progress_bar()
    try:
        model = cls.from_pretrained(*args, attn_implementation="eager", experts_implementation="eager", **kwargs)
    finally:
        logging.set_verbosity(verbosity)
    return model.eval()


def load_hf_model(path: str | Path) -> nn.Module:
    """``from_pretrained`` with the class the checkpoint names (validated by :mod:`symalign.checkpoint`)."""
    from symalign.checkpoint.config import load_config
    from symalign.families import get_adapter

    config = load_config(path)
    return _quiet_from_pretrained(get_adapter(config).model_class(config), str(path))


def check_evaluable(path: str | Path) -> str:
    """The objective of the checkpoint at ``path`` read from its config alone (the class it names, see
    :func:`symalign.evaluate.objective.head_objective`): an unsupported head is refused before any weights
    are loaded."""
    from symalign.checkpoint.config import load_config
    from symalign.evaluate.objective import head_objective
    from symalign.families import get_adapter

    config = load_config(path)
    return head_objective(get_adapter(config).model_class(config), config)


def load_rewritten(path: str | Path) -> nn.Module:
    """The checkpoint rewritten exactly in the whole-model format of ``symalign align --scope model``
    (:func:`symalign.families.prepare`: norm gains folded, GPT-2's head untied), loaded by ``from_pretrained``
    from the rewritten weights in memory (nothing written). It computes the checkpoint's function; ``prepare``
    leaves a checkpoint that is already in this format (an aligned output) unchanged."""
    import copy

    from symalign.checkpoint.config import saved_names
    from symalign.checkpoint.hf import load_checkpoint
    from symalign.families import prepare

    ckpt = load_checkpoint(path)
    prep = prepare(ckpt.config, ckpt.state, ckpt.adapter.spec(ckpt.config, ckpt.state.keys()))
    config = copy.deepcopy(ckpt.config)
    if prep.untied:
        config.tie_word_embeddings = False
    state = saved_names(config, prep.state)
    ckpt_class = ckpt.adapter.model_class(config)
    del prep, ckpt
    return _quiet_from_pretrained(ckpt_class, None, config=config, state_dict=state)


class LinePath:
    """The line ``A -> B`` over one resident model whose tensors are overwritten per point (module docstring)."""

    def __init__(self, model: nn.Module, a: TensorSource, b: TensorSource):
        self.model, self.a, self.b = model, a, b
        params = {**model.state_dict(keep_vars=True), **dict(model.named_buffers()), **dict(model.named_parameters())}
        shapes_b = b.shapes
        for name, shape in a.shapes.items():
            if name not in params or tuple(params[name].shape) != tuple(shape):
                raise CheckpointError(f"{getattr(a, 'path', 'A')}: tensor {name!r} does not fit the model "
                                      f"{type(model).__name__} loaded from it")
            if tuple(shapes_b.get(name, ())) != tuple(shape):
                raise SymalignError(f"tensor {name!r} has shape {tuple(shape)} in A but {shapes_b.get(name)} in B; "
                                    "interpolation needs two models of the same architecture")
        self.params = {k: params[k] for k in a.shapes}

    @torch.no_grad()
    def set(self, t: float) -> None:
        """Write ``lerp(A, B, t)`` (A at ``t = 0``, B at ``t = 1``, bit for bit) into the model."""
        for name, p in self.params.items():
            src = self.a if (not p.is_floating_point() or t == 0.0) else self.b if t == 1.0 else None
            if p.dim() == 0:
                x = (src or self.a).read([name], p.dtype if p.is_floating_point() else None)[name]
                p.copy_(torch.lerp(x, self.b.read([name], p.dtype)[name], t) if src is None else x)
                continue
            rows = max(1, CHUNK_ELEMENTS // max(1, p[0].numel()))
            for lo in range(0, p.shape[0], rows):
                hi = min(p.shape[0], lo + rows)
                if src is not None:
                    x = src.read_rows(name, lo, hi, p.dtype if p.is_floating_point() else None)
                else:
                    x = torch.lerp(self.a.read_rows(name, lo, hi, p.dtype), self.b.read_rows(name, lo, hi, p.dtype), t)
                p[lo:hi].copy_(x)


@dataclass
class Pair:
    """What :func:`curve` runs on: the resident model (A's architecture), the two sources, the batches, the info."""

    model: nn.Module
    a: TensorSource
    b: TensorSource
    evalset: EvalSet
    info: dict[str, Any]


def open_pair(dir_a: str | Path, dir_b: str | Path, data: str, opts: EvalOptions | None = None,
              evalset: EvalSet | None = None, scope: str = "attention", stream: bool = False,
              reuse: Pair | None = None, device: torch.device | None = None) -> Pair:
    """A and B checked (same architecture, same vocabulary, an evaluable head) and opened as sources, A's model
    loaded as the resident model, and the batches built from it (``evalset``: reuse batches built before, e.g. for
    a baseline curve, so both curves see the very same tokens and masks; ``reuse``: a pair opened before from the
same A, whose resident model and A source serve again).

    ``scope="model"``, or a B marked folded (an ``align --scope model`` output) with an A that is not: both are
    first rewritten exactly in the whole-model format (:func:`load_rewritten`), so B' is interpolated against A in
    the parametrisation it was aligned in. ``stream``: the sources are the checkpoint folders, read lazily; only
    the plain parametrisation streams (folded checkpoints need the in-memory rewrite and are refused).
    ``device``: the resident model lives and is evaluated there (:mod:`symalign.device`); the sources stay on the
    CPU and each point's chunks are copied over."""
    scope, a_folded = _pair_scope(dir_a, dir_b, scope, stream)
    lazy_a, lazy_b = _checked_headers(dir_a, dir_b, scope)
    if stream:
        model = reuse.model if reuse is not None else load_hf_model(dir_a)
        a, b = (reuse.a if reuse is not None else lazy_a), lazy_b
    else:
        model, a, b = _in_memory_sources(dir_a, dir_b, scope, reuse)
    if evalset is None:
        evalset = build_eval(dir_a, model, data, opts)
    check_tokenizers([dir_a, dir_b], evalset, opts)  # B is held to the rule A met
    if device is not None and reuse is None:
        model.to(device)
    info = {"task": evalset.objective, "data": data, "model_type": model.config.model_type, "scope": scope,
            "a_folded": a_folded or scope == "model", "threads": torch.get_num_threads(), "arithmetic": describe(),
            **device_of(next(model.parameters()).device)}
    if stream:
        info["streamed"] = True
    return Pair(model, a, b, evalset, info)


def _pair_scope(dir_a: str | Path, dir_b: str | Path, scope: str, stream: bool) -> tuple[str, bool]:
    """``(scope, a_folded)``: the scope the pair is measured in -- ``"model"`` also when B is marked folded (an
    ``align --scope model`` output) and A is not (``a_folded``) -- after checking the scope, that A has an
    evaluable head, and that ``stream`` is not asked of a folded checkpoint."""
    from symalign.checkpoint.folded import is_folded

    if scope not in ("attention", "model"):
        raise ConfigError(f"unknown scope {scope!r}; use attention or model")
    check_evaluable(dir_a)
    a_folded = scope == "attention" and is_folded(dir_b) and not is_folded(dir_a)
    if stream and (scope != "attention" or is_folded(dir_b) or is_folded(dir_a)):
        raise ConfigError("interpolate --stream measures the checkpoints as stored; a folded (--scope model) "
                          "checkpoint needs the in-memory rewrite: use --no-stream")
    if a_folded:  # B' is an `align --scope model` output, marked folded: measure the path that was aligned
        scope = "model"
    return scope, a_folded


def _checked_headers(dir_a: str | Path, dir_b: str | Path, scope: str):
    """Both checkpoints opened from their headers only, checked to share the architecture (a tensor only one holds
    is allowed under ``scope="model"``: compared after the rewrite) and the vocabulary."""
    from symalign.checkpoint.config import check_same_architecture
    from symalign.checkpoint.lazy import open_checkpoint

    lazy_a, lazy_b = open_checkpoint(dir_a), open_checkpoint(dir_b)  # headers only
    try:
        check_same_architecture(lazy_a, lazy_b)
    except MatchError as exc:
        if scope == "model" and "exists only in" in str(exc):
            pass  # e.g. GPT-2's untied head of an aligned output: compared after the rewrite
        elif "exists only in" in str(exc):
            raise MatchError(f"{exc}; if B was aligned with --scope model, pass --scope model") from None
        else:
            raise
    check_same_vocabulary([dir_a, dir_b])
    return lazy_a, lazy_b


def _in_memory_sources(dir_a: str | Path, dir_b: str | Path, scope: str, reuse: Pair | None):
    """``(model, a, b)`` in memory: B's tensors, and A's resident model with a copy of its tensors (the model's own
    are overwritten per point) or ``reuse``'s; under ``scope="model"`` both rewritten (:func:`load_rewritten`)."""
    load = load_rewritten if scope == "model" else load_hf_model
    model_b = load(dir_b)
    b = StateTensors(lmc.full_state(model_b), dir_b)
    del model_b
    if reuse is not None:
        model, a = reuse.model, reuse.a
    else:  # the model's own tensors are overwritten per point: A is a copy
        model = load(dir_a)
        a = StateTensors({k: v.clone() for k, v in lmc.full_state(model).items()}, dir_a)
    lmc.check_compatible(a.state, b.state)
    return model, a, b


def curve(pair: Pair, points: int = 25, progress: Callable[[int, float], None] | None = None
          ) -> tuple[lmc.Curve, list[Metrics]]:
    """The curve (loss, accuracy) at ``points`` evenly spaced ``t`` and every point's full metrics (module
    docstring); the resident model's weights are overwritten."""
    if points < 2:
        raise SymalignError(f"an interpolation curve needs at least 2 points, got {points}")
    path = LinePath(pair.model, pair.a, pair.b)
    ts = [i / (points - 1) for i in range(points)]
    metrics = []
    for i, t in enumerate(ts):
        path.set(t)
        metrics.append(evaluate_model(pair.model, pair.evalset))
        if progress is not None:
            progress(i, t)
    return lmc.Curve(ts, [m.loss for m in metrics], [m.accuracy for m in metrics]), metrics
