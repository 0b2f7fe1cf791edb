"""``symalign demo``: the keys of results.json, and stale runs refused (issue 24). Tiny models
(the demo's own sizes are set in :mod:`symalign.experiments.demo`)."""

from __future__ import annotations

import json

import pytest

from _cli_util import run_symalign
from symalign.errors import ConfigError
from symalign.experiments import demo

TINY = {"family": "vit", "d_model": 8, "n_layers": 1, "n_heads": 2, "d_ff": 8, "patch_size": 4, "pooling": "cls"}
MAIN_KEYS = ("naive_loss_barrier", "aligned_loss_barrier", "barrier_ratio_percent", "naive_acc_barrier",
             "aligned_acc_barrier")


@pytest.fixture(scope="module")
def tiny_demo(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setattr(demo, "MODEL", TINY)
    out = tmp_path_factory.mktemp("demo")
    summary = demo.run_demo(out, steps=3, learned_steps=2, progress=False)
    yield out, summary, mp
    mp.undo()


@pytest.mark.slow
def test_results_json_keys(tiny_demo):
    out, summary, _ = tiny_demo
    on_disk = json.loads((out / "results.json").read_text())
    assert set(on_disk["encodings"]) == {"sinusoidal", "rope"}
    for d in on_disk["encodings"].values():
        for k in MAIN_KEYS:
            assert k in d
        assert set(d["stage2_ablation_ratio_percent"]) == {"none", "orthogonal", "full", "learned"}
    assert {(r["encoding"], r["scope"]) for r in on_disk["rows"]} >= {
        ("rope", "first-attention"), ("rope", "all-attention"), ("sinusoidal", "first-attention"), ("rope", "full")}
    w = on_disk["whole_model"]
    for k in ("acc_A", "acc_B", "merged_naive_acc", "merged_aligned_acc", "merged_learned_acc"):
        assert 0.0 <= w[k] <= 1.0
    assert on_disk["seed_pairs"] == 1 and on_disk["test_items"] == 449 and on_disk["threads"] >= 1
    assert (out / "curves.png").stat().st_size > 1000 and "merged" in (out / "report.md").read_text()


def test_other_steps_are_refused(tiny_demo):
    out, summary, _ = tiny_demo
    before = (out / "results.json").read_text()
    with pytest.raises(ConfigError, match=r"train\.steps 3 -> 5.*--fresh"):
        demo.run_demo(out, steps=5, learned_steps=2, progress=False)
    assert (out / "results.json").read_text() == before


def test_cli_refuses_in_one_line(tiny_demo, monkeypatch, capsys):
    out, _, _ = tiny_demo
    code, stdout, err = run_symalign(monkeypatch, capsys, "demo", "--no-tour", "--steps", "5", "--learned-steps",
                                     "2", "-o", out)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--fresh" in err, err


def test_another_arithmetic_is_refused(tiny_demo, monkeypatch):
    """A run folder made in native arithmetic is not extended in portable arithmetic (nor the reverse): the
    arithmetic decides the numbers, as the settings do."""
    from symalign import arithmetic

    out, _, _ = tiny_demo
    before = (out / "results.json").read_text()
    for k, v in arithmetic.PORTABLE_ENV.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError, match="made in native arithmetic and this run is in portable arithmetic"):
        demo.run_demo(out, steps=3, learned_steps=2, progress=False)
    assert (out / "results.json").read_text() == before
