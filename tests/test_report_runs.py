"""``symalign report`` over the folders the README makes (issue 33, item 4): interpolate results get
their own table, the demo's summary is skipped with a note, rows carry run / config / split / seeds,
and the seed-pair table never averages runs of another split or config."""

from __future__ import annotations

import json
from pathlib import Path

from _cli_util import run_symalign

ROOT = Path(__file__).resolve().parents[1]


def _curve(barrier: float, loss_a: float = 0.5, loss_b: float = 0.6) -> dict:
    t = [0.0, 0.5, 1.0]
    loss = [loss_a, (loss_a + loss_b) / 2 + barrier, loss_b]
    return {"t": t, "loss": loss, "acc": [0.9, 0.8, 0.9], "loss_barrier": barrier, "acc_barrier": barrier / 10,
            "midpoint_loss_barrier": barrier}


def _experiment(root: Path, out: str, seeds: list[int], split: str, ratios: dict[str, float], variants=None,
                steps: int | None = None):
    """One scope's results.json as ``symalign experiment configs/vit-digits-rope.toml --out runs/OUT``
    records it (the recorded config with the command's overrides)."""
    from symalign.experiments.config import load_experiment_config, parse_config

    cfg = load_experiment_config(ROOT / "configs" / "vit-digits-rope.toml").to_dict()
    cfg["protocol"].update(seeds=seeds, eval_split=split, **({"variants": variants} if variants else {}))
    cfg["train"].update({"steps": steps} if steps else {})
    cfg = parse_config(cfg).to_dict()
    scope_dir = root / out / cfg["name"] / "all-attention"
    scope_dir.mkdir(parents=True)
    (root / out / cfg["name"] / "config.json").write_text(json.dumps(cfg))
    res = {"scope": "all-attention", "family": "vit", "pe": "rope", "data": "digits", "eval_split": split,
           "endpoints": {"A": {"loss": 0.5, "acc": 0.9}, "B": {"loss": 0.6, "acc": 0.9}}, "naive": _curve(1.0),
           "variants": {k: {"curve": _curve(v / 100), "loss_barrier_ratio_percent": v, "function_change": 0.0}
                        for k, v in ratios.items()},
           "stage1": [], "experiment": cfg["name"], "seeds": seeds, "threads": 1, "config": cfg}
    (scope_dir / "results.json").write_text(json.dumps(res))


def _interpolate(root: Path, out: str, baseline: bool) -> None:
    """``symalign interpolate A B [--baseline C] -o runs/OUT``'s results.json (its keys as written)."""
    d = root / out
    d.mkdir(parents=True)
    res = {"task": "causal-lm", "data": "shakespeare", "model_type": "gpt2", "scope": "gpt2-a → gpt2-b",
           "A": "gpt2-a", "B": "gpt2-b", "family": "gpt2", "pe": "", "rewrite": "attention",
           "evaluation": {"objective": "causal-lm", "data": "shakespeare", "items": 256},
           "points": [{"t": 0.0, "loss": 0.5}], "curve": _curve(0.2)}
    if baseline:
        res.update(naive=_curve(0.8), naive_label="A → gpt2-b0", variants={"gpt2-b": {"curve": _curve(0.2)}},
                   barrier_ratio_percent=25.0)
    else:
        res.update(naive=_curve(0.2), naive_label="A → gpt2-b", variants={})
    (d / "results.json").write_text(json.dumps(res))


def _readme_runs(root: Path) -> None:
    _experiment(root, "results", [1, 2], "test", {"none": 60.0, "orthogonal": 40.0, "full": 10.0})
    _experiment(root, "pair2", [3, 4], "test", {"none": 70.0, "orthogonal": 50.0, "full": 20.0})
    _experiment(root, "lv", [1, 2], "test", {"full": 10.0, "learned": 5.0}, variants=["full", "learned"])
    _experiment(root, "train-split", [1, 2], "train", {"none": 90.0, "orthogonal": 80.0, "full": 70.0})
    _interpolate(root, "gpt2-ab", baseline=True)
    _interpolate(root, "gpt2-model", baseline=False)
    (root / "demo").mkdir()
    (root / "demo" / "results.json").write_text(json.dumps({"encodings": {}, "rows": [], "seconds": 1.0}))


def _section(text: str, title: str) -> str:
    return text.split(title, 1)[1].split("\n## ", 1)[0]


