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
           "run_checkpoint", "run_model", "run_state"]
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
def run_model(adapter: Adapter, config: Any, dtype: torch.dtype, path: str | os.PathLike | None = None,
              state: Mapping[str, Tensor] | None = None, seed: int = 0) -> Tensor:
    """Output on a random batch (``adapter.dummy_inputs``, seeded) of the model loaded by ``from_pretrained`` with its
    class, eager attention, in ``dtype``, under :meth:`~symalign.arch.base.Adapter.function_check_config`: from the
    folder ``path`` (under its own config), or -- ``state`` -- from weights in memory under the names
    ``save_pretrained`` writes (``from_pretrained(None, state_dict=...)``: transformers' own loading, no file)."""
    cls = adapter.model_class(config)
    own = adapter.function_check_config(cls.config_class.from_pretrained(str(path)) if state is None
                                        else copy.deepcopy(config))
    source = str(path) if state is None else None
    model = cls.from_pretrained(source, config=own, dtype=dtype, attn_implementation="eager",
                                experts_implementation="eager",
                                **({} if state is None else {"state_dict": dict(state)})).eval()
    inputs = adapter.dummy_inputs(config, seed=seed)
    inputs = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in inputs.items()}
    y = _first_output(model(**inputs)).to(torch.float64)
    del model
    gc.collect()
    return y


def run_checkpoint(adapter: Adapter, config: Any, path: str | os.PathLike, dtype: torch.dtype,
                   seed: int = 0) -> Tensor:
    """:func:`run_model` of the checkpoint folder ``path``."""
    return run_model(adapter, config, dtype, path=path, seed=seed)


def run_state(adapter: Adapter, config: Any, state: Mapping[str, Tensor], dtype: torch.dtype,
              seed: int = 0) -> Tensor:
    """:func:`run_model` of the weights ``state`` in memory under ``config`` (the same random batch)."""
    return run_model(adapter, config, dtype, state=state, seed=seed)


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
