r"""GPT-J: interleaved partial rotary, parallel attention + FF behind one LayerNorm, head with a bias.

Layout (``transformer.`` prefix): ``h.{i}.attn.{q,k,v}_proj`` (no biases),
``attn.out_proj`` (no bias), ``mlp.fc_in``/``mlp.fc_out`` (biases), ``ln_1`` read by
both branches (``x + attn(ln_1 x) + mlp(ln_1 x)``), ``ln_f``, ``wte``, ``lm_head``
(with a bias). RoPE rotates the first ``rotary_dim`` dimensions of each head in
adjacent pairs (``rotate_every_two``: pairing ``interleaved``): Q-K group
``H(r, interleaved) (+) GL(d - r)``. ``ln_1``'s gain and bias fold into Q/K/V and
``fc_in`` together, ``ln_f``'s into ``lm_head`` (weight and bias): residual ``O_1(D)``.
"""

from __future__ import annotations

from typing import Any

from symalign.errors import ConfigError
from symalign.families.base import Decoder, Family
from symalign.families.declared import DECODER, Case, Tiny
from symalign.tolerance import FLOAT32_COMPUTE_FLOOR


class GPTJFamily(Family):
    family = "GPT-J"
    model_types = ("gptj",)
    pairing = "interleaved"
    decl = Decoder(layer="h.{i}.", q="attn.q_proj", k="attn.k_proj", v="attn.v_proj", o="attn.out_proj",
                   gate=None, up=None, ff_in="mlp.fc_in", down="mlp.fc_out", ff_act="activation_function",
                   norm="layer", pre_attn_norm="ln_1", pre_ff_norm="ln_1", embed="wte", final_norm="ln_f",
                   heads=("lm_head",), base="transformer.")
    tiny = Tiny("GPTJForCausalLM", "GPTJConfig", {**DECODER, "rotary_dim": 4})
    probe_kw = {"rotary_dim": 4}
    cases = (Case(probe=True, groups={"qk.0": "H(4,interleaved)+GL(4)^4"}, residual="O_1(32)", streamed=("big",),
                  row="GPT-J (rotary_dim 4)"),
             Case({"tie_word_embeddings": True}))

    @property
    def precision_floor(self) -> float:  # type: ignore[override]
        """transformers' GPT-J computes the attention scores in float32 whatever the weights' dtype."""
        return FLOAT32_COMPUTE_FLOOR

    def rotary(self, config: Any, d: int) -> int | None:
        r = getattr(config, "rotary_dim", None)
        if r is None:
            raise ConfigError(f"{self.family}: rotary_dim=None applies a {config.hidden_size}-wide sinusoid table "
                              "to each head; set rotary_dim (at most head_dim)")
        if not 0 < int(r) <= d or int(r) % 2:
            raise ConfigError(f"{self.family}: rotary_dim={r} must be even and in (0, head_dim={d}]")
        return int(r)
