"""Write the ``tables`` of docs/scaling.md's streamed-run tables into the committed result files they come from.

``bench_align_stream.py`` writes raw measurements, and no ``tables``, to ``benchmarks/results/*.json``.
Each entry of :data:`SPECS` names one such file (a 7B run), a table name, the function that derives the
table's rows from the file's raw keys, and the columns (``(key, header[, format])``, as
:func:`symalign.experiments.docs_tables.make_table` takes them). For each entry this script sets
``tables[NAME]`` of the file and leaves every other key, ``provenance`` included, as it is; the file is
rewritten (atomically, :func:`symalign.atomic.write_json`) only when that table changed. ``symalign docs``
then renders the ``<!-- results: FILE table=NAME -->`` blocks of docs/scaling.md from them.
Deterministic and idempotent: the rows are a pure function of the raw keys, and a second run changes
nothing. No measurement is made or altered here; the only text the script adds is row labels (which
command a step ran). The docs test requires a complete ``provenance`` record
of every file a docs table names. A profile file that gathers several runs under labels
(``stream_model_memory_7b``, ``moe_stream_memory``), each run with its own record, gets a top-level one
derived from them (:func:`runs_provenance`: the newest run's record, every run's command); its table gives
each row's own commit. The older ``stream_small``, ``stream_tiny`` and ``stream_*_partial`` files record no
provenance at all and are not tabulated.

    .venv/bin/python benchmarks/tables_from_results.py            # write the tables
    .venv/bin/python benchmarks/tables_from_results.py --check    # exit 1 if a table is missing or stale
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from symalign.atomic import write_json  # noqa: E402
from symalign.experiments.docs_tables import make_table  # noqa: E402

GB_PER_GIB = 2**30 / 1e9
GOALS_GB = {"attention": 3.0, "model": 4.0}  # the peak-RSS goals (decimal GB), as in stream_table.py
RATIO_GOAL = 2.0  # the goal: wall time within 2x of the floor measured in the same run

Row = dict[str, Any]
ColumnSpec = tuple[str, str] | tuple[str, str, str]

ALIGN_ATTENTION = "`align --stream --scope attention`"
MERGE_NO_ALIGN = "`merge A B' --no-align --stream`"
ALIGN_MODEL_1 = "`align --stream --scope model --max-sweeps 1`"
ALIGN_MODEL_2 = "`align --stream --scope model --max-sweeps 2`"


@dataclass(frozen=True)
class Spec:
    """One generated table: the result file (relative to the repository), its name and how it is derived."""

    file: str
    table: str
    rows: Callable[[Mapping[str, Any]], list[Row]]
    columns: Sequence[ColumnSpec]
    runs: tuple[str, ...] = ()  # labels of runs with their own provenance: the file's record is derived from them


def _scaled(x: float | None, factor: float) -> float | None:
    """``x * factor`` (``None`` stays ``None``); unrounded, so a cell is rounded once, by its format."""
    return None if x is None else float(x) * factor


def _clean(row: Row) -> Row:
    """``row`` without its ``None`` cells (rendered as ``-`` either way)."""
    return {k: v for k, v in row.items() if v is not None}


def _peak_gib(step: Mapping[str, Any]) -> float | None:
    """A step's peak RSS in GiB; older files name it ``peak_rss_gb`` although it holds GiB (stream_table.py)."""
    for key in ("peak_rss_gib", "peak_rss_gb", "peak_rss_gb_so_far"):
        if step.get(key) is not None:
            return float(step[key])
    return None


def _peak_goal(scope: str, gib: float | None) -> str | None:
    """``"< 3 GB: met"`` and the like for a scope with a peak-RSS goal, else ``None``."""
    goal = GOALS_GB.get(scope)
    if goal is None or gib is None:
        return None
    return f"< {goal:g} GB: {'met' if gib * GB_PER_GIB < goal else 'not met'}"


def _ratio_goal(ratio: float | None) -> str | None:
    """``"met"`` / ``"not met"`` for the wall-time goal of an alignment (within 2x of the floor)."""
    return None if ratio is None else ("met" if ratio <= RATIO_GOAL else "not met")


def _stopped_at(step: Mapping[str, Any]) -> str | None:
    """``"pass 1: layer 19/32"`` from the last progress line of a step stopped before its end."""
    lines = step.get("progress_lines") or []
    if not lines:
        return None
    m = re.search(r"(pass \d+|writing): layer \d+/\d+", lines[-1][1])
    return m.group(0) if m else None


