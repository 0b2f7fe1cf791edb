"""``symalign align --scope model``: whole-model alignment of two Hugging Face checkpoints.

Steps: load and validate both checkpoints, rewrite each exactly in its own format
(:func:`symalign.families.hfmodel.prepare`: norm gains folded where the residual group
needs it; the group per family -- ``O(D)``, ``O_1(D)`` or ``S_D`` -- is tabled there),
match the rewritten B to the rewritten A with
:func:`symalign.match.whole.match_whole` (residual stream, FF units, attention),
apply, check on a random batch that OUT computes B's function (refuse to write
otherwise), write OUT atomically (GPT-2: with ``tie_word_embeddings = false``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import torch

from symalign.errors import ConfigError


def run_align_model(a_dir: Path, b_dir: Path, out_dir: Path, stage2: str = "full", stage1: bool = True,
                    force: bool = False, max_iter: int = 20, write_reference: Path | None = None,
                    say: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Whole-model alignment (module docstring). ``max_iter``: sweeps of the alternating solver;
    ``write_reference``: also write A's folded form there (what OUT is to be interpolated with);
    ``say``: receives progress lines (stderr in the CLI)."""
    from symalign import hf_io
    from symalign.match.distance import distance, relative_distance
    from symalign.families.hfmodel import prepare
    from symalign.match.whole import match_whole
    from symalign.spec import apply

    t0 = time.perf_counter()
    if stage2 not in ("none", "orthogonal", "full"):
        raise ConfigError(f"unknown --stage2 {stage2!r}; use one of none, orthogonal, full")
    if max_iter < 1:
        raise ConfigError(f"--max-sweeps must be at least 1, got {max_iter}")
    say = say or (lambda s: None)
    out_path = hf_io.check_output_dir(out_dir, [a_dir, b_dir], force)
    ref_path = None
    if write_reference is not None:
        ref_path = hf_io.check_output_dir(write_reference, [a_dir, b_dir], force)
        if ref_path == out_path:
            raise ConfigError("--write-reference must differ from --out")
    say("loading A and B")
    a = hf_io.load_checkpoint(a_dir)
    b = hf_io.load_checkpoint(b_dir)
    hf_io.check_same_architecture(a, b)
    pa = prepare(a.config, a.state, a.adapter.spec(a.config, a.state.keys()))
    pb = prepare(b.config, b.state, b.adapter.spec(b.config, b.state.keys()))
    spec = pb.spec
    before = relative_distance(pa.state, pb.state, spec.tensors)
    say(f"matching the whole model ({spec.dim} group dimensions; up to {max_iter} sweeps)")
    # A's spec first: a mismatch is reported as "<A's group> in A, <B's group> in B"
    d0 = max(distance(pa.spec, pa.state, pb.state), 1e-300)
    result = match_whole(pa.spec, pa.state, pb.state, spec_b=pb.spec, stage1=stage1, stage2=stage2,
                         max_iter=max_iter,
                         progress=lambda k, d: say(f"sweep {k}/{max_iter}: squared distance {d / d0:.4f} of unaligned"))
    say(f"matched in {result.iterations} sweeps" + ("" if result.converged else " (not converged)"))
    out_state = apply(spec, result.transform, pb.state)
    after = relative_distance(pa.state, out_state, spec.tensors)
    t_match = time.perf_counter()
    marker = {"command": "align", "scope": "model", "folded": True, "untied_head": pb.untied,
              "a": str(Path(a_dir).resolve()), "b": str(Path(b_dir).resolve()),
              "reference": str(ref_path) if ref_path is not None else None}
    say("checking that OUT computes B's function")
    tmp = hf_io.stage_checkpoint(out_path, out_state, b_dir, {"tie_word_embeddings": False} if pb.untied else None,
                                 marker=marker)
    del out_state
    chk = hf_io.verify_and_commit(tmp, out_path, b, b_dir, "whole-model alignment")
    verify = {"relative_output_change": chk.rel, "tolerance": chk.tolerance, "dtype": chk.dtype}
    reference = None
    if ref_path is not None:
        from symalign.hf_fold import write_folded

        say("writing A's folded form (--write-reference)")
        reference = {"path": str(ref_path), "verify": write_folded(a, ref_path).to_dict()}
    t_end = time.perf_counter()
    notes = list(pb.notes)
    if not result.converged:
        notes.append(f"matching did not converge in {max_iter} sweeps (the distance was still falling); "
                     "raise --max-sweeps for a closer alignment -- OUT is exact either way")
    notes.append("OUT is in folded form (norm gains folded" + (", head untied" if pb.untied else "")
                 + "): interpolate it with A's folded form (--write-reference DIR, or let `symalign interpolate` "
                 "fold A, which it does when OUT is marked folded)")
    return {
        "a": str(a_dir), "b": str(b_dir), "out": str(out_path),
        "architecture": b.config.model_type, "family": b.adapter.family, "scope": "model",
        "stage1": stage1, "stage2": stage2, "dtype": str(b.dtype).replace("torch.", ""),
        "group": {"dim": spec.dim, "spaces": spec.describe()},
        "distance": {"before": {"total": before}, "after": {"total": after}},
        "verify": verify,
        "notes": notes, "untied_head": pb.untied, "folded": True, "reference": reference,
        "max_sweeps": max_iter, "converged": result.converged, "threads": torch.get_num_threads(),
        "match": result.to_dict(),
        "timing_s": {"match": t_match - t0, "total": t_end - t0},
    }
