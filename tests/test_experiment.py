"""The experiment protocol end to end on tiny models: results, resumption, reports, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from _whole_util import check_whole_model_scopes
from symalign import lmc
from symalign.errors import SymalignError
from symalign.experiments import parse_config, run_experiment
from symalign.experiments.report import write_report

pytestmark = pytest.mark.slow  # trains models / starts Ray: `pytest -m "not slow"` skips it

TINY = {
    "name": "tiny",
    "data": "digits",
    "model": {"family": "vit", "pe": "rope", "d_model": 16, "n_layers": 2, "n_heads": 2, "d_ff": 32,
              "patch_size": 4},
    "train": {"steps": 30, "batch_size": 32, "lr": 3e-3, "eval_every": 0},
    "protocol": {"scopes": ["first-attention"], "seeds": [1, 2], "points": 3, "eval_items": 64,
                 "variants": ["orthogonal", "full"], "stage1_ablation": True},
}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    res = run_experiment(parse_config(TINY), out, progress=False)
    return out, res


def test_protocol_writes_results_and_aligned_function_is_unchanged(tiny_run):
    out, (res,) = tiny_run
    path = out / "tiny" / "first-attention" / "results.json"
    on_disk = json.loads(path.read_text())
    assert on_disk["scope"] == "first-attention" and on_disk["pe"] == "rope"
    assert set(on_disk["variants"]) == {"orthogonal", "full", "full-no-stage1"}
    for v in on_disk["variants"].values():
        assert v["function_change"] <= 1e-4
        c = v["curve"]
        assert c["loss"][0] == pytest.approx(on_disk["naive"]["loss"][0], rel=1e-9)  # same A endpoint
        assert c["loss"][-1] == pytest.approx(on_disk["naive"]["loss"][-1], rel=1e-4)  # B' ~ B
    assert (out / "tiny" / "first-attention" / "curves.png").stat().st_size > 1000
    assert on_disk["stage1"][0]["rank"] >= 1 and on_disk["stage1"][0]["n_permutations"] == 2
    assert "tiny" in (out / "summary.md").read_text()


def test_rerun_skips_finished_work(tiny_run):
    out, (res,) = tiny_run
    path = out / "tiny" / "first-attention" / "results.json"
    before = path.stat().st_mtime_ns
    res2 = run_experiment(parse_config(TINY), out, progress=False)
    assert path.stat().st_mtime_ns == before
    assert res2[0]["naive"] == res["naive"]


def test_interrupted_scope_resumes(tiny_run, tmp_path):
    """Delete the results of a finished scope: the rerun recomputes them from the checkpoints."""
    out, (res,) = tiny_run
    path = out / "tiny" / "first-attention" / "results.json"
    saved = path.read_text()
    path.unlink()
    try:
        (res2,) = run_experiment(parse_config(TINY), out, progress=False)
        assert res2["naive"]["loss"] == pytest.approx(res["naive"]["loss"], rel=1e-12)
    finally:
        path.write_text(saved)


def test_report(tiny_run):
    out, _ = tiny_run
    rep = write_report(out)
    text = rep.read_text()
    assert "| experiment |" in text and "curves.png" in text


def test_report_errors(tmp_path):
    with pytest.raises(SymalignError, match="no results"):
        write_report(tmp_path)
    with pytest.raises(SymalignError, match="no such directory"):
        write_report(tmp_path / "missing")


def test_curve_refuses_different_architectures(tiny_run):
    from symalign.models import build_model

    out, _ = tiny_run
    a = build_model({**TINY["model"], "image_size": 8, "n_classes": 10, "max_len": 8}, seed=0)
    b = build_model({**TINY["model"], "d_model": 32, "image_size": 8, "n_classes": 10, "max_len": 8}, seed=0)
    with pytest.raises(SymalignError, match="shape"):
        lmc.curve(a, lmc.full_state(a), lmc.full_state(b), lambda: [(torch.zeros(1, 1, 8, 8), torch.zeros(1).long())])


def test_block_and_full_scopes_use_whole_model_matching(tmp_path):
    """first-block aligns attention + FF of block 0; full rewrites the norms and aligns the residual
    stream too. B' computes B's function in every case."""
    cfg = {**TINY, "name": "tiny-whole", "model": {**TINY["model"], "pe": "learned"},
           "protocol": {**TINY["protocol"], "scopes": ["first-block", "full"], "variants": ["full"],
                        "stage1_ablation": False}}
    check_whole_model_scopes(run_experiment(parse_config(cfg), tmp_path, progress=False))


def test_full_scope_runs_seed002_methods(tmp_path):
    """protocol.methods on the full scope: weight / activation / learned matching each give a curve on
    the same test batches; learned matching is never worse than weight matching on its selection
    batches, and every aligned B' computes B's function."""
    cfg = {**TINY, "name": "tiny-methods", "model": {**TINY["model"], "n_layers": 1},
           "protocol": {**TINY["protocol"], "scopes": ["model"], "variants": ["full"], "stage1_ablation": False,
                        "methods": ["weight", "activation", "learned"], "learned_steps": 4,
                        "method_batch_size": 16, "learned_lambda": [0.4, 0.6]}}
    (res,) = run_experiment(parse_config(cfg), tmp_path, progress=False)
    assert res["scope"] == "full" and set(res["methods"]) == {"weight", "activation", "learned"}
    assert "U(0.4, 0.6)" in res["methods"]["learned"]["match"]["notes"][0]  # protocol.learned_lambda is used
    naive = res["naive"]["loss"]
    for m in res["methods"].values():
        assert m["function_change"] <= 1e-4
        assert m["curve"]["loss"][0] == pytest.approx(naive[0], rel=1e-4)
        assert m["curve"]["loss"][-1] == pytest.approx(naive[-1], rel=1e-4)
    assert res["methods"]["weight"]["curve"]["loss_barrier"] == pytest.approx(
        res["variants"]["full"]["curve"]["loss_barrier"], rel=1e-6, abs=1e-9)
    summary = (tmp_path / "summary.csv").read_text()
    assert "learned-matching_loss_barrier" in summary


def test_learned_variant_refines_full_stage2_on_attention_scopes(tmp_path):
    """variant "learned": the full two-stage result refined by learned matching over the scope's
    attention spaces only -- an exact symmetry (B' computes B's function), never worse than its
    start on the validation batches, resumable, and recorded like any other variant."""
    cfg = {**TINY, "name": "tiny-learned",
           "protocol": {**TINY["protocol"], "scopes": ["all-attention"], "variants": ["full", "learned"],
                        "stage1_ablation": False, "learned_steps": 4, "method_batch_size": 16}}
    (res,) = run_experiment(parse_config(cfg), tmp_path, progress=False)
    assert set(res["variants"]) == {"full", "learned"}
    learned = res["variants"]["learned"]
    assert learned["function_change"] <= 1e-4
    m = learned["match"]
    assert m["method"] == "learned" and m["steps"] == 4 and m["objective"] <= m["objective_init"]
    assert set(m["spaces"]) == set(res["spaces_aligned"])  # the scope's spaces, nothing else
    assert (tmp_path / "tiny-learned" / "all-attention" / "learned-stage2.pt").exists()
    assert learned["curve"]["loss"][-1] == pytest.approx(res["naive"]["loss"][-1], rel=1e-4)
    assert "learned_ratio_percent" in (tmp_path / "summary.csv").read_text()


def test_learned_variant_on_a_gpt_with_tied_embeddings(tmp_path):
    """The built-in GPT ties its head to the token embedding; learned matching evaluates the
    interpolated model with each tied parameter once (functional_call refuses two values)."""
    cfg = {"name": "tiny-gpt-learned", "data": "synthetic", "data_options": {"kind": "lm"},
           "model": {"family": "gpt", "pe": "rope", "d_model": 16, "n_layers": 2, "n_heads": 2, "d_ff": 32},
           "train": {"steps": 20, "batch_size": 8, "context": 16, "lr": 3e-3, "eval_every": 0},
           "protocol": {"scopes": ["first-attention"], "seeds": [1, 2], "points": 3, "eval_items": 8,
                        "variants": ["full", "learned"], "learned_steps": 3, "method_batch_size": 4}}
    (res,) = run_experiment(parse_config(cfg), tmp_path, progress=False)
    assert res["variants"]["learned"]["function_change"] <= 1e-4
    assert res["variants"]["learned"]["match"]["steps"] == 3


def _toml(cfg: dict) -> str:
    def val(v):
        return json.dumps(v) if not isinstance(v, bool) else str(v).lower()
    lines = [f"{k} = {val(v)}" for k, v in cfg.items() if not isinstance(v, dict)]
    for sec, body in cfg.items():
        if isinstance(body, dict):
            lines += [f"[{sec}]"] + [f"{k} = {val(v)}" for k, v in body.items()]
    return "\n".join(lines) + "\n"


def test_cli_seeds_override_trains_another_pair(tmp_path, monkeypatch, capsys):
    """``--seeds 3 --seeds 4`` trains and aligns the pair (3, 4); a repeated seed is refused (exit 2)."""
    from _cli_util import run_symalign

    cfg = tmp_path / "tiny.toml"
    small = {**TINY, "protocol": {**TINY["protocol"], "variants": ["full"], "stage1_ablation": False}}
    cfg.write_text(_toml(small))
    code, out, err = run_symalign(monkeypatch, capsys, "experiment", cfg, "--out", tmp_path / "p2", "--seeds", 3,
                                  "--seeds", 4, "--json", "--quiet")
    assert code == 0, err
    run = tmp_path / "p2" / "tiny" / "first-attention"
    assert (run / "seed3").is_dir() and (run / "seed4").is_dir() and not (run / "seed1").exists()
    assert json.loads(out)[0]["scope"] == "first-attention"
    assert json.loads((run / "results.json").read_text())["seeds"] == [3, 4]
    code, _, err = run_symalign(monkeypatch, capsys, "experiment", cfg, "--out", tmp_path / "p3", "--seeds", 5,
                                "--seeds", 5)
    assert code == 2 and "protocol.seeds" in err and not (tmp_path / "p3").exists()
    # the finished pair (3, 4) is not passed off as another pair's result
    code, _, err = run_symalign(monkeypatch, capsys, "experiment", cfg, "--out", tmp_path / "p2", "--quiet")
    assert code == 2 and "seed pair [3, 4], not [1, 2]" in err and "--out" in err
    assert not (run / "seed1").exists()


def test_cli_variant_and_learned_steps_override(tmp_path, monkeypatch, capsys):
    """``--variant`` replaces protocol.variants (validated: an unknown one exits 2 before any training);
    ``--learned-steps`` sets the learned variant's steps."""
    from _cli_util import run_symalign

    cfg = tmp_path / "tiny.toml"
    cfg.write_text(_toml({**TINY, "protocol": {**TINY["protocol"], "stage1_ablation": False,
                                               "method_batch_size": 16}}))
    code, _, err = run_symalign(monkeypatch, capsys, "experiment", cfg, "--out", tmp_path / "bad", "--variant", "best")
    assert code == 2 and "protocol.variants" in err and "learned" in err and not (tmp_path / "bad").exists()
    code, out, err = run_symalign(monkeypatch, capsys, "experiment", cfg, "--out", tmp_path / "ok", "--variant", "full",
                                  "--variant", "learned", "--learned-steps", 2, "--json", "--quiet")
    assert code == 0, err
    res = json.loads((tmp_path / "ok" / "tiny" / "first-attention" / "results.json").read_text())
    assert list(res["variants"]) == ["full", "learned"] and res["variants"]["learned"]["match"]["steps"] == 2
    assert "learned_ratio_percent" in json.loads(out)[0]


