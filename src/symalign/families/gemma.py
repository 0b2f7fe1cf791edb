r"""Gemma, Gemma 2 and Gemma 3 (text): ``(1 + w)`` RMSNorm gains, GeGLU, ``head_dim != D / h``.

Common to the three: ``q/k/v/o_proj`` with ``head_dim`` from the config (``h d`` need not
be ``D``), RoPE ``rotate_half`` over the whole head, a gated FF (GELU-tanh), every
RMSNorm multiplying by ``1 + w`` (stored ``w``), the embedding scaled by ``sqrt(D)`` (a
scalar: it commutes with every residual map), a head tied to the embedding by default.

* **Gemma**: pre-norms only. Untied head: the gains ``1 + w`` fold into the readers
  (``w <- 0``), residual ``O(D)``. Tied head: ``S_D``, every ``w`` permuted with the
  stream (``1 + P w = P (1 + w)``).
* **Gemma 2**: pre- and post-norms on both branches (``input_layernorm``,
  ``post_attention_layernorm``, ``pre_feedforward_layernorm``,
  ``post_feedforward_layernorm``), attention logit soft-capping
  ``c tanh(s / c)`` (elementwise on the scores: any map preserving every score keeps
  it), sliding-window layers (a mask), final logit soft-capping (on the output): the
  attention group is Llama's; the residual group is ``S_D`` with permuted gains.
* **Gemma 3**: Gemma 2's layout plus per-head QK-norm ``q_norm``/``k_norm`` over
  ``head_dim`` with ``(1 + w)`` gains shared by the heads: Q-K group ``+-1`` per
  plane, gain rescalings acting on ``1 + w`` (:class:`~symalign.groups.OffsetPerHead`),
  and a RoPE table per layer type (``sliding_attention`` / ``full_attention``: both
  must rotate the same width, else the layer types would need different groups and
  the config is refused naming ``rope_parameters``).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from symalign.arch.rope import rotary_module
from symalign.errors import ConfigError
from symalign.families.base import Decoder, Family, refuse

_POST = dict(pre_attn_norm="input_layernorm", post_attn_norm="post_attention_layernorm",
             pre_ff_norm="pre_feedforward_layernorm", post_ff_norm="post_feedforward_layernorm")


class GemmaFamily(Family):
    family = "Gemma"
    model_types = ("gemma",)
    decl = Decoder(norm="rms1p")


class Gemma2Family(Family):
    family = "Gemma 2"
    model_types = ("gemma2",)
    decl = Decoder(norm="rms1p", **_POST)


class Gemma3Family(Family):
    family = "Gemma 3"
    model_types = ("gemma3_text",)
    decl = Decoder(norm="rms1p", q_norm="self_attn.q_norm", k_norm="self_attn.k_norm", **_POST)

    def rotary(self, config: Any, d: int) -> int | None:
        rot = rotary_module(config, "gemma3")
        widths = {2 * int(getattr(rot, f"{t}_inv_freq").numel()) for t in sorted(set(config.layer_types))}
        if len(widths) != 1:
            raise refuse(self.family, "rope_parameters", f"the layer types rotate different widths {sorted(widths)} "
                         "of each head, so their Q-K groups differ")
        r = widths.pop()
        if not 0 < r <= d:
            raise ConfigError(f"{self.family}: RoPE rotates {r} of head_dim={d} dimensions")
        return r

    def position_embeddings(self, model: nn.Module, i: int, x: Tensor, positions: Tensor) -> Any:
        return model.base_model.rotary_emb(x, positions, model.config.layer_types[i])
