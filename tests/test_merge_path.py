"""``symalign merge`` chooses its path: streamed by itself above a size where streaming keeps the scope, and says so.

The threshold (:data:`symalign.stream.merge.AUTO_STREAM_BYTES`, 8 MiB) is lowered here so that the tiny test models
cross it; the rule itself is :func:`symalign.commands.merge.choose_path`.
"""

from __future__ import annotations

import json

import pytest
import torch

from _cli_util import run_symalign
from hf_tiny import make_model
from test_stream import _pair, _state

from symalign.commands.merge import choose_path
from symalign.stream.auto import weights_bytes


def _merge(monkeypatch, capsys, *args):
    return run_symalign(monkeypatch, capsys, "merge", *map(str, args))


def _limit(monkeypatch, value: int) -> None:
    monkeypatch.setattr("symalign.stream.merge.AUTO_STREAM_BYTES", value)


@pytest.mark.slow
def test_auto_rule_size_scope_and_explicit_flags(tmp_path, monkeypatch):
    """Below the limit: in memory; above it: streamed where the family streams the scope the merge would use,
    in memory where it does not (a BERT's whole-model scope); --stream/--no-stream decide alone; --universe never
    streams by itself."""
    _, _, da, db = _pair(tmp_path, shard=None)
    size = weights_bytes(da) + weights_bytes(db)
    _limit(monkeypatch, size)  # at the limit: not above it
    streamed, why = choose_path([da, db], None, False, None, True)
    assert not streamed and why.startswith("auto") and "at most" in why
    _limit(monkeypatch, size - 1)
    for scope, align in ((None, True), ("model", True), ("attention", True), (None, False)):
        streamed, why = choose_path([da, db], None, False, scope, align)
        assert streamed and why.startswith("auto") and "exceed" in why, (scope, align)
    assert "--scope model" in choose_path([da, db], None, False, None, True)[1]
    assert "plain average" in choose_path([da, db], None, False, None, False)[1]
    assert choose_path([da, db], False, False, None, True) == (False, None)
    assert choose_path([da, db], True, False, None, True) == (True, None)
    assert choose_path([da, db], None, True, None, True)[0] is False

    ea, eb = tmp_path / "EA", tmp_path / "EB"
    for seed, d in ((0, ea), (1, eb)):
        make_model("bert", dtype=torch.float32, seed=seed).save_pretrained(d)
    _limit(monkeypatch, 1)
    # a bare encoder (no residual space): its layers' FF units and attention, streamed as in memory
    streamed, why = choose_path([ea, eb], None, False, None, True)
    assert streamed and "--scope model" in why
    assert choose_path([ea, eb], None, False, "attention", True)[0] is True
    from symalign.families import FAMILIES

    family = next(f.model_types[0] for f in FAMILIES if f.tiny is not None and "model" not in f.scopes.stream)
    for seed, d in ((0, ea), (1, eb)):  # a family declaring no streamed model scope (T5): in memory
        make_model(family, dtype=torch.float32, seed=seed).save_pretrained(d)
    streamed, why = choose_path([ea, eb], None, False, None, True)
    assert not streamed and "without --stream" in why


@pytest.mark.slow
def test_path_keys_and_line_in_memory(tmp_path, monkeypatch, capsys):
    """Small checkpoints: in memory, the JSON and the printed line say so and why; --no-stream: no reason given."""
    _, _, da, db = _pair(tmp_path, shard=None)
    code, out, err = _merge(monkeypatch, capsys, da, db, "-o", tmp_path / "M", "--json", "--no-progress")
    assert code == 0, err
    res = json.loads(out)
    assert res["path"] == "in memory" and "at most 8 MiB" in res["path_default"]
    code, out, err = _merge(monkeypatch, capsys, da, db, "-o", tmp_path / "N", "--no-progress")
    assert code == 0, err
    assert "path: in memory (auto, the checkpoints" in out
    code, out, err = _merge(monkeypatch, capsys, da, db, "-o", tmp_path / "K", "--json", "--no-stream",
                            "--no-progress")
    res = json.loads(out)
    assert res["path"] == "in memory" and res["path_default"] is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.slow
def test_auto_streamed_merge_equals_explicit_stream_bit_for_bit(dtype, tmp_path, monkeypatch, capsys):
    """Above the limit the default merge streams with the default whole-model scope: its output is the explicit
    ``--stream`` merge's, bit for bit, and it says it streamed by itself (JSON and the printed line)."""
    _, _, da, db = _pair(tmp_path, dtype=dtype)
    _limit(monkeypatch, 1)
    code, out, err = _merge(monkeypatch, capsys, da, db, "-o", tmp_path / "AUTO", "--json", "--no-progress")
    assert code == 0, err
    res = json.loads(out)
    assert res["path"] == "streamed" and res["path_default"].startswith("auto") and res["scope"] == "model"
    assert "stream" in res and json.loads((tmp_path / "AUTO" / "symalign.json").read_text())["streamed"] is True
    code, out, err = _merge(monkeypatch, capsys, da, db, "-o", tmp_path / "STR", "--json", "--stream",
                            "--no-progress")
    assert code == 0, err
    res = json.loads(out)
    assert res["path"] == "streamed" and res["path_default"] is None and res["scope"] == "model"
    auto, explicit = _state(tmp_path / "AUTO"), _state(tmp_path / "STR")
    assert set(auto) == set(explicit)
    for k in auto:
        assert auto[k].dtype == explicit[k].dtype and torch.equal(auto[k], explicit[k]), k
    code, out, err = _merge(monkeypatch, capsys, da, db, "-o", tmp_path / "LINE", "--no-progress")
    assert code == 0 and "path: streamed (auto, the checkpoints" in out, err
    code, out, err = _merge(monkeypatch, capsys, da, db, "-o", tmp_path / "MEM", "--json", "--no-stream",
                            "--no-progress")
    assert code == 0 and json.loads(out)["path"] == "in memory", err


def test_no_align_in_memory_is_the_plain_average(tmp_path, monkeypatch, capsys):
    """--no-align in memory (A's tensors released once summed) is still round(w_A A + w_B B), as streamed."""
    _, _, da, db = _pair(tmp_path, shard=None)
    code, out, err = _merge(monkeypatch, capsys, da, db, "--no-align", "--no-stream", "--weights", "1,3",
                            "-o", tmp_path / "OUT", "--json", "--no-progress")
    assert code == 0, err
    a, b, m = _state(da), _state(db), _state(tmp_path / "OUT")
    for k in a:
        want = (0.25 * a[k].double() + 0.75 * b[k].double()).to(a[k].dtype)
        assert torch.equal(m[k], want), k
