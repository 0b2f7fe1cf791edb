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
        ax_l.legend(fontsize=8)
        ax_a.legend(fontsize=8)
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


def collect(runs_dir: Path) -> list[dict]:
    """Every scope's ``results.json`` under ``runs_dir`` (any depth, linked folders too), sorted by path, then the results of a
    sweep store ``runs_dir/sweep.sqlite`` (if any) that no results.json already gave."""
    out = []
    for p in _result_files(Path(runs_dir)):
        try:
            res = json.loads(p.read_text())
        except json.JSONDecodeError as exc:
            raise SymalignError(f"{p}: not valid JSON ({exc}); delete it to recompute that run") from exc
        if isinstance(res, dict) and "naive" in res and "variants" in res:
            res["_path"] = str(p.parent)
            out.append(res)
    store = Path(runs_dir) / "sweep.sqlite"
    if store.exists():
        from symalign.experiments.sweep.store import stored_results

        seen = {(r.get("experiment"), r.get("scope")) for r in out}
        out += [r for r in stored_results(store) if (r.get("experiment"), r.get("scope")) not in seen]
    return out


def _fmt(v) -> str:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.4g}"
    return str(v)


def summary_rows(results: list[dict]) -> list[dict]:
    from symalign.experiments.metrics import summary_row

    return [summary_row(r.get("experiment", Path(r["_path"]).parent.name), r) for r in results]


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
        row = {"experiment": r.get("experiment", ""), "scope": r["scope"],
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
            rows.append({"experiment": r.get("experiment", ""), "pe": r["pe"], "scope": r["scope"],
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


def pairs_table(results: list[dict], variant: str = "full") -> list[dict]:
    """Experiments x scopes measured on two or more seed pairs (e.g. ``symalign experiment --seeds 3
    --seeds 4`` into another runs directory): the ``variant``'s barrier ratio per pair, its mean and
    sample standard deviation (``n - 1``)."""
    groups: dict[tuple[str, str], dict[tuple[int, ...], float]] = {}
    for r in results:
        pair = _pair_of(r)
        if pair is None or variant not in r["variants"]:
            continue
        key = (r.get("experiment", ""), r["scope"])
        groups.setdefault(key, {})[pair] = r["variants"][variant]["loss_barrier_ratio_percent"]
    rows = []
    for (exp, scope), by_pair in sorted(groups.items()):
        if len(by_pair) < 2:
            continue
        vals = [by_pair[k] for k in sorted(by_pair)]
        rows.append({"experiment": exp, "scope": scope,
                     "seed pairs": ", ".join("-".join(map(str, k)) for k in sorted(by_pair)),
                     f"{variant} % per pair": ", ".join(f"{v:.1f}" for v in vals),
                     f"mean {variant} %": statistics.mean(vals), "std": statistics.stdev(vals)})
    return rows


def write_report(runs_dir: str | Path, out: str | Path | None = None) -> Path:
    """One Markdown report with the tables across runs and the plots; returns its path."""
    runs_dir = Path(runs_dir)
    if not runs_dir.is_dir():
        raise SymalignError(f"{runs_dir}: no such directory")
    results = collect(runs_dir)
    if not results:
        raise SymalignError(f"{runs_dir}: no results.json found; run `symalign experiment CONFIG.toml` first")
    out = Path(out) if out else runs_dir / "report.md"
    rows = summary_rows(results)
    parts = ["# symalign report\n", f"{len(results)} runs under `{runs_dir}`.\n",
             "Barriers are `max_t [L(t) - ((1-t) L_A + t L_B)]` on held-out data (accuracy: sign flipped); "
             "the ratio is aligned / naive in percent.\n", "## Barrier ratios (aligned / naive, %)\n",
             markdown_table(compact_rows(results)), "## All barriers\n", markdown_table(rows)]
    for variant in STAGE2_VARIANTS:
        pairs = pairs_table(results, variant)
        if pairs:
            parts += [f"## Seed pairs: the barrier ratio across pairs (stage 2 `{variant}`)\n", markdown_table(pairs)]
    s1 = stage1_table(results)
    if s1:
        parts += ["## Stage 1: rank of the chosen head permutation\n", markdown_table(s1)]
    parts.append("## Curves\n")
    for r in results:
        png = Path(r["_path"]) / "curves.png"
        if png.exists():
            rel = os.path.relpath(png, out.parent)
            parts.append(f"### {r.get('experiment', '')} · {r['scope']}\n\n![curves]({rel})\n")
    _write_text_atomic(out, "\n".join(parts))
    return out
