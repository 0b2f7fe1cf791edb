"""``symalign probe`` / ``symalign tour`` on the command line: JSON, help, and one-line errors (exit 2)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from _cli_util import run_symalign


def run_main(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """Run :func:`symalign.cli.main` in-process (same path as the console script)."""
    return run_symalign(monkeypatch, capsys, *args)


def test_probe_json(monkeypatch, capsys):
    code, out, _ = run_main(monkeypatch, capsys, "probe", "--pe", "rope", "--d-model", "8", "--heads", "2",
                            "--head-dim", "4", "--bias", "--seq-len", "6", "--json")
    assert code == 0
    d = json.loads(out)
    assert d["nullity"] == d["predicted"] == 48
    assert d["head_permutations_preserved"] is True
    assert d["parameters"] == 288 and d["method"] == "dense" and d["match"] is True
    assert d["config"]["max_len"] == 6


def test_probe_table_alibi(monkeypatch, capsys):
    code, out, _ = run_main(monkeypatch, capsys, "probe", "--pe", "alibi", "--seq-len", "6")
    assert code == 0
    assert "match" in out and "False" in out  # heads pinned by the slopes


@pytest.mark.parametrize("command", ["probe", "tour", "demo"])
def test_help(monkeypatch, capsys, command):
    code, out, _ = run_main(monkeypatch, capsys, command, "--help")
    assert code == 0 and "Usage" in out


@pytest.mark.parametrize("args,needle", [
    (["--pe", "rope", "--head-dim", "3", "--d-model", "6", "--heads", "2"], "even"),        # odd rotated width
    (["--pe", "rope", "--head-dim", "4", "--rotary-fraction", "0.25"], "even"),              # r = 1
    (["--d-model", "9", "--heads", "2"], "not divisible"),
    (["--heads", "4", "--kv-heads", "3", "--d-model", "8"], "must divide"),
    (["--pe", "nope"], "unknown positional encoding"),
    (["--pe", "rope", "--pairing", "diagonal"], "pairing"),
    (["--method", "svd"], "method"),
    (["--seq-len", "1"], "seq-len"),
    (["--head-dim", "0"], "--head-dim must be a positive integer"),                       # was ZeroDivisionError
    (["--head-dim", "-2"], "--head-dim must be a positive integer"),                      # was a RuntimeError
    (["--kv-heads", "0"], "--kv-heads must be a positive integer"),                       # was "must divide"
    (["--pe", "none", "--rotary-fraction", "0.5"], "--rotary-fraction applies only to RoPE"),  # was ignored
    (["--pe", "alibi", "--pairing", "interleaved"], "--pairing applies only to RoPE"),     # was ignored
    (["--layer", "1"], "only with --hf"),
    (["--hf", "llama", "--pe", "rope"], "--pe describes the reference layer"),
    (["--hf", "no-such-family"], "neither a checkpoint folder nor a transformers model_type"),
    (["--hf", "llama", "--layer", "7"], "out of range"),
    (["--hf", "llama", "--layer", "-1"], "--layer must be >= 0"),
    # #19: the sites of an encoder-decoder (T5): --layer [STACK.]I [--cross]
    (["--cross"], "only with --hf"),
    (["--hf", "t5", "--layer", "decoder"], "--layer must be a layer index I or STACK.I"),
    (["--hf", "t5", "--layer", ".1"], "names no stack before the dot"),
    (["--hf", "t5", "--layer", "decoder.-1"], "--layer must be >= 0"),
    (["--hf", "t5", "--layer", "middle.1"], "T5 has the stacks encoder, decoder"),
    (["--hf", "t5", "--layer", "decoder.2"], "out of range: the decoder has 2 blocks"),
    (["--hf", "t5", "--layer", "2"], "out of range: the encoder has 2 blocks"),
    (["--hf", "t5", "--cross"], "cross-attention is in the decoder's blocks; use --layer decoder.0 --cross"),
    (["--hf", "t5", "--layer", "encoder.1", "--cross"], "use --layer decoder.1 --cross"),
    (["--hf", "llama", "--layer", "decoder.1"], "Llama has a single stack of layers; use --layer 1"),
    (["--hf", "llama", "--cross"], "Llama has no cross-attention"),
    # a mixture-of-experts block: refused (was a tracer traceback), not traced or run out of memory
    (["--hf", "mixtral", "--block"], "routes each token to its experts data-dependently"),
])
def test_bad_input_one_line_exit_2(monkeypatch, capsys, args, needle):
    code, out, err = run_main(monkeypatch, capsys, "probe", *args)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in err


def test_usage_error_exits_2(monkeypatch, capsys):
    code, _, err = run_main(monkeypatch, capsys, "probe", "--d-model", "eight")
    assert code == 2 and "Traceback" not in err


@pytest.mark.slow
def test_console_script_bad_pe():
    """The installed entry point: unknown --pe is one line on stderr, exit 2, no traceback."""
    exe = Path(sys.executable).parent / "symalign"
    proc = subprocess.run([str(exe), "probe", "--pe", "xpos"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert "xpos" in proc.stderr


def test_probe_api_without_parameters():
    import torch
    from torch import nn

    from symalign.errors import SymalignError
    from symalign.probe import probe

    with pytest.raises(SymalignError):
        probe(nn.Identity(), torch.randn(2, 3))


@pytest.mark.parametrize("sub", ["", "sub"])
def test_tour_out_existing_file_is_one_line_before_work(monkeypatch, capsys, tmp_path, sub):
    """``tour --out FILE`` (or a path under a file) was a traceback after the whole tour; now exit 2 first."""
    import importlib

    P = importlib.import_module("symalign.probe")

    def no_work(**kw):
        raise AssertionError("the tour ran before --out was checked")

    monkeypatch.setattr(P, "probe_tour", no_work)
    target = tmp_path / "a-file"
    target.write_text("keep me")
    code, out, err = run_main(monkeypatch, capsys, "tour", "--out", str(target / sub if sub else target))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "existing file" in err and "Traceback" not in err
    assert target.read_text() == "keep me"


def test_probe_hf_json(monkeypatch, capsys):
    """#19 item 4: ``probe --hf llama --json`` -- the real layer's nullity beside the adapter's declared dimension."""
    pytest.importorskip("transformers")
    code, out, _ = run_main(monkeypatch, capsys, "probe", "--hf", "llama", "--json")
    assert code == 0
    row = json.loads(out)["probes"][0]
    assert row["family"] == "Llama" and row["site"] == "attention" and row["layer"] == 0
    assert row["nullity"] == row["declared"] == row["expected"] == 2 * 4 + 2 * 16 and row["match"] is True
    assert row["ad"] == "both" and "softmax(dtype=float32)" in row["upcasts"]
    assert set(row["near_null"]) == {"1e-3", "1e-4"} and len(row["rope_planes"]) == 2


