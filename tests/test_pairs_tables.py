"""The seed-pair aggregation of the benchmark table scripts: means, sample stds, the paper's numbers."""

from __future__ import annotations

import importlib.util
import json
import statistics
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_pair_rows_mean_std_and_paper() -> None:
    rt = _load("results_table")
    rows = [{"experiment": "e", "scope": "s", "seeds": f"{i}-{i + 1}", "naive": 1.0 + i, "none": 80.0 + i,
             "orthogonal": 12.0, "full": f} for i, f in zip((1, 3, 5), (10.0, 20.0, 33.0))]
    rows.append({"experiment": "e", "scope": "t", "seeds": "1-2", "naive": 2.0, "full": 5.0})
    agg = {(r["experiment"], r["scope"]): r for r in rt.pair_rows(rows)}
    s = agg[("e", "s")]
    assert s["pairs"] == 3 and s["seeds"] == "1-2, 3-4, 5-6"
    assert s["full_mean"] == pytest.approx(21.0)
    assert s["full_std"] == pytest.approx(statistics.stdev([10.0, 20.0, 33.0]))
    assert s["full_per_pair"] == "10.0, 20.0, 33.0" and s["full_pm"] == "21.0 ± 11.5"
    assert s["full_paper"] == "7-12 %" and s["orthogonal_std"] == 0.0
    one = agg[("e", "t")]
    assert one["pairs"] == 1 and one["full_std"] is None and one["full_pm"] == "5.0"


def test_pair_rows_carry_the_learned_variant_without_a_paper_number() -> None:
    """``learned`` (the project's data-driven stage 2) is aggregated like the others; the paper has no such row."""
    rt = _load("results_table")
    rows = [{"experiment": "e", "scope": "s", "seeds": f"{i}-{i + 1}", "naive": 1.0, "full": 9.0, "learned": x}
            for i, x in zip((1, 3, 5), (1.0, 2.0, 6.0))]
    (agg,) = rt.pair_rows(rows)
    assert agg["learned_per_pair"] == "1.0, 2.0, 6.0" and agg["learned_pm"] == "3.0 ± 2.6"
    assert agg["learned_paper"] == "-" and agg["full_paper"] == "7-12 %"


def test_seed002_summary_cells() -> None:
    st = _load("seed002_table")
    rows = [{"seeds": "1-2", "vanilla": 2.0, "weight": 0.5, "weight_pct": 25.0},
            {"seeds": "3-4", "vanilla": 1.0, "weight": 0.3, "weight_pct": 30.0}]
    agg = st.summarise("x", rows)
    assert agg["pairs"] == 2 and agg["vanilla_mean"] == pytest.approx(1.5)
    assert agg["weight_pct_std"] == pytest.approx(statistics.stdev([25.0, 30.0]))
    assert agg["weight_cell"] == "0.400 ± 0.141 (27.5 ± 3.5 %)"
    assert "learned_cell" not in agg


def test_seed002_reuse_keeps_rows_of_the_same_recipe_and_refuses_another(tmp_path) -> None:
    st = _load("seed002_table")
    row = {"experiment": "x", "seeds": "1-2", "vanilla": 2.0, "weight": 0.5, "weight_pct": 25.0}
    f = tmp_path / "old.json"
    f.write_text(json.dumps({"steps": 1500, "rows": [row]}))  # an older file: batch size and stream seed defaulted
    recipe = {"steps": 1500, "batch_size": st.DEFAULTS["batch_size"], "stream_seed": st.DEFAULTS["stream_seed"]}
    assert st.reusable([f], recipe, ["weight"]) == {("x", "1-2"): row}
    with pytest.raises(SystemExit, match="rerun without --reuse"):
        st.reusable([f], {**recipe, "steps": 6000}, ["weight"])
    with pytest.raises(SystemExit, match="rerun without --reuse"):
        st.reusable([f], recipe, ["weight", "learned"])


