"""LMC curves for Hugging Face checkpoints on symalign's datasets.

The checkpoint's task head decides what it is evaluated on:

* ``...ForCausalLM`` / ``...LMHeadModel``: a byte-level language-modelling corpus
  (``shakespeare``, ``bible``); token ``i`` is byte ``i``, so the vocabulary must
  cover the 256 byte values; loss in nats per byte, next-byte accuracy.
* ``...ForSequenceClassification``: a labelled byte-sequence dataset (``wordnet``,
  ``fortunes``); ``num_labels`` must equal the dataset's classes.
* ``...ForImageClassification``: an image dataset (``digits``, ``fashion-mnist``);
  the config's ``image_size``/``num_channels``/``num_labels`` must match it.

Mismatches are refused before anything is evaluated, naming the setting to change.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from symalign import lmc
from symalign.errors import ConfigError


@dataclass
class HFEvalTask:
    """What a checkpoint is evaluated on: the symalign task kind and the evaluation batches."""

    task: str  # "lm" | "classification"
    batches: list


def _head_kind(model: nn.Module) -> str:
    name = type(model).__name__
    if name.endswith(("ForCausalLM", "LMHeadModel")):
        return "lm"
    if name.endswith("ForSequenceClassification"):
        return "text"
    if name.endswith("ForImageClassification"):
        return "image"
    raise ConfigError(f"{name} has no task head symalign can evaluate; save the model as a ...ForCausalLM, "
                      "...ForSequenceClassification or ...ForImageClassification")


def eval_task(model: nn.Module, data: str, eval_items: int | None = 2000, context: int = 128,
              batch_size: int = 64, data_options: dict | None = None) -> HFEvalTask:
    """Check that ``model`` fits dataset ``data`` and build its evaluation batches (test split)."""
    from symalign.data import eval_batches, load_dataset

    cfg = model.config
    kind = _head_kind(model)
    ds = load_dataset(data, **(data_options or {}))
    want = {"lm": "lm", "text": "text", "image": "image"}[kind]
    if ds.modality != want:
        raise ConfigError(f"{type(model).__name__} needs a {want} dataset, but {data!r} is {ds.modality}")
    if kind == "lm":
        if int(cfg.vocab_size) < 256:
            raise ConfigError(f"the model's vocabulary ({cfg.vocab_size}) does not cover the 256 byte tokens of "
                              f"{data!r}; use a model with vocab_size >= 256")
        limit = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
        if limit is not None:
            context = min(context, int(limit))
    else:
        labels = int(getattr(cfg, "num_labels", 0))
        if labels != ds.n_classes:
            raise ConfigError(f"the model has num_labels={labels} but {data!r} has {ds.n_classes} classes")
        if kind == "image":
            c, h, w = ds.input_shape
            if int(cfg.image_size) != h or int(getattr(cfg, "num_channels", c)) != c:
                raise ConfigError(f"the model expects {cfg.num_channels}x{cfg.image_size}x{cfg.image_size} images, "
                                  f"{data!r} has {c}x{h}x{w}")
        elif int(cfg.vocab_size) < 256:
            raise ConfigError(f"the model's vocabulary ({cfg.vocab_size}) does not cover the 256 byte tokens")
    dtype = next(model.parameters()).dtype
    batches = [(x.to(dtype) if x.is_floating_point() else x, y)
               for x, y in eval_batches(ds, "test", batch_size, context, eval_items)]
    return HFEvalTask("lm" if kind == "lm" else "classification", batches)


def load_hf_model(path: str | Path) -> nn.Module:
    """``from_pretrained`` with the class the checkpoint names (validated by :mod:`symalign.hf_io`)."""
    from symalign.hf_io import load_config
    from symalign.arch import get_adapter

    from transformers.utils import logging

    config = load_config(path)
    cls = get_adapter(config).model_class(config)
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # no "Loading weights" bars or load reports in symalign's output
    logging.disable_progress_bar()
    try:
        model = cls.from_pretrained(str(path), attn_implementation="eager")
    finally:
        logging.set_verbosity(verbosity)
    return model.eval()


def hf_curve(dir_a: str | Path, dir_b: str | Path, data: str, points: int = 25, eval_items: int | None = 2000,
             context: int = 128, data_options: dict | None = None) -> tuple[lmc.Curve, dict[str, Any]]:
    """The interpolation curve ``(1 - t) A + t B`` of two HF checkpoints on ``data``.

    When B is marked folded (the output of ``align --scope model``, written in the
    coordinates it was aligned in: norm gains folded, GPT-2's head untied) and A is not,
    the curve runs from A's folded form (:mod:`symalign.hf_fold`, checked to compute A's
    function): the path the alignment made short, ``(1 - t) fold(A) + t B``.
    """
    import shutil

    from symalign.hf_fold import folded_copy, is_folded
    from symalign.hf_io import check_same_architecture, load_checkpoint

    scratch = None
    folded_a = is_folded(dir_b) and not is_folded(dir_a)
    try:
        if folded_a:
            dir_a, scratch = folded_copy(dir_a)
        check_same_architecture(load_checkpoint(dir_a), load_checkpoint(dir_b))
        model_a, model_b = load_hf_model(dir_a), load_hf_model(dir_b)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    task = eval_task(model_a, data, eval_items, context, data_options=data_options)
    sa, sb = lmc.full_state(model_a), lmc.full_state(model_b)
    del model_b
    with torch.no_grad():
        c = lmc.curve(model_a, sa, sb, lambda: task.batches, task.task, points)
    return c, {"task": task.task, "data": data, "model_type": model_a.config.model_type,
               "a_folded": folded_a, "threads": torch.get_num_threads()}
