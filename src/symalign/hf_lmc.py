"""LMC curves of two Hugging Face checkpoints, evaluated as the checkpoints are meant to be used.

The checkpoint's head decides the objective (causal LM, masked LM, sequence or
image classification) and its tokenizer / image processor how the data is read
(:mod:`symalign.evaluate`). :func:`hf_curve` loads A and B (validated, same
architecture, same vocabulary), builds the fixed evaluation batches once from A,
and evaluates ``(1 - t) A + t B`` at every point.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from symalign import lmc
from symalign.arithmetic import describe
from symalign.evaluate import EvalOptions, EvalSet, build_eval, check_same_vocabulary, check_tokenizers, eval_curve
from symalign.evaluate.run import Metrics


def load_hf_model(path: str | Path) -> nn.Module:
    """``from_pretrained`` with the class the checkpoint names (validated by :mod:`symalign.checkpoint`)."""
    from symalign.families import get_adapter
    from symalign.checkpoint.config import load_config

    from transformers.utils import logging

    config = load_config(path)
    cls = get_adapter(config).model_class(config)
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # no "Loading weights" bars or load reports in symalign's output
    logging.disable_progress_bar()
    try:
        model = cls.from_pretrained(str(path), attn_implementation="eager", experts_implementation="eager")
    finally:
        logging.set_verbosity(verbosity)
    return model.eval()


def check_evaluable(path: str | Path) -> str:
    """The objective of the checkpoint at ``path`` read from its config alone (the class it names, see
    :func:`symalign.evaluate.objective.head_objective`): an unsupported head is refused before any weights
    are loaded."""
    from symalign.checkpoint.config import load_config
    from symalign.evaluate.objective import head_objective
    from symalign.families import get_adapter

    config = load_config(path)
    return head_objective(get_adapter(config).model_class(config), config)


@dataclass
class HFPair:
    """A loaded pair: A's model (the architecture), both state dicts, and the fixed evaluation batches."""

    model: nn.Module
    state_a: dict
    state_b: dict
    evalset: EvalSet
    info: dict[str, Any]


def load_rewritten(path: str | Path) -> nn.Module:
    """The checkpoint rewritten exactly in the whole-model format of ``symalign align --scope model``
    (:func:`symalign.families.prepare`: norm gains folded, GPT-2's head untied), loaded with
    ``from_pretrained`` from a temporary copy. It computes the checkpoint's function; ``prepare`` leaves
    a checkpoint that is already in this format (an aligned output) unchanged."""
    from symalign.checkpoint.hf import load_checkpoint
    from symalign.checkpoint.output import stage_checkpoint
    from symalign.families import prepare

    ckpt = load_checkpoint(path)
    prep = prepare(ckpt.config, ckpt.state, ckpt.adapter.spec(ckpt.config, ckpt.state.keys()))
    edits = {"tie_word_embeddings": False} if prep.untied else None
    scratch = Path(tempfile.mkdtemp(prefix=".symalign-rewrite-"))
    try:
        tmp = stage_checkpoint(scratch / "model", prep.state, path, edits)
        return load_hf_model(tmp)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def load_pair(dir_a: str | Path, dir_b: str | Path, data: str, opts: EvalOptions | None = None,
              evalset: EvalSet | None = None, scope: str = "attention") -> HFPair:
    """Load A and B (validated, same architecture, same vocabulary) and build the batches from A.

    ``scope="model"``: both are first rewritten exactly in the whole-model format
    (:func:`load_rewritten`), so a B aligned with ``--scope model`` is interpolated
    against A in the same parametrisation (and a baseline B too: only the alignment
    differs between the two curves). ``evalset``: reuse batches built before (e.g.
    for the baseline curve, so both curves see the very same tokens and masks).
    """
    from symalign.errors import ConfigError, MatchError
    from symalign.checkpoint.config import check_same_architecture
    from symalign.checkpoint.hf import load_checkpoint

    if scope not in ("attention", "model"):
        raise ConfigError(f"unknown scope {scope!r}; use attention or model")
    check_evaluable(dir_a)
    from symalign.hf_fold import is_folded

    a_folded = scope == "attention" and is_folded(dir_b) and not is_folded(dir_a)
    if a_folded:  # B' is an `align --scope model` output, marked folded: measure the path that was aligned
        scope = "model"
    try:
        check_same_architecture(load_checkpoint(dir_a), load_checkpoint(dir_b))
    except MatchError as exc:
        if scope == "model" and "exists only in" in str(exc):
            pass  # e.g. GPT-2's untied head of an aligned output: compared after the rewrite
        elif "exists only in" in str(exc):
            raise MatchError(f"{exc}; if B was aligned with --scope model, pass --scope model") from None
        else:
            raise
    check_same_vocabulary([dir_a, dir_b])
    load = load_rewritten if scope == "model" else load_hf_model
    model_a, model_b = load(dir_a), load(dir_b)
    if evalset is None:
        evalset = build_eval(dir_a, model_a, data, opts)
    check_tokenizers([dir_a, dir_b], evalset, opts)  # B is held to the rule A met
    sa, sb = lmc.full_state(model_a), lmc.full_state(model_b)
    lmc.check_compatible(sa, sb)
    return HFPair(model_a, sa, sb, evalset,
                  {"task": evalset.objective, "data": data, "model_type": model_a.config.model_type,
                   "scope": scope, "a_folded": a_folded or scope == "model",
                   "threads": torch.get_num_threads(), "arithmetic": describe()})


def hf_curve(dir_a: str | Path, dir_b: str | Path, data: str, points: int = 25, opts: EvalOptions | None = None,
             progress: Callable[[int, float], None] | None = None, evalset: EvalSet | None = None,
             ) -> tuple[lmc.Curve, list[Metrics], EvalSet, dict[str, Any]]:
    """The interpolation curve ``(1 - t) A + t B`` of two HF checkpoints on ``data`` (see :func:`load_pair`)."""
    pair = load_pair(dir_a, dir_b, data, opts, evalset)
    curve, metrics = eval_curve(pair.model, pair.state_a, pair.state_b, pair.evalset, points, progress)
    return curve, metrics, pair.evalset, pair.info
