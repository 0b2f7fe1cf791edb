"""The streamed runs' table of docs/scaling.md, from the JSON files `bench_align_stream.py --json` wrote.

One row per finished step (``attention``, ``model``, ``merge``) of each file: the shape (layers of the
7B width), the code it ran (commit), its threads and load, the wall time against the floor measured in
the same run (reading both checkpoints once, writing one, plus the matcher's exact Gram products), the
peak RSS of the measured process (``ru_maxrss`` of the child, in GiB = 2^30 bytes and GB = 10^9 bytes),
and the per-layer check. Steps that were stopped (``error``) are left out. The output is a result file
(provenance + ``tables``) that ``symalign docs`` renders between the markers of docs/scaling.md.

    python benchmarks/stream_table.py benchmarks/results/stream_7b.json \\
        benchmarks/results/stream_7b_model.json ... --out benchmarks/results/stream_summary.json

Older files name the peak ``peak_rss_gb`` although they hold GiB (``ru_maxrss * 1024 / 2**30``);
both names are read as GiB.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from symalign.atomic import write_text  # noqa: E402
from symalign.experiments.docs_tables import make_table  # noqa: E402
from symalign.provenance import provenance  # noqa: E402

STEPS = ("attention", "model", "merge")
GOALS_GB = {"attention": 3.0, "model": 4.0}  # the peak-RSS goals (decimal GB)

COLUMNS = [("file", "result file"), ("step", "step"), ("layers", "layers"), ("commit", "commit"),
           ("threads", "threads"), ("load", "load avg start / end"), ("wall_s", "wall s", ".0f"),
           ("floor_s", "floor s", ".0f"), ("wall_over_floor", "wall / floor", ".2f"),
           ("peak_gib", "peak RSS GiB", ".2f"), ("peak_gb", "peak RSS GB", ".2f"), ("goal", "peak goal"),
           ("passes", "passes"), ("checked", "layers checked"), ("exact_max", "check exact max", ".1e"),
           ("stored_max", "check stored max", ".1e")]


def _peak_gib(step: dict) -> float | None:
    for key in ("peak_rss_gib", "peak_rss_gb"):
        if key in step:
            return float(step[key])
    return None


def rows_of(path: Path) -> list[dict]:
    """The finished steps of one ``bench_align_stream.py`` result file."""
    d = json.loads(path.read_text())
    prov = d.get("provenance") or {}
    layers = (d.get("shape") or {}).get("layers")
    load = "-"
    if d.get("load_average_start") and d.get("load_average_end"):
        load = f"{d['load_average_start'][0]:.1f} / {d['load_average_end'][0]:.1f}"
    out = []
    for name in STEPS:
        step = d.get(name)
        if not isinstance(step, dict) or "error" in step or "wall_s" not in step:
            continue
        gib = _peak_gib(step)
        gb = None if gib is None else gib * 2**30 / 1e9
        check = step.get("check") or {}
        goal = GOALS_GB.get(name)
        out.append({
            "file": path.name, "step": name, "layers": layers,
            "commit": f"`{str(prov.get('commit', '-'))[:7]}`", "threads": prov.get("threads", d.get("threads")),
            "load": load, "wall_s": step["wall_s"], "floor_s": step.get("floor_s"),
            "wall_over_floor": step.get("wall_over_floor"), "peak_gib": gib, "peak_gb": gb,
            "goal": "-" if goal is None or gb is None else f"< {goal:g} GB: {'met' if gb < goal else 'not met'}",
            "passes": step.get("passes"), "checked": check.get("layers"),
            "exact_max": check.get("exact_max"), "stored_max": check.get("stored_max"),
        })
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", type=Path, help="bench_align_stream.py --json files")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    rows = [r for f in a.files for r in rows_of(f)]
    if not rows:
        raise SystemExit("error: no finished step in the files given; pass bench_align_stream.py --json results")
    shown = [str(f.resolve().relative_to(ROOT) if f.resolve().is_relative_to(ROOT) else f) for f in a.files]
    result = {"provenance": provenance(command=["python", "benchmarks/stream_table.py", *shown, "--out", str(a.out)],
                                       threads=1),
              "tables": {"runs": make_table(rows, COLUMNS)}}
    write_text(a.out, json.dumps(result, indent=1) + "\n")
    print(f"{len(rows)} rows -> {a.out}")


if __name__ == "__main__":
    main()
