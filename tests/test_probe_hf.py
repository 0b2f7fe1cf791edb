"""``symalign.probe.hf``: every family's real attention layer -- measured nullity == the adapter's declared group.

The measured side differentiates the real Hugging Face module (eager, float64, generic
weights) through its real call; the declared side is ``get_adapter(config).spec``
restricted to the layer. Exact symmetries outside any declared group (the key-bias
translations softmax ignores) are named and counted separately.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from symalign.probe.hf import probe_hf  # noqa: E402

# family -> (declared dim, undeclared terms) on the tiny config (D=16, h=4, d_h=4, h_kv=2 where the family has GQA)
EXPECTED = {
    "gpt2": (4 * 16 + 4 * 16, {"key_bias": 16}),     # S_4 x GL(4)^4 x GL(4)^4, key bias without RoPE free
    "llama": (2 * 4 + 2 * 16, {}),                   # GQA h_kv=2: H(4)^2 on Q-K, GL(4)^2 on V-O
    "mistral": (2 * 4 + 2 * 16, {}),
    "qwen2": (2 * 4 + 2 * 16, {}),                   # Q/K/V biases; the key bias is rotated: not free
    "bert": (4 * 16 + 4 * 16, {"key_bias": 16}),
    "vit": (4 * 16 + 4 * 16, {"key_bias": 16}),
    "roformer": (4 * 4 + 4 * 16, {}),                # H(4) per head, rotated key bias
    "modernbert": (4 * 4 + 4 * 16, {}),
}


@pytest.mark.parametrize("model_type", sorted(EXPECTED))
@pytest.mark.slow
def test_declared_equals_measured(model_type):
    (row,) = probe_hf(model_type, ad="forward")
    declared, undeclared = EXPECTED[model_type]
    res = row.result
    assert row.site == "attention" and res.method == "dense" and res.outputs >= 2 * res.parameters
    assert row.declared == declared and row.undeclared == undeclared
    assert res.nullity == row.expected == declared + sum(undeclared.values()), (res.nullity, row.to_dict())
    assert row.match is True and res.largest_null < 1e-12 and res.singular_value_gap > 1e8


@pytest.mark.slow
def test_checkpoint_folder_and_a_later_layer(tmp_path):
    """A saved checkpoint's own config (2 layers, GQA); layer 1; forward and reverse mode agree."""
    from hf_tiny import make_model

    make_model("llama", hidden_size=16, head_dim=4, intermediate_size=16).save_pretrained(tmp_path)
    (row,) = probe_hf(str(tmp_path), layer=1, ad="both")
    assert row.module == "layers.1.self_attn" and row.layer == 1 and row.config["num_hidden_layers"] == 2
    assert row.result.nullity == row.declared == 2 * 4 + 2 * 16  # h=4, h_kv=2, d_h=4: H(4)^2 + GL(4)^2
    assert row.result.rope_planes and len(row.result.rope_planes) == 2


@pytest.mark.slow
def test_llama_block_nullity():
    """The block: attention 40 + RMSNorm gains absorbed by the next linear maps (2 x 16) + SwiGLU unit scalings (32)."""
    attn, block = probe_hf("llama", block=True, ad="forward")
    assert block.site == "block" and block.module == "layers.0" and block.declared is None and block.match is None
    assert block.result.nullity == attn.result.nullity + 16 + 16 + 32


@pytest.mark.parametrize("ad", ["forward", "reverse"])
@pytest.mark.slow
def test_modernbert_without_float64_upcast_is_refused_in_both_modes(monkeypatch, ad):
    """ModernBERT rotates Q and K in float32 *before* the scores: without the upcast neither mode is clean."""
    from symalign.probe import AmbiguousSpectrumError, Float64Mode

    monkeypatch.setattr(Float64Mode, "__torch_function__",
                        lambda self, func, types, args=(), kwargs=None: func(*args, **(kwargs or {})))
    with pytest.raises(AmbiguousSpectrumError, match=r"16 lie between .* anywhere from 64 to 80"):
        probe_hf("modernbert", ad=ad)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", __import__("symalign.families", fromlist=["model_types"]).model_types())
def test_probe_by_model_type_matches_the_declaration(model_type):
    """`symalign probe --hf MODEL_TYPE` for every family: the tiny config it builds probes cleanly and the
    measured nullity equals the declared dimension (plus the named exact gauges). Before the tiny configs
    followed the head width, GPT-J (rotary_dim 64 > head_dim) and Falcon (head_dim a property) crashed, and
    Qwen3 / Gemma 2 / Gemma 3 were refused as ambiguous."""
    from symalign.probe.hf import probe_hf

    rows = probe_hf(model_type)
    assert rows and all(r.to_dict()["match"] for r in rows), [r.to_dict()["nullity"] for r in rows]
