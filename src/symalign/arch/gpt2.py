r"""GPT-2: fused, transposed ``Conv1D`` projections with biases; learned ``wpe``; tied head.

Layout per layer ``i`` (``Conv1D`` stores ``(in, out)``, ``y = x W + b``):

* ``h.{i}.attn.c_attn.weight`` ``(D, 3D)``: the head axis is **axis 1**, with
  Q, K, V in the segments ``(0, D)``, ``(D, D)``, ``(2D, D)``; head ``j`` at
  ``j d .. (j+1) d`` of each. Acting covariantly on axis 1 forms ``W T^T``, i.e.
  ``q -> T q``: exactly the convention of :mod:`symalign.groups`.
* ``h.{i}.attn.c_attn.bias`` ``(3D,)``: axis 0, same segments.
* ``h.{i}.attn.c_proj.weight`` ``(h d, D)``: the head axis is **axis 0**
  (contravariant for V-O). ``c_proj.bias`` is on the model axis: untouched.

Group: ``S_h x (GL(d) x GL(d))^h`` (learned absolute positions). The score scale
(``1/sqrt(d)``, ``scale_attn_by_inverse_layer_idx``, ``reorder_and_upcast_attn``)
is one scalar per layer and commutes with every element. Cross-attention
(``add_cross_attention``) is left out of the spec (its weights are untouched).
"""

from __future__ import annotations

from typing import Any

from symalign.arch.base import Adapter, AttentionLayout, Proj, bias_if, gl, heads_of
from symalign.nn.sites import ActivationSite, linear_heads_site


class GPT2Adapter(Adapter):
    family = "GPT-2"
    model_types = ("gpt2",)
    pairing = None
    auto_classes = ("AutoModelForCausalLM", "AutoModel")
    probe = "h.0.attn.c_attn.weight"

    def layouts(self, config: Any, prefix: str, keys: set[str]) -> list[AttentionLayout]:
        D, h, d, _ = heads_of(config)
        out = []
        for i in range(int(config.num_hidden_layers)):
            p = f"{prefix}h.{i}.attn."
            bias = bias_if(keys, p + "c_attn.bias", True)
            q, k, v = (Proj(p + "c_attn.weight", 1, (j * D, D), bias) for j in range(3))
            o = Proj(p + "c_proj.weight", 0)
            out.append(AttentionLayout(q, k, v, o, h, d, h, gl(d), gl(d)))
        return out

    def activation_sites(self, model: Any) -> list[ActivationSite]:
        """``residual`` at the input of every block ``h.i`` and of ``ln_f``; ``ff.i`` at the input of
        ``mlp.c_proj`` (after the GELU); ``heads.i`` at the input of ``attn.c_proj`` (a ``Conv1D``:
        weight ``(h d, D)``)."""
        config = model.config
        p = self.prefix(set(model.state_dict().keys()))

        def module(name: str):
            return model.get_submodule(p + name)

        sites = []
        for i in range(int(config.num_hidden_layers)):
            sites.append(ActivationSite("residual", module(f"h.{i}")))
            sites.append(ActivationSite(f"ff.{i}", module(f"h.{i}.mlp.c_proj")))
            sites.append(linear_heads_site(f"heads.{i}", module(f"h.{i}.attn.c_proj"), int(config.n_head),
                                           transposed=True))
        sites.append(ActivationSite("residual", module("ln_f")))
        return sites
