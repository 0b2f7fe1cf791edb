"""``symalign interpolate A_DIR B_DIR --data DATASET``: LMC curve and barriers of two HF checkpoints."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer


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


def register(app: typer.Typer) -> None:
    app.command("interpolate")(interpolate_command)


def interpolate_command(
    a_dir: Path = typer.Argument(..., metavar="A_DIR", help="Model A: a save_pretrained directory."),
    b_dir: Path = typer.Argument(..., metavar="B_DIR", help="Model B (e.g. the output of `symalign align`)."),
    data: str = typer.Option(..., "--data", help="Dataset: shakespeare, bible (LM); wordnet, fortunes (text "
                                                  "classification); digits, fashion-mnist (images)."),
    data_option: list[str] = typer.Option([], "--data-option", help="KEY=VALUE passed to the dataset loader "
                                                                     "(e.g. subset=5000, kind=lm for synthetic)."),
    points: int = typer.Option(25, help="Evenly spaced interpolation points in [0, 1]."),
    baseline: Optional[Path] = typer.Option(None, help="Also plot A -> BASELINE (e.g. B before alignment)."),
    eval_items: int = typer.Option(2000, "--eval-items", help="Held-out examples (LM: windows) per point."),
    context: int = typer.Option(128, help="LM context length."),
    out: Path = typer.Option(Path("runs/interpolate"), "-o", "--out", help="Writes OUT/results.json and OUT/curves.png."),
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON."),
) -> None:
    """Evaluate (1-t) A + t B on held-out data: loss and accuracy curves, loss/accuracy barriers, PNG plot."""
    from symalign.atomic import write_json
    from symalign.experiments.report import plot_curves
    from symalign.hf_lmc import hf_curve
    from symalign.lmc import barrier_ratio

    from symalign.commands import checks

    opts = checks.data_options(parse_options(data_option))  # arguments checked before any evaluation
    checks.positive(context, "--context")
    checks.positive(eval_items, "--eval-items")
    if points < 2:
        from symalign.errors import ConfigError

        raise ConfigError(f"--points must be at least 2 (the two endpoints), got {points}")
    from symalign.hf_io import load_config

    for path in [a_dir, b_dir] + ([baseline] if baseline is not None else []):
        load_config(path)  # a missing folder or a typo fails here, not after the first curve
    checks.output_dir(out)
    checks.not_inside(out, [a_dir, b_dir] + ([baseline] if baseline is not None else []))
    curve, info = hf_curve(a_dir, b_dir, data, points, eval_items, context, opts)
    res: dict = {**info, "A": str(a_dir), "B": str(b_dir), "family": info["model_type"], "pe": "",
                 "scope": f"{a_dir.name} → {b_dir.name}"}
    if baseline is not None:
        base_curve, _ = hf_curve(a_dir, baseline, data, points, eval_items, context, opts)
        res.update(naive=base_curve.to_dict(), naive_label=f"A → {baseline.name}",
                   variants={b_dir.name: {"curve": curve.to_dict()}},
                   barrier_ratio_percent=barrier_ratio(curve.loss_barrier, base_curve.loss_barrier))
    else:
        res.update(naive=curve.to_dict(), naive_label=f"A → {b_dir.name}", variants={})
    res["curve"] = curve.to_dict()
    write_json(out / "results.json", res)
    plot_curves(res, out / "curves.png")
    if as_json:
        typer.echo(json.dumps(res, indent=2))
        return
    typer.echo(f"loss barrier {curve.loss_barrier:.4f}, accuracy barrier {curve.acc_barrier:.4f}, "
               f"midpoint loss barrier {curve.midpoint_loss_barrier:.4f}"
               + (f"; ratio vs baseline {res['barrier_ratio_percent']:.1f}%" if baseline is not None else ""))
    typer.echo(f"wrote {out / 'results.json'} and {out / 'curves.png'}")