def test_stage1_rank_reuse_keeps_rows_whose_runs_are_gone() -> None:
    """``--reuse`` rows of requested experiments/scopes stay when no run folder holds them; others are dropped."""
    s1 = _load("stage1_rank")
    new = [{"experiment": "b", "scope": "first-attention", "seeds": "1,2", "rank": 1}]
    old = [{"experiment": "a", "scope": "first-attention", "seeds": "1,2", "rank": 3},
           {"experiment": "b", "scope": "first-attention", "seeds": "1,2", "rank": 9},  # recomputed: new wins
           {"experiment": "a", "scope": "all-attention", "seeds": "1,2", "rank": 2},  # scope not requested
           {"experiment": "c", "scope": "first-attention", "seeds": "1,2", "rank": 5}]  # experiment not requested
    out = s1.kept_without_runs(new, old, ["a", "b"], ["first-attention"])
    assert [(r["experiment"], r["rank"]) for r in out] == [("a", 3), ("b", 1)]


def test_residual_ablation_summary_counts_pairs_lowered_by_the_residual() -> None:
    ra = _load("residual_ablation")
    rows = [{"experiment": "x", "variant": v, "residual_group": "O(4)", "before_pct": b, "after_pct": a}
            for v, _, _ in ra.VARIANTS for b, a in ((100.0, 20.0), (90.0, 95.0))]
    out = ra.summarise(rows)
    assert [s["variant"] for s in out] == [v for v, _, _ in ra.VARIANTS]
    s = out[0]
    assert s["pairs"] == 2 and s["lower_after"] == "1 of 2" and s["before_mean"] == pytest.approx(95.0)
    assert s["after_std"] == pytest.approx(statistics.stdev([20.0, 95.0]))
    assert s["before_cell"] == f"95.0 ± {statistics.stdev([100.0, 90.0]):.1f} %"


def test_learned_summary_counts_pairs_and_takes_the_steps_from_config_or_command(tmp_path) -> None:
    """Each cell of the summary comes from its source file; steps from the config or ``--learned-steps``."""
    ls = _load("learned_summary")
    assert ls.learned_steps("vit-fmnist-rope-deep", "symalign experiment ...") == 500
    assert ls.learned_steps("vit-digits-rope", "symalign experiment ...") == 6000
    assert ls.learned_steps("vit-digits-rope", "symalign experiment ... --learned-steps 250 --threads 1") == 250
    rt = _load("results_table")
    rows = [{"experiment": "vit-digits-rope", "scope": "s", "seeds": f"{i}-{i + 1}", "naive": 1.0, "full": f,
             "learned": x} for i, f, x in zip((1, 3, 5), (30.0, 12.0, 8.0), (13.0, 4.0, 9.0))]
    src = tmp_path / "r.json"
    src.write_text(json.dumps({"provenance": {"command": "x", "commit": "abcdef0123456789"},
                               "tables": {"pairs": {"rows": rt.pair_rows(rows)}}}))
    (row,) = ls.rows_of(str(src))
    assert row["pairs"] == 3 and row["steps"] == 6000 and row["commit"] == "abcdef0123"
    assert row["full_in"] == "2 of 3" and row["learned_in"] == "2 of 3" and row["lower"] == "2 of 3"
    assert row["full_pm"] == "16.7 ± 11.7" and row["learned_pm"] == "**8.7 ± 4.5**"


def test_training_runs_row_shows_the_last_evaluation_with_the_earlier_ones() -> None:
    tr = _load("training_runs")
    hist = [{"step": s, "val_loss": v, "tok_per_s": r} for s, v, r in ((500, 1.81, 3000.0), (1000, 1.52, 5000.0))]
    meta = {"metrics": {"val_loss": 1.52, "test_loss": 1.45, "train_seconds": 1234.4}, "history": hist,
            "step": 1000, "seed": 0, "model": {}, "train": {}, "data": {}}
    r = tr.row(meta, "GPT", "RoPE")
    assert r["val"] == "**1.520** nats/byte (1.810 @500)" and r["test"] == "1.450"
    assert r["wall"] == "1234 s (4,000 tok/s)"
    hist = [{"step": 430, "val_accuracy": 0.79, "val_loss": 0.6, "img_per_s": 600.0},
            {"step": 1300, "val_accuracy": 0.86, "val_loss": 0.4, "img_per_s": 600.0}]
    meta = {"metrics": {"val_accuracy": 0.86, "test_accuracy": 0.858, "train_seconds": 300.0}, "history": hist,
            "step": 1300, "seed": 0, "model": {}, "train": {}, "data": {}}
    r = tr.row(meta, "ViT", "RoPE")
    assert r["val"] == "**86.0 %** (79.0 @430)" and r["test"] == "85.8 %"
