"""Hub ids as checkpoint arguments (issue 33, item 15): ``symalign align org/model-a org/model-b``,
``merge`` and ``interpolate`` resolve ids through huggingface_hub's cache with ``--revision``, offline
from a cache built here (no network); an id not cached is refused in one line (exit 2) before any
work; the snapshot and revision are recorded; a local folder of the same name wins."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

from _cli_util import run_symalign

SHA = {"main": "a" * 40, "v1": "b" * 40}


def _cache_model(cache: Path, repo: str, seed: int, refs: dict[str, int] | None = None) -> dict[str, Path]:
    """Write ``repo`` into ``cache`` in huggingface_hub's layout: ``models--org--name/blobs/<sha256>``,
    ``snapshots/<commit>/<file>`` symlinks to the blobs, ``refs/<branch>`` naming the commit. Each ref
    gets a tiny random GPT-2 (``refs``: ref -> seed; default ``main`` only). Returns ref -> snapshot."""
    from hf_tiny import make_model

    root = cache / f"models--{repo.replace('/', '--')}"
    out = {}
    for ref, s in (refs or {"main": seed}).items():
        commit = SHA[ref]
        staging = root / f"staging-{ref}"
        make_model("gpt2", dtype=torch.float32, seed=s).save_pretrained(staging)
        snap = root / "snapshots" / commit
        snap.mkdir(parents=True)
        (root / "blobs").mkdir(exist_ok=True)
        for f in sorted(staging.iterdir()):
            digest = hashlib.sha256(f.read_bytes()).hexdigest()
            blob = root / "blobs" / digest
            if not blob.exists():
                f.rename(blob)
            (snap / f.name).symlink_to(os.path.relpath(blob, snap))
        for leftover in staging.iterdir():
            leftover.unlink()
        staging.rmdir()
        (root / "refs").mkdir(exist_ok=True)
        (root / "refs" / ref).write_text(commit)
        out[ref] = snap
    return out


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An offline Hugging Face cache under tmp_path holding org/model-a (main) and org/model-b (main, v1)."""
    cache = tmp_path / "hf-home" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    snaps = {"a": _cache_model(cache, "org/model-a", 0), "b": _cache_model(cache, "org/model-b", 1,
                                                                           {"main": 1, "v1": 2})}
    return cache, snaps


def test_align_resolves_hub_ids_offline_and_records_the_snapshot(hub_cache, monkeypatch, capsys):
    cache, snaps = hub_cache
    code, out, err = run_symalign(monkeypatch, capsys, "align", "org/model-a@main", "org/model-b", "-o", "out",
                                  "--revision", "v1", "--json")  # --revision: ids without their own @REV
    assert code == 0, err
    marker = json.loads(Path("out/symalign.json").read_text())
    assert marker["a"] == str(snaps["a"]["main"].resolve()) or Path(marker["a"]).samefile(snaps["a"]["main"])
    hub = {h["id"]: h for h in marker["hub"]}
    assert hub["org/model-b"]["revision"] == "v1" and hub["org/model-b"]["commit"] == SHA["v1"]
    assert Path(hub["org/model-b"]["snapshot"]).samefile(snaps["b"]["v1"])
    assert hub["org/model-a"]["revision"] == "main" and hub["org/model-a"]["commit"] == SHA["main"]
    res = json.loads(out)
    assert {h["id"] for h in res["provenance"]["hub"]} == {"org/model-a", "org/model-b"}
    assert Path(res["b"]).samefile(snaps["b"]["v1"])


def test_a_pinned_revision_and_the_default_main(hub_cache, monkeypatch, capsys):
    """``org/name@REV`` pins one input; without --revision the other is read at main."""
    cache, snaps = hub_cache
    code, out, err = run_symalign(monkeypatch, capsys, "align", "org/model-b", "org/model-b@v1", "-o", "out",
                                  "--json")
    assert code == 0, err
    res = json.loads(out)
    assert Path(res["a"]).samefile(snaps["b"]["main"]) and Path(res["b"]).samefile(snaps["b"]["v1"])
    revs = sorted((h["revision"], h["commit"]) for h in json.loads(Path("out/symalign.json").read_text())["hub"])
    assert revs == [("main", SHA["main"]), ("v1", SHA["v1"])]


def test_an_id_not_in_the_cache_is_refused_in_one_line_before_any_work(hub_cache, monkeypatch, capsys):
    cache, _ = hub_cache
    for argv in (["align", "org/model-a", "org/missing", "-o", "out"],
                 ["align", "org/model-a", "org/model-b", "--revision", "v9", "-o", "out"],
                 ["merge", "org/model-a", "org/missing", "-o", "out"],
                 ["interpolate", "org/missing", "org/model-b", "--data", "shakespeare", "-o", "out"]):
        code, _, err = run_symalign(monkeypatch, capsys, *argv)
        assert code == 2, (argv, err)
        line = err.strip()
        assert "\n" not in line and "not in the Hugging Face cache" in line and str(cache) in line, line
        assert "HF_HUB_OFFLINE" in line and "Traceback" not in err
        assert not Path("out").exists()


@pytest.mark.slow
def test_a_local_folder_wins_over_a_hub_id(hub_cache, monkeypatch, capsys):
    from hf_tiny import make_model

    _, snaps = hub_cache
    make_model("gpt2", dtype=torch.float32, seed=5).save_pretrained(Path("org/model-b"))
    code, out, err = run_symalign(monkeypatch, capsys, "align", "org/model-a", "org/model-b", "-o", "out", "--json")
    assert code == 0, err
    res = json.loads(out)
    assert Path(res["b"]).resolve() == (Path.cwd() / "org/model-b").resolve()
    assert [h["id"] for h in json.loads(Path("out/symalign.json").read_text())["hub"]] == ["org/model-a"]


@pytest.mark.slow
def test_merge_reads_hub_ids(hub_cache, monkeypatch, capsys):
    _, snaps = hub_cache
    code, out, err = run_symalign(monkeypatch, capsys, "merge", "org/model-a", "org/model-b", "-o", "merged",
                                  "--json")
    assert code == 0, err
    marker = json.loads(Path("merged/symalign.json").read_text())
    assert sorted(h["id"] for h in marker["hub"]) == ["org/model-a", "org/model-b"]
    assert all(Path(p).is_dir() for p in marker["inputs"])


def test_resolve_leaves_other_arguments_alone(tmp_path, monkeypatch):
    from symalign.io.hub import is_hub_id, resolve

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert not is_hub_id("/abs/path") and not is_hub_id("a/b/c") and not is_hub_id("./x/y")
    assert is_hub_id("org/name") and is_hub_id("org/name@v1.0")
    assert resolve(tmp_path / "missing") == tmp_path / "missing"  # the command's own check speaks
    assert resolve("plain-name") == Path("plain-name")


def test_online_failures_name_their_cause(monkeypatch, tmp_path):
    """Online (HF_HUB_OFFLINE unset) the line says what went wrong: unreachable, unknown id or revision."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    from symalign.io.hub import _failure

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    line = _failure("checkpoint", "org/x", "org/x", "main", tmp_path, LocalEntryNotFoundError("no connection"))
    assert "could not be reached" in line and "HF_HUB_OFFLINE is set" not in line
    missing = type("RepositoryNotFoundError", (Exception,), {})
    assert "does not exist on the Hub" in _failure("checkpoint", "org/x", "org/x", "main", tmp_path, missing())
    rev = type("RevisionNotFoundError", (Exception,), {})
    assert "no such revision" in _failure("checkpoint", "org/x", "org/x", "v9", tmp_path, rev())
