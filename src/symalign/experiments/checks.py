r"""What the protocol checks before it trains or reuses anything.

* :func:`check_inputs`: the dataset loads, the model config fits it, the family supports
  every scope and method asked for -- before any training;
* :func:`check_recorded` / :func:`check_reusable`: a run directory is reused only with the
  config (and seed pair, evaluation split) it was recorded with;
* :func:`discard_run`: ``--fresh`` removes a previous run directory (only one symalign wrote).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from symalign.errors import ConfigError
from symalign.experiments.config import ExperimentConfig, check_methods


def check_inputs(cfg: ExperimentConfig) -> None:
    """Everything that can be checked before training: the dataset loads, the model config fits
    it (:func:`symalign.train.fit_config`: family/task, vocabulary, positions, classes, image
    shape), and an ``hf:`` family supports every scope asked for."""
    from symalign.data import load_dataset
    from symalign.models.hf import check_model_section, is_hf_family
    from symalign.train import fit_config

    family = cfg.model.get("family", "gpt")
    if is_hf_family(family):
        check_model_section(cfg.model, cfg.protocol.scopes)
    check_methods(cfg.model, cfg.protocol)
    ds = load_dataset(cfg.data, **cfg.data_options)
    fit_config(cfg.model | {"family": family}, ds, int(cfg.train.get("context", 128)))



def check_reusable(done: dict, seeds: list[int], scope_dir: Path, eval_split: str) -> None:
    """A finished scope may only be reused for the seed pair and the evaluation split it was run
    with (older results without ``"seeds"``: the pair whose checkpoints lie beside them; without
    ``"eval_split"``: the test split)."""
    have = done.get("seeds")
    same = list(have) == list(seeds) if have is not None else all((scope_dir / f"seed{s}").is_dir() for s in seeds)
    if not same:
        raise ConfigError(f"{scope_dir / 'results.json'} holds the seed pair {have or 'of another run'}, not {seeds}; "
                          "give a second seed pair its own runs directory (--out)")
    split = done.get("eval_split", "test")
    if split != eval_split:
        raise ConfigError(f"{scope_dir / 'results.json'} was measured on the {split} split, not {eval_split}; "
                          "give each evaluation split its own runs directory (--out)")


# What the checkpoints of a run depend on: a run directory recorded with other values is stale.
TRAINING_KEYS = ("name", "data", "data_options", "model", "train")
TRAINING_PROTOCOL_KEYS = ("base_seed", "freeze")


def config_diff(old: Any, new: Any, prefix: str = "") -> list[str]:
    """The differing leaves of two JSON-like configs, as ``"model.d_model 16 -> 32"``."""
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for k in sorted(set(old) | set(new), key=str):
            out += config_diff(old.get(k), new.get(k), f"{prefix}{k}.")
        return out
    return [] if old == new else [f"{prefix.rstrip('.')} {old!r} -> {new!r}"]



def _training_part(d: dict) -> dict:
    proto = d.get("protocol") or {}
    return {**{k: d.get(k) for k in TRAINING_KEYS}, "protocol": {k: proto.get(k) for k in TRAINING_PROTOCOL_KEYS}}



def _result_part(d: dict) -> dict:
    """The config less ``protocol.scopes``, with the protocol's defaults filled in (``to_dict``
    leaves out optional settings at their defaults)."""
    from dataclasses import asdict

    from symalign.experiments.config import Protocol

    proto = {**asdict(Protocol()), **(d.get("protocol") or {})}
    return {**d, "protocol": {k: v for k, v in proto.items() if k != "scopes"}}



def _stale(what: Path, diff: list[str]) -> ConfigError:
    shown = "; ".join(diff[:3]) + (f"; and {len(diff) - 3} more" if len(diff) > 3 else "")
    return ConfigError(f"{what} was recorded with a different config ({shown}); use another --out, or --fresh "
                       "to discard the old run and start over")



ARITHMETIC_FILE = "arithmetic.json"


def check_arithmetic(root: Path) -> None:
    """Refuse to extend a run directory made in another arithmetic (:mod:`symalign.arithmetic`): its checkpoints
    and results would be mixed with this process's, and the thread count aside, the arithmetic is what decides
    the numbers. ``root/arithmetic.json`` records the mode; a run made before it was recorded was native."""
    from symalign.arithmetic import active

    path, now = root / ARITHMETIC_FILE, active()
    try:
        old = json.loads(path.read_text()).get("mode", "native") if path.is_file() else "native"
    except ValueError:
        old = "native"
    if old != now:
        raise ConfigError(f"{root} was made in {old} arithmetic and this run is in {now} arithmetic; use "
                          f"another --out, --fresh to start over, or run in {old} arithmetic "
                          "(SYMALIGN_ARITHMETIC, or symalign demo --arithmetic)")


def check_recorded(cfg: ExperimentConfig, root: Path) -> None:
    """Refuse to reuse a run directory whose checkpoints or results were made with another config.

    ``root/config.json`` must agree with ``cfg`` on everything the checkpoints depend on
    (:data:`TRAINING_KEYS`, ``protocol.base_seed``/``freeze``); each existing
    ``root/<scope>/results.json`` on the whole config except ``protocol.scopes`` (results
    written before configs were recorded in them: the seed pair and evaluation split,
    :func:`check_reusable`).
    """
    new = cfg.to_dict()
    recorded = root / "config.json"
    if recorded.is_file():
        try:
            old = json.loads(recorded.read_text())
        except ValueError:
            old = {}
        diff = config_diff(_training_part(old), _training_part(new))
        if diff:
            raise _stale(root, diff)
        check_arithmetic(root)
    for scope in cfg.protocol.scopes:
        res_path = root / scope / "results.json"
        if not res_path.is_file():
            continue
        done = json.loads(res_path.read_text())
        check_reusable(done, cfg.protocol.seeds, root / scope, cfg.protocol.eval_split)
        if "config" in done:
            diff = config_diff(_result_part(done["config"]), _result_part(new))
            if diff:
                raise _stale(res_path, diff)



def discard_run(root: Path) -> None:
    """``--fresh``: remove a previous run directory -- only one symalign wrote (it holds ``config.json``
    with a ``protocol`` section), never an arbitrary folder."""
    import shutil

    if not root.exists():
        return
    try:
        ok = root.is_dir() and "protocol" in json.loads((root / "config.json").read_text())
    except (OSError, ValueError):
        ok = False
    if not ok:
        raise ConfigError(f"{root} is not a symalign experiment run (no config.json with a protocol); "
                          "remove it yourself or use another --out")
    shutil.rmtree(root)