def test_report_pairs_table_mean_and_std(tmp_path):
    """Two or more seed pairs of one experiment and scope give a row with the ratio per pair, the mean and
    the sample standard deviation; a scope with one pair gives none."""
    from symalign.experiments.report import pairs_table

    def res(seeds, ratio, scope="all-attention"):
        return {"experiment": "e", "scope": scope, "seeds": seeds,
                "variants": {"full": {"loss_barrier_ratio_percent": ratio}}}

    legacy = tmp_path / "e" / "all-attention"
    for s in (1, 2):
        (legacy / f"seed{s}").mkdir(parents=True)
    old = {"experiment": "e", "scope": "all-attention", "_path": str(legacy),
           "variants": {"full": {"loss_barrier_ratio_percent": 10.0}}}  # no "seeds": from the folders
    rows = pairs_table([old, res([3, 4], 20.0), res([5, 6], 30.0), res([1, 2], 5.0, "first-attention")])
    assert len(rows) == 1
    (row,) = rows
    assert row["seed pairs"] == "1-2, 3-4, 5-6" and row["full % per pair"] == "10.0, 20.0, 30.0"
    assert row["mean full %"] == pytest.approx(20.0) and row["std"] == pytest.approx(10.0)


def test_report_has_a_seed_pairs_table_per_stage2_variant(tmp_path):
    """`symalign report`: every stage-2 variant measured on two or more pairs gets its own seed-pairs
    table (here `full` and `learned`), with the ratio per pair; one measured on a single pair gets none."""
    from symalign.experiments.report import write_report

    def variant(ratio):
        return {"loss_barrier_ratio_percent": ratio, "curve": {"loss_barrier": ratio / 100, "acc_barrier": 0.0}}

    for pair, full, learned in (((1, 2), 16.0, 3.5), ((3, 4), 11.0, 3.0)):
        res = {"experiment": "e", "family": "vit", "data": "d", "pe": "rope", "scope": "all-attention",
               "seeds": list(pair), "endpoints": {"A": {"acc": 0.9}, "B": {"acc": 0.9}},
               "naive": {"loss_barrier": 1.0, "acc_barrier": 0.3},
               "variants": {"full": variant(full), "learned": variant(learned)}}
        if pair == (1, 2):
            res["variants"]["orthogonal"] = variant(17.0)
        d = tmp_path / f"p{pair[0]}" / "e" / "all-attention"
        d.mkdir(parents=True)
        (d / "results.json").write_text(json.dumps(res))
    text = write_report(tmp_path).read_text()
    assert "across pairs (stage 2 `full`)" in text and "across pairs (stage 2 `learned`)" in text
    assert "stage 2 `orthogonal`" not in text
    learned = text.split("stage 2 `learned`")[1]
    assert "3.5, 3.0" in learned and "16.0, 11.0" not in learned


