"""Built-in models: every family x PE builds, trains a step, and its declared spec is exact."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from symalign.errors import ConfigError
from symalign.models import ModelConfig, build_model
from symalign.spec import apply, sample

FAMILIES = ("vit", "gpt", "encoder")
PES = ("none", "sinusoidal", "learned", "rope", "alibi")
OPTIONS = {
    "base": {},
    "gqa_relu_rms": {"n_kv_heads": 2, "activation": "relu", "norm": "rmsnorm", "bias": False},
    "rope_inter_partial": {"rope_pairing": "interleaved", "rotary_fraction": 0.5, "pooling": "mean",
                           "tie_embeddings": False},
    "post_ln": {"pre_norm": False, "n_kv_heads": 1},
}


def tiny(family: str, pe: str, **kw) -> ModelConfig:
    base = dict(family=family, d_model=16, n_layers=2, n_heads=4, d_ff=24, pe=pe, vocab_size=11, n_classes=3,
                image_size=8, patch_size=4, channels=2, max_len=8)
    base.update(kw)
    return ModelConfig(**base)


def inputs(cfg: ModelConfig, gen: torch.Generator, batch: int = 3) -> torch.Tensor:
    if cfg.family == "vit":
        return torch.randn(batch, cfg.channels, cfg.image_size, cfg.image_size, generator=gen, dtype=torch.float64)
    return torch.randint(0, cfg.vocab_size, (batch, 7), generator=gen)


def perturb(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Give every parameter generic values (norm gains != 1, nonzero biases)."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))


CASES = [(f, pe, o) for f, pe, o in itertools.product(FAMILIES, PES, OPTIONS)
         if not (o == "rope_inter_partial" and pe != "rope")]


@pytest.mark.parametrize("family,pe,opt", CASES)
def test_spec_is_exact(family, pe, opt):
    cfg = tiny(family, pe, **OPTIONS[opt])
    gen = torch.Generator().manual_seed(0)
    model = build_model(cfg, seed=1).double().eval()
    perturb(model, gen)
    x = inputs(cfg, gen)
    y = model(x)
    spec = model.symmetry_spec()
    state = model.state_dict()
    spec.check(state)
    assert ("residual" in spec.spaces) == (pe != "sinusoidal")
    assert all(f"ff.{i}" in spec.spaces and f"vo.{i}" in spec.spaces for i in range(cfg.n_layers))
    new_state = apply(spec, sample(spec, 3), state)
    other = copy.deepcopy(model)
    other.load_state_dict(new_state)
    y2 = other(x)
    changed = sum(not torch.equal(state[k], new_state[k]) for k in state)
    assert changed >= len(spec.tensors) // 2  # the element really moved the weights
    rel = ((y2 - y).norm() / y.norm()).item()
    assert rel <= 1e-10, rel


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_backward_float32(family):
    cfg = tiny(family, "rope", dropout=0.1)
    model = build_model(cfg, seed=0)
    gen = torch.Generator().manual_seed(0)
    x = inputs(cfg, gen).float() if family == "vit" else inputs(cfg, gen)
    out = model(x)
    expect = (3, 7, cfg.vocab_size) if family == "gpt" else (3, cfg.n_classes)
    assert out.shape == expect
    out.square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_sinusoidal_residual_permutation_is_not_a_symmetry():
    """Why the spec omits ``residual`` under sinusoidal PE: permuting the stream breaks the model."""
    from symalign.groups import Permutation
    from symalign.models.blocks import blocks_spec, RESIDUAL

    cfg = tiny("gpt", "sinusoidal")
    model = build_model(cfg, seed=0).double()
    spec = blocks_spec(cfg, residual=True)
    for name, axis in (("tok_emb.weight", 1), ("head.weight", 1), ("norm_f.weight", 0), ("norm_f.bias", 0)):
        spec.act_on(name, RESIDUAL, axis)
    x = inputs(cfg, torch.Generator().manual_seed(0))
    y = model(x)
    other = copy.deepcopy(model)
    other.load_state_dict(apply(spec, {RESIDUAL: Permutation(16).sample(1)}, model.state_dict()))
    assert ((other(x) - y).norm() / y.norm()).item() > 1e-3


def test_gpt_causal_and_tied():
    cfg = tiny("gpt", "learned")
    model = build_model(cfg, seed=0).double()
    assert model.head.weight is model.tok_emb.weight
    x = inputs(cfg, torch.Generator().manual_seed(0))
    y = model(x)
    x2 = x.clone()
    x2[:, -1] = (x2[:, -1] + 1) % cfg.vocab_size
    assert torch.allclose(model(x2)[:, :-1], y[:, :-1])  # the future does not leak


def test_seeded_init_is_deterministic():
    a = build_model(tiny("vit", "rope"), seed=5).state_dict()
    b = build_model(tiny("vit", "rope"), seed=5).state_dict()
    c = build_model(tiny("vit", "rope"), seed=6).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


@pytest.mark.parametrize("kw,word", [
    ({"pe": "nope"}, "pe"),
    ({"d_model": 18}, "n_heads"),
    ({"n_kv_heads": 3}, "n_kv_heads"),
    ({"pe": "rope", "head_dim": 3, "d_model": 12}, "even"),
    ({"family": "cnn"}, "family"),
    ({"image_size": 9}, "patch_size"),
])
def test_config_errors_name_the_field(kw, word):
    with pytest.raises(ConfigError, match=word):
        tiny(kw.pop("family", "vit"), kw.pop("pe", "none"), **kw)


def test_config_roundtrip_and_unknown_key():
    cfg = tiny("encoder", "alibi", n_kv_heads=2)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="colour"):
        ModelConfig.from_dict({**cfg.to_dict(), "colour": 1})
