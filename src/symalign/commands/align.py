"""``symalign align A_DIR B_DIR -o OUT_DIR``: B aligned to A, written as a loadable checkpoint.

The work is the align pipeline (:func:`symalign.pipeline.align`: read, prepare, match,
verify, write -- for ``--scope attention`` and ``--scope model``, in memory or streamed);
``--module`` aligns state dicts of any traceable module
(:func:`symalign.commands.align_module.run_align_module`). Every path returns an
:class:`~symalign.align_result.AlignResult`; ``--json`` prints it (keys in docs/whole-model.md).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Optional

import typer

from symalign.align_result import AlignResult
from symalign.commands import checks, interrupt
from symalign.io.hub import REVISION_HELP, resolve_all
from symalign.pipeline import SCOPES, STAGE2, AlignJob, align

__all__ = ["SCOPES", "STAGE2", "run_align", "register"]


def run_align(a_dir: Path, b_dir: Path, out_dir: Path, scope: str = "attention", stage2: str = "full",
              stage1: bool = True, force: bool = False, max_sweeps: int = 20,
              write_reference: Path | None = None, say: Callable[[str], None] | None = None,
              stream: bool | None = None, progress: bool = True,
              return_transform: bool = False, experts: str | None = None, device: Any = None) -> AlignResult:
    """Align B to A and write OUT (:func:`symalign.pipeline.align`); returns the result.

    ``max_sweeps`` and ``write_reference`` apply to
    ``scope="model"``; ``say`` receives progress lines. ``stream``: process the checkpoints
    layer by layer (:mod:`symalign.stream`); ``None`` decides by size
    (:func:`symalign.stream.auto.should_stream`). ``experts``: ``"exact"`` or ``"paired"``, how
    mixture-of-experts layers are matched (``scope="model"`` only; ``None``: exact).
    """
    return align(AlignJob(Path(a_dir), Path(b_dir), Path(out_dir), scope=scope, stage1=stage1, stage2=stage2,
                          max_sweeps=max_sweeps, force=force,
                          write_reference=write_reference, stream=stream, progress=progress, say=say,
                          return_transform=return_transform, experts=experts, device=device))


def register(app: typer.Typer) -> None:
    @app.command("align")
    def align(
        a_dir: Path = typer.Argument(..., metavar="A_DIR", help="Reference checkpoint A (save_pretrained "
                                                                  "directory, or a Hub id org/name)."),
        b_dir: Path = typer.Argument(..., metavar="B_DIR", help="Checkpoint B, to be aligned to A."),
        out: Path = typer.Option(..., "-o", "--out", help="Output directory: B aligned to A."),
        scope: Optional[str] = typer.Option(None, help="attention | model (model: residual stream, FF units and "
                                            "attention; OUT is written in folded form, see --write-reference and "
                                            "docs/whole-model.md). Default: attention for checkpoints; model for "
                                            "--module (every traced space: a CNN or an MLP has no attention)."),
        max_sweeps: int = typer.Option(20, "--max-sweeps", min=1, help="--scope model: sweeps of the alternating "
                                       "solver (a warning says when it did not converge)."),
        write_reference: Optional[Path] = typer.Option(None, "--write-reference", metavar="DIR",
                                                       help="--scope model: also write A's folded form to DIR "
                                                            "(interpolate DIR with OUT)."),
        experts: Optional[str] = typer.Option(None, "--experts", metavar="exact|paired", help="--scope model on a "
                                              "mixture-of-experts checkpoint (Mixtral, Qwen2-MoE, OLMoE): how experts "
                                              "and their units are matched. exact (default): the joint optimum, but "
                                              "it forms all E^2 expert-pair products where the Gram screen does not "
                                              "apply (Mixtral: hours per layer at full size); paired: approximate, E "
                                              "products (recovers a planted pair; may differ from exact on unrelated "
                                              "models, docs/whole-model.md 4b)."),
        stage2: str = typer.Option("full", help="Inside-head alignment: none | orthogonal | full."),
        no_stage1: bool = typer.Option(False, "--no-stage1", help="Keep B's head order (skip the head assignment)."),
        force: bool = typer.Option(False, "--force", help="Replace OUT if it is a previous symalign output "
                                                          "(atomically); other folders are never replaced."),
        stream: Optional[bool] = typer.Option(None, "--stream/--no-stream", help="Process the checkpoints one "
                                              "layer at a time (bounded memory; per-layer function check). Default: "
                                              "streamed when both checkpoints exceed a quarter of the memory."),
        as_json: bool = typer.Option(False, "--json", help="Print one JSON object with the diagnostics."),
        strict: bool = typer.Option(False, "--strict", help="--module: refuse (exit 2, nothing written) when any "
                                    "part of the model would be left unchanged (docs/tracing.md)."),
        revision: Optional[str] = typer.Option(None, "--revision", help=REVISION_HELP),
        module: Optional[str] = typer.Option(None, "--module", help="pkg.mod:factory returning any nn.Module: "
                                   "A_DIR, B_DIR and OUT are then state-dict files (torch.save); spec traced "
                                   "(docs/tracing.md)."),
        threads: Optional[int] = checks.threads_option(),
        device: str = checks.device_option(),
        max_device_memory: Optional[str] = checks.max_device_memory_option(),
    ) -> None:
        """Align checkpoint B to A through exact symmetries -- of the attention layers (--scope attention) or
        of the whole model: residual stream, FF units and attention (--scope model); OUT computes B's function."""
        from rich.console import Console

        err = Console(stderr=True)
        say = (lambda s: err.print(f"[dim]align:[/] {s}")) if not as_json else None
        checks.use_threads(threads)
        dev = checks.use_device(device, say)
        cap = checks.use_max_device_memory(max_device_memory, dev)
        interrupt.keep_output(*([out] + ([write_reference] if write_reference is not None else [])))
        default_scope = scope is None
        if default_scope:
            scope = "model" if module else "attention"
        if module:
            from symalign.commands.align_module import run_align_module

            if experts is not None:
                from symalign.errors import ConfigError

                raise ConfigError("--experts applies to Hugging Face mixture-of-experts checkpoints; drop it with "
                                  "--module")

            from symalign.atomic import check_writable

            check_writable(Path(out).parent, f"-o {out}")  # OUT is a state-dict file here, written beside itself
            info = run_align_module(module, a_dir, b_dir, out, scope, stage2, not no_stage1, force,
                                    max_sweeps=max_sweeps, strict=strict, device=dev)
            if default_scope:
                info.notes.append("scope: model, the default for --module (--scope attention aligns the attention "
                                  "layers only)")
        else:
            if strict:
                from symalign.errors import ConfigError

                raise ConfigError("--strict applies to --module (a Hugging Face checkpoint is aligned whole by "
                                  "its family's spec); drop it")
            a_dir, b_dir = resolve_all([a_dir, b_dir], revision, "checkpoint")  # Hub ids -> cached snapshots
            info = run_align(a_dir, b_dir, out, scope=scope, stage2=stage2, stage1=not no_stage1, force=force,
                             max_sweeps=max_sweeps, write_reference=write_reference, say=say, stream=stream,
                             experts=experts, device=dev)
        info.memory = {**(info.memory or {}), **cap}
        if as_json:
            typer.echo(json.dumps(info.to_dict(), default=_jsonable))
            return
        d0, d1 = info.distance["before"]["total"], info.distance["after"]["total"]
        typer.echo(f"aligned {info.family} {b_dir} to {a_dir} -> {info.out}")
        what = "whole-model" if info.scope == "model" else "attention"
        typer.echo(f"{what} distance to A: {d0:.4g} -> {d1:.4g} (relative); output change "
                   f"{info.check.rel:.1e} ({info.check.kind} check, {info.check.dtype}); {info.timings.total_s:.1f} s")
        if info.coverage:
            typer.echo(info.coverage["summary"])
        for note in info.notes:
            typer.echo(f"note: {note}")
        if info.reference:
            typer.echo(f"wrote A's folded form -> {info.reference['path']} (interpolate it with OUT)")
        if not info.converged:
            typer.echo(f"symalign: warning: matching did not converge in {info.max_sweeps} sweeps; "
                       "raise --max-sweeps for a closer alignment", err=True)


def _jsonable(x: Any) -> Any:
    if hasattr(x, "tolist"):
        return x.tolist()
    return str(x)