def stream_step(d: Mapping[str, Any], scope: str, label: str) -> Row:
    """One step (``attention``, ``model`` or ``merge``) of a ``bench_align_stream.py`` result file."""
    s, floor = d[scope], d.get("floor") or {}
    gib, ratio = _peak_gib(s), s.get("wall_over_floor")
    totals = s.get("matcher_totals") or {}
    wall = s.get("wall_s")
    stopped = _stopped_at(s) if "error" in s else None
    return _clean({
        "step": label + (f" (stopped at the deadline in {stopped})" if stopped else ""),
        "wall_s": wall, "wall_min": _scaled(wall, 1 / 60),
        "cpu_s": s.get("cpu_s"), "peak_gib": gib, "peak_gb": _scaled(gib, GB_PER_GIB),
        "peak_goal": _peak_goal(scope, gib), "floor_s": s.get("floor_s"),
        "read_s": floor.get("read_both_s") if "floor_s" in s else None,
        "write_s": floor.get("write_one_s") if "floor_s" in s else None,
        "grams_s": s.get("grams_s"), "stage1_s": totals.get("time_stage1_s"),
        "grams2_s": totals.get("time_grams_s"), "stage2_s": totals.get("time_stage2_s"),
        "ratio": ratio, "ratio_goal": _ratio_goal(ratio) if scope in GOALS_GB else None,
        "read_gib": s.get("bytes_read_gb"),
    })


def stream_steps(steps: Sequence[tuple[str, str]]) -> Callable[[Mapping[str, Any]], list[Row]]:
    """Rows of the given ``(scope, label)`` steps of a file."""

    def rows(d: Mapping[str, Any]) -> list[Row]:
        return [stream_step(d, scope, label) for scope, label in steps]

    return rows


def stage_times(label: str) -> Callable[[Mapping[str, Any]], list[Row]]:
    """The attention step's time per stage (summed over the layers) and its peak, as one row named
    ``label (commit)``; a figure the file does not hold stays ``None`` (``-``), so two runs' rows line up."""

    def rows(d: Mapping[str, Any]) -> list[Row]:
        a = d["attention"]
        totals, t = a.get("matcher_totals") or {}, a.get("timings") or {}
        match = t["prepare_s"] + t["match_s"] if "prepare_s" in t and "match_s" in t else None
        return [{
            "run": f"{label} ({d['provenance']['commit'][:7]})", "wall_s": a.get("wall_s"), "cpu_s": a.get("cpu_s"),
            "stage1_s": totals.get("time_stage1_s"), "grams2_s": totals.get("time_grams_s"),
            "stage2_s": totals.get("time_stage2_s"), "read_s": t.get("read_s"), "match_s": match,
            "check_s": t.get("verify_s"), "write_s": t.get("write_s"), "peak_gib": _peak_gib(a),
        }]

    return rows


STEP_COLUMNS: tuple[ColumnSpec, ...] = (
    ("step", "step"), ("wall_s", "wall s", ".0f"), ("wall_min", "wall min", ".1f"),
    ("peak_gib", "peak RSS GiB", ".2f"), ("peak_gb", "peak RSS GB", ".2f"), ("peak_goal", "peak goal"),
    ("floor_s", "floor s (same run)", ".0f"), ("read_s", "of which: read both s", ".1f"),
    ("write_s", "write one s", ".1f"), ("grams_s", "Gram products s", ".0f"))
STAGE_COLUMNS: tuple[ColumnSpec, ...] = (
    ("stage1_s", "stage 1 s", ".0f"), ("grams2_s", "stage-2 Grams s", ".0f"), ("stage2_s", "stage 2 s", ".0f"))
RATIO_COLUMNS: tuple[ColumnSpec, ...] = (
    ("ratio", "wall / floor", ".2f"), ("ratio_goal", "2x goal"), ("cpu_s", "CPU s", ".0f"),
    ("read_gib", "read GiB", ".2f"))
STAGE_TIME_COLUMNS: tuple[ColumnSpec, ...] = (
    ("run", "run"), ("wall_s", "wall s", ".0f"), ("cpu_s", "CPU (user + system) s", ".0f"),
    ("stage1_s", "stage 1 (head-pair products + assignment) s", ".0f"), ("grams2_s", "stage-2 Grams s", ".0f"),
    ("stage2_s", "stage 2 (L-BFGS over `GL(d)`, V-O; RoPE planes for Q-K) s", ".0f"),
    ("read_s", "main thread: read s", ".0f"), ("match_s", "prepare + match (waits for stage 2 included) s", ".0f"),
    ("check_s", "check s", ".0f"), ("write_s", "write s", ".0f"), ("peak_gib", "peak RSS GiB", ".2f"))