@pytest.mark.parametrize("layer,cross,site,module", [
    ("decoder.1", False, "attention", "decoder.block.1.layer.0.SelfAttention"),
    ("decoder.1", True, "cross-attention", "decoder.block.1.layer.1.EncDecAttention"),
])
@pytest.mark.slow
def test_probe_hf_t5_decoder_sites_json(monkeypatch, capsys, layer, cross, site, module):
    """#19: T5's decoder self-attention and cross-attention through the CLI: measured == declared, ``--json``."""
    pytest.importorskip("transformers")
    code, out, err = run_main(monkeypatch, capsys, "probe", "--hf", "t5", "--layer", layer, "--json",
                              *(["--cross"] if cross else []))
    assert code == 0, err
    (row,) = json.loads(out)["probes"]
    assert row["family"] == "T5" and row["stack"] == "decoder" and row["layer"] == 1 and row["site"] == site
    assert row["module"] == module and row["config"]["num_decoder_layers"] == 2
    assert row["nullity"] == row["declared"] == row["expected"] == 2 * 4 * 16 and row["match"] is True


@pytest.mark.slow
def test_probe_hf_table_names_the_module(monkeypatch, capsys):
    """The table's title shows the module path (it is not swallowed as a rich markup tag)."""
    pytest.importorskip("transformers")
    monkeypatch.setenv("COLUMNS", "200")  # the title on one line whatever the terminal (pytest-xdist's is 80)
    code, out, _ = run_main(monkeypatch, capsys, "probe", "--hf", "t5", "--layer", "decoder.0", "--cross")
    assert code == 0 and "decoder layer 0 cross-attention [decoder.block.0.layer.1.EncDecAttention]" in out


def test_probe_hf_table(monkeypatch, capsys):
    pytest.importorskip("transformers")
    code, out, _ = run_main(monkeypatch, capsys, "probe", "--hf", "mistral")
    assert code == 0 and "declared by the adapter" in out and "Mistral" in out and "match" in out
    assert "softmax(dtype=float32)" in out and "RoPE plane rotation" in out


def test_tour_writes_json_atomically(monkeypatch, capsys, tmp_path):
    import importlib

    P = importlib.import_module("symalign.probe")

    full_tour = P.probe_tour

    def small_tour(**kw):
        return full_tour(variants=["alibi"], biases=(False,))

    monkeypatch.setattr(P, "probe_tour", small_tour)
    code, out, _ = run_main(monkeypatch, capsys, "tour", "--out", str(tmp_path), "--json")
    assert code == 0
    rows = json.loads(out)["tour"]
    assert rows[0]["variant"] == "alibi" and rows[0]["head_permutations_preserved"] is False
    saved = json.loads((tmp_path / "symmetry.json").read_text())
    assert saved["tour"] == rows
    assert not list(tmp_path.glob("*.tmp"))


def test_block_probe_refused_when_its_jacobian_cannot_fit(monkeypatch):
    """--block forms dense Jacobians of ~(2n) x n float64 values: refused before they would exhaust memory."""
    from symalign.errors import ConfigError
    from symalign.probe import hf

    monkeypatch.setattr(hf, "_available_bytes", lambda: 10 * 2**20)  # 10 MiB left
    with pytest.raises(ConfigError, match="--block: the .* block .* parameters, whose dense Jacobians need about"):
        hf.probe_hf("llama", block=True)
