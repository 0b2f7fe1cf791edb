"""LMC curves of two Hugging Face checkpoints, evaluated as the checkpoints are meant to be used.

The checkpoint's head decides the objective (causal LM, masked LM, sequence or
image classification) and its tokenizer / image processor how the data is read
(:mod:`symalign.evaluate`). :func:`hf_curve` loads A and B (validated, same
architecture, same vocabulary), builds the fixed evaluation batches once from A,
and evaluates ``(1 - t) A + t B`` at every point.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from torch import nn

from symalign import lmc
from symalign.evaluate import EvalOptions, EvalSet, build_eval, check_same_vocabulary, eval_curve
from symalign.evaluate.run import Metrics


def load_hf_model(path: str | Path) -> nn.Module:
    """``from_pretrained`` with the class the checkpoint names (validated by :mod:`symalign.hf_io`)."""
    from symalign.arch import get_adapter
    from symalign.hf_io import load_config

    config = load_config(path)
    cls = get_adapter(config).model_class(config)
    model = cls.from_pretrained(str(path), attn_implementation="eager")
    return model.eval()


@dataclass
class HFPair:
    """A loaded pair: A's model (the architecture), both state dicts, and the fixed evaluation batches."""

    model: nn.Module
    state_a: dict
    state_b: dict
    evalset: EvalSet
    info: dict[str, Any]


def load_pair(dir_a: str | Path, dir_b: str | Path, data: str, opts: EvalOptions | None = None,
              evalset: EvalSet | None = None) -> HFPair:
    """Load A and B (validated, same architecture, same vocabulary) and build the batches from A.

    ``evalset``: reuse batches built before (e.g. for the baseline curve, so both
    curves see the very same tokens and masks).
    """
    from symalign.hf_io import check_same_architecture, load_checkpoint

    check_same_architecture(load_checkpoint(dir_a), load_checkpoint(dir_b))
    check_same_vocabulary([dir_a, dir_b])
    model_a, model_b = load_hf_model(dir_a), load_hf_model(dir_b)
    if evalset is None:
        evalset = build_eval(dir_a, model_a, data, opts)
    sa, sb = lmc.full_state(model_a), lmc.full_state(model_b)
    return HFPair(model_a, sa, sb, evalset,
                  {"task": evalset.objective, "data": data, "model_type": model_a.config.model_type})


def hf_curve(dir_a: str | Path, dir_b: str | Path, data: str, points: int = 25, opts: EvalOptions | None = None,
             progress: Callable[[int, float], None] | None = None, evalset: EvalSet | None = None,
             ) -> tuple[lmc.Curve, list[Metrics], EvalSet, dict[str, Any]]:
    """The interpolation curve ``(1 - t) A + t B`` of two HF checkpoints on ``data`` (see :func:`load_pair`)."""
    pair = load_pair(dir_a, dir_b, data, opts, evalset)
    curve, metrics = eval_curve(pair.model, pair.state_a, pair.state_b, pair.evalset, points, progress)
    return curve, metrics, pair.evalset, pair.info
