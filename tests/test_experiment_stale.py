"""Stale results are refused (issue 24): a run directory recorded with another config is never
reused or relabelled; ``--fresh`` starts over."""

from __future__ import annotations

import copy
import json

import pytest

from _cli_util import run_symalign
from symalign.errors import ConfigError
from symalign.experiments import parse_config, run_experiment

SMALL = {
    "name": "stale",
    "data": "digits",
    "model": {"family": "vit", "pe": "rope", "d_model": 16, "n_layers": 1, "n_heads": 2, "d_ff": 16,
              "patch_size": 4},
    "train": {"steps": 6, "batch_size": 16, "lr": 3e-3, "eval_every": 0, "eval_items": 32},
    "protocol": {"scopes": ["first-attention"], "seeds": [1, 2], "points": 3, "eval_items": 32,
                 "variants": ["none"]},
}


def _changed(**edits) -> dict:
    d = copy.deepcopy(SMALL)
    for path, value in edits.items():
        section, key = path.split("__")
        d[section][key] = value
    return d


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    run_experiment(parse_config(SMALL), out, progress=False)
    return out


@pytest.mark.slow
def test_changed_model_is_refused_and_config_kept(first_run):
    root = first_run / "stale"
    before = (root / "config.json").read_text()
    with pytest.raises(ConfigError, match=r"model\.d_model 16 -> 32.*train\.steps 6 -> 12.*--fresh"):
        run_experiment(parse_config(_changed(model__d_model=32, train__steps=12)), first_run, progress=False)
    assert (root / "config.json").read_text() == before


def test_changed_measurement_is_refused(first_run):
    with pytest.raises(ConfigError, match=r"results\.json was recorded with a different config.*points 3 -> 5"):
        run_experiment(parse_config(_changed(protocol__points=5)), first_run, progress=False)


def test_same_config_reuses_and_records_threads(first_run):
    res = run_experiment(parse_config(SMALL), first_run, progress=False)[0]
    assert isinstance(res["threads"], int) and res["threads"] >= 1
    assert res["config"]["model"]["d_model"] == 16


@pytest.mark.slow
def test_fresh_starts_over(tmp_path):
    run_experiment(parse_config(SMALL), tmp_path, progress=False)
    new = _changed(train__steps=8)
    res = run_experiment(parse_config(new), tmp_path, progress=False, fresh=True)[0]
    assert res["config"]["train"]["steps"] == 8
    ck = json.loads(next((tmp_path / "stale" / "base").glob("ckpt-*/config.json")).read_text())
    assert ck["train"]["steps"] == 8


def test_fresh_never_deletes_a_foreign_folder(tmp_path):
    (tmp_path / "stale").mkdir()
    (tmp_path / "stale" / "mine.txt").write_text("keep")
    with pytest.raises(ConfigError, match="not a symalign experiment run"):
        run_experiment(parse_config(SMALL), tmp_path, progress=False, fresh=True)
    assert (tmp_path / "stale" / "mine.txt").read_text() == "keep"


def test_cli_refuses_in_one_line(first_run, tmp_path, monkeypatch, capsys):
    toml = tmp_path / "stale.toml"
    lines = ['name = "stale"', 'data = "digits"', "[model]",
             'family = "vit"', 'pe = "rope"', "d_model = 32", "n_layers = 1", "n_heads = 2", "d_ff = 16",
             "patch_size = 4", "[train]", "steps = 6", "batch_size = 16", "lr = 3e-3", "eval_every = 0",
             "eval_items = 32", "[protocol]", 'scopes = ["first-attention"]', "seeds = [1, 2]", "points = 3",
             "eval_items = 32", 'variants = ["none"]']
    toml.write_text("\n".join(lines) + "\n")
    code, out, err = run_symalign(monkeypatch, capsys, "experiment", toml, "--out", first_run, "--quiet")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "model.d_model 16 -> 32" in err and "--fresh" in err and "skipping" not in out + err