def test_report_on_the_readme_runs_keys_rows_and_never_mixes_splits(tmp_path, monkeypatch, capsys):
    runs = tmp_path / "runs"
    _readme_runs(runs)
    code, out, err = run_symalign(monkeypatch, capsys, "report", runs)
    assert code == 0, err
    text = (runs / "report.md").read_text()
    # the first table names the run, config, split and seeds of every row
    first = _section(text, "## Barrier ratios")
    header = next(line for line in first.splitlines() if line.startswith("|"))
    for col in ("run", "config", "eval_split", "seeds"):
        assert f"| {col} |" in header
    assert "| train-split/vit-digits-rope |" in first and "| train |" in first
    # seed pairs: the test-split pairs 1-2 and 3-4 of one config; the train split is not averaged in
    pairs = _section(text, "stage 2 `full`)")
    (row,) = [line for line in pairs.splitlines() if line.startswith("| vit-digits-rope")]
    assert "| test |" in row and "1-2, 3-4" in row and "10.0, 20.0" in row and "70.0" not in row
    assert "lv/vit-digits-rope, pair2/vit-digits-rope" in row  # the first run by path measured 1-2
    # lv ran other variants of the same config: its full 1-2 is the pair results/ measured, counted once
    assert "measured in `lv/vit-digits-rope` and `results/vit-digits-rope` (the same ratio)" in text
    assert "stage 2 `learned`" not in text  # one pair only
    # interpolate results in their own table; the demo summary skipped with a note
    interp = _section(text, "## Interpolations")
    assert "| gpt2-ab |" in interp and "| gpt2-model |" in interp and "| 25 |" in interp
    assert "skipped `demo/results.json`" in text
    # summary.csv has the identifying columns too
    header = (runs / "summary.csv").read_text().splitlines()[0].split(",")
    assert header[:5] == ["experiment", "run", "config", "eval_split", "seeds"]


def test_the_same_pair_in_two_runs_of_one_config_counts_once_with_a_note(tmp_path):
    from symalign.experiments.report import write_report

    runs = tmp_path / "runs"
    _experiment(runs, "a", [1, 2], "test", {"full": 10.0})
    _experiment(runs, "b", [1, 2], "test", {"full": 12.0})
    _experiment(runs, "c", [3, 4], "test", {"full": 20.0})
    _experiment(runs, "d", [5, 6], "test", {"full": 90.0}, steps=50)  # another config: never pooled
    text = write_report(runs).read_text()
    row = next(line for line in _section(text, "stage 2 `full`)").splitlines() if line.startswith("| vit"))
    assert "1-2, 3-4 |" in row and "10.0, 20.0" in row and "12.0" not in row and "90.0" not in row
    assert "measured in `a/vit-digits-rope` and `b/vit-digits-rope` (10.0 % and 12.0 %)" in text


def test_only_interpolate_results_make_a_report(tmp_path, monkeypatch, capsys):
    _interpolate(tmp_path, "one", baseline=False)
    code, _, err = run_symalign(monkeypatch, capsys, "report", tmp_path)
    assert code == 0, err
    assert "## Interpolations" in (tmp_path / "report.md").read_text()


def test_the_demo_model_has_its_own_name():
    """The demo's D=48 ViT is not configs/vit-digits-<pe>.toml's D=32 model: their names differ."""
    from symalign.experiments.config import load_experiment_config
    from symalign.experiments.demo import ENCODINGS, demo_config

    for pe in ENCODINGS:
        cfg = load_experiment_config(ROOT / "configs" / f"vit-digits-{pe}.toml")
        demo = demo_config(pe)
        assert demo["model"]["d_model"] != cfg.model["d_model"] and demo["name"] != cfg.name


def test_curve_legends_sit_below_the_axes_not_over_the_curves(tmp_path, monkeypatch):
    """The demo figure's legends used to cover curves in two panels: each legend is now drawn below its axes."""
    from symalign.experiments import report

    figs = []
    monkeypatch.setattr(report, "_save_fig_atomic", lambda fig, path: figs.append(fig))
    curve = {"t": [0.0, 0.5, 1.0], "loss": [0.1, 2.0, 0.2], "acc": [0.9, 0.2, 0.9], "loss_barrier": 1.85}
    res = {"family": "vit", "pe": "rope", "scope": "full", "naive": curve,
           "variants": {"orthogonal": {"curve": curve}, "full": {"curve": curve}}}
    report.plot_curves([res, res], tmp_path / "c.png", title="t")
    fig = figs[0]
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        legend = ax.get_legend().get_window_extent(renderer)
        assert legend.y1 <= ax.get_window_extent(renderer).y0 + 1e-6  # entirely below the plotting area
