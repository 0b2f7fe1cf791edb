r"""Sweep grids: a base experiment config, axes and cases, expanded into named runs.

See :mod:`symalign.experiments.sweep` for the grid file format. :func:`parse_grid`
validates every run's config before anything runs.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from symalign.errors import ConfigError, SymalignError
from symalign.experiments.config import ExperimentConfig, parse_config, read_toml

SECTIONS = ("name", "data", "data_options", "model", "train", "protocol")
DICT_SECTIONS = ("data_options", "model", "train", "protocol")
GRID_KEYS = ("grid", "cases", "resources")
MAX_NAME = 120


@dataclass(frozen=True)
class Resources:
    """What each task asks for: Ray's ``num_cpus``/``num_gpus``, and torch threads (``None``: per backend)."""

    cpus_per_run: float = 1
    gpus_per_run: float = 0
    threads_per_run: int | None = None

    def __post_init__(self):
        if not self.cpus_per_run > 0:
            raise ConfigError(f"[resources] cpus_per_run must be > 0, got {self.cpus_per_run}")
        if self.gpus_per_run < 0:
            raise ConfigError(f"[resources] gpus_per_run must be >= 0, got {self.gpus_per_run}")
        if self.threads_per_run is not None and (not isinstance(self.threads_per_run, int)
                                                 or self.threads_per_run < 1):
            raise ConfigError(f"[resources] threads_per_run must be a positive integer, got {self.threads_per_run!r}")


@dataclass(frozen=True)
class Run:
    """One point of the grid: its name, the overrides that made it, and its validated config."""

    name: str
    overrides: dict[str, Any]
    config: ExperimentConfig

    def config_json(self) -> str:
        """The config as canonical JSON (what the store keeps and compares)."""
        return json.dumps(self.config.to_dict(), sort_keys=True)


