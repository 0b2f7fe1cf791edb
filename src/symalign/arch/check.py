"""Functional check that a written checkpoint computes what the original did.

Guards against adapter (and matcher) bugs: both directories are loaded with
``from_pretrained`` exactly as a user would, one after the other, run on the
same small random batch, and the relative difference of the first output
(logits or last hidden state) is returned. Loading OUT this way also proves
it is a complete, loadable checkpoint.
"""

from __future__ import annotations

import gc
import os
from typing import Any

import torch
from torch import Tensor

from symalign.arch.base import Adapter

# Relative output change allowed by the storage precision of the weights.
TOLERANCE: dict[torch.dtype, float] = {torch.float64: 1e-8, torch.float32: 1e-4, torch.bfloat16: 5e-2,
                                       torch.float16: 2e-2}
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
    """Output of ``path`` (loaded with its model class, eager attention, in ``dtype``) on a random batch."""
    cls = adapter.model_class(config)
    model = cls.from_pretrained(str(path), dtype=dtype, attn_implementation="eager", experts_implementation="eager").eval()
    inputs = adapter.dummy_inputs(config, seed=seed)
    inputs = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in inputs.items()}
    y = _first_output(model(**inputs)).to(torch.float64)
    del model
    gc.collect()
    return y


def check_dtype(n_params: int) -> torch.dtype:
    return torch.float64 if n_params <= FLOAT64_MAX_PARAMS else torch.float32


def functional_difference(adapter: Adapter, config: Any, ref_dir: str | os.PathLike, new_dir: str | os.PathLike,
                          dtype: torch.dtype) -> float:
    """``||f_new(x) - f_ref(x)|| / ||f_ref(x)||`` on a random batch (``inf`` if not finite)."""
    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        y_ref = run_checkpoint(adapter, config, ref_dir, dtype)
        y_new = run_checkpoint(adapter, config, new_dir, dtype)
    finally:
        logging.set_verbosity(verbosity)
        logging.enable_progress_bar()
    if not (torch.isfinite(y_ref).all() and torch.isfinite(y_new).all()):
        return float("inf")
    denom = float(y_ref.norm())
    diff = float((y_new - y_ref).norm())
    return diff / denom if denom > 0 else diff
