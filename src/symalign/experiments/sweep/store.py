r"""The sweep's results store: one SQLite table ``runs``, written only by the driver.

One row per run (its config, the grid point, status, timings, host, the per-scope
results as JSON); one transaction per finished run, so a killed sweep never leaves a
partial row.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from symalign.experiments.sweep.grid import Run

STORE_FILE = "sweep.sqlite"
RUNS_SUBDIR = "runs"

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    name        TEXT PRIMARY KEY,
    config      TEXT NOT NULL,               -- ExperimentConfig as JSON
    overrides   TEXT NOT NULL,               -- the grid point as JSON
    status      TEXT NOT NULL CHECK (status IN ('done', 'failed')),
    error       TEXT,
    traceback   TEXT,
    started_at  REAL,                        -- unix time, in the worker
    finished_at REAL,
    seconds     REAL,
    backend     TEXT,                        -- 'local' or 'ray'
    host        TEXT,
    threads     INTEGER,
    attempts    INTEGER NOT NULL DEFAULT 1,
    run_dir     TEXT NOT NULL,               -- relative to the store's directory
    results     TEXT                         -- {scope: results.json contents} as JSON
)
"""

UPSERT = """
INSERT INTO runs (name, config, overrides, status, error, traceback, started_at, finished_at, seconds,
                  backend, host, threads, attempts, run_dir, results)
VALUES (:name, :config, :overrides, :status, :error, :traceback, :started_at, :finished_at, :seconds,
        :backend, :host, :threads, 1, :run_dir, :results)
ON CONFLICT(name) DO UPDATE SET
    config = excluded.config, overrides = excluded.overrides, status = excluded.status,
    error = excluded.error, traceback = excluded.traceback, started_at = excluded.started_at,
    finished_at = excluded.finished_at, seconds = excluded.seconds, backend = excluded.backend,
    host = excluded.host, threads = excluded.threads, attempts = runs.attempts + 1,
    run_dir = excluded.run_dir, results = excluded.results
"""


class ResultsStore:
    """The sweep's SQLite store; only the driver process writes it, one transaction per run."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.conn = sqlite3.connect(str(self.path), timeout=60)
        self.conn.row_factory = sqlite3.Row
        with self.conn:
            self.conn.execute(SCHEMA)

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> "ResultsStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def rows(self) -> dict[str, dict]:
        """Every row, by run name."""
        return {r["name"]: dict(r) for r in self.conn.execute("SELECT * FROM runs ORDER BY name")}

    def record(self, run: Run, outcome: dict, backend: str) -> None:
        """Insert or replace ``run``'s row from a task outcome (atomically)."""
        row = {
            "name": run.name, "config": run.config_json(), "overrides": json.dumps(run.overrides, sort_keys=True),
            "status": "done" if outcome.get("ok") else "failed", "error": outcome.get("error"),
            "traceback": outcome.get("traceback"), "started_at": outcome.get("started"),
            "finished_at": outcome.get("finished"), "seconds": outcome.get("seconds"), "backend": backend,
            "host": outcome.get("host"), "threads": outcome.get("threads"),
            "run_dir": f"{RUNS_SUBDIR}/{run.name}", "results": outcome.get("results_json"),
        }
        with self.conn:
            self.conn.execute(UPSERT, row)


def read_rows(path: str | Path) -> dict[str, dict]:
    """The rows of an existing store, opened read-only (empty when there is no store)."""
    path = Path(path)
    if not path.exists():
        return {}
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=60)
    conn.row_factory = sqlite3.Row
    try:
        return {r["name"]: dict(r) for r in conn.execute("SELECT * FROM runs ORDER BY name")}
    except sqlite3.OperationalError:  # no runs table yet
        return {}
    finally:
        conn.close()


def stored_results(path: str | Path) -> list[dict]:
    """Every scope's results of the ``done`` runs of a store, with ``_path`` = the scope's run directory."""
    path = Path(path)
    out = []
    for row in read_rows(path).values():
        if row["status"] != "done" or not row["results"]:
            continue
        for scope, res in json.loads(row["results"]).items():
            res.setdefault("experiment", row["name"])
            res["_path"] = str(path.parent / row["run_dir"] / scope)
            out.append(res)
    return out


# ----------------------------------------------------------------------------
