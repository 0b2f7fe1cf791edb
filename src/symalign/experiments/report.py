"""Reports: curve plots (PNG), the summary table (CSV + Markdown) and the Markdown report.

Every writer builds its file under a temporary name and renames it into place.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from symalign.atomic import atomic_path  # noqa: E402
from symalign.atomic import write_text as _write_text_atomic  # noqa: E402
from symalign.errors import SymalignError  # noqa: E402
from symalign.experiments.config import VARIANTS as STAGE2_VARIANTS  # noqa: E402


def _save_fig_atomic(fig, path: Path) -> None:
    try:
        with atomic_path(path, suffix=".png") as tmp:
            fig.savefig(tmp, dpi=110, bbox_inches="tight", format="png")
    finally:
        plt.close(fig)


def plot_curves(results: dict | list[dict], path: Path, title: str | None = None) -> Path:
    """Loss and accuracy along the path, naive vs aligned, one row per result."""
    rows = results if isinstance(results, list) else [results]
    fig, axes = plt.subplots(len(rows), 2, figsize=(10, 3.4 * len(rows)), squeeze=False, layout="constrained")
    for (ax_l, ax_a), res in zip(axes, rows):
        label = f"{res.get('family', '')} {res.get('pe', '')} · {res.get('scope', '')}"
        naive = res.get("naive_label", "naive")
        curves = {naive: res["naive"], **{f"aligned ({k})": v["curve"] for k, v in res["variants"].items()}}
        for name, c in curves.items():
            style = "--" if name == naive and res["variants"] else "-"
            ax_l.plot(c["t"], c["loss"], style, marker=".", label=f"{name}: B={c['loss_barrier']:.3f}")
            ax_a.plot(c["t"], [100 * a for a in c["acc"]], style, marker=".", label=name)
        ax_l.set(xlabel="t  (A → B)", ylabel="held-out loss", title=label)
        ax_a.set(xlabel="t  (A → B)", ylabel="accuracy (%)", title=label)
        for ax in (ax_l, ax_a):  # below the axes: a legend inside covered the curves it names
            ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
        ax_l.grid(alpha=0.3)
        ax_a.grid(alpha=0.3)
    if title:
        fig.suptitle(title)  # constrained layout leaves room for it (tight_layout let it overlap)
    _save_fig_atomic(fig, path)
    return path


def _result_files(root: Path) -> list[Path]:
    """Every ``results.json`` below ``root``, sorted, following linked folders (a runs tree assembled
    from links to other runs directories) but entering each real folder once (no link cycles)."""
    found, seen = [], set()
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        real = os.path.realpath(dirpath)
        if real in seen:
            dirnames[:] = []
            continue
        seen.add(real)
        if "results.json" in filenames:
            found.append(Path(dirpath) / "results.json")
    return sorted(found)


def result_kind(res: object) -> str | None:
    """What a ``results.json`` holds: ``"experiment"`` (one scope of ``symalign experiment``: naive and
    aligned curves, endpoints), ``"interpolate"`` (``symalign interpolate``: a curve between two
    checkpoints, with ``--baseline`` a second one) or ``None`` (anything else, e.g. the demo's summary)."""
    if not isinstance(res, dict):
        return None
    if all(k in res for k in ("curve", "points", "A", "B")):
        return "interpolate"
    if all(k in res for k in ("naive", "variants", "scope")):
        return "experiment"
    return None


@dataclass
class Collected:
    """The results under a runs directory, by kind, and the files skipped (path, why)."""

    experiments: list[dict] = field(default_factory=list)
    interpolations: list[dict] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)


def _why_skipped(res: object) -> str:
    if isinstance(res, dict) and "encodings" in res and "rows" in res:
        return "the summary of `symalign demo` (its runs, in the folder `runs/` beside it, are reported)"
    return "not a result of `symalign experiment` or `symalign interpolate`"


def _recorded_config(run_dir: Path) -> dict | None:
    """The run folder's ``config.json`` (what ``symalign experiment`` last ran there), if readable."""
    try:
        cfg = json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) else None


