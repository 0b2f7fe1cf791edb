"""Tables in README.md and docs/ are renderings of committed result files (``make results-docs``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from symalign.errors import ConfigError
from symalign.experiments.docs_tables import blocks, make_table, render_file, stale_blocks
from symalign.provenance import provenance

ROOT = Path(__file__).resolve().parents[1]


def test_every_docs_table_matches_its_result_file():
    assert not stale_blocks(ROOT), "run `make results-docs` (symalign docs) and commit the docs"


def test_every_result_file_records_its_provenance():
    for path in sorted((ROOT / "results").glob("*.json")):
        prov = json.loads(path.read_text()).get("provenance") or {}
        for key in ("commit", "command", "threads", "versions", "machine", "date"):
            assert prov.get(key) is not None, f"{path.name}: provenance has no {key!r}"


def test_every_result_file_a_docs_table_names_records_its_provenance():
    """benchmarks/results/ files too (merge_peers.json, merge_scopes.json, ...), once a table in the docs shows them."""
    for _, rel, _ in blocks(ROOT):
        prov = json.loads((ROOT / rel).read_text()).get("provenance") or {}
        for key in ("commit", "command", "threads", "versions", "machine", "date"):
            assert prov.get(key) is not None, f"{rel}: provenance has no {key!r}"


def _repo(tmp_path: Path) -> Path:
    (tmp_path / "results").mkdir()
    (tmp_path / "docs").mkdir()
    table = make_table([{"name": "rope", "ratio": 37.21}, {"name": "sin", "ratio": None}],
                       [("name", "encoding"), ("ratio", "ratio %", ".1f")])
    res = {"provenance": provenance("symalign demo", threads=1, seed_pairs=1), "tables": {"main": table}}
    (tmp_path / "results" / "r.json").write_text(json.dumps(res))
    (tmp_path / "README.md").write_text("# x\n\n<!-- results: results/r.json table=main -->\nold\n<!-- /results -->\n")
    (tmp_path / "docs" / "a.md").write_text("no tables here\n")
    return tmp_path


def test_render_then_check_and_a_changed_number_fails(tmp_path):
    root = _repo(tmp_path)
    assert stale_blocks(root) == ["README.md: results/r.json table=main"]
    assert render_file(root / "README.md", root) and not render_file(root / "README.md", root)
    text = (root / "README.md").read_text()
    assert "| rope | 37.2 |" in text and "| sin | - |" in text and "1 seed pair" in text and "1 thread" in text
    assert stale_blocks(root) == [] and blocks(root) == [("README.md", "results/r.json", "main")]
    res = json.loads((root / "results" / "r.json").read_text())
    res["tables"]["main"]["rows"][0]["ratio"] = 37.31
    (root / "results" / "r.json").write_text(json.dumps(res))
    assert stale_blocks(root) == ["README.md: results/r.json table=main"]


def test_bad_blocks_are_named(tmp_path):
    root = _repo(tmp_path)
    (root / "README.md").write_text("<!-- results: results/none.json table=main -->\n<!-- /results -->\n")
    with pytest.raises(ConfigError, match="results/none.json"):
        stale_blocks(root)
    (root / "README.md").write_text("<!-- results: results/r.json table=other -->\n<!-- /results -->\n")
    with pytest.raises(ConfigError, match="no table 'other'"):
        stale_blocks(root)
    with pytest.raises(ConfigError, match="column key"):
        make_table([{"a": 1}], [("b", "B")])


def test_cli_check_and_write(tmp_path):
    from typer.testing import CliRunner

    from symalign.cli import app

    root = _repo(tmp_path)
    r = CliRunner().invoke(app, ["docs", "--root", str(root), "--check"])
    assert r.exit_code == 1 and "stale: README.md" in r.output
    r = CliRunner().invoke(app, ["docs", "--root", str(root)])
    assert r.exit_code == 0 and "changed: README.md" in r.output
    assert CliRunner().invoke(app, ["docs", "--root", str(root), "--check"]).exit_code == 0
    shutil.rmtree(root / "results")
    assert CliRunner().invoke(app, ["docs", "--root", str(root), "--check"]).exit_code != 0


def test_readme_demo_table_is_the_committed_demo_result():
    """The README shows `make demo`'s printed table; every row must equal results/demo.json (the run it came
    from, with its provenance) to the printed precision."""
    import re

    demo = json.loads((ROOT / "results" / "demo.json").read_text())["demo"]
    text = (ROOT / "README.md").read_text()
    shown = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("│ ").split("│")]
        if len(cells) == 8 and cells[0] in ("sinusoidal", "rope"):
            shown[(cells[0], cells[1], cells[2].rstrip(" *"))] = cells[3:]
    rows = [r for r in demo["rows"] if r["scope"] != "full"]  # the whole-model rows have their own table
    assert len(shown) == len(rows) == 16
    for r in rows:
        want = [f"{r['naive_loss_barrier']:.4f}", f"{r['aligned_loss_barrier']:.4f}",
                f"{r['barrier_ratio_percent']:.1f}", f"{r['naive_acc_barrier']:.4f}", f"{r['aligned_acc_barrier']:.4f}"]
        assert shown[(r["encoding"], r["scope"], r["stage2"])] == want, r
    w = demo["whole_model"]
    row = next(line for line in text.splitlines() if re.match(r"│ \d\.\d{3} │ \d\.\d{3} │", line))
    cells = [c.strip() for c in row.strip("│ ").split("│")]
    assert cells[:5] == [f"{w[k]:.3f}" for k in ("acc_A", "acc_B", "merged_naive_acc", "merged_aligned_acc",
                                                  "merged_learned_acc")]
    assert cells[5] == f"{w['naive_loss_barrier']:.4f}"


def test_readme_demo_times_agree_with_the_printed_output_and_results_json():
    """The README's demo time is the one its pasted output printed, and the measuring time it names is
    results/demo.json's ``seconds`` (issue 33: 147 s in the text against 151 s under the table)."""
    import re

    text = (ROOT / "README.md").read_text()
    seconds = json.loads((ROOT / "results" / "demo.json").read_text())["demo"]["seconds"]
    printed = int(re.search(r"runs/demo/curves\.png \((\d+) s\)", text).group(1))
    said = int(re.search(r"the demo itself (\d+) s", text).group(1))
    measuring = int(re.search(r"\((\d+) s of it\s+training, aligning and measuring", text).group(1))
    assert said == printed and measuring == round(seconds) and measuring <= printed