def without(columns: Sequence[ColumnSpec], *keys: str) -> tuple[ColumnSpec, ...]:
    """``columns`` less those whose key is in ``keys`` (a file that never recorded them)."""
    return tuple(c for c in columns if c[0] not in keys)


def profile_rows(d: Mapping[str, Any]) -> list[Row]:
    """The before/after rows of a two-run ``profile_stream_memory.py`` file: commit, peak and the line at the peak."""
    rows = []
    for key in ("before", "after"):
        r = d[key]
        commit = r["provenance"]["commit"]
        gib = r["align"]["peak_rss_gib"]
        rows.append({"run": key, "commit": f"`{commit[:7]}`" + (" (+ the change)" if commit.endswith("+dirty") else ""),
                     "peak_gib": gib, "peak_gb": gib * GB_PER_GIB, "peak_goal": _peak_goal("model", gib),
                     "at_peak": f"`{r['align']['at_peak'][0]}`", "wall_s": r["align"]["wall_s"]})
    return rows


def labelled_profile_rows(runs: Sequence[tuple[str, str, str]], in_layers: bool = False
                          ) -> Callable[[Mapping[str, Any]], list[Row]]:
    """Rows of a profile file that keeps several runs under labels: one per ``(label, command key, row name)``
    present (``command key``: ``align``, ``merge``, ``model``, ``attention``...), with the run's own commit, the
    peak (with the model scope's goal unless ``in_layers``), the source line at the peak and the wall
    time; ``in_layers`` also gives the peak in layers (``peak_layers``, ``above_baseline_layers``)."""
    def rows(d: Mapping[str, Any]) -> list[Row]:
        out = []
        for label, key, name in runs:
            step = (d.get(label) or {}).get(key)
            if step is None:
                continue
            commit = d[label]["provenance"]["commit"]
            gib = step["peak_rss_gib"]
            row = {"run": name, "commit": f"`{commit[:7]}`" + (" (+ uncommitted)" if commit.endswith("+dirty") else ""),
                   "peak_gib": gib, "peak_gb": gib * GB_PER_GIB,
                   "peak_goal": None if in_layers else _peak_goal("model", gib),
                   "at_peak": f"`{step['at_peak'][0]}`", "wall_s": step.get("wall_s")}
            if in_layers:
                row |= {"in_layers": step.get("peak_layers"), "above_layers": step.get("above_baseline_layers")}
            out.append(_clean(row))
        return out
    return rows


def runs_provenance(d: Mapping[str, Any], labels: Sequence[str]) -> dict:
    """The provenance of a file gathering the runs ``labels`` (each with its own record): the newest run's record
    (commit, threads, versions, machine, date), with ``command`` listing every run's command and ``runs`` the
    labels. Nothing is invented: each field is copied from a run's own record."""
    recs = [(label, d[label]["provenance"]) for label in labels if label in d]
    newest = max(recs, key=lambda lr: lr[1]["date"])[1]
    return {**newest, "command": "; ".join(f"{label}: {rec['command']}" for label, rec in recs),
            "runs": [label for label, _ in recs], "derived_from": "the runs' own provenance records"}


MOE_COLUMNS: tuple[ColumnSpec, ...] = (
    ("run", "run"), ("commit", "commit"), ("peak_gib", "peak RSS GiB", ".3f"), ("in_layers", "in `L`", ".2f"),
    ("above_layers", "above the baseline, in `L`", ".2f"), ("wall_s", "wall s", ".0f"),
    ("at_peak", "source line at the peak"))


PROFILE_COLUMNS: tuple[ColumnSpec, ...] = (
    ("run", "run"), ("commit", "commit"), ("peak_gib", "peak RSS GiB", ".3f"), ("peak_gb", "peak RSS GB", ".2f"),
    ("peak_goal", "peak goal"), ("at_peak", "source line at the peak"), ("wall_s", "wall s", ".0f"))