def _identify(res: dict, runs_dir: Path) -> None:
    """``res["_run"]``: the run folder (relative to ``runs_dir``) and the columns that tell runs apart
    (:func:`~symalign.experiments.metrics.run_columns`: config hash, split, seeds)."""
    from symalign.experiments.metrics import run_columns

    folder = Path(res["_path"]).parent if "_path" in res else None
    run = os.path.relpath(folder, runs_dir) if folder is not None else "?"
    config = _recorded_config(folder) if folder is not None and "config" not in res else None
    res["_run"] = {"run": run, **run_columns(res, config, _pair_of(res))}


def collect_all(runs_dir: Path) -> Collected:
    """Every ``results.json`` under ``runs_dir`` (any depth, linked folders too), sorted by path and
    sorted by kind (:func:`result_kind`; other files are listed as skipped), then the results of a
    sweep store ``runs_dir/sweep.sqlite`` (if any) that no results.json already gave. Each experiment
    result gets ``_path`` (its folder) and ``_run`` (:func:`_identify`)."""
    runs_dir = Path(runs_dir)
    out = Collected()
    for p in _result_files(runs_dir):
        try:
            res = json.loads(p.read_text())
        except json.JSONDecodeError as exc:
            raise SymalignError(f"{p}: not valid JSON ({exc}); delete it to recompute that run") from exc
        kind = result_kind(res)
        if kind is None:
            out.skipped.append((os.path.relpath(p, runs_dir), _why_skipped(res)))
            continue
        res["_path"] = str(p.parent)
        (out.experiments if kind == "experiment" else out.interpolations).append(res)
    store = runs_dir / "sweep.sqlite"
    if store.exists():
        from symalign.experiments.sweep.store import stored_results

        seen = {(r.get("experiment"), r.get("scope")) for r in out.experiments}
        out.experiments += [r for r in stored_results(store) if (r.get("experiment"), r.get("scope")) not in seen]
    for r in out.experiments:
        _identify(r, runs_dir)
    return out


def collect(runs_dir: Path) -> list[dict]:
    """The experiment results under ``runs_dir`` (:func:`collect_all`)."""
    return collect_all(runs_dir).experiments


def _run(r: dict) -> dict:
    """The identifying columns of an experiment result (run folder, config hash, split, seeds)."""
    if "_run" in r:
        return r["_run"]
    from symalign.experiments.metrics import run_columns

    return {"run": "?", **run_columns(r, None, _pair_of(r))}


def _fmt(v) -> str:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.4g}"
    return str(v)


def summary_rows(results: list[dict]) -> list[dict]:
    """One row per experiment result, keyed by run folder, config hash, split and seeds."""
    from symalign.experiments.metrics import summary_row

    return [summary_row(r.get("experiment", Path(r["_path"]).parent.name), r, _run(r)) for r in results]


def markdown_table(rows: list[dict]) -> str:
    if not rows:
        return "_no results_\n"
    cols = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_fmt(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def write_summary(runs_dir: Path) -> list[dict]:
    """Regenerate ``summary.csv`` and ``summary.md`` from every result under ``runs_dir``.

    Rebuilt from the per-run files (not appended), so a resumed run never duplicates a row.
    """
    rows = summary_rows(collect(runs_dir))
    if rows:
        cols = list(dict.fromkeys(k for r in rows for k in r))
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)
        _write_text_atomic(Path(runs_dir) / "summary.csv", buf.getvalue())
        _write_text_atomic(Path(runs_dir) / "summary.md", markdown_table(rows))
    return rows


