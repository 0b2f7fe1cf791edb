"""Print the families table of docs/symmetry.md: each family's layer-0 attention, measured vs declared.

Usage: ``.venv/bin/python benchmarks/families_table.py [--out results/families-probe.json]`` (about 30 s);
``--out`` writes both tables (``tables.attention``, ``tables.moe``) with provenance to a result file that
``symalign docs`` writes into docs/symmetry.md. Tiny random transformers models built
from configs (D=16, 2 heads, head_dim 4 or 8, one K/V head where the family has GQA), O(1) random weights,
dense float64 Jacobian of the real attention module (``symalign.probe.families.probe_layer``); T5: each of its
three kinds of attention layer.
"""

from __future__ import annotations

import torch
import transformers as T

from symalign.families import get_adapter
from symalign.probe.families import probe_layer, probe_moe_block

BASE = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16, vocab_size=32,
            max_position_embeddings=32, pad_token_id=0, bos_token_id=1, eos_token_id=2)
GQA = dict(num_key_value_heads=1, head_dim=4)
# QK-norm: scaling one head's W_Q (or W_K) rows is undone by the norm up to its eps, a near-symmetry with singular
# values ~ eps that the probe refuses to classify at eps = 1e-6; a larger eps separates it (tests/test_families.py).
EPS = dict(rms_norm_eps=1e-2)
ROWS = [
    ("Llama (GQA)", T.LlamaForCausalLM, T.LlamaConfig(**GQA, **BASE)),
    ("Mistral (GQA)", T.MistralForCausalLM, T.MistralConfig(**GQA, **BASE)),
    ("Qwen2 (GQA, Q/K/V biases)", T.Qwen2ForCausalLM, T.Qwen2Config(**GQA, **BASE)),
    ("GPT-NeoX (rotary_pct 0.5, biases)", T.GPTNeoXForCausalLM, T.GPTNeoXConfig(rotary_pct=0.5, **BASE)),
    ("GPT-NeoX (no biases)", T.GPTNeoXForCausalLM, T.GPTNeoXConfig(rotary_pct=0.5, attention_bias=False, **BASE)),
    ("Falcon (multi-query, parallel)", T.FalconForCausalLM, T.FalconConfig(**BASE)),
    ("Falcon (new decoder, 1 K/V head)", T.FalconForCausalLM,
     T.FalconConfig(new_decoder_architecture=True, num_kv_heads=1, **BASE)),
    ("Falcon (per-head fused, biases)", T.FalconForCausalLM, T.FalconConfig(multi_query=False, bias=True, **BASE)),
    ("Falcon ALiBi (multi-query)", T.FalconForCausalLM, T.FalconConfig(alibi=True, **BASE)),
    ("Falcon ALiBi (new decoder, 1 K/V head)", T.FalconForCausalLM,
     T.FalconConfig(alibi=True, new_decoder_architecture=True, num_kv_heads=1, **BASE)),
    ("Falcon ALiBi (per-head fused, biases)", T.FalconForCausalLM,
     T.FalconConfig(alibi=True, multi_query=False, bias=True, **BASE)),
    ("GPT-J (rotary_dim 4)", T.GPTJForCausalLM, T.GPTJConfig(rotary_dim=4, **BASE)),
    ("Phi (partial 0.5, biases)", T.PhiForCausalLM, T.PhiConfig(**BASE)),
    ("Phi + qk_layernorm (affine QK-norm)", T.PhiForCausalLM, T.PhiConfig(qk_layernorm=True, **BASE)),
    ("Phi-3 (fused qkv)", T.Phi3ForCausalLM, T.Phi3Config(num_key_value_heads=1, **BASE)),
    ("Qwen3 (QK-norm per head)", T.Qwen3ForCausalLM, T.Qwen3Config(**GQA, **EPS, **BASE)),
    ("Qwen3 + attention_bias", T.Qwen3ForCausalLM, T.Qwen3Config(attention_bias=True, **GQA, **EPS, **BASE)),
    ("OLMo 2 (QK-norm over all heads)", T.Olmo2ForCausalLM, T.Olmo2Config(num_key_value_heads=1, **EPS, **BASE)),
    ("OLMo 2, h_kv = h", T.Olmo2ForCausalLM, T.Olmo2Config(**EPS, **BASE)),
    ("Gemma", T.GemmaForCausalLM, T.GemmaConfig(**GQA, **BASE)),
    ("Gemma 2 (soft-capping)", T.Gemma2ForCausalLM, T.Gemma2Config(query_pre_attn_scalar=4, **GQA, **BASE)),
    ("Gemma 3 (QK-norm, 1 + w gains)", T.Gemma3ForCausalLM, T.Gemma3TextConfig(query_pre_attn_scalar=4, **GQA, **EPS, **BASE)),
    # layer 1 (full attention) rotates 1 of the head's 2 planes (proportional RoPE), layer 0 (sliding) both
    ("Gemma 3, full layer: proportional RoPE 0.5", T.Gemma3ForCausalLM,
     T.Gemma3TextConfig(query_pre_attn_scalar=4, layer_types=["sliding_attention", "full_attention"],
                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                                                            "rope_theta": 1e6}},
                        **GQA, **EPS, **{**BASE, "num_hidden_layers": 2}), 1),
    ("Mixtral (GQA)", T.MixtralForCausalLM, T.MixtralConfig(num_local_experts=4, **GQA, **BASE)),
    ("Qwen2-MoE (GQA, Q/K/V biases)", T.Qwen2MoeForCausalLM,
     T.Qwen2MoeConfig(num_experts=4, moe_intermediate_size=4, shared_expert_intermediate_size=4, **GQA, **BASE)),
    ("OLMoE (QK-norm over all heads)", T.OlmoeForCausalLM, T.OlmoeConfig(num_experts=4, num_key_value_heads=1, **EPS,
                                                                         **BASE)),
]
# Mixture-of-experts blocks (layer 0's router + experts [+ shared expert]): D = 8, E = 4 experts, top-2, F = 4.
MOE = dict(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=4,
           vocab_size=32, max_position_embeddings=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
           num_experts_per_tok=2)
