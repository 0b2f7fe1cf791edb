"""Tiny random Hugging Face models of every supported family (shared by the HF tests)."""

from __future__ import annotations

import torch

transformers = __import__("pytest").importorskip("transformers")
T = transformers
T.utils.logging.disable_progress_bar()
T.utils.logging.set_verbosity_error()

_TOK = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _configs():
    return {
        "gpt2": (T.GPT2LMHeadModel, lambda: T.GPT2Config(n_embd=16, n_layer=2, n_head=4, vocab_size=64,
                                                        n_positions=32, **_TOK)),
        "llama": (T.LlamaForCausalLM, lambda: T.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                            num_key_value_heads=2, intermediate_size=32,
                                                            vocab_size=64, max_position_embeddings=64, **_TOK)),
        "mistral": (T.MistralForCausalLM, lambda: T.MistralConfig(hidden_size=32, num_hidden_layers=2,
                                                                  num_attention_heads=4, num_key_value_heads=2,
                                                                  intermediate_size=32, vocab_size=64,
                                                                  max_position_embeddings=64, **_TOK)),
        "qwen2": (T.Qwen2ForCausalLM, lambda: T.Qwen2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                            num_key_value_heads=2, intermediate_size=32,
                                                            vocab_size=64, max_position_embeddings=64, **_TOK)),
        "bert": (T.BertModel, lambda: T.BertConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                                                   intermediate_size=32, vocab_size=64, max_position_embeddings=32,
                                                   pad_token_id=0)),
        "vit": (T.ViTForImageClassification, lambda: T.ViTConfig(hidden_size=16, num_hidden_layers=2,
                                                                 num_attention_heads=4, intermediate_size=32,
                                                                 image_size=8, patch_size=4, num_labels=3)),
        "roformer": (T.RoFormerModel, lambda: T.RoFormerConfig(hidden_size=32, num_hidden_layers=2,
                                                               num_attention_heads=4, intermediate_size=32,
                                                               vocab_size=64, embedding_size=32,
                                                               max_position_embeddings=64, pad_token_id=0)),
        "modernbert": (T.ModernBertForMaskedLM, lambda: T.ModernBertConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=32, vocab_size=64,
            max_position_embeddings=64, global_attn_every_n_layers=2, local_attention=4,
            cls_token_id=1, sep_token_id=2, **_TOK)),
    }


FAMILIES = tuple(_configs())


def config(name: str, **overrides):
    cfg = _configs()[name][1]()
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def randomize(model: torch.nn.Module, seed: int) -> None:
    """O(1)-scale random weights so attention patterns are far from uniform (symmetry breaks show)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                fan_in = p.shape[0] if "c_attn" in name or "c_proj" in name or "c_fc" in name else p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * (1.5 / fan_in ** 0.5))
            else:
                base = 1.0 if ("norm" in name.lower() or "ln_" in name) and name.endswith("weight") else 0.0
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=g, dtype=torch.float64))


def make_model(name: str, dtype=torch.float64, seed: int = 0, attn: str = "eager", **overrides):
    cls, _ = _configs()[name]
    cfg = config(name, **overrides)
    torch.manual_seed(seed)
    model = cls._from_config(cfg, attn_implementation=attn)
    model = model.to(dtype)
    randomize(model, seed)
    return model.eval()


def inputs(model, seed: int = 0, batch: int = 2, seq: int = 8) -> dict:
    from symalign.families import get_adapter

    x = get_adapter(model).dummy_inputs(model.config, batch=batch, seq=seq, seed=seed)
    return {k: (v.to(model.dtype) if v.is_floating_point() else v) for k, v in x.items()}


def output(model, x) -> torch.Tensor:
    with torch.no_grad():
        out = model(**x)
    return (out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state).double()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())
