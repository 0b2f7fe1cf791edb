"""``symalign align --scope model``: whole-model alignment of two Hugging Face checkpoints.

Steps: load and validate both checkpoints, rewrite each exactly in its own format
(:func:`symalign.match.hfmodel.prepare`: norm gains folded where the residual group
needs it; the group per family -- ``O(D)``, ``O_1(D)`` or ``S_D`` -- is tabled there),
match the rewritten B to the rewritten A with
:func:`symalign.match.whole.match_whole` (residual stream, FF units, attention),
apply, check on a random batch that OUT computes B's function (refuse to write
otherwise), write OUT atomically (GPT-2: with ``tie_word_embeddings = false``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from symalign.errors import ConfigError

# HF Llama-style RMSNorm computes in float32 whatever the weights' dtype: a rotated
# stream changes its rounding, so a float64 check resolves only ~1e-7.
RMSNORM_FLOOR = 1e-6


def run_align_model(a_dir: Path, b_dir: Path, out_dir: Path, stage2: str = "full", stage1: bool = True,
                    force: bool = False, max_iter: int = 20) -> dict[str, Any]:
    from symalign import hf_io
    from symalign.match.distance import relative_distance
    from symalign.match.hfmodel import LLAMA_LIKE, prepare
    from symalign.match.whole import match_whole
    from symalign.spec import apply

    t0 = time.perf_counter()
    if stage2 not in ("none", "orthogonal", "full"):
        raise ConfigError(f"unknown --stage2 {stage2!r}; use one of none, orthogonal, full")
    out_path = hf_io.check_output_dir(out_dir, [a_dir, b_dir], force)
    a = hf_io.load_checkpoint(a_dir)
    b = hf_io.load_checkpoint(b_dir)
    hf_io.check_same_architecture(a, b)
    pa = prepare(a.config, a.state, b.adapter.spec(a.config, a.state.keys()))
    pb = prepare(b.config, b.state, b.adapter.spec(b.config, b.state.keys()))
    spec = pb.spec
    before = relative_distance(pa.state, pb.state, spec.tensors)
    result = match_whole(spec, pa.state, pb.state, spec_b=pa.spec, stage1=stage1, stage2=stage2, max_iter=max_iter)
    out_state = apply(spec, result.transform, pb.state)
    after = relative_distance(pa.state, out_state, spec.tensors)
    t_match = time.perf_counter()
    floor = RMSNORM_FLOOR if b.config.model_type in LLAMA_LIKE else 0.0
    tmp = hf_io.stage_checkpoint(out_path, out_state, b_dir, {"tie_word_embeddings": False} if pb.untied else None)
    del out_state
    verify = hf_io.verify_and_commit(tmp, out_path, b, b_dir, "whole-model alignment", floor)
    t_end = time.perf_counter()
    return {
        "a": str(a_dir), "b": str(b_dir), "out": str(out_path),
        "architecture": b.config.model_type, "family": b.adapter.family, "scope": "model",
        "stage1": stage1, "stage2": stage2, "dtype": str(b.dtype).replace("torch.", ""),
        "group": {"dim": spec.dim, "spaces": spec.describe()},
        "distance": {"before": {"total": before}, "after": {"total": after}},
        "verify": verify,
        "notes": pb.notes, "untied_head": pb.untied,
        "match": result.to_dict(),
        "timing_s": {"match": t_match - t0, "total": t_end - t0},
    }