def test_report_follows_linked_run_folders_once(tmp_path):
    """A runs tree assembled from links to other runs directories is collected; a link cycle neither
    loops nor counts a result twice."""
    from symalign.experiments.report import collect

    res = {"experiment": "e", "scope": "first-attention", "naive": {}, "variants": {}}
    for pair in ("p2", "p3"):
        d = tmp_path / pair / "e" / "first-attention"
        d.mkdir(parents=True)
        (d / "results.json").write_text(json.dumps(res))
    tree = tmp_path / "all"
    tree.mkdir()
    for pair in ("p2", "p3"):
        (tree / pair).symlink_to(tmp_path / pair, target_is_directory=True)
    (tmp_path / "p2" / "loop").symlink_to(tree, target_is_directory=True)  # p2/loop -> all -> p2 ...
    paths = [r["_path"] for r in collect(tree)]
    assert sorted(Path(p).parts[-3] for p in paths) == ["p2", "p3"]


def test_eval_split_train_measures_the_curve_on_the_training_split(tiny_run, tmp_path, monkeypatch, capsys):
    """``--eval-split train``: the curve's endpoints are each model's own loss on the training split
    (checked by hand with cross-entropy), not the test split's; a later run in the same directory
    with another split is refused (exit 2) and leaves the results alone."""
    import shutil

    import torch.nn.functional as F
    from _cli_util import run_symalign

    from symalign.checkpoint import load_model
    from symalign.data import eval_batches, load_dataset

    src, (res_test,) = tiny_run
    out = tmp_path / "train-split"
    shutil.copytree(src / "tiny" / "base", out / "tiny" / "base")
    for s in (1, 2):  # the trained pair, reused: no training in this test
        shutil.copytree(src / "tiny" / "first-attention" / f"seed{s}", out / "tiny" / "first-attention" / f"seed{s}")
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(_toml(TINY))
    code, _, err = run_symalign(monkeypatch, capsys, "experiment", cfg, "--out", out, "--eval-split", "train",
                                "--quiet")
    assert code == 0, err
    path = out / "tiny" / "first-attention" / "results.json"
    res = json.loads(path.read_text())
    assert res["eval_split"] == "train" and res_test["eval_split"] == "test"
    ds = load_dataset("digits")
    batches = list(eval_batches(ds, "train", 256, 128, TINY["protocol"]["eval_items"]))
    for end, seed in (("A", 1), ("B", 2)):
        model, _ = load_model(out / "tiny" / "first-attention" / f"seed{seed}")
        model.eval()
        with torch.no_grad():
            nll = sum(F.cross_entropy(model(x).double(), y, reduction="sum").item() for x, y in batches)
        own = nll / sum(len(y) for _, y in batches)
        assert res["endpoints"][end]["loss"] == pytest.approx(own, rel=1e-9)
        assert res["endpoints"][end]["loss"] != pytest.approx(res_test["endpoints"][end]["loss"], rel=1e-6)
    before = path.read_bytes()
    code, _, err = run_symalign(monkeypatch, capsys, "experiment", cfg, "--out", out, "--eval-split", "test", "--quiet")
    assert code == 2 and "measured on the train split" in err and path.read_bytes() == before
    code, _, err = run_symalign(monkeypatch, capsys, "experiment", cfg, "--out", out, "--eval-split", "holdout")
    assert code == 2 and "protocol.eval_split" in err