def compact_rows(results: list[dict]) -> list[dict]:
    """The paper-style table: endpoint accuracies, naive loss barrier, and the barrier ratio
    (aligned / naive, %) of every stage-2 variant (and of stage 1 switched off)."""
    rows = []
    for r in results:
        row = {"experiment": r.get("experiment", ""), **_run(r), "scope": r["scope"],
               "acc A / B": f"{r['endpoints']['A']['acc']:.3f} / {r['endpoints']['B']['acc']:.3f}",
               "naive loss barrier": r["naive"]["loss_barrier"], "naive acc barrier": r["naive"]["acc_barrier"]}
        for key, v in r["variants"].items():
            row[f"{key} %"] = v["loss_barrier_ratio_percent"]
        full = r["variants"].get("full")
        if full is not None:
            row["aligned loss barrier"] = full["curve"]["loss_barrier"]
            row["aligned acc barrier"] = full["curve"]["acc_barrier"]
        rows.append(row)
    return rows


def stage1_table(results: list[dict]) -> list[dict]:
    rows = []
    for r in results:
        for e in r.get("stage1", []):
            rows.append({"experiment": r.get("experiment", ""), **_run(r), "pe": r["pe"], "scope": r["scope"],
                         "layer": e["layer"], "rank": e.get("rank", "-"), "of": e.get("n_permutations", "-"),
                         "Lhat": e.get("lhat", float("nan"))})
    return rows


def _pair_of(r: dict) -> tuple[int, ...] | None:
    """The seed pair of a result: recorded (``"seeds"``), else the ``seed<N>`` checkpoint folders beside it."""
    if r.get("seeds"):
        return tuple(int(x) for x in r["seeds"])
    if "_path" not in r:
        return None
    found = sorted(int(d.name[4:]) for d in Path(r["_path"]).glob("seed*") if d.name[4:].isdigit())
    return tuple(found) if len(found) == 2 else None


def pairs_table(results: list[dict], variant: str = "full", notes: list[str] | None = None) -> list[dict]:
    """Runs of one config measured on two or more seed pairs (e.g. ``symalign experiment --seeds 3
    --seeds 4`` into another runs directory): the ``variant``'s barrier ratio per pair, its mean and
    sample standard deviation (``n - 1``).

    Results are pooled only when experiment, config hash, evaluation split and scope agree
    (:func:`_run`): runs of another config or split are never averaged in. One pair measured by two
    runs of the same config counts once (the first run by path); ``notes`` receives a line naming both.
    """
    groups: dict[tuple[str, str, str, str], dict[tuple[int, ...], tuple[float, str]]] = {}
    for r in results:
        pair = _pair_of(r)
        if pair is None or variant not in r["variants"]:
            continue
        run = _run(r)
        key = (r.get("experiment", ""), run["config"], run["eval_split"], r["scope"])
        value = (r["variants"][variant]["loss_barrier_ratio_percent"], run["run"])
        have = groups.setdefault(key, {})
        if pair in have:
            if notes is not None:
                same = "the same ratio" if have[pair][0] == value[0] else f"{have[pair][0]:.1f} % and {value[0]:.1f} %"
                notes.append(f"seed pair {'-'.join(map(str, pair))} of {key[0]} (config {key[1]}, {key[2]} split, "
                             f"{key[3]}, stage 2 `{variant}`) was measured in `{have[pair][1]}` and `{value[1]}` "
                             f"({same}); the table counts it once, from `{have[pair][1]}`")
            continue
        have[pair] = value
    rows = []
    for (exp, config, split, scope), by_pair in sorted(groups.items()):
        if len(by_pair) < 2:
            continue
        vals = [by_pair[k][0] for k in sorted(by_pair)]
        rows.append({"experiment": exp, "config": config, "eval_split": split, "scope": scope,
                     "seed pairs": ", ".join("-".join(map(str, k)) for k in sorted(by_pair)),
                     "runs": ", ".join(by_pair[k][1] for k in sorted(by_pair)),
                     f"{variant} % per pair": ", ".join(f"{v:.1f}" for v in vals),
                     f"mean {variant} %": statistics.mean(vals), "std": statistics.stdev(vals)})
    return rows