RES = "benchmarks/results/"
MOE_LABELS = ("before", "after_4d2cc9c", "after", "head")  # moe_stream_memory.json's runs, oldest first
SPECS: tuple[Spec, ...] = (
    Spec(RES + "stream_7b_one_engine.json", "steps",
         stream_steps([("attention", ALIGN_ATTENTION), ("merge", MERGE_NO_ALIGN),
                       ("model", ALIGN_MODEL_1 + " (32 layers)")]),
         STEP_COLUMNS + STAGE_COLUMNS + RATIO_COLUMNS),
    Spec(RES + "stream_7b_model_2pass.json", "steps",
         stream_steps([("model", "`align --stream --scope model --max-sweeps 2` (32 layers)")]),
         STEP_COLUMNS + RATIO_COLUMNS),
    Spec(RES + "stream_tiny_head.json", "steps",
         stream_steps([("attention", ALIGN_ATTENTION), ("merge", MERGE_NO_ALIGN),
                       ("model", "`align --stream --scope model --max-sweeps 2`")]),
         STEP_COLUMNS + STAGE_COLUMNS + RATIO_COLUMNS),
    Spec(RES + "stream_model_memory_7b2.json", "profile", profile_rows, PROFILE_COLUMNS),
    Spec(RES + "stream_model_memory_7b2s2.json", "profile",
         labelled_profile_rows([("before", "align", "2 layers, before: " + ALIGN_MODEL_2),
                                ("after", "align", "2 layers, after: " + ALIGN_MODEL_2),
                                ("after_8_layers", "align", "8 layers, after: " + ALIGN_MODEL_2)]),
         PROFILE_COLUMNS, runs=("before", "after", "after_8_layers")),
    Spec(RES + "stream_7b_model_blocked.json", "steps",
         stream_steps([("model", ALIGN_MODEL_1 + " (32 layers)")]), STEP_COLUMNS + RATIO_COLUMNS),
    Spec(RES + "stream_7b.json", "steps",
         stream_steps([("attention", ALIGN_ATTENTION), ("merge", MERGE_NO_ALIGN)]),
         STEP_COLUMNS + STAGE_COLUMNS + RATIO_COLUMNS),
    Spec(RES + "stream_7b.json", "stages", stage_times("after"), STAGE_TIME_COLUMNS),
    Spec(RES + "stream_7b_before.json", "stages", stage_times("before"), STAGE_TIME_COLUMNS),
    Spec(RES + "stream_7b_before.json", "steps",
         stream_steps([("attention", ALIGN_ATTENTION), ("merge", MERGE_NO_ALIGN + " (B' = the aligned output)"),
                       ("model", "`align --stream --scope model --max-sweeps 2`")]),
         STEP_COLUMNS + STAGE_COLUMNS + without(RATIO_COLUMNS, "cpu_s")),
    Spec(RES + "stream_model_memory_7b.json", "profile",
         labelled_profile_rows([("before", "align", "before: " + ALIGN_MODEL_1),
                                ("after_align", "align", "after: " + ALIGN_MODEL_1),
                                ("after_merge", "merge", "after: `merge --stream --scope model --max-sweeps 1`"),
                                ("blocked_align", "align", "blocked: " + ALIGN_MODEL_1)]),
         PROFILE_COLUMNS, runs=("before", "after_align", "after_merge", "blocked_align")),
    Spec(RES + "moe_stream_memory.json", "profile",
         labelled_profile_rows([(label, key, f"{label}: `{cmd}`") for label in MOE_LABELS
                                for key, cmd in (("model", "align --stream --scope model --max-sweeps 1"),
                                                 ("merge", "merge --stream --scope model --max-sweeps 1"),
                                                 ("attention", "align --stream --scope attention"))],
                               in_layers=True),
         MOE_COLUMNS, runs=MOE_LABELS),
)


def table_of(spec: Spec, data: Mapping[str, Any]) -> dict:
    """The ``tables`` entry ``spec`` derives from a result file's contents."""
    return make_table(spec.rows(data), spec.columns)


def update(spec: Spec, root: Path = ROOT, write: bool = True) -> bool:
    """Set ``spec``'s table in its file (only when it differs); ``True`` when it was missing or stale."""
    path = root / spec.file
    data = json.loads(path.read_text())
    table = table_of(spec, data)
    prov = runs_provenance(data, spec.runs) if spec.runs else data.get("provenance")
    if (data.get("tables") or {}).get(spec.table) == table and data.get("provenance") == prov:
        return False
    if write:
        data.setdefault("tables", {})[spec.table] = table
        if spec.runs:
            data = {"provenance": prov, **{k: v for k, v in data.items() if k != "provenance"}}
        write_json(path, data)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    """Write (or with ``--check`` only list) the missing or stale tables; the exit status for ``--check``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a table is missing or stale")
    args = ap.parse_args(argv)
    stale = [f"{s.file} table={s.table}" for s in SPECS if update(s, write=not args.check)]
    for name in stale:
        print(("stale: " if args.check else "wrote: ") + name)
    return 1 if (args.check and stale) else 0


if __name__ == "__main__":
    sys.exit(main())
