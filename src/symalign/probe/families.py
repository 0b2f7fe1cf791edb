r"""Measure a family's declared attention group on its real transformers layer (Jacobian nullity, float64).

transformers computes two steps in float32 whatever the weights' dtype: the eager
softmax (``softmax(..., dtype=float32)``) and the RMSNorm normalisation. Their rounding
(``~1e-8`` relative) leaves true null directions of the float64 Jacobian at singular
values ``~1e-8 s_1`` instead of ``~1e-16 s_1``, where a ``1e-9`` threshold counts them
as rank. :func:`float64_numerics` swaps in the same formulas evaluated in the weights'
dtype (an attention function registered with transformers' ``AttentionInterface``, and
the RMSNorm forward ``w * x / sqrt(mean(x^2) + eps)``, ``(1 + w) * ...`` for Gemma; T5's
``T5LayerNorm`` is that RMSNorm too), after
which null singular values sit at ``~1e-16`` with a gap of ``1e8`` or more.

:func:`probe_layer` measures layer ``i``'s attention (``x -> attn(x)``, RoPE from the
model's rotary module, no mask) and returns it beside the declared dimension: the
layer's spaces in the family's spec plus the named bias gauges (:func:`bias_gauge`).
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

ATTENTION = "symalign_eager_float64"


def eager_float64(module, query, key, value, attention_mask, scaling, dropout=0.0, softcap=None, **kw):
    """transformers' eager attention (GQA repeat, soft-capping, T5's position bias, additive mask) with the
    softmax in the inputs' dtype."""
    g = getattr(module, "num_key_value_groups", 1)
    b, h, s, d = key.shape
    key = key[:, :, None].expand(b, h, g, s, d).reshape(b, h * g, s, d)
    value = value[:, :, None].expand(b, h, g, s, d).reshape(b, h * g, s, d)
    w = torch.matmul(query, key.transpose(2, 3)) * scaling
    if softcap is not None:
        w = torch.tanh(w / softcap) * softcap
    if kw.get("position_bias") is not None:  # T5: the stack's relative position bias, before the mask
        w = w + kw["position_bias"]
    if attention_mask is not None:
        w = w + attention_mask[:, :, :, : key.shape[-2]]
    w = torch.softmax(w, dim=-1)
    return torch.matmul(w, value).transpose(1, 2).contiguous(), w


def _rms(self, x):
    eps = getattr(self, "variance_epsilon", None) or getattr(self, "eps", 1e-6)
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (1.0 + self.weight) * y if "Gemma" in type(self).__name__ else self.weight * y


def _router(self, hidden_states):
    """transformers' top-k router (Mixtral, Qwen2-MoE, OLMoE) with the softmax in the weights' dtype: softmax over
    the experts, top-``k``, renormalised when ``norm_topk_prob`` (Mixtral, which has no such flag, always)."""
    logits = torch.nn.functional.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
    top, idx = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
    if getattr(self, "norm_topk_prob", True):
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top, idx


def float64_routers(model: nn.Module) -> nn.Module:
    """``model`` (in place) with its mixture-of-experts routers' softmax in the weights' dtype (:func:`_router`)."""
    for m in model.modules():
        if type(m).__name__.endswith("TopKRouter"):
            m.forward = types.MethodType(_router, m)
    return model


def float64_numerics(model: nn.Module) -> nn.Module:
    """``model`` (in place) with its RMSNorms, eager softmax and mixture-of-experts routers evaluated in the
    weights' dtype (same formulas, same masks: the model's eager causal / sliding-window / padding mask)."""
    import sys

    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import eager_mask

    AttentionInterface.register(ATTENTION, eager_float64)
    # the masks eager attention gets (causal, sliding window, padding): without a mask function registered
    # under the same name, transformers builds no mask for a custom attention and it would attend both ways
    AttentionMaskInterface.register(ATTENTION, eager_mask)
    # only families whose attention goes through transformers' attention interface (Falcon's own eager path
    # already takes the softmax in the inputs' dtype)
    interface = hasattr(sys.modules[type(model).__module__], "eager_attention_forward")
    for m in model.modules():
        if type(m).__name__.endswith("RMSNorm") or type(m).__name__ == "T5LayerNorm":
            m.forward = types.MethodType(_rms, m)
        cfg = getattr(m, "config", None)
        if interface and cfg is not None and hasattr(cfg, "_attn_implementation"):
            cfg._attn_implementation = ATTENTION
    return float64_routers(model)


