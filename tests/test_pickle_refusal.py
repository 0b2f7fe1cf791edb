"""Run folders are data, never code: optimizer state (``optim.pt``) and learned-matching resume files
are read with ``weights_only=True``; a crafted pickle is refused in one line naming the file, and
nothing it names runs (issue 33, item 14)."""

from __future__ import annotations

import pathlib

import pytest
import torch

from symalign.errors import CheckpointError


class _Crafted:
    """Unpickling this touches ``path``: the stand-in for a pickle that runs code."""

    def __init__(self, path: pathlib.Path):
        self.path = path

    def __reduce__(self):
        return (pathlib.Path.touch, (self.path,))


def _craft(where: pathlib.Path, marker: pathlib.Path) -> pathlib.Path:
    torch.save({"optimizer": _Crafted(marker), "rng": {}}, where)
    return where


TRAIN = ("train", "--family", "vit", "--data", "synthetic", "--pe", "rope", "--d-model", 16, "--layers", 1,
         "--heads", 2, "--d-ff", 32, "--patch-size", 4, "--steps", 2, "--batch-size", 4, "--quiet")


def test_a_crafted_optim_pt_is_refused_in_one_line_and_runs_nothing(tmp_path, monkeypatch, capsys):
    from _cli_util import run_symalign

    from symalign.checkpoint import load_run

    run = tmp_path / "shared-run"
    code, _, err = run_symalign(monkeypatch, capsys, *TRAIN, "--out", run)
    assert code == 0, err
    ck = load_run(run)
    saved = ck.optim_state()  # what symalign writes loads without pickled code
    assert set(saved) >= {"optimizer", "rng"} and isinstance(saved["rng"]["torch"], torch.Tensor)
    marker = tmp_path / "code-ran"
    bad = _craft(ck.path / "optim.pt", marker)
    with pytest.raises(CheckpointError) as info:
        ck.optim_state()
    msg = str(info.value)
    assert str(bad) in msg and "refused" in msg and "\n" not in msg
    assert not marker.exists()
    # through the CLI: resuming the shared run exits 2 with that one line
    code, _, err = run_symalign(monkeypatch, capsys, *TRAIN, "--out", run, "--resume")
    assert code == 2 and "refused" in err and str(bad) in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1 and not marker.exists()


def _tiny_pair():
    from _whole_util import model

    from symalign.rewrite import rewrite_model

    return rewrite_model(model("vit", "rope", seed=1)), rewrite_model(model("vit", "rope", seed=2))


def _batches(cfg):
    from _whole_util import inputs

    g = torch.Generator().manual_seed(0)
    x = inputs(cfg, n=4, seed=0)
    return [(x, torch.randint(0, cfg.n_classes, (x.shape[0],), generator=g))]


def test_learned_matching_resume_files_round_trip_and_refuse_crafted_pickles(tmp_path):
    from symalign.match.learned import learn_matching

    a, b = _tiny_pair()
    data = _batches(a.cfg)
    ck = tmp_path / "learned.pt"
    kw = {"schedule": "constant", "lr": 1e-3}  # a constant rate: the run can be extended
    learn_matching(a, b, data, steps=2, checkpoint=ck, **kw)
    res = learn_matching(a, b, data, steps=3, checkpoint=ck, **kw)  # resumes from the file written above
    assert res.start_step == 2
    marker = tmp_path / "code-ran"
    _craft(ck, marker)
    with pytest.raises(CheckpointError) as info:
        learn_matching(a, b, data, steps=3, checkpoint=ck)
    assert str(ck) in str(info.value) and "refused" in str(info.value)
    assert not marker.exists()


def test_learned_many_resume_file_refuses_crafted_pickles(tmp_path):
    from symalign.match.learned_many import learn_many

    a, b = _tiny_pair()
    ck = tmp_path / "many.pt"
    marker = tmp_path / "code-ran"
    _craft(ck, marker)
    with pytest.raises(CheckpointError) as info:
        learn_many([a, b], _batches(a.cfg), steps=2, checkpoint=ck, rounds=1)
    assert str(ck) in str(info.value) and "refused" in str(info.value)
    assert not marker.exists()
