"""Tiny random models of the families in :mod:`symalign.families` (D=32, 2 layers), and their probe."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
        "llama": (T.LlamaForCausalLM, cfg(T.LlamaConfig, num_key_value_heads=2)),
        "mistral": (T.MistralForCausalLM, cfg(T.MistralConfig, num_key_value_heads=2)),
        "qwen2": (T.Qwen2ForCausalLM, cfg(T.Qwen2Config, num_key_value_heads=2)),
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
        "falcon": (T.FalconForCausalLM, cfg(T.FalconConfig, tie_word_embeddings=False)),  # multi-query, parallel
    }


FAMILIES = tuple(_configs())


def make(name: str, dtype=torch.float64, seed: int = 0, attn: str = "eager", **overrides):
    cls, cfg_fn = _configs()[name]
    cfg = cfg_fn(**overrides)
    torch.manual_seed(seed)
    model = cls._from_config(cfg, attn_implementation=attn).to(dtype)
    randomize(model, seed)
    return model.eval()


from symalign.probe.families import float64_numerics  # noqa: E402,F401  (re-exported for the tests)


@dataclass
class Planted:
    """A planted pair on disk: ``B = element . A`` (``scope`` "model": on A's exact rewrite ``prepare``)."""

    spec: Any
    target: dict  # A's state (or its rewrite): what ``element`` was applied to
    element: dict
    untied: bool  # the rewrite untied the head (model scope only)


def plant_checkpoints(a, scope: str, dtype, tmp_path, seed: int = 7) -> Planted:
    """Save ``a`` in ``dtype`` as ``tmp_path/A`` and ``B = g . A`` (``g = sample(spec, seed)`` of A's spec for
    ``scope``) in A's layout as ``tmp_path/B``; the planted-recovery tests align B to A and expect ``target``."""
    from symalign.checkpoint.hf import load_checkpoint
    from symalign.checkpoint.output import write_checkpoint
    from symalign.families import prepare
    from symalign.spec import apply, sample

    a.to(dtype).save_pretrained(tmp_path / "A")
    ck = load_checkpoint(tmp_path / "A")
    spec, target, untied = ck.adapter.spec(ck.config, ck.state.keys()), ck.state, False
    if scope == "model":
        prep = prepare(ck.config, ck.state, spec, type(a).__name__)
        spec, target, untied = prep.spec, prep.state, prep.untied
    t = sample(spec, seed)
    write_checkpoint(tmp_path / "B", {k: v.to(dtype) for k, v in apply(spec, t, target).items()},
                           tmp_path / "A")
    return Planted(spec, target, t, untied)