class AttentionProbe(nn.Module):
    """Layer ``i``'s real attention as ``x -> attn(x)`` (RoPE from the model's own rotary module, no mask; other
    inputs, such as ALiBi's bias, from :meth:`~symalign.families.base.Family.attention_kwargs`)."""

    def __init__(self, family: Any, model: nn.Module, i: int):
        super().__init__()
        self.attn = family.attention_module(model, i)
        self.pe = lambda x, pos: family.position_embeddings(model, i, x, pos)  # buffers only: not parameters
        self.kwargs = lambda x: family.attention_kwargs(x, model.config)

    def forward(self, x):
        pos = torch.arange(x.shape[1]).unsqueeze(0).expand(x.shape[0], -1)
        return self.attn(hidden_states=x, position_embeddings=self.pe(x, pos), **self.kwargs(x))[0]


@dataclass
class LayerProbe:
    """Measured nullity of one real attention layer beside what the family declares."""

    family: str
    layer: int
    parameters: int
    nullity: int
    group: int
    gauge: dict[str, int]
    gap: float
    describe: dict[str, str]

    @property
    def declared(self) -> int:
        return self.group + sum(self.gauge.values())

    @property
    def match(self) -> bool:
        return int(self.nullity) == self.declared


def probe_layer(family: Any, model: nn.Module, i: int = 0, seq: int = 6, ratio: int = 3, seed: int = 1) -> LayerProbe:
    """Dense float64 probe of layer ``i`` of ``model`` (converted in place to float64 numerics)."""
    from symalign.probe.measure import probe

    model = float64_numerics(model.to(torch.float64))
    spec = family.spec(model).restrict(family.layer_spaces(i))
    gauge = family.gauge_nullity(model.config, model.state_dict().keys(), i)
    mod = AttentionProbe(family, model, i)
    n = sum(p.numel() for p in mod.parameters())
    D = int(model.config.hidden_size)
    x = torch.randn(-(-ratio * n // (seq * D)), seq, D, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(seed))
    res = probe(mod, x, method="dense", check_heads=False)
    return LayerProbe(family.family, i, n, int(res.nullity), spec.dim, gauge, float(res.singular_value_gap or 0.0),
                      spec.describe())


class BlockProbe(nn.Module):
    """Layer ``i``'s real feed-forward block (``layer.mlp``: router, experts, shared expert) as ``x -> mlp(x)``."""

    def __init__(self, model: nn.Module, i: int):
        super().__init__()
        self.mlp = model.base_model.layers[i].mlp

    def forward(self, x):
        return self.mlp(x)


def probe_moe_block(family: Any, model: nn.Module, i: int = 0, ratio: int = 3, seed: int = 1) -> LayerProbe:
    """Dense float64 probe of sparse layer ``i``'s mixture-of-experts block (model converted in place).

    Declared: the layer's ``experts``/``ff`` spaces (permutations: dimension 0) plus the family's named
    continuous directions (:meth:`~symalign.families.moe.MoEFamily.block_gauge`). The input is one sequence
    of ``ceil(ratio n / D)`` generic tokens; routing must be generic and stable on it (every expert chosen by
    some token, the ``k``-th and ``k+1``-th router probabilities of every token apart by more than ``1e-6``),
    else :class:`~symalign.errors.SymalignError`: an unused expert or a tie would add null directions that
    are not symmetries.
    """
    from symalign.errors import SymalignError
    from symalign.families import prepare
    from symalign.probe.measure import probe

    model = float64_numerics(model.to(torch.float64))
    state = {k: v.detach() for k, v in model.state_dict().items()}
    spec = prepare(model.config, state, family.spec(model.config, state.keys())).spec
    spec = spec.restrict(spec.select(("experts", "ff"), i))
    gauge = family.block_gauge(model.config, state, i)
    mod = BlockProbe(model, i)
    n = sum(p.numel() for p in mod.parameters())
    D = int(model.config.hidden_size)
    x = torch.randn(1, -(-ratio * n // D), D, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    router = mod.mlp.gate
    with torch.no_grad():
        p = torch.softmax(x.reshape(-1, D) @ router.weight.T, dim=-1).sort(dim=-1, descending=True)
    k, E = int(router.top_k), int(router.weight.shape[0])
    margin = float((p.values[:, k - 1] - p.values[:, k]).min()) if k < E else 1.0
    used = int(torch.unique(p.indices[:, :k]).numel())
    if margin <= 1e-6 or used < E:
        raise SymalignError(f"layer {i}: routing is not generic on the probe's input (top-{k} margin {margin:.1e}, "
                            f"{used} of {E} experts used); try another seed")
    res = probe(mod, x, method="dense", check_heads=False)
    return LayerProbe(family.family, i, n, int(res.nullity), spec.dim, gauge, float(res.singular_value_gap or 0.0),
                      spec.describe())
