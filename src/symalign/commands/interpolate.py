"""``symalign interpolate A_DIR B_DIR --data DATA``: LMC curve and barriers of two HF checkpoints.

The checkpoints are evaluated on their own objective with their own tokenizer or
image processor (:mod:`symalign.evaluate`); ``--data`` is a built-in dataset name,
a text file, a JSONL file, an image folder or a saved ``datasets`` dataset.
Writes ``OUT/results.json`` and ``OUT/curves.png`` (with ``--baseline``, the
baseline curve and the aligned one in one plot) and the marker ``OUT/symalign.json``,
all at once (OUT is built beside itself and renamed into place; an earlier OUT is
replaced only with ``--force``); a progress bar per point on stderr. A B that
``symalign align`` aligned to another A is refused (``--force``: a warning).
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import typer

from symalign.commands import checks
from symalign.io.hub import REVISION_HELP

DATA_HELP = ("A built-in dataset (shakespeare, bible, wordnet, fortunes, digits, fashion-mnist, synthetic, ...), "
             "a plain text file, a .jsonl file (--text-field), a folder of images in class sub-folders, or a "
             "dataset saved with datasets' save_to_disk (or in its offline cache).")


def parse_options(items: list[str]) -> dict:
    """``["subset=500", "kind=lm"]`` -> ``{"subset": 500, "kind": "lm"}`` (integers parsed)."""
    from symalign.errors import ConfigError

    out: dict = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--data-option expects KEY=VALUE, got {item!r}")
        out[key] = int(value) if value.lstrip("-").isdigit() else value
    return out


@contextmanager
def point_progress(total: int, label: str, enabled: bool = True) -> Iterator:
    """A rich progress bar on stderr advanced once per evaluated point; yields the ``progress(i, t)`` callback."""
    if not enabled:
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=False) as bar:
        task = bar.add_task(label, total=total)
        try:
            yield lambda i, t: bar.update(task, completed=i + 1, description=f"{label} t={t:.2f}")
        except BaseException:
            bar.live.transient = True  # a refusal or an interrupt leaves its own one line, not the bar
            raise


def _streams(dirs: list[Path], stream: bool | None) -> bool:
    """Stream if asked, else when the checkpoints together exceed a quarter of the memory."""
    from symalign.stream.auto import STREAM_FRACTION, physical_memory, weights_bytes

    if stream is not None:
        return stream
    return sum(weights_bytes(d) for d in dirs) > STREAM_FRACTION * physical_memory()


RESULT_FILES = ("results.json", "curves.png")
"""What ``interpolate`` writes into OUT (with the marker ``symalign.json``)."""


def check_results_dir(out: Path, force: bool) -> None:
    """OUT may be absent, an empty folder, or (with ``--force``) an earlier ``interpolate`` output -- marked
    ``{"command": "interpolate"}``, or holding only :data:`RESULT_FILES` (outputs older than the marker);
    any other folder is refused even with ``--force``, as ``align`` and ``merge`` refuse folders they did
    not make. OUT is replaced as a whole (built beside itself, then renamed), so its parent must be writable."""
    from symalign.atomic import check_writable
    from symalign.io.folder import MARKER_NAME, read_marker
    from symalign.errors import ConfigError

    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is an existing file, not a folder; pass a folder path")
    if out.is_dir() and any(out.iterdir()):
        names = {p.name for p in out.iterdir()}
        ours = read_marker(out).get("command") == "interpolate" or (
            "results.json" in names and names <= {*RESULT_FILES, MARKER_NAME})
        if not ours:
            raise ConfigError(f"--out {out} is a folder interpolate did not write ({len(names)} entries); --force "
                              "only replaces interpolate's own results: pick another folder")
        if not force:
            raise ConfigError(f"--out {out} already holds interpolate results; pass --force to replace them, or "
                              "pick another folder")
    check_writable(out.parent, f"--out {out}")


def check_reference(a_dir: Path, others: list[Path], force: bool) -> list[str]:
    """Refuse a checkpoint that ``symalign align`` aligned to another A than ``a_dir`` (its ``symalign.json``
    names that A, and A's folded form when ``--write-reference`` wrote one): the curve would join two
    parametrisations no alignment relates. ``force``: go on, and return the warnings to print instead."""
    from symalign.io.folder import read_marker
    from symalign.errors import ConfigError

    here = Path(a_dir).resolve()
    warnings = []
    for d in others:
        marker = read_marker(d)
        if marker.get("command") != "align" or not marker.get("a"):
            continue
        refs = {Path(r).resolve() for r in (marker["a"], marker.get("reference")) if r}
        if here in refs:
            continue
        line = (f"{d} was aligned to {marker['a']} (its symalign.json), not to {a_dir}: the curve joins "
                "models no alignment relates")
        if not force:
            raise ConfigError(f"{line}; interpolate against {marker['a']}, or pass --force if {a_dir} holds "
                              "the same checkpoint")
        warnings.append(f"{line} (--force)")
    return warnings


def write_results(out: Path, res: dict) -> None:
    """OUT with ``results.json``, ``curves.png`` and the marker, built in a temporary sibling and renamed into
    place (:func:`symalign.checkpoint.output.commit`): OUT is the previous results or the new ones, never a mix."""
    from symalign.atomic import fix_modes, make_temp_dir, write_json
    from symalign.io.folder import MARKER_NAME, commit, discard
    from symalign.experiments.report import plot_curves

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = make_temp_dir(out.parent, f".{out.name}.tmp-")
    try:
        write_json(tmp / "results.json", res)
        plot_curves(res, tmp / "curves.png")
        write_json(tmp / MARKER_NAME, {"tool": "symalign", "command": "interpolate",
                                       "a": str(Path(res["A"]).resolve()), "b": str(Path(res["B"]).resolve())})
        fix_modes(tmp)
        commit(tmp, out)
    except BaseException:
        discard(tmp)
        raise


def register(app: typer.Typer) -> None:
    app.command("interpolate")(interpolate_command)


def interpolate_command(
    a_dir: Path = typer.Argument(..., metavar="A_DIR", help="Model A: a save_pretrained directory."),
    b_dir: Path = typer.Argument(..., metavar="B_DIR", help="Model B (e.g. the output of `symalign align`)."),
    data: str = typer.Option(..., "--data", help=DATA_HELP),
    data_option: list[str] = typer.Option([], "--data-option", help="KEY=VALUE passed to a built-in dataset's "
                                                                     "loader (e.g. kind=lm for synthetic)."),
    split: Optional[str] = typer.Option(None, "--split", help="Split to measure (default: test, else validation, "
                                                              "else train)."),
    text_field: Optional[str] = typer.Option(None, "--text-field", help="JSONL field / dataset column of the text "
                                                                        "(default: text)."),
    label_field: Optional[str] = typer.Option(None, "--label-field", help="Field / column of the class label "
                                                                          "(default: label)."),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", help="Tokenizer folder for checkpoints saved "
                                            "without one ('bytes': token i is byte i)."),
    image_processor: Optional[str] = typer.Option(None, "--image-processor", help="Image processor folder for "
                                                  "checkpoints saved without one."),
    scope: str = typer.Option("attention", help="model: rewrite every endpoint exactly in the whole-model format "
                              "first (for B aligned with `symalign align --scope model`)."),
    points: int = typer.Option(25, help="Evenly spaced interpolation points in [0, 1]."),
    baseline: Optional[Path] = typer.Option(None, help="Also plot A -> BASELINE (e.g. B before alignment)."),
    eval_items: Optional[int] = typer.Option(None, "--eval-items", help="Windows (LM) or examples measured per "
                                                                        "point (default 256)."),
    eval_tokens: Optional[int] = typer.Option(None, "--eval-tokens", help="LM: tokens measured per point "
                                                                          "(windows = tokens // context)."),
    context: Optional[int] = typer.Option(None, help="Window length in tokens (default: the model's maximum, "
                                                     "at most 512)."),
    mask_seed: int = typer.Option(0, "--mask-seed", help="Seed of the fixed 15% masking (masked LM)."),
    batch_size: int = typer.Option(16, "--batch-size", help="Windows or examples per forward pass."),
    out: Path = typer.Option(Path("runs/interpolate"), "-o", "--out",
                             help="Writes OUT/results.json and OUT/curves.png."),
    stream: Optional[bool] = typer.Option(None, "--stream/--no-stream", help="Build each point by streaming "
                                          "the weights from disk into one resident model (A's). Default: streamed "
                                          "when the checkpoints exceed a quarter of the memory."),
    no_progress: bool = typer.Option(False, "--no-progress", help="No progress bar on stderr."),
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON."),
    revision: Optional[str] = typer.Option(None, "--revision", help=REVISION_HELP),
    force: bool = typer.Option(False, "--force", help="Replace OUT if it holds earlier interpolate results "
                               "(other folders are never replaced); and interpolate a B that `symalign align` "
                               "aligned to another A than A_DIR (refused otherwise; a warning is printed)."),
    threads: Optional[int] = checks.threads_option(),
    device: str = checks.device_option("Where the resident model is evaluated: auto (CUDA when present, else the "
                                       "CPU), cpu, cuda, cuda:N or mps; the points are built on the CPU."),
    module: Optional[str] = typer.Option(None, "--module", help="pkg.mod:factory: A_DIR and B_DIR are state dicts "
                                         "(.pt) of this module (as for `align --module`); --data a built-in "
                                         "classification dataset."),
    bn_reset: Optional[bool] = typer.Option(None, "--bn-reset/--no-bn-reset", help="--module: recompute BatchNorm "
                                            "statistics on the training split at every point (default: on where "
                                            "the module has BatchNorm)."),
    repair: bool = typer.Option(False, "--repair", help="--module: REPAIR-renormalise the interpolated "
                                "network's hidden activations to the interpolated endpoint statistics."),
) -> None:
    """Evaluate (1-t) A + t B on held-out data with the checkpoint's own tokenizer and objective:
    loss and accuracy curves, barriers, PNG plot."""
    if module is not None:  # any torch module: symalign.commands.interpolate_module
        return _interpolate_module(module, a_dir, b_dir, data, data_option, split, points, baseline, eval_items,
                                   batch_size, out, bn_reset, repair, no_progress, as_json, force, threads, device)
    from symalign.evaluate import EvalOptions

    from symalign.commands import interrupt

    data_options = _check_arguments(data, data_option, context, eval_items, eval_tokens, batch_size, points,
                                    repair, bn_reset)
    a_dir, b_dir, baseline, warnings = _check_inputs(a_dir, b_dir, baseline, revision, out, force)
    checks.use_threads(threads)
    dev = checks.use_device(device, None if as_json or no_progress else
                            lambda line: typer.echo(f"interpolate: {line}", err=True))
    interrupt.keep_output(out)
    for line in warnings:
        typer.echo(f"symalign: warning: {line}", err=True)
    opts = EvalOptions(split=split, text_field=text_field, label_field=label_field, eval_items=eval_items,
                       eval_tokens=eval_tokens, context=context, batch_size=batch_size, mask_seed=mask_seed,
                       tokenizer=tokenizer, image_processor=image_processor, data_options=data_options)
    curves = _measure_curves(a_dir, b_dir, baseline, data, opts, scope, stream, dev, points, not no_progress)
    res = _results(a_dir, b_dir, baseline, curves)
    write_results(out, res)
    if as_json:
        typer.echo(json.dumps(res, indent=2, default=float))
        return
    for line in _summary_lines(res, curves, data, out, baseline is not None):
        typer.echo(line)


def _check_arguments(data: str, data_option: list[str], context: Optional[int], eval_items: Optional[int],
                     eval_tokens: Optional[int], batch_size: int, points: int, repair: bool,
                     bn_reset: Optional[bool]) -> dict:
    """The checkpoint curve's arguments checked before any file is read; returns the parsed ``--data-option``s."""
    from symalign.data.user import check_data_path
    from symalign.errors import ConfigError

    if repair or bn_reset is not None:
        raise ConfigError("--repair and --bn-reset apply to --module curves; the checkpoints' own models are "
                          "measured as they are")
    data_options = checks.data_options(parse_options(data_option))  # arguments checked before any evaluation
    check_data_path(data)
    if context is not None:
        checks.positive(context, "--context")
    if eval_items is not None:
        checks.positive(eval_items, "--eval-items")
    if eval_tokens is not None:
        checks.positive(eval_tokens, "--eval-tokens")
    if batch_size < 1:
        raise ConfigError(f"--batch-size must be at least 1, got {batch_size}")
    if points < 2:
        raise ConfigError(f"--points must be at least 2 (the two endpoints), got {points}")
    return data_options


def _check_inputs(a_dir: Path, b_dir: Path, baseline: Optional[Path], revision: Optional[str], out: Path,
                  force: bool) -> tuple[Path, Path, Optional[Path], list[str]]:
    """Hub ids resolved to snapshots, every checkpoint's config read and A's head checked evaluable, OUT checked
    (outside the inputs, replaceable) and each B checked aligned to A; returns the resolved folders and the
    ``--force`` warnings to print."""
    from symalign.checkpoint.config import load_config
    from symalign.io.hub import resolve_all
    from symalign.jobs.interpolate import check_evaluable

    a_dir, b_dir, baseline = resolve_all([a_dir, b_dir, baseline], revision, "checkpoint")  # Hub ids -> snapshots
    others = [b_dir] + ([baseline] if baseline is not None else [])
    for path in [a_dir, *others]:
        load_config(path)  # a missing folder or a typo fails here, not after the first curve
    check_evaluable(a_dir)  # a head symalign cannot evaluate is refused before any weights are loaded
    checks.not_inside(out, [a_dir, *others])
    check_results_dir(out, force)
    return a_dir, b_dir, baseline, check_reference(a_dir, others, force)


@dataclass
class _Curves:
    """The measured A -> B line (and A -> BASELINE, when asked): the pair's description, the evaluation set,
    the barriers (:class:`symalign.lmc.Curve`) and the per-point metrics."""

    info: dict
    evalset: Any
    curve: Any
    metrics: list
    base_curve: Any = None
    base_metrics: Optional[list] = None


def _measure_curves(a_dir: Path, b_dir: Path, baseline: Optional[Path], data: str, opts, scope: str,
                    stream: Optional[bool], dev, points: int, progress: bool) -> _Curves:
    """Evaluate ``points`` evenly spaced points of A -> B (and A -> BASELINE on the same resident model and
    batches), streamed when :func:`_streams` says so; the models are released on return."""
    from symalign.jobs.interpolate import curve as line_curve
    from symalign.jobs.interpolate import open_pair

    streamed = _streams([a_dir, b_dir] + ([baseline] if baseline is not None else []), stream)
    pair = open_pair(a_dir, b_dir, data, opts, scope=scope, stream=streamed, device=dev)
    evalset, info = pair.evalset, pair.info
    base = None
    if baseline is not None:  # checked before any curve; the same resident model and batches
        base = open_pair(a_dir, baseline, data, opts, evalset=evalset, scope=scope if streamed else info["scope"],
                         stream=streamed, reuse=pair)
    with point_progress(points, f"A → {b_dir.name}", progress) as cb:
        curve, metrics = line_curve(pair, points, cb)
    measured = _Curves(info, evalset, curve, metrics)
    if base is not None:
        with point_progress(points, f"A → {baseline.name}", progress) as cb:
            measured.base_curve, measured.base_metrics = line_curve(base, points, cb)
    del pair, base
    return measured


def _results(a_dir: Path, b_dir: Path, baseline: Optional[Path], curves: _Curves) -> dict:
    """``results.json``: the pair's description, the per-point metrics, the A -> B curve as ``curve`` and as the
    naive one (or, with a baseline, A -> BASELINE as naive, A -> B as a variant, and the barrier ratio), and the
    Hub sources of Hub-id inputs."""
    from symalign.io.hub import sources
    from symalign.lmc import barrier_ratio

    info, curve = curves.info, curves.curve
    res: dict = {**info, "A": str(a_dir), "B": str(b_dir), "family": info["model_type"], "pe": "",
                 "scope": f"{a_dir.name} → {b_dir.name}", "rewrite": info["scope"],
                 "evaluation": curves.evalset.info, "points": [m.to_dict() for m in curves.metrics]}
    if curves.base_curve is not None:
        res.update(naive=curves.base_curve.to_dict(), naive_label=f"A → {baseline.name}",
                   naive_points=[m.to_dict() for m in curves.base_metrics],
                   variants={b_dir.name: {"curve": curve.to_dict()}},
                   barrier_ratio_percent=barrier_ratio(curve.loss_barrier, curves.base_curve.loss_barrier))
    else:
        res.update(naive=curve.to_dict(), naive_label=f"A → {b_dir.name}", variants={})
    res["curve"] = curve.to_dict()
    if sources([a_dir, b_dir, baseline]):
        res["hub"] = sources([a_dir, b_dir, baseline])  # id, revision, commit and snapshot of Hub-id inputs
    return res


def _summary_lines(res: dict, curves: _Curves, data: str, out: Path, has_baseline: bool) -> list[str]:
    """The three lines printed without ``--json``: endpoint losses (and per byte), barriers, files written."""
    objective, metrics, curve = curves.evalset.objective, curves.metrics, curves.curve
    unit = {"causal-lm": "nats/token", "masked-lm": "nats/masked token"}.get(objective, "nats")
    return [f"{objective} on {data}: loss A {metrics[0].loss:.4f}, B {metrics[-1].loss:.4f} ({unit})"
            + (f"; per byte A {metrics[0].loss_per_byte:.4f}, B {metrics[-1].loss_per_byte:.4f}"
               if metrics[0].loss_per_byte is not None else ""),
            f"loss barrier {curve.loss_barrier:.4f}, accuracy barrier {curve.acc_barrier:.4f}, "
            f"midpoint loss barrier {curve.midpoint_loss_barrier:.4f}"
            + (f"; ratio vs baseline {res['barrier_ratio_percent']:.1f}%" if has_baseline else ""),
            f"wrote {out / 'results.json'} and {out / 'curves.png'}"]


def _interpolate_module(module, a_path, b_path, data, data_option, split, points, baseline, eval_items, batch_size,
                        out, bn_reset, repair, no_progress, as_json, force, threads, device) -> None:
    """``interpolate --module``: the arguments checked, then
    :func:`symalign.commands.interpolate_module.run_interpolate_module`."""
    from symalign.commands import checks
    from symalign.commands.interpolate_module import dumps, run_interpolate_module, summary_lines
    from symalign.errors import ConfigError

    opts = checks.data_options(parse_options(data_option))
    if points < 2:
        raise ConfigError(f"--points must be at least 2 (the two endpoints), got {points}")
    if batch_size < 1:
        raise ConfigError(f"--batch-size must be at least 1, got {batch_size}")
    if eval_items is not None:
        checks.positive(eval_items, "--eval-items")
    inputs = [a_path, b_path] + ([baseline] if baseline is not None else [])
    for path in inputs:
        if not path.is_file():
            raise ConfigError(f"{path}: no such file; interpolate --module takes state-dict files saved with "
                              "torch.save(model.state_dict(), path)")
    if device not in ("auto", "cpu"):
        raise ConfigError(f"--device {device}: interpolate --module evaluates on the CPU; drop --device")
    checks.not_inside(out, inputs)
    check_results_dir(out, force)
    checks.use_threads(threads)
    with point_progress(points * (2 if baseline is not None else 1), f"A → {b_path.name}", not no_progress) as cb:
        res = run_interpolate_module(module, a_path, b_path, data, data_options=opts, split=split, points=points,
                                     batch_size=batch_size, eval_items=eval_items, bn_reset=bn_reset, repair=repair,
                                     baseline=baseline, progress=cb)
    write_results(out, res)
    if as_json:
        typer.echo(dumps(res))
        return
    for line in summary_lines(res):
        typer.echo(line)
    typer.echo(f"wrote {out / 'results.json'} and {out / 'curves.png'}")
