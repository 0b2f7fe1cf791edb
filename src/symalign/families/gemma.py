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
  and a RoPE table per layer type (``sliding_attention`` / ``full_attention``, each with
  its own ``rope_parameters``). The types may rotate different widths of each head: a
  ``partial_rotary_factor`` ``p`` under ``rope_type="proportional"`` keeps the whole
  head's ``rotate_half`` planes ``(k, k + d/2)`` and zeroes the frequencies of all but
  the first ``r/2 = floor(p d / 2)``. Each layer then gets the group of its own type:
  ``+-1`` on each turning plane and on each of the ``d - r`` unrotated coordinates, the
  gain scales likewise (:meth:`Gemma3Family.rotary_layers`). Other RoPE types with
  ``p < 1`` give a table shorter than the head, which transformers' Gemma 3 cannot
  apply (its forward fails): refused naming ``rope_parameters``.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from symalign.arch.rope import rotary_module
from symalign.families.base import Decoder, Family, refuse
from symalign.families.declared import DECODER, Case, Tiny
from symalign.groups import PlaneSigns

_POST = dict(pre_attn_norm="input_layernorm", post_attn_norm="post_attention_layernorm",
             pre_ff_norm="pre_feedforward_layernorm", post_ff_norm="post_feedforward_layernorm")


class GemmaFamily(Family):
    family = "Gemma"
    model_types = ("gemma",)
    decl = Decoder(norm="rms1p")
    tiny = Tiny("GemmaForCausalLM", "GemmaConfig", {**DECODER, "num_key_value_heads": 2, "head_dim": 16})
    probe_kw = {"head_dim": 4, "num_key_value_heads": 1}
    cases = (Case(probe=True, row="Gemma"), Case({"tie_word_embeddings": False}, residual="O(32)"),
             Case({"tie_word_embeddings": True}, exact=False, residual="S_32"))


class Gemma2Family(Family):
    family = "Gemma 2"
    model_types = ("gemma2",)
    decl = Decoder(norm="rms1p", **_POST)
    tiny = Tiny("Gemma2ForCausalLM", "Gemma2Config", {**DECODER, "num_key_value_heads": 2, "head_dim": 16,
                                                       "sliding_window": 4, "query_pre_attn_scalar": 16})
    probe_kw = {"head_dim": 4, "num_key_value_heads": 1}
    cases = (Case(probe=True, groups={"qk.0": "H(16,half)^2"}, streamed=("float32", "merge"),
                  row="Gemma 2 (soft-capping)"),
             Case({"attn_logit_softcapping": None, "final_logit_softcapping": None}),
             Case({"tie_word_embeddings": True}, exact=False, residual="S_32"))


class Gemma3Family(Family):
    family = "Gemma 3"
    model_types = ("gemma3_text",)
    decl = Decoder(norm="rms1p", q_norm="self_attn.q_norm", k_norm="self_attn.k_norm", **_POST)
    tiny = Tiny("Gemma3ForCausalLM", "Gemma3TextConfig", {
        **DECODER, "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 4, "query_pre_attn_scalar": 16,
        "layer_types": ["sliding_attention", "full_attention"]})
    probe_kw = {"head_dim": 4, "num_key_value_heads": 1, "rms_norm_eps": 1e-2}  # eps: declared.PROBE
    cases = (Case(probe=True, row="Gemma 3 (QK-norm, 1 + w gains)"),
             Case({"tie_word_embeddings": True}, exact=False, residual="S_32"),
             # layer 1 (full attention) rotates 1 of the head's 2 planes (proportional RoPE), layer 0 (sliding) both
             Case({"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                       "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                                                          "rope_theta": 1e6}}},
                  exact=False, row="Gemma 3, full layer: proportional RoPE 0.5", layer=1))

    def rotary_layers(self, config: Any, d: int) -> list[int | None]:
        """Each layer's rotated width: that of its layer type's RoPE table (module doc).

        transformers' Gemma 3 multiplies the whole head by its type's ``cos``/``sin``, so
        every table has ``d / 2`` frequencies; a partial rotation is a table whose last
        frequencies are zero (``rope_type="proportional"`` with a ``partial_rotary_factor``):
        ``r = 2 * (number of nonzero frequencies)``, and the group is
        :class:`~symalign.groups.PlaneSigns` with ``proportional=True`` (:meth:`qk_group`).
        A table of another length cannot run (the rotation fails on a shape mismatch), and
        zeros that do not trail would not be planes of a partial rotation: both are refused
        naming ``rope_parameters``.
        """
        rot = rotary_module(config, "gemma3")
        width = {}
        for t in sorted(set(config.layer_types)):
            inv = getattr(rot, f"{t}_inv_freq")
            if 2 * int(inv.numel()) != d:
                raise refuse(self.family, "rope_parameters", f"the {t} RoPE table has {int(inv.numel())} "
                             f"frequencies for head_dim={d}, and transformers' Gemma 3 applies it to the whole head "
                             f"(its forward fails); rotate part of a head with rope_type 'proportional' instead")
            nonzero = int((inv != 0).sum())
            if not bool((inv[:nonzero] != 0).all()):
                raise refuse(self.family, "rope_parameters", f"the {t} RoPE table has zero frequencies before "
                             "nonzero ones: not a partial rotation of the head's first planes")
            width[t] = 2 * nonzero
        return [width[t] for t in config.layer_types]

    def qk_group(self, config: Any, d: int, r: int | None):
        """``PlaneSigns`` on the layer's turning planes: the first ``r / 2`` of the whole head (proportional)."""
        return PlaneSigns(d, "half", r if r is not None else 0, proportional=True)

    def position_embeddings(self, model: nn.Module, i: int, x: Tensor, positions: Tensor) -> Any:
        return model.base_model.rotary_emb(x, positions, model.config.layer_types[i])
