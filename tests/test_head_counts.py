"""Checkpoints with different head structures (same tensor shapes) are refused by every command,
naming A's and B's head configurations the right way round (issue 24)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from _cli_util import run_symalign  # noqa: E402


def _save(path, model):
    model.save_pretrained(path)
    return path


def _gpt2(path, heads, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_embd=16, n_layer=1, n_head=heads, vocab_size=256, n_positions=32)
    return _save(path, transformers.GPT2LMHeadModel(cfg))


def _llama(path, heads, kv, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=heads,
                                   num_key_value_heads=kv, head_dim=32 // heads, intermediate_size=32,
                                   vocab_size=256, max_position_embeddings=64)
    return _save(path, transformers.LlamaForCausalLM(cfg))


@pytest.fixture(params=["gpt2", "llama"])
def pair(request, tmp_path):
    if request.param == "gpt2":
        a, b = _gpt2(tmp_path / "A4", 4), _gpt2(tmp_path / "B8", 8, seed=1)
        return a, b, "A (", "has 4 attention heads (4 key/value heads, head_dim 4)", "has 8 attention heads"
    a, b = _llama(tmp_path / "A4", 4, 2), _llama(tmp_path / "B8", 8, 4, seed=1)
    return a, b, "A (", "has 4 attention heads (2 key/value heads, head_dim 8)", "has 8 attention heads (4 key"


def test_same_tensor_shapes(pair):
    from symalign.checkpoint.hf import load_checkpoint

    a, b = load_checkpoint(pair[0]), load_checkpoint(pair[1])
    assert {k: v.shape for k, v in a.state.items()} == {k: v.shape for k, v in b.state.items()}


@pytest.mark.parametrize("argv", [["align"], ["align", "--scope", "model"], ["interpolate"]])
def test_refused_by_every_command(argv, pair, tmp_path, monkeypatch, capsys):
    a, b, _, a_text, b_text = pair
    out = tmp_path / "OUT"
    extra = ["-o", out] if argv[0] == "align" else ["--data", "shakespeare", "-o", out]
    if argv[0] == "interpolate":
        extra = ["--data", "synthetic", "--data-option", "kind=lm", "-o", out]
    code, _, err = run_symalign(monkeypatch, capsys, *argv, a, b, *extra)
    errors = [ln for ln in err.splitlines() if ln.startswith("symalign: error:")]  # (progress lines aside)
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert f"A ({a}) {a_text}" in err and f"B ({b}) {b_text}" in err, err
    assert err.index("A (") < err.index("B (")
    assert not out.exists()
