"""symalign.trace: traced specs equal the hand-written ones and keep the function (float64)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import _trace_models as M
import symalign
from symalign.errors import ConfigError, SpecError
from symalign.groups import GeneralLinear, Permutation, PositiveMonomial, RotaryPlanes
from symalign.models import ModelConfig, build_model
from symalign.spec import SymmetrySpec, apply, sample
from symalign.tracing import check_spec, trace


def actions(spec: SymmetrySpec) -> dict:
    return {t: sorted((a.space, a.axis, a.variance, a.rep, a.segment) for a in acts)
            for t, acts in spec.tensors.items()}


def assert_same_spec(traced: SymmetrySpec, hand: SymmetrySpec) -> None:
    assert traced.describe() == hand.describe()
    assert {k: type(g) for k, g in traced.spaces.items()} == {k: type(g) for k, g in hand.spaces.items()}
    assert actions(traced) == actions(hand)
    assert {k: set(v) for k, v in traced.couplings.items()} == {k: set(v) for k, v in hand.couplings.items()}


def independent_change(model: nn.Module, spec: SymmetrySpec, x, seed: int = 7, kwargs=None) -> float:
    """Relative output change of a float64 copy under a random element (not the tracer's own check)."""
    m = copy.deepcopy(model).double().eval()
    x = x.double() if x.is_floating_point() else x
    with torch.no_grad():
        y = m(x, **(kwargs or {}))
        y = y if isinstance(y, torch.Tensor) else y.logits
        m.load_state_dict(apply(spec, sample(spec, seed), m.state_dict()))
        y2 = m(x, **(kwargs or {}))
        y2 = y2 if isinstance(y2, torch.Tensor) else y2.logits
    return float((y2 - y).abs().max() / y.abs().max())


def test_trace_is_exported_without_shadowing():
    assert symalign.trace is trace
    import symalign.tracing.api as api  # the package stays importable

    assert api.trace is trace


# -- built-in models: the hand-written specs -----------------------------------------------------------

BUILTIN = [
    dict(family="gpt", pe="rope", rotary_fraction=0.5),
    dict(family="gpt", pe="learned", activation="relu"),
    dict(family="gpt", pe="alibi", n_kv_heads=1),
    dict(family="gpt", pe="rope", rope_pairing="interleaved", norm="rmsnorm", n_kv_heads=1, n_heads=4),
    dict(family="vit", pe="none", pooling="mean"),
    dict(family="vit", pe="rope", activation="relu", bias=False),
    dict(family="encoder", pe="sinusoidal"),
    dict(family="encoder", pe="learned", pre_norm=False),
]


@pytest.mark.parametrize("kw", BUILTIN, ids=lambda kw: "-".join(str(v) for v in kw.values()))
def test_builtin_models_match_hand_written_spec(kw):
    base = dict(d_model=16, n_layers=2, n_heads=2, d_ff=24, vocab_size=11, max_len=8, image_size=8, patch_size=4,
                n_classes=3)
    cfg = ModelConfig(**{**base, **kw})
    model = build_model(cfg, seed=1)
    x = torch.randn(2, 1, 8, 8) if cfg.family == "vit" else torch.randint(0, 11, (2, 6))
    res = trace(model, x)
    assert_same_spec(res.spec, model.symmetry_spec())
    assert res.function_change <= 1e-10
    assert independent_change(model, res.spec, x) <= 1e-10


def test_rewritten_model_traces_to_whole_spec():
    """After the exact RMSNorm rewrite the stream is O(D): the tracer finds the rewrite's whole_spec."""
    from symalign.rewrite import rewrite_model

    cfg = ModelConfig(family="gpt", d_model=16, n_layers=2, n_heads=2, d_ff=24, vocab_size=11, max_len=8, pe="rope")
    model = rewrite_model(build_model(cfg, seed=2))
    x = torch.randint(0, 11, (2, 6))
    res = trace(model, x)
    assert_same_spec(res.spec, model.symmetry_spec())


# -- Hugging Face families: the adapters' specs ------------------------------------------------------------

@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_hf_models_match_adapter_spec(family):
    import hf_tiny
    from symalign.families import get_adapter

    model = hf_tiny.make_model(family, attn="sdpa", use_cache=False)
    ids = torch.randint(3, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    res = trace(model, {"input_ids": ids} if family == "gpt2" else (ids,))  # keyword or positional inputs
    attention = [k for k in res.spec.spaces if k.split(".")[0] in ("heads", "qk", "vo")]
    assert_same_spec(res.spec.restrict(attention), get_adapter(model.config).spec(model))
    # beyond the adapters: the stream and the FF units (GPT-2's GELU, Llama's SwiGLU: permutations only)
    assert res.spec.spaces["residual"] == Permutation(model.config.hidden_size)
    assert [k for k in res.spec.spaces if k.startswith("ff.")] == ["ff.0", "ff.1"]
    assert all(type(res.spec.spaces[k]) is Permutation for k in ("ff.0", "ff.1"))
    floor = 1e-5 if family == "llama" else 1e-10  # Llama's RMSNorm computes in float32 (noted in the result)
    assert res.function_change <= floor
    assert independent_change(model, res.spec, ids, kwargs={"use_cache": False}) <= floor
    if family == "llama":
        assert any("float32" in n for n in res.notes)
        assert isinstance(res.spec.spaces["qk.0"].inner, RotaryPlanes)


@pytest.mark.parametrize("family", ["mistral", "qwen2", "bert", "vit", "modernbert"])
def test_more_hf_families_match_adapter_spec(family):
    """Fused Wqkv and GLU halves (ModernBERT), post-LN (BERT), a conv patch embedding (ViT)."""
    import hf_tiny
    from symalign.families import get_adapter

    extra = {"use_cache": False} if family in ("mistral", "qwen2") else {}
    model = hf_tiny.make_model(family, attn="sdpa", **extra)
    x = dict(hf_tiny.inputs(model))
    res = trace(model, x)
    attention = [k for k in res.spec.spaces if k.split(".")[0] in ("heads", "qk", "vo")]
    assert_same_spec(res.spec.restrict(attention), get_adapter(model.config).spec(model))
    assert res.function_change <= res.tolerance <= 1e-5
    if family == "vit":  # the conv patch embedding, CLS token and positions: the stream is aligned too
        assert res.spec.spaces["residual"] == Permutation(model.config.hidden_size) and res.coverage.left == []


# -- user modules --------------------------------------------------------------------------------------------

def test_mlp_units():
    model = M.randomise(M.mlp(), 0)
    x = torch.randn(5, 8)
    res = trace(model, x)
    s = res.spec.spaces
    assert s == {"ff.0": PositiveMonomial(16), "ff.1": Permutation(12), "ff.2": PositiveMonomial(10)}
    assert actions(res.spec)["0.weight"] == [("ff.0", 0, "co", None, None)]
    assert actions(res.spec)["2.weight"] == [("ff.0", 1, "contra", None, None), ("ff.1", 0, "co", None, None)]
    assert any("output" in str(k) for k in res.skipped)
    assert independent_change(model, res.spec, x) <= 1e-10


@pytest.mark.parametrize("norm_first,activation", [(True, "relu"), (False, "gelu")])
def test_vit_from_transformer_encoder_layer(norm_first, activation):
    model = M.randomise(M.EncoderViT(norm_first=norm_first, activation=activation), 1)
    x = torch.randn(2, 1, 8, 8)
    res = trace(model, x)
    s = res.spec
    assert {k for k in s.spaces} == {"heads.0", "qk.0", "vo.0", "heads.1", "qk.1", "vo.1", "residual", "ff.0", "ff.1"}
    assert s.spaces["qk.0"].inner == GeneralLinear(8)
    want_ff = PositiveMonomial(32) if activation == "relu" else Permutation(32)
    assert s.spaces["ff.0"] == want_ff
    inproj = actions(s)["encoder.layers.0.self_attn.in_proj_weight"]
    assert ("qk.0", 0, "co", "query", (0, 16)) in inproj and ("qk.0", 0, "contra", "kv", (16, 16)) in inproj
    assert ("vo.0", 0, "co", "kv", (32, 16)) in inproj and ("residual", 1, "contra", None, None) in inproj
    assert ("residual", 2, "co", None, None) in actions(s)["cls"]
    assert ("residual", 2, "co", None, None) in actions(s)["pos"]
    assert independent_change(model, s, x) <= 1e-10


@pytest.mark.parametrize("bias", [True, False])
def test_multihead_attention_stack(bias):
    model = M.randomise(M.MHAStack(bias=bias), 2)
    x = torch.randint(0, 20, (2, 5))
    res = trace(model, x)
    assert res.spec.describe()["heads.1"] == "S_4" and res.spec.describe()["qk.1"] == "GL(4)^4"
    acts = actions(res.spec)
    assert ("qk.0", 0, "co", "query", (0, 16)) in acts["attn.0.in_proj_weight"]
    assert ("vo.1", 1, "contra", "query", None) in acts["attn.1.out_proj.weight"]
    assert (("vo.0", 0, "co", "kv", (32, 16)) in acts.get("attn.0.in_proj_bias", [])) == bias
    assert independent_change(model, res.spec, x) <= 1e-10


def test_nanogpt_with_rope_and_tied_head():
    model = M.randomise(M.NanoGPT(), 3)
    x = torch.randint(0, 32, (2, 6))
    res = trace(model, x)
    s = res.spec
    assert s.spaces["qk.0"].inner == RotaryPlanes(8, "interleaved", 8)
    assert s.spaces["residual"] == Permutation(16)  # tied wte/lm_head: co and contra on one tensor
    assert ("residual", 1, "co", None, None) in actions(s)["wte.weight"]
    assert ("residual", 1, "contra", None, None) in actions(s)["lm_head.weight"]
    assert independent_change(model, s, x) <= 1e-10


def test_position_map_without_a_candidate_group_is_not_guessed():
    """A per-position diagonal scaling of q and k commutes with no candidate Q-K group: Q-K is left out."""

    class Late(M.NanoGPT):
        def forward(self, idx):
            x = self.wte(idx)
            B, T, D = x.shape
            blk = self.blocks[0]
            q, k, v = blk.c_attn(blk.ln_1(x)).split(D, dim=2)
            q, k, v = (t.view(B, T, self.h, D // self.h).transpose(1, 2) for t in (q, k, v))
            scale = 1 + torch.arange(T, dtype=q.dtype)[:, None] * torch.linspace(0.1, 0.8, D // self.h, dtype=q.dtype)
            q, k = q * scale, k * scale
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + blk.c_proj(y.transpose(1, 2).reshape(B, T, D))
            return self.lm_head(self.ln_f(x))

    model = M.randomise(Late(layers=1), 4)
    x = torch.randint(0, 32, (2, 6))
    res = trace(model, x)
    assert "qk.0" not in res.spec.spaces and "heads.0" in res.spec.spaces and "vo.0" in res.spec.spaces
    assert any("Q-K not aligned" in s.reason for s in res.skipped)
    assert independent_change(model, res.spec, x) <= 1e-10


def test_non_standard_parts_are_listed_and_left_out():
    model = M.randomise(M.Odd(), 5).eval()
    x = torch.randn(4, 6)
    res = trace(model, x)
    reasons = [(s.layer, s.reason) for s in res.skipped]
    assert not any(layer == "bn" for layer, _ in reasons)  # BatchNorm1d is recognised: fc1's units permute
    assert any("sort" in r and "(fc3)" in r for _, r in reasons)
    assert any("fixed tensor (buffer) is added" in r and "(fc4)" in r for _, r in reasons)
    acted = set(res.spec.tensors)
    assert not acted & {"fc3.bias", "fc4.weight", "fc4.bias"}
    assert actions(res.spec)["fc3.weight"] == [("ff.1", 1, "contra", None, None)]  # its units are sorted: not moved
    assert actions(res.spec)["bn.running_var"] == [("ff.0", 0, "co", None, None)]
    assert res.spec.describe() == {"ff.0": "S_10", "ff.1": "O(8)", "ff.2": "S_9 x R+^9"}  # fc1+BN, fc2, fc5
    assert len(res.coverage.left) == 2 and "sort" in res.coverage.summary()
    assert independent_change(model, res.spec, x) <= 1e-10


def test_check_refuses_a_wrong_spec_naming_the_layer():
    model = M.randomise(M.mlp((4, 6, 2), ("gelu",)), 6).double()
    spec = SymmetrySpec()
    spec.add_space("ff.0", PositiveMonomial(6))  # GELU has no positive scaling
    spec.act_on("0.weight", "ff.0", 0)
    spec.act_on("0.bias", "ff.0", 0)
    spec.act_on("2.weight", "ff.0", 1, "contra")
    with pytest.raises(SpecError, match=r"'ff.0'.*layer 0 changes the function"):
        check_spec(model, spec, {"ff.0": "0"}, (torch.randn(3, 4, dtype=torch.float64),), {})


def test_untraceable_module_is_refused_with_one_line():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x):
            return self.fc(x) if float(x.sum()) > 0 else -x

    with pytest.raises(ConfigError, match="torch.export could not trace Branchy"):
        trace(Branchy(), torch.randn(2, 3))


def test_convolution_channels_are_a_space_and_flatten_acts_blockwise():
    class Conv(nn.Module):
        def __init__(self):
            super().__init__()
            self.c, self.f, self.g = nn.Conv2d(1, 4, 3), nn.Linear(4 * 6 * 6, 10), nn.Linear(10, 2)

        def forward(self, x):
            return self.g(torch.relu(self.f(torch.relu(self.c(x)).flatten(1))))

    model = M.randomise(Conv(), 8)
    x = torch.randn(3, 1, 8, 8)
    res = trace(model, x)
    assert res.spec.describe() == {"ff.0": "S_4 x R+^4", "ff.1": "S_10 x R+^10"}
    assert actions(res.spec)["f.weight"] == sorted([("ff.0", 1, "contra", None, (j, 1, 36)) for j in range(36)]
                                                   + [("ff.1", 0, "co", None, None)])
    assert res.coverage.left == []
    assert independent_change(model, res.spec, x) <= 1e-10


def test_position_map_needs_two_positions():
    model = M.randomise(M.NanoGPT(layers=1), 9)
    x = torch.randint(0, 32, (2, 1))
    res = trace(model, x)  # one position: RoPE looks like the identity, so the layer is not aligned
    assert not {"heads.0", "qk.0", "vo.0"} & set(res.spec.spaces) and "ff.0" in res.spec.spaces
    assert any("at least 2 positions" in s.reason for s in res.skipped)
    assert independent_change(model, res.spec, x) <= 1e-10


def test_glu_halves_of_one_projection_are_one_space():
    """``a, b = fc(x).chunk(2)``; ``out(silu(a) * b)``: both segments of fc carry the same permutation."""

    class GLU(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.out = nn.Linear(6, 2 * 10), nn.Linear(10, 3)

        def forward(self, x):
            a, b = self.fc(x).chunk(2, dim=-1)
            return self.out(torch.nn.functional.silu(a) * b)

    model = M.randomise(GLU(), 10)
    x = torch.randn(4, 6)
    res = trace(model, x)
    assert res.spec.describe() == {"ff.0": "S_10"}
    assert actions(res.spec)["fc.weight"] == [("ff.0", 0, "co", None, (0, 10)), ("ff.0", 0, "co", None, (10, 10))]
    assert independent_change(model, res.spec, x) <= 1e-10


def test_gainless_layernorm_stream_is_centred_orthogonal():
    from symalign.groups import CenteredOrthogonal

    class Stream(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.mid, self.out = nn.Linear(5, 8), nn.Linear(8, 8), nn.Linear(8, 3)
            self.norm = nn.LayerNorm(8, elementwise_affine=False)

        def forward(self, x):
            h = self.inp(x)
            h = h + self.mid(self.norm(h))
            return self.out(self.norm(h))

    model = M.randomise(Stream(), 12)
    x = torch.randn(4, 5)
    res = trace(model, x)
    assert res.spec.spaces == {"residual": CenteredOrthogonal(8)}
    assert independent_change(model, res.spec, x) <= 1e-10