def interpolate_rows(results: list[dict], runs_dir: Path) -> list[dict]:
    """One row per ``symalign interpolate`` result: the two checkpoints, the evaluation, the curve's
    endpoint losses and barriers and (with ``--baseline``) the baseline's barrier and the ratio."""
    rows = []
    for r in results:
        c, ev = r["curve"], r.get("evaluation", {})
        row = {"run": os.path.relpath(r["_path"], runs_dir), "A": r["A"], "B": r["B"], "model": r.get("family", ""),
               "data": ev.get("data", r.get("data", "")), "objective": ev.get("objective", r.get("task", "")),
               "items": ev.get("items", ""), "points": len(c["t"]), "loss A": c["loss"][0], "loss B": c["loss"][-1],
               "loss barrier": c["loss_barrier"], "acc barrier": c["acc_barrier"]}
        if r.get("variants"):
            row.update({"baseline": r.get("naive_label", ""), "baseline loss barrier": r["naive"]["loss_barrier"],
                        "ratio %": r.get("barrier_ratio_percent", float("nan"))})
        rows.append(row)
    return rows


def write_report(runs_dir: str | Path, out: str | Path | None = None) -> Path:
    """One Markdown report with the tables across runs and the plots; returns its path.

    Every experiment row carries its run folder, config hash, evaluation split and seed pair, and
    only rows that agree on all but the seed pair are averaged (:func:`pairs_table`);
    ``symalign interpolate`` results get their own table; other ``results.json`` files are listed
    as skipped, with the reason.
    """
    runs_dir = Path(runs_dir)
    if not runs_dir.is_dir():
        raise SymalignError(f"{runs_dir}: no such directory")
    found = collect_all(runs_dir)
    results = found.experiments
    if not results and not found.interpolations:
        raise SymalignError(f"{runs_dir}: no results.json of symalign experiment or interpolate found; run "
                            "`symalign experiment CONFIG.toml` first")
    out = Path(out) if out else runs_dir / "report.md"
    counts = [f"{len(results)} experiment results (one per run and scope)"] if results else []
    counts += [f"{len(found.interpolations)} interpolate results"] if found.interpolations else []
    parts = ["# symalign report\n", f"{' and '.join(counts)} under `{runs_dir}`.\n"]
    notes: list[str] = []
    if results:
        parts += ["Barriers are `max_t [L(t) - ((1-t) L_A + t L_B)]` on held-out data (accuracy: sign flipped); "
                  "the ratio is aligned / naive in percent. `run` is the run folder, `config` a hash of its "
                  "config without the seeds, split and scopes, so rows with the same `config` differ only in "
                  "`eval_split`, `seeds` and `scope`.\n", "## Barrier ratios (aligned / naive, %)\n",
                  markdown_table(compact_rows(results)), "## All barriers\n", markdown_table(summary_rows(results))]
        for variant in STAGE2_VARIANTS:
            pairs = pairs_table(results, variant, notes)
            if pairs:
                parts += [f"## Seed pairs: the barrier ratio across pairs (stage 2 `{variant}`)\n",
                          "Pooled only within one experiment, config, split and scope.\n", markdown_table(pairs)]
        s1 = stage1_table(results)
        if s1:
            parts += ["## Stage 1: rank of the chosen head permutation\n", markdown_table(s1)]
    if found.interpolations:
        parts += ["## Interpolations (`symalign interpolate`)\n",
                  "The curve A -> B of each run; with `--baseline`, the baseline's barrier and the ratio.\n",
                  markdown_table(interpolate_rows(found.interpolations, runs_dir))]
    if notes or found.skipped:
        parts.append("## Notes\n")
        parts += [f"- {n}" for n in notes]
        parts += [f"- skipped `{path}`: {why}" for path, why in found.skipped]
        parts.append("")
    parts.append("## Curves\n")
    for r in results + found.interpolations:
        png = Path(r["_path"]) / "curves.png"
        if png.exists():
            rel = os.path.relpath(png, out.parent)
            title = " · ".join(str(x) for x in (_run(r)["run"], r["scope"])) if "naive" in r and "endpoints" in r \
                else os.path.relpath(r["_path"], runs_dir)
            parts.append(f"### {title}\n\n![curves]({rel})\n")
    _write_text_atomic(out, "\n".join(parts))
    return out
