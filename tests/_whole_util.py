"""Helpers for the whole-model tests: tiny built-in models with O(1) random weights."""

from __future__ import annotations

import torch

from _match_util import rel
from symalign.models import ModelConfig, build_model

FAMILIES = ("vit", "gpt", "encoder")
PES = ("none", "sinusoidal", "learned", "rope", "alibi")


def config(family: str, pe: str, **kw) -> ModelConfig:
    base = dict(family=family, d_model=16, n_layers=2, n_heads=4, pe=pe, vocab_size=32, max_len=16, image_size=8,
                patch_size=4, n_classes=5, d_ff=32)
    base.update(kw)
    return ModelConfig(**base)


def randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Non-trivial gains (~1 +- 0.3), biases (~0.3), weights (~0.5): every fold and centring matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            base = 1.0 if ("norm" in n and n.endswith("weight")) else 0.0
            scale = 0.5 if p.dim() > 1 else 0.3
            p.copy_(base + scale * torch.randn(p.shape, generator=g, dtype=torch.float64))
    return model


def model(family: str, pe: str, seed: int = 1, **kw) -> torch.nn.Module:
    return randomize(build_model(config(family, pe, **kw)).double().eval(), seed)


def inputs(cfg: ModelConfig, n: int = 3, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if cfg.family == "vit":
        return torch.randn(n, cfg.channels, cfg.image_size, cfg.image_size, generator=g, dtype=torch.float64)
    return torch.randint(0, cfg.vocab_size, (n, 10), generator=g)


def rel_out(y: torch.Tensor, y0: torch.Tensor) -> float:
    return float((y.detach() - y0.detach()).norm() / y0.detach().norm())


def rel_state(a: dict, b: dict) -> float:
    """Relative distance over the floating tensors of ``a`` (see ``_match_util.rel``)."""
    return rel(a, b)


def check_whole_model_scopes(results: list[dict]) -> None:
    """The protocol's first-block and full scopes on one model pair: first-block aligns exactly the
    attention and FF spaces of block 0, full adds the residual stream and every later block, and
    each aligned B' computes B's function (its curve's endpoints are the naive curve's)."""
    import pytest

    res = {r["scope"]: r for r in results}
    assert set(res["first-block"]["spaces_aligned"]) == {"heads.0", "qk.0", "vo.0", "ff.0"}
    assert "residual" in res["full"]["spaces_aligned"] and "ff.1" in res["full"]["spaces_aligned"]
    for r in res.values():
        v = r["variants"]["full"]
        assert v["function_change"] <= 1e-4
        assert v["curve"]["loss"][0] == pytest.approx(r["naive"]["loss"][0], rel=1e-4)
        assert v["curve"]["loss"][-1] == pytest.approx(r["naive"]["loss"][-1], rel=1e-4)
