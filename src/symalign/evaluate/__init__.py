"""Evaluating Hugging Face checkpoints as they are meant to be used.

The checkpoint decides: its head the objective (:mod:`.objective`), its tokenizer
or image processor how the data is read (:mod:`.build`, :mod:`.text`).
:mod:`.run` evaluates parameter sets and interpolation curves.
"""

from symalign.evaluate.build import (EvalOptions, EvalSet, build_eval, check_same_vocabulary, check_tokenizers,
                                     resolve_tokenizer)
from symalign.evaluate.objective import OBJECTIVES, head_objective
from symalign.evaluate.run import Metrics, eval_curve, evaluate_model, evaluate_state

__all__ = ["EvalOptions", "EvalSet", "build_eval", "check_same_vocabulary", "check_tokenizers", "resolve_tokenizer",
           "OBJECTIVES", "head_objective", "Metrics", "eval_curve", "evaluate_model", "evaluate_state"]
