"""``symalign align A_DIR B_DIR -o OUT_DIR``: B aligned to A, written as a loadable checkpoint.

Steps: load and validate both checkpoints (:mod:`symalign.hf_io`), build the
attention spec with the family adapter (:mod:`symalign.arch`), match B to A
(:func:`symalign.match.match_attention`), apply the transform to B, check on a
random batch that OUT computes B's function (refuse to write otherwise), then
write OUT atomically with B's config and tokenizer files.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, Optional

import typer

from symalign.errors import ConfigError

SCOPES = ("attention", "model")
STAGE2 = ("none", "orthogonal", "full")


def load_matcher() -> Callable[..., Any]:
    """``symalign.match.match_attention`` (imported lazily; tests may replace this function)."""
    try:
        from symalign.match import match_attention
    except ImportError as exc:
        raise ConfigError(f"the attention matcher (symalign.match) is not available: {exc}") from None
    return match_attention


def run_align(a_dir: Path, b_dir: Path, out_dir: Path, scope: str = "attention", stage2: str = "full",
              stage1: bool = True, force: bool = False, stream: bool | None = None,
              progress: bool = True, max_iter: int = 20) -> dict[str, Any]:
    """Align B to A and write OUT; returns the diagnostics (see the module docstring).

    ``stream``: process the checkpoints layer by layer (:mod:`symalign.stream`); ``None``
    decides by size (:func:`symalign.stream.auto.should_stream`).
    """
    from symalign import hf_io
    from symalign.arch.fused import split_segments
    from symalign.match.distance import attention_distance
    from symalign.spec import apply

    t0 = time.perf_counter()
    if scope not in SCOPES:
        raise ConfigError(f"unknown scope {scope!r}; use one of {', '.join(SCOPES)}")
    if stage2 not in STAGE2:
        raise ConfigError(f"unknown --stage2 {stage2!r}; use one of {', '.join(STAGE2)}")
    from symalign.stream.auto import run_streamed, should_stream

    if should_stream(a_dir, b_dir, scope, stream):
        return run_streamed(a_dir, b_dir, out_dir, scope, stage2=stage2, stage1=stage1, force=force,
                            progress=progress, max_iter=max_iter)
    if scope == "model":
        from symalign.commands.align_model import run_align_model

        return run_align_model(a_dir, b_dir, out_dir, stage2=stage2, stage1=stage1, force=force, max_iter=max_iter)
    if stage2 not in STAGE2:
        raise ConfigError(f"unknown --stage2 {stage2!r}; use one of {', '.join(STAGE2)}")
    out_path = hf_io.check_output_dir(out_dir, [a_dir, b_dir], force)

    a = hf_io.load_checkpoint(a_dir)
    b = hf_io.load_checkpoint(b_dir)
    hf_io.check_same_architecture(a, b)
    spec = b.adapter.spec(b.config, b.state.keys())
    spec.check(a.state)
    spec.check(b.state)
    t_load = time.perf_counter()

    before = attention_distance(spec, a.state, b.state)
    # The matcher reads whole tensors: give it fused Q|K|V tensors cut into their segments.
    view_spec, (view_a, view_b) = split_segments(spec, a.state, b.state)
    result = load_matcher()(view_spec, view_a, view_b, stage1=stage1, stage2=stage2)
    del view_a, view_b
    out_state = apply(spec, result.transform, b.state)
    after = attention_distance(spec, a.state, out_state)
    del a
    t_match = time.perf_counter()

    tmp = hf_io.stage_checkpoint(out_path, out_state, b_dir)
    del out_state
    t_check = time.perf_counter()
    verify = hf_io.verify_and_commit(tmp, out_path, b, b_dir, f"the {b.adapter.family} adapter or the matcher")
    t_end = time.perf_counter()
    return {
        "a": str(a_dir), "b": str(b_dir), "out": str(out_path),
        "architecture": b.config.model_type, "family": b.adapter.family, "scope": scope,
        "stage1": stage1, "stage2": stage2, "dtype": str(b.dtype).replace("torch.", ""),
        "group": {"dim": spec.dim, "spaces": spec.describe()},
        "distance": {"before": before, "after": after},
        "verify": verify,
        "match": result.to_dict(),
        "timing_s": {"load": t_load - t0, "match": t_match - t_load, "write": t_check - t_match,
                     "verify_and_commit": t_end - t_check, "total": t_end - t0},
    }


def register(app: typer.Typer) -> None:
    @app.command("align")
    def align(
        a_dir: Path = typer.Argument(..., help="Reference checkpoint A (save_pretrained directory)."),
        b_dir: Path = typer.Argument(..., help="Checkpoint B, to be aligned to A."),
        out: Path = typer.Option(..., "-o", "--out", help="Output directory: B aligned to A."),
        scope: str = typer.Option("attention", help="attention | model (model: residual stream, FF units and "
                                  "attention, in the checkpoint's own format; see docs/whole-model.md)."),
        stage2: str = typer.Option("full", help="Inside-head alignment: none | orthogonal | full."),
        no_stage1: bool = typer.Option(False, "--no-stage1", help="Keep B's head order (skip the head assignment)."),
        force: bool = typer.Option(False, "--force", help="Replace OUT_DIR if it exists (atomically)."),
        stream: Optional[bool] = typer.Option(None, "--stream/--no-stream", help="Process the checkpoints one "
                                              "layer at a time (bounded memory; per-layer function check). Default: "
                                              "streamed when both checkpoints exceed a quarter of the memory."),
        max_iter: int = typer.Option(20, "--max-iter", min=1, help="--scope model: at most this many sweeps "
                                     "(streamed: passes over both checkpoints)."),
        as_json: bool = typer.Option(False, "--json", help="Print one JSON object with the diagnostics."),
    ) -> None:
        """Align checkpoint B to A through exact attention symmetries; OUT computes B's function."""
        info = run_align(a_dir, b_dir, out, scope=scope, stage2=stage2, stage1=not no_stage1, force=force,
                         stream=stream, max_iter=max_iter)
        if as_json:
            typer.echo(json.dumps(info, default=_jsonable))
            return
        d0, d1 = info["distance"]["before"]["total"], info["distance"]["after"]["total"]
        typer.echo(f"aligned {info['family']} {b_dir} to {a_dir} -> {info['out']}")
        what = "whole-model" if info["scope"] == "model" else "attention"
        typer.echo(f"{what} distance to A: {d0:.4g} -> {d1:.4g} (relative); output change "
                   f"{info['verify']['relative_output_change']:.1e}; {info['timing_s']['total']:.1f} s")
        for note in info.get("notes", []):
            typer.echo(f"note: {note}")


def _jsonable(x: Any) -> Any:
    if hasattr(x, "tolist"):
        return x.tolist()
    return str(x)