MOE_ROWS = [
    ("Mixtral (renormalised top-2)", T.MixtralForCausalLM, T.MixtralConfig(num_local_experts=4, **MOE)),
    ("Qwen2-MoE (shared expert F_s = 4)", T.Qwen2MoeForCausalLM,
     T.Qwen2MoeConfig(num_experts=4, moe_intermediate_size=4, shared_expert_intermediate_size=4, **MOE)),
    ("Qwen2-MoE, norm_topk_prob", T.Qwen2MoeForCausalLM,
     T.Qwen2MoeConfig(num_experts=4, moe_intermediate_size=4, shared_expert_intermediate_size=4,
                      norm_topk_prob=True, **MOE)),
    ("OLMoE", T.OlmoeForCausalLM, T.OlmoeConfig(num_experts=4, **MOE)),
]
# T5: every attention site of a one-block encoder-decoder (layer numbers: encoder 0, decoder self 1, cross 2)
T5 = T.T5Config(d_model=16, num_heads=2, d_kv=4, d_ff=16, num_layers=1, num_decoder_layers=1, vocab_size=32,
                decoder_start_token_id=0)
ROWS += [(f"T5 ({site})", T.T5ForConditionalGeneration, T5, i)
         for i, site in enumerate(["encoder self-attention", "decoder self-attention, causal", "cross-attention"])]


def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = 1.0 if "norm" in name and name.endswith("weight") and "Gemma" not in type(model).__name__ else 0.0
            scale = 1.5 / p.shape[-1] ** 0.5 if p.dim() >= 2 else 0.2
            p.copy_(base + scale * torch.randn(p.shape, generator=g, dtype=torch.float64))


def _random_model(cls, cfg):
    """The transformers model ``cls`` of ``cfg`` in float64, eager kernels, generic random weights."""
    model = cls._from_config(cfg, attn_implementation="eager", experts_implementation="eager")
    model = model.to(torch.float64).eval()
    randomize(model)
    return model


def _row(name: str, r) -> dict:
    """One table row (cells) of a probe result (:class:`symalign.probe.families` row)."""
    return {"family": name, "parameters": r.parameters,
            "nullity": f"{r.nullity}" + ("" if r.match else " **MISMATCH**"), "declared": r.declared,
            "group": f"{r.group}: " + ", ".join(f"{k.split('.')[0]} {v}" for k, v in r.describe.items()),
            "gauge": ", ".join(f"{k} {v}" for k, v in r.gauge.items()) or "-", "gap": f"{r.gap:.0e}",
            "match": bool(r.match)}


def main() -> None:
    import argparse
    import shlex
    import sys
    from pathlib import Path

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="write the result file for `symalign docs`")
    args = ap.parse_args()
    T.utils.logging.set_verbosity_error()
    torch.set_num_threads(1)
    attention = []
    for name, cls, cfg, *layer in ROWS:
        model = _random_model(cls, cfg)
        attention.append(_row(name, probe_layer(get_adapter(model), model, layer[0] if layer else 0)))
    moe = []
    for name, cls, cfg in MOE_ROWS:
        model = _random_model(cls, cfg)
        moe.append(_row(name, probe_moe_block(get_adapter(model), model, 0)))
    cols = [("family", "family (config)"), ("parameters", "params"), ("nullity", "measured nullity"),
            ("declared", "declared"), ("group", "group terms"), ("gauge", "bias gauges"), ("gap", "gap")]
    moe_cols = [("family", "MoE block (config)"), ("parameters", "params"), ("nullity", "measured nullity"),
                ("declared", "declared"), ("group", "group"), ("gauge", "undeclared, named"), ("gap", "gap")]
    for rows, c in ((attention, cols), (moe, moe_cols)):
        print("| " + " | ".join(h for _, h in c) + " |")
        print("|" + "---|" * len(c))
        for r in rows:
            print("| " + " | ".join(str(r[k]) for k, _ in c) + " |")
        print()
    if args.out:
        from symalign.atomic import write_json
        from symalign.experiments.docs_tables import make_table
        from symalign.provenance import provenance

        command = shlex.join(["python", "benchmarks/families_table.py", *sys.argv[1:]])
        write_json(args.out, {"provenance": provenance(command, 1),
                              "tables": {"attention": make_table(attention, cols), "moe": make_table(moe, moe_cols)},
                              "rows": {"attention": attention, "moe": moe}})
    if not all(r["match"] for r in attention + moe):
        sys.exit("some rows do not match (marked **MISMATCH**)")


if __name__ == "__main__":
    main()
