r"""Sweeps: a grid of experiment configs, run in parallel, recorded in one SQLite store.

A grid file is an experiment TOML (``name``, ``data``, ``[model]``, ``[train]``,
``[protocol]``, ...) -- the *base* -- plus::

    [grid]                                   # axes: dotted config paths -> lists of values
    "model.pe" = ["sinusoidal", "rope"]
    "protocol.seeds" = [[1, 2], [3, 4]]

    [[cases]]                                # optional: one more axis of bundled overrides
    label = "vit-digits"
    data = "digits"
    model = { family = "vit", d_model = 32 } # nested tables are merged key by key

    [resources]                              # optional
    cpus_per_run = 1                         # Ray: num_cpus of each task
    gpus_per_run = 0                         # Ray: num_gpus of each task
    threads_per_run = 1                      # torch threads in each task (both backends)

The runs are the Cartesian product ``cases x axis_1 x axis_2 x ...``; each is a
complete :class:`~symalign.experiments.config.ExperimentConfig`, validated
before anything runs, named ``<base name>_<case label>_<key>=<value>_...``
(deterministic; a short hash replaces the parts when the name gets long).

Each run is one task calling :func:`~symalign.experiments.protocol.run_experiment`
in ``OUT/runs/<run name>``; tasks run on a local process pool (spawn context)
or as Ray tasks. Workers return their results to the driver, which alone writes
the ``runs`` table of ``OUT/sweep.sqlite``, one transaction per finished run, so
a killed sweep never leaves a partial row; re-running skips rows marked ``done``
and retries ``failed`` ones.

One module per job: :mod:`~symalign.experiments.sweep.grid` (grid files -> runs),
:mod:`~symalign.experiments.sweep.store` (the SQLite store),
:mod:`~symalign.experiments.sweep.backends` (local pool, Ray),
:mod:`~symalign.experiments.sweep.progress` (the progress bar) and
:mod:`~symalign.experiments.sweep.driver` (:func:`run_sweep`); their public names are
re-exported here.
"""

from __future__ import annotations

from symalign.experiments.sweep.backends import (LocalBackend, RayBackend, check_reachable, cpu_count,
                                                 execute_run, make_backend, set_threads, threads_per_task)
from symalign.experiments.sweep.driver import SweepSummary, check_store, run_sweep
from symalign.experiments.sweep.grid import (DICT_SECTIONS, GRID_KEYS, MAX_NAME, SECTIONS, Grid,
                                             Resources, Run, expand, load_grid, parse_grid, run_name)
from symalign.experiments.sweep.progress import RunsBar
from symalign.experiments.sweep.store import (RUNS_SUBDIR, SCHEMA, STORE_FILE, UPSERT, ResultsStore,
                                              read_rows, stored_results)

__all__ = ["DICT_SECTIONS", "GRID_KEYS", "MAX_NAME", "RUNS_SUBDIR", "SCHEMA", "SECTIONS", "STORE_FILE", "UPSERT",
           "Grid", "LocalBackend", "RayBackend", "Resources", "ResultsStore", "Run", "RunsBar", "SweepSummary",
           "check_reachable", "check_store", "cpu_count", "execute_run", "expand", "load_grid", "make_backend",
           "parse_grid", "read_rows", "run_name", "run_sweep", "set_threads", "stored_results", "threads_per_task"]
