"""Functional check that a written checkpoint computes what the original did.

Guards against adapter (and matcher) bugs: both directories are loaded with
``from_pretrained`` exactly as a user would, one after the other, run on the
same small random batch, and the relative difference of the first output
(logits or last hidden state) is measured against the tolerance table
(:mod:`symalign.tolerance`). Loading OUT this way also proves it is a complete,
loadable checkpoint.
"""

from __future__ import annotations

import copy
import gc
import os
from typing import Any, Mapping

import torch
from torch import Tensor

from symalign.arch.base import Adapter
from symalign.tolerance import TOLERANCE, FunctionCheck, function_tolerance, relative_change

__all__ = ["TOLERANCE", "check_function", "check_state_function", "output_change", "check_dtype",
           "run_checkpoint", "run_state"]
FLOAT64_MAX_PARAMS = 200_000_000  # above this, compute in float32 to bound memory


def _first_output(out: Any) -> Tensor:
    if isinstance(out, Tensor):
        return out
    for name in ("logits", "last_hidden_state"):
        t = getattr(out, name, None)
        if t is not None:
            return t
    return out[0]


@torch.no_grad()
def run_checkpoint(adapter: Adapter, config: Any, path: str | os.PathLike, dtype: torch.dtype,
                   seed: int = 0) -> Tensor:
    """Output of ``path`` (loaded with its model class, eager attention, in ``dtype``, under its own config as
    :meth:`~symalign.arch.base.Adapter.function_check_config` sets it for a check) on a random batch."""
    cls = adapter.model_class(config)
    own = adapter.function_check_config(cls.config_class.from_pretrained(str(path)))
    model = cls.from_pretrained(str(path), config=own, dtype=dtype, attn_implementation="eager",
                                experts_implementation="eager").eval()
    inputs = adapter.dummy_inputs(config, seed=seed)
    inputs = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in inputs.items()}
    y = _first_output(model(**inputs)).to(torch.float64)
    del model
    gc.collect()
    return y


@torch.no_grad()
def run_state(adapter: Adapter, config: Any, state: Mapping[str, Tensor], dtype: torch.dtype,
              seed: int = 0) -> Tensor:
    """Output of the model ``config`` describes with the weights ``state`` (under the names ``save_pretrained``
    writes), loaded by ``from_pretrained(None, state_dict=...)`` -- transformers' own loading, no file -- in
    ``dtype`` with eager attention, under :meth:`~symalign.arch.base.Adapter.function_check_config`, on the same
    random batch as :func:`run_checkpoint`."""
    from transformers.utils import logging

    cls = adapter.model_class(config)
    own = adapter.function_check_config(copy.deepcopy(config))
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        model = cls.from_pretrained(None, config=own, state_dict=dict(state), dtype=dtype,
                                    attn_implementation="eager", experts_implementation="eager").eval()
    finally:
        logging.set_verbosity(verbosity)
    inputs = adapter.dummy_inputs(config, seed=seed)
    inputs = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in inputs.items()}
    y = _first_output(model(**inputs)).to(torch.float64)
    del model
    gc.collect()
    return y


def check_dtype(n_params: int) -> torch.dtype:
    return torch.float64 if n_params <= FLOAT64_MAX_PARAMS else torch.float32


def output_change(adapter: Adapter, config: Any, ref_dir: str | os.PathLike,
                  new: str | os.PathLike | tuple[Any, Mapping[str, Tensor]], dtype: torch.dtype) -> tuple[float, float]:
    """``(||f_new(x) - f_ref(x)|| / ||f_ref(x)||, max |f_new(x) - f_ref(x)|)`` on a random batch
    (``inf`` if not finite). ``new``: a checkpoint folder, or ``(config, state)`` of weights in memory
    (:func:`run_state`)."""
    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        y_ref = run_checkpoint(adapter, config, ref_dir, dtype)
        y_new = (run_state(adapter, new[0], new[1], dtype) if isinstance(new, tuple)
                 else run_checkpoint(adapter, config, new, dtype))
    finally:
        logging.set_verbosity(verbosity)
        logging.enable_progress_bar()
    return relative_change(y_ref, y_new)


def check_function(b: Any, b_dir: str | os.PathLike, new_dir: str | os.PathLike, floor: float = 0.0
                   ) -> FunctionCheck:
    """Does the checkpoint ``new_dir`` compute B's function? ``b``: B loaded or opened (``adapter``,
    ``config``, ``numel``, ``dtype``). Computed in float64 when B is small enough, else float32;
    the bound is :func:`symalign.tolerance.function_tolerance` of B's dtype and the check's dtype,
    raised to the adapter's precision floor and ``floor``."""
    dtype = check_dtype(b.numel)
    rel, max_abs = output_change(b.adapter, b.config, b_dir, new_dir, dtype)
    tol = function_tolerance(b.dtype, dtype, floor=max(b.adapter.precision_floor, floor))
    return FunctionCheck.of(rel, max_abs, dtype, tol)


def check_state_function(b: Any, b_dir: str | os.PathLike, config: Any, state: Mapping[str, Tensor],
                         floor: float = 0.0) -> FunctionCheck:
    """:func:`check_function` for weights in memory: does ``state`` under ``config`` (B's config, or B's with the
    edits an aligned output records) compute checkpoint B's function? Nothing is written: the aligned model is
    loaded from ``state`` by :func:`run_state`; B from ``b_dir``. Same dtype, batch and bound."""
    dtype = check_dtype(b.numel)
    rel, max_abs = output_change(b.adapter, b.config, b_dir, (config, state), dtype)
    tol = function_tolerance(b.dtype, dtype, floor=max(b.adapter.precision_floor, floor))
    return FunctionCheck.of(rel, max_abs, dtype, tol)