@dataclass
class Grid:
    """A parsed grid: the sweep name, its runs (in expansion order) and the task resources."""

    name: str
    runs: list[Run]
    resources: Resources = field(default_factory=Resources)
    source: str = "grid"


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """Nested tables -> ``{"a.b": leaf}`` (a leaf is anything that is not a table)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        path = f"{prefix}{k}"
        if isinstance(v, dict) and (path not in SECTIONS or path in DICT_SECTIONS):
            out.update(_flatten(v, path + "."))
        else:
            out[path] = v
    return out


def _axes(grid: dict, source: str) -> list[tuple[str, list]]:
    """The ``[grid]`` table as ``(dotted key, values)`` axes; tables nest (``model.pe`` == ``"model.pe"``)."""
    axes = []
    for key, values in _flatten_axes(grid).items():
        if not isinstance(values, list):
            raise ConfigError(f"{source}: [grid] {key!r} must be a list of values, got {values!r}")
        if not values:
            raise ConfigError(f"{source}: [grid] axis {key!r} is empty; give at least one value")
        _check_path(key, source)
        axes.append((key, values))
    return axes


def _flatten_axes(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten_axes(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _check_path(key: str, source: str) -> None:
    """A dotted key is ``section`` or ``section.field`` with a known section (not ``name``)."""
    parts = key.split(".")
    if key == "name":
        raise ConfigError(f"{source}: 'name' cannot vary: run names are derived from the grid (set the base name)")
    if parts[0] not in SECTIONS:
        raise ConfigError(f"{source}: unknown grid key {key!r} (section {parts[0]!r}); "
                          f"use one of {', '.join(SECTIONS)} or a dotted path like 'model.pe'")
    if len(parts) > 2 or (len(parts) == 2 and parts[0] not in DICT_SECTIONS):
        raise ConfigError(f"{source}: unknown grid key {key!r}; a key is a section or section.field, "
                          "e.g. 'data' or 'model.pe'")


def _set(d: dict, key: str, value: Any) -> None:
    """``d[section][field] = value`` for ``"section.field"`` (``d[section] = value`` for a bare section)."""
    parts = key.split(".")
    if len(parts) == 1:
        d[key] = copy.deepcopy(value)
    else:
        d.setdefault(parts[0], {})[parts[1]] = copy.deepcopy(value)


def _cases(raw: Any, source: str) -> list[tuple[str, dict[str, Any]]]:
    """``[[cases]]`` as ``(label, {dotted key: value})``; no cases -> one empty case."""
    if raw is None:
        return [("", {})]
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"{source}: [[cases]] must be a non-empty array of tables")
    out = []
    for i, case in enumerate(raw):
        if not isinstance(case, dict):
            raise ConfigError(f"{source}: case {i} must be a table")
        case = dict(case)
        label = str(case.pop("label", f"case{i}"))
        flat = _flatten(case)
        for key in flat:
            _check_path(key, f"{source}: case {label!r}")
        out.append((label, flat))
    return out


def _slug(v: Any) -> str:
    """A short, path-safe rendering of one value."""
    if isinstance(v, bool):
        s = str(v).lower()
    elif isinstance(v, (list, tuple)):
        s = "+".join(_slug(x) for x in v)
    elif isinstance(v, dict):
        s = _digest(v, 8)
    else:
        s = str(v)
    return re.sub(r"[^A-Za-z0-9.+=-]", "-", s)


def _digest(obj: Any, n: int) -> str:
    return hashlib.sha1(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:n]


def _short_keys(keys: list[str]) -> dict[str, str]:
    """The last path component of each key, or the full key where two keys share it."""
    last = [k.split(".")[-1] for k in keys]
    return {k: (s if last.count(s) == 1 else k) for k, s in zip(keys, last)}


def run_name(base: str, label: str, point: list[tuple[str, Any]], short: dict[str, str]) -> str:
    """``base[_label]_key=value_...``; a hash of the overrides when that exceeds :data:`MAX_NAME` chars."""
    parts = [base] + ([_slug(label)] if label else []) + [f"{short[k]}={_slug(v)}" for k, v in point]
    name = "_".join(parts)
    if len(name) > MAX_NAME:
        name = f"{base}_{_digest([label, point], 10)}"
    return name


def expand(base: dict, axes: list[tuple[str, list]], cases: list[tuple[str, dict]], source: str = "grid"
           ) -> list[Run]:
    """The Cartesian product ``cases x axes`` as validated runs; duplicate names raise :class:`ConfigError`."""
    base_name = str(base.get("name", "sweep"))
    short = _short_keys([k for k, _ in axes])
    runs: list[Run] = []
    seen: dict[str, dict] = {}
    for (label, case), values in itertools.product(cases, itertools.product(*(v for _, v in axes))):
        point = list(zip((k for k, _ in axes), values))
        d = copy.deepcopy(base)
        for key, value in [*case.items(), *point]:
            _set(d, key, value)
        name = run_name(base_name, label, point, short)
        overrides = {**({"case": label} if label else {}), **dict(point)}
        if name in seen:
            raise ConfigError(f"{source}: two grid points get the same run name {name!r} "
                              f"({seen[name]} and {overrides}); remove the duplicate value or relabel the case")
        seen[name] = overrides
        d["name"] = name
        try:
            cfg = parse_config(d, f"{source}: run {name!r}")
        except SymalignError as exc:  # an unknown key or value, an unknown dataset...
            raise ConfigError(f"{source}: run {name!r} (overrides {overrides}): {exc}") from exc
        runs.append(Run(name, overrides, cfg))
    return runs


def parse_grid(d: dict, source: str = "grid", default_name: str = "sweep") -> Grid:
    """Validate a grid dict (base config + ``[grid]`` + ``[[cases]]`` + ``[resources]``) and expand it."""
    for k in d:
        if k not in SECTIONS and k not in GRID_KEYS:
            raise ConfigError(f"{source}: unknown key {k!r}; allowed: {', '.join(SECTIONS + GRID_KEYS)}")
    base = {k: copy.deepcopy(v) for k, v in d.items() if k in SECTIONS}
    base.setdefault("name", default_name)
    grid = d.get("grid", {})
    if not isinstance(grid, dict):
        raise ConfigError(f"{source}: [grid] must be a table of dotted keys -> lists")
    res = d.get("resources", {})
    allowed = ("cpus_per_run", "gpus_per_run", "threads_per_run")
    for k in res:
        if k not in allowed:
            raise ConfigError(f"{source}: unknown key [resources] {k!r}; allowed: {', '.join(allowed)}")
    runs = expand(base, _axes(grid, source), _cases(d.get("cases"), source), source)
    return Grid(name=str(base["name"]), runs=runs, resources=Resources(**res), source=source)


def load_grid(path: str | Path) -> Grid:
    """Read, validate and expand a TOML grid file (nothing runs)."""
    path = Path(path)
    return parse_grid(read_toml(path, "grid"), str(path), default_name=path.stem)
