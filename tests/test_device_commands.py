"""``--device`` on ``demo`` and ``sweep``: the training device reaches every run, the first progress line names it,
and a device this machine lacks is refused in one line before any training."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from _cli_util import run_symalign
from symalign.errors import ConfigError

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")

BASE = {"name": "g", "data": "digits",
        "model": {"family": "vit", "d_model": 16, "n_layers": 1, "n_heads": 2, "d_ff": 32, "patch_size": 4},
        "train": {"steps": 3, "batch_size": 32, "eval_every": 0},
        "protocol": {"scopes": ["first-attention"], "points": 2, "eval_items": 32, "variants": ["full"]}}


GRID_TOML = """name = "g"
data = "digits"
[model]
family = "vit"
d_model = 16
n_layers = 1
n_heads = 2
d_ff = 32
patch_size = 4
[train]
steps = 3
batch_size = 32
eval_every = 0
[protocol]
scopes = ["first-attention"]
points = 2
eval_items = 32
variants = ["full"]
[grid]
"protocol.seeds" = [[1, 2]]
"""


def _grid_file(tmp_path) -> str:
    path = tmp_path / "g.toml"
    path.write_text(GRID_TOML)
    return str(path)


# -- demo -----------------------------------------------------------------------------------------------------------

def test_demo_passes_the_device_and_names_it_first(tmp_path, monkeypatch, capsys):
    seen = {}

    def fake_run_demo(out, **kw):
        seen.update(kw)
        raise ConfigError("stopped by the test")

    monkeypatch.setattr("symalign.experiments.demo.run_demo", fake_run_demo)
    code, out, err = run_symalign(monkeypatch, capsys, "demo", "--no-tour", "--device", "cpu", "-o", tmp_path / "d")
    assert code == 2 and "stopped by the test" in err
    assert seen["device"] == "cpu"
    assert out.strip().splitlines()[0] == "device: cpu"
    code, out, err = run_symalign(monkeypatch, capsys, "demo", "--no-tour", "-o", tmp_path / "d")
    assert seen["device"] is None  # the default: training where auto puts it, the curves on the CPU
    assert out.strip().splitlines()[0].startswith("device: ")


@no_cuda
@pytest.mark.parametrize("command", ["demo", "sweep"])
def test_device_cuda_without_cuda_is_refused_before_training(command, tmp_path, monkeypatch, capsys):
    def boom(*a, **k):
        raise AssertionError("training started before the device was checked")

    monkeypatch.setattr("symalign.train.train", boom)
    args = ["--no-tour", "-o", tmp_path / "d"] if command == "demo" else [_grid_file(tmp_path), "-o", tmp_path / "s"]
    code, out, err = run_symalign(monkeypatch, capsys, command, *args, "--device", "cuda")
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and "use --device cpu" in lines[0], err
    assert not (tmp_path / "d").exists() and not (tmp_path / "s").exists()


def test_demo_device_reaches_every_experiment(monkeypatch, tmp_path):
    from symalign.experiments import demo

    seen = []

    def fake(cfg, out, **kw):
        seen.append(kw.get("device"))
        raise ConfigError("stop")

    monkeypatch.setattr(demo, "run_experiment", fake)
    with pytest.raises(ConfigError):
        demo.run_demo(tmp_path, steps=1, progress=False, device="cpu")
    assert seen == ["cpu"]
    assert demo.training_device("cpu") == {"device": "cpu"}


# -- sweep ----------------------------------------------------------------------------------------------------------

def test_sweep_device_is_recorded_in_every_run_config():
    from symalign.experiments.sweep import parse_grid
    from symalign.experiments.sweep.driver import with_device

    g = parse_grid({**copy.deepcopy(BASE), "grid": {"model.pe": ["sinusoidal", "rope"]}})
    assert with_device(g, None) is g
    for run in with_device(g, "cuda").runs:
        assert run.config.protocol.device == "cuda" and run.config.to_dict()["protocol"]["device"] == "cuda"
    same = with_device(g, "cpu")  # the default device: the recorded configs (and the store's) are unchanged
    assert [r.config_json() for r in same.runs] == [r.config_json() for r in g.runs]
    with pytest.raises(ConfigError, match="protocol.device"):
        with_device(g, "tpu")


def test_sweep_gpus_per_run_reaches_ray_and_is_refused_without_it():
    from symalign.commands.sweep import gpu_resources, run_device_of
    from symalign.experiments.sweep import parse_grid
    from symalign.experiments.sweep.backends import make_backend

    g = parse_grid({**copy.deepcopy(BASE), "grid": {"model.pe": ["rope"]}})
    res = g.resources
    assert gpu_resources(res, None, "cuda", "10.0.0.1:6379").gpus_per_run == 1  # cuda on Ray: one GPU per run
    assert gpu_resources(res, 0.5, "cuda", "local").gpus_per_run == 0.5
    assert gpu_resources(res, None, "cpu", "local").gpus_per_run == 0
    assert gpu_resources(res, None, None, None) is res
    with pytest.raises(ConfigError, match="use it with --ray"):
        gpu_resources(res, 1, "cuda", None)
    with pytest.raises(ConfigError, match="0 or more"):
        gpu_resources(res, -1, "cuda", "local")
    # a cluster's devices are elsewhere: only the form is checked here
    assert run_device_of("cuda:1", "10.0.0.1:6379") == "cuda" and run_device_of(None, None) is None
    with pytest.raises(ConfigError, match="unknown --device"):
        run_device_of("gpu", "10.0.0.1:6379")
    from dataclasses import replace

    b = make_backend(replace(g, resources=gpu_resources(res, None, "cuda", "local")), 1, "local", "cuda")
    assert b.device == "cuda" and b.resources.gpus_per_run == 1 and "1 GPU" in b.describe()
    assert "device: cuda" in b.describe()
    assert "device: cpu" in make_backend(g, 1, None, "cpu").describe()


def test_sweep_task_runs_the_experiment_on_the_device(monkeypatch, tmp_path):
    from symalign.experiments.sweep import parse_grid
    from symalign.experiments.sweep.backends import execute_run

    seen = {}

    def fake(cfg, runs_dir, progress=True, device=None, **kw):
        seen["device"] = device
        return []

    monkeypatch.setattr("symalign.experiments.protocol.run_experiment", fake)
    g = parse_grid({**copy.deepcopy(BASE), "grid": {"model.pe": ["rope"]}})
    out = execute_run(g.runs[0].config.to_dict(), str(tmp_path), 1, "cpu")
    assert out["ok"] and seen["device"] == "cpu"


def test_sweep_gpus_per_run_without_ray_exits_2(tmp_path, monkeypatch, capsys):
    code, out, err = run_symalign(monkeypatch, capsys, "sweep", _grid_file(tmp_path), "-o", tmp_path / "s",
                                  "--gpus-per-run", "1")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--ray" in err
    assert not (tmp_path / "s").exists()


@pytest.mark.slow
def test_sweep_device_cpu_runs_there_and_says_so(tmp_path, monkeypatch, capsys):
    code, out, err = run_symalign(monkeypatch, capsys, "sweep", _grid_file(tmp_path), "-o", tmp_path / "s",
                                  "--device", "cpu", "--workers", "1", "--threads", "1", "--json", "--quiet")
    assert code == 0, err
    assert json.loads(out)["done"] == 1
    from symalign.experiments.sweep import read_rows

    rows = read_rows(tmp_path / "s" / "sweep.sqlite")
    (row,) = rows.values()
    assert json.loads(row["config"])["protocol"].get("device", "cpu") == "cpu"
    code, out, err = run_symalign(monkeypatch, capsys, "sweep", _grid_file(tmp_path), "-o", tmp_path / "s",
                                  "--device", "cpu")
    assert code == 0 and err.strip().splitlines()[0].endswith("device: cpu"), err
