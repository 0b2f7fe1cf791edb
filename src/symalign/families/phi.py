r"""Phi (phi-1, phi-1.5, phi-2): partial rotary, parallel attention + FF behind one LayerNorm, biases.

Layout (``model.`` prefix): ``layers.{i}.self_attn.{q,k,v}_proj`` (biases),
``self_attn.dense`` (O, bias), ``mlp.fc1``/``mlp.fc2`` (biases), ``input_layernorm``
read by both branches, ``final_layernorm``, ``embed_tokens``, ``lm_head`` (bias).
RoPE ``rotate_half`` on ``r = 2 len(inv_freq)`` dimensions (``partial_rotary_factor``):
``H(r) (+) GL(d - r)`` on Q-K. Residual ``O_1(D)`` after folding the LayerNorms.

``qk_layernorm=True`` puts a LayerNorm (centring, gain and bias over ``head_dim``,
shared by the heads) on Q and K before RoPE; it is refused, naming the option: the
exact group there (maps fixing the all-ones vector, commuting with the gain, the
bias and every rotation) is not mapped.
"""

from __future__ import annotations

from typing import Any

from symalign.families.base import Decoder, Family, refuse


class PhiFamily(Family):
    family = "Phi"
    model_types = ("phi",)
    decl = Decoder(o="self_attn.dense", gate=None, up=None, ff_in="mlp.fc1", down="mlp.fc2", norm="layer",
                   pre_attn_norm="input_layernorm", pre_ff_norm="input_layernorm", final_norm="final_layernorm")

    def check_config(self, config: Any) -> None:
        if bool(getattr(config, "qk_layernorm", False)):
            raise refuse(self.family, "qk_layernorm=True", "a LayerNorm with bias on Q and K per head is not mapped "
                         "(use qk_layernorm=False checkpoints, the released phi-1/1.5/2 setting)")
