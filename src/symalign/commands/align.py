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

import torch
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
              stage1: bool = True, force: bool = False, max_sweeps: int = 20,
              write_reference: Path | None = None, say: Callable[[str], None] | None = None,
              stream: bool | None = None, progress: bool = True, max_iter: int | None = None) -> dict[str, Any]:
    """Align B to A and write OUT; returns the diagnostics (see the module docstring).

    ``max_sweeps`` (``max_iter``: the same, older name) and ``write_reference`` apply to
    ``scope="model"`` (see :func:`symalign.commands.align_model.run_align_model`); ``say``
    receives progress lines. ``stream``: process the checkpoints layer by layer
    (:mod:`symalign.stream`); ``None`` decides by size (:func:`symalign.stream.auto.should_stream`).
    """
    from symalign import hf_io
    from symalign.match.distance import attention_distance
    from symalign.spec import apply

    t0 = time.perf_counter()
    if scope not in SCOPES:
        raise ConfigError(f"unknown scope {scope!r}; use one of {', '.join(SCOPES)}")
    if stage2 not in STAGE2:
        raise ConfigError(f"unknown --stage2 {stage2!r}; use one of {', '.join(STAGE2)}")
    from symalign.stream.auto import run_streamed, should_stream

    if max_iter is not None:
        max_sweeps = max_iter
    if should_stream(a_dir, b_dir, scope, stream):
        if write_reference is not None:
            raise ConfigError("--write-reference is not available with --stream yet; align without --stream, "
                              "or let `symalign interpolate` fold A itself (OUT is marked folded)")
        return run_streamed(a_dir, b_dir, out_dir, scope, stage2=stage2, stage1=stage1, force=force,
                            progress=progress, max_iter=max_sweeps)
    if scope == "model":
        from symalign.commands.align_model import run_align_model

        return run_align_model(a_dir, b_dir, out_dir, stage2=stage2, stage1=stage1, force=force,
                               max_iter=max_sweeps, write_reference=write_reference, say=say)
    if write_reference is not None:
        raise ConfigError("--write-reference applies to --scope model (attention alignment keeps A's format: "
                          "interpolate with A itself)")
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
    result = load_matcher()(spec, a.state, b.state, stage1=stage1, stage2=stage2)  # reads fused segments
    out_state = apply(spec, result.transform, b.state)
    after = attention_distance(spec, a.state, out_state)
    del a
    t_match = time.perf_counter()

    tmp = hf_io.stage_checkpoint(out_path, out_state, b_dir, marker={
        "command": "align", "scope": scope, "folded": False,
        "a": str(Path(a_dir).resolve()), "b": str(Path(b_dir).resolve())})
    del out_state
    t_check = time.perf_counter()
    chk = hf_io.verify_and_commit(tmp, out_path, b, b_dir, f"the {b.adapter.family} adapter or the matcher")
    verify = {"relative_output_change": chk.rel, "tolerance": chk.tolerance, "dtype": chk.dtype}
    t_end = time.perf_counter()
    return {
        "a": str(a_dir), "b": str(b_dir), "out": str(out_path),
        "architecture": b.config.model_type, "family": b.adapter.family, "scope": scope,
        "stage1": stage1, "stage2": stage2, "dtype": str(b.dtype).replace("torch.", ""),
        "threads": torch.get_num_threads(),
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
        a_dir: Path = typer.Argument(..., metavar="A_DIR", help="Reference checkpoint A (save_pretrained "
                                                                  "directory)."),
        b_dir: Path = typer.Argument(..., metavar="B_DIR", help="Checkpoint B, to be aligned to A."),
        out: Path = typer.Option(..., "-o", "--out", help="Output directory: B aligned to A."),
        scope: str = typer.Option("attention", help="attention | model (model: residual stream, FF units and "
                                  "attention; OUT is written in folded form, see --write-reference and "
                                  "docs/whole-model.md)."),
        max_sweeps: int = typer.Option(20, "--max-sweeps", "--max-iter", min=1, help="--scope model: sweeps of the alternating "
                                                                "solver (a warning says when it did not converge)."),
        write_reference: Optional[Path] = typer.Option(None, "--write-reference", metavar="DIR",
                                                       help="--scope model: also write A's folded form to DIR "
                                                            "(interpolate DIR with OUT)."),
        stage2: str = typer.Option("full", help="Inside-head alignment: none | orthogonal | full."),
        no_stage1: bool = typer.Option(False, "--no-stage1", help="Keep B's head order (skip the head assignment)."),
        force: bool = typer.Option(False, "--force", help="Replace OUT if it is a previous symalign output "
                                                          "(atomically); other folders are never replaced."),
        stream: Optional[bool] = typer.Option(None, "--stream/--no-stream", help="Process the checkpoints one "
                                              "layer at a time (bounded memory; per-layer function check). Default: "
                                              "streamed when both checkpoints exceed a quarter of the memory."),
        as_json: bool = typer.Option(False, "--json", help="Print one JSON object with the diagnostics."),
        module: Optional[str] = typer.Option(None, "--module", help="pkg.mod:factory returning any nn.Module: A_DIR, B_DIR and "
                                   "OUT are then state-dict files (torch.save); spec traced (docs/tracing.md)."),
    ) -> None:
        """Align checkpoint B to A through exact symmetries -- of the attention layers (--scope attention) or
        of the whole model: residual stream, FF units and attention (--scope model); OUT computes B's function."""
        from rich.console import Console

        err = Console(stderr=True)
        say = (lambda s: err.print(f"[dim]align:[/] {s}")) if not as_json else None
        if module:
            from symalign.commands.align_module import run_align_module

            info = run_align_module(module, a_dir, b_dir, out, scope, stage2, not no_stage1, force)
        else:
            info = run_align(a_dir, b_dir, out, scope=scope, stage2=stage2, stage1=not no_stage1, force=force,
                             max_sweeps=max_sweeps, write_reference=write_reference, say=say, stream=stream)
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
        if info.get("reference"):
            typer.echo(f"wrote A's folded form -> {info['reference']['path']} (interpolate it with OUT)")
        if info.get("converged") is False:
            typer.echo(f"symalign: warning: matching did not converge in {info['max_sweeps']} sweeps; "
                       "raise --max-sweeps for a closer alignment", err=True)


def _jsonable(x: Any) -> Any:
    if hasattr(x, "tolist"):
        return x.tolist()
    return str(x)
