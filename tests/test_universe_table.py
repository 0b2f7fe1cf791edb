"""benchmarks/universe_table.py: the rows of a many-model merge table, and runs of other models refused."""

import importlib.util
from pathlib import Path

import pytest

from symalign.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("universe_table", ROOT / "benchmarks" / "universe_table.py")
ut = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ut)


def run(alpha, acc, universe_loss=0.84):
    return {"args": {"alpha": alpha}, "universe": {
        "names": ["runs/a/s1", "runs/a/s2"], "models": [{"loss": 0.36, "acc": 0.87}, {"loss": 0.35, "acc": 0.875}],
        "vanilla": {"loss": 2.9, "acc": 0.1},
        "universe": {"loss": universe_loss, "acc": 0.70, "rounds": 3, "function_change": 3e-7},
        "learned-many": {"steps": 1500, "loss": 0.5, "acc": acc, "selected": "learned", "function_change": 3e-7,
                         "time_s": 290.4}}}


def test_one_row_per_model_and_merge_with_alpha():
    rows = ut.rows([run(0.1, 0.8215), run(1.0, 0.83)])
    assert [r["merge"] for r in rows] == ["model 1 alone (s1)", "model 2 alone (s2)", "vanilla average",
                                          "universe matching (3 rounds)", "learn_many", "learn_many"]
    assert [r.get("alpha") for r in rows[-2:]] == [0.1, 1.0]
    assert rows[-2]["acc"] == pytest.approx(82.15) and rows[-1]["time_s"] == 290


def test_runs_of_other_models_are_refused():
    with pytest.raises(ConfigError, match="do not share"):
        ut.rows([run(0.1, 0.82), run(1.0, 0.83, universe_loss=0.9)])


def test_the_rewritten_average_is_a_row_where_the_run_has_it():
    r = run(1.0, 0.85)
    r["universe"]["vanilla-rewritten"] = {"loss": 2.8, "acc": 0.0995}
    rows = ut.rows([r])
    assert rows[3] == {"merge": "vanilla average of the rewritten models", "loss": 2.8, "acc": pytest.approx(9.95)}


def test_width_rows_give_both_curves_and_the_ratio():
    curve = {"t": [0.0, 0.5, 1.0], "loss": [0.36, 3.17, 0.35], "acc": [0.868, 0.097, 0.872]}
    w = {"naive": {**curve, "loss_barrier": 2.815, "acc_barrier": 0.773},
         "weight": {**curve, "loss": [0.36, 0.901, 0.35], "loss_barrier": 0.585, "acc_barrier": 0.248},
         "loss_barrier_ratio_percent": 20.8, "match": {"seconds": 32.6}, "embed_change": 2.9e-7,
         "aligned_change": 3.0e-7}
    naive, weight = ut.width_rows({"widths": w})
    assert naive["mid_loss"] == 3.17 and naive["acc_barrier"] == pytest.approx(77.3) and "ratio" not in naive
    assert weight["ratio"] == 20.8 and weight["mid_loss"] == 0.901 and weight["seconds"] == 33
    with pytest.raises(ConfigError, match="no widths block"):
        ut.width_rows({})
