"""Tiny random models of the families in :mod:`symalign.families` (D=32, 2 layers), and their probe."""

from __future__ import annotations

import torch

from hf_tiny import randomize

transformers = __import__("pytest").importorskip("transformers")
T = transformers

_TOK = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _configs():
    base = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32, vocab_size=64,
                max_position_embeddings=64)

    def cfg(cls, **fixed):
        return lambda **kw: cls(**{**base, **_TOK, **fixed, **kw})

    return {
        "gpt_neox": (T.GPTNeoXForCausalLM, cfg(T.GPTNeoXConfig, rotary_pct=0.5)),
        "qwen3": (T.Qwen3ForCausalLM, cfg(T.Qwen3Config, num_key_value_heads=2, head_dim=8)),
        "phi3": (T.Phi3ForCausalLM, cfg(T.Phi3Config, num_key_value_heads=2)),
        "olmo2": (T.Olmo2ForCausalLM, cfg(T.Olmo2Config, num_key_value_heads=2)),
        "gemma": (T.GemmaForCausalLM, cfg(T.GemmaConfig, num_key_value_heads=2, head_dim=16)),
        "gemma2": (T.Gemma2ForCausalLM, cfg(T.Gemma2Config, num_key_value_heads=2, head_dim=16, sliding_window=4,
                                            query_pre_attn_scalar=16)),
        "gemma3_text": (T.Gemma3ForCausalLM, cfg(T.Gemma3TextConfig, num_key_value_heads=2, head_dim=16,
                                                 sliding_window=4, query_pre_attn_scalar=16,
                                                 layer_types=["sliding_attention", "full_attention"])),
        "gptj": (T.GPTJForCausalLM, cfg(T.GPTJConfig, rotary_dim=4)),
        "phi": (T.PhiForCausalLM, cfg(T.PhiConfig)),
    }


FAMILIES = tuple(_configs())


def make(name: str, dtype=torch.float64, seed: int = 0, attn: str = "eager", **overrides):
    cls, cfg_fn = _configs()[name]
    cfg = cfg_fn(**overrides)
    torch.manual_seed(seed)
    model = cls._from_config(cfg, attn_implementation=attn).to(dtype)
    randomize(model, seed)
    return model.eval()


def eager64(module, query, key, value, attention_mask, scaling, dropout=0.0, softcap=None, **kw):
    """transformers' eager attention with the softmax in the inputs' dtype (theirs upcasts to float32,
    whose rounding (~1e-8) would hide true null directions of the float64 Jacobian)."""
    g = module.num_key_value_groups if hasattr(module, "num_key_value_groups") else 1
    b, h, s, d = key.shape
    key = key[:, :, None].expand(b, h, g, s, d).reshape(b, h * g, s, d)
    value = value[:, :, None].expand(b, h, g, s, d).reshape(b, h * g, s, d)
    w = torch.matmul(query, key.transpose(2, 3)) * scaling
    if softcap is not None:
        w = torch.tanh(w / softcap) * softcap
    if attention_mask is not None:
        w = w + attention_mask[:, :, :, : key.shape[-2]]
    w = torch.softmax(w, dim=-1)
    return torch.matmul(w, value).transpose(1, 2).contiguous(), w


T.AttentionInterface.register("eager64", eager64)


class AttentionProbe(torch.nn.Module):
    """Layer ``i``'s real attention as ``x -> attn(x)`` (RoPE from the model's own rotary module, no mask)."""

    def __init__(self, family, model, i: int):
        super().__init__()
        self.attn = family.attention_module(model, i)
        self.pe = lambda x, pos: family.position_embeddings(model, i, x, pos)  # buffers only: not parameters

    def forward(self, x):
        pos = torch.arange(x.shape[1]).unsqueeze(0).expand(x.shape[0], -1)
        return self.attn(hidden_states=x, position_embeddings=self.pe(x, pos), attention_mask=None)[0]


def _rms64(self, x):
    eps = getattr(self, "variance_epsilon", None) or getattr(self, "eps", 1e-6)
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (1.0 + self.weight) * y if "Gemma" in type(self).__name__ else self.weight * y


def float64_numerics(model):
    """The same formulas in the weights' dtype: RMSNorms without their float32 upcast, eager attention
    without the float32 softmax (what makes transformers' float64 forward exact to ~1e-16)."""
    import types

    for m in model.modules():
        if type(m).__name__.endswith("RMSNorm"):
            m.forward = types.MethodType(_rms64, m)
    model.config._attn_implementation = "eager64"
    for m in model.modules():
        if hasattr(m, "config") and hasattr(m.config, "_attn_implementation"):
            m.config._attn_implementation = "eager64"
    return model
