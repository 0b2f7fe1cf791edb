r"""GPT-2: LayerNorm and a tied head; the stream has the centred subgroup ``O_1(D)``.

``ln_1``/``ln_2`` fold into ``c_attn``/``c_fc`` (``Conv1D`` stores ``(in, out)``:
``W <- diag(g) W``, ``bias <- bias + b W``; then ``g = 1, b = 0``). The norm keeps
its centring ``C``, so a rotation must commute with it: the group is
``O_1(D) = {O in O(D): O 1 = 1}`` (:class:`~symalign.groups.CenteredOrthogonal`).
``ln_f``'s gain cannot be folded into the tied head, so the head is **untied**:
``lm_head = wte diag(g_f)``, ``ln_f.bias <- b_f / g_f`` (rotates covariantly),
``ln_f.weight <- 1``, and the output config gets ``tie_word_embeddings = false``.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import Tensor

from symalign.errors import MatchError
from symalign.families.common import RESIDUAL, Prepared, back, copy_spec, ff_group, prefix_of, to_f64
from symalign.groups import CenteredOrthogonal
from symalign.spec import SymmetrySpec


def prepare_gpt2(config: Any, state: Mapping[str, Tensor], att: SymmetrySpec) -> Prepared:
    s, dt = to_f64(state)
    p = prefix_of(s, "h.0.attn.c_attn.weight")
    D = int(config.hidden_size)
    spec = copy_spec(att)
    spec.add_space(RESIDUAL, CenteredOrthogonal(D), "residual")
    for t in ("wte.weight", "wpe.weight"):
        spec.act_on(p + t, RESIDUAL, 1, "co")
    d_ff = int(getattr(config, "n_inner", None) or 4 * D)
    for i in range(int(config.num_hidden_layers)):
        lp = f"{p}h.{i}."
        for ln, lin in (("ln_1", "attn.c_attn"), ("ln_2", "mlp.c_fc")):
            g, b = s[f"{lp}{ln}.weight"], s[f"{lp}{ln}.bias"]
            w = s[f"{lp}{lin}.weight"]
            s[f"{lp}{lin}.bias"] = s[f"{lp}{lin}.bias"] + b @ w
            s[f"{lp}{lin}.weight"] = g[:, None] * w
            s[f"{lp}{ln}.weight"] = torch.ones_like(g)
            s[f"{lp}{ln}.bias"] = torch.zeros_like(b)
            spec.act_on(f"{lp}{lin}.weight", RESIDUAL, 0, "contra")
        for out in ("attn.c_proj", "mlp.c_proj"):
            spec.act_on(f"{lp}{out}.weight", RESIDUAL, 1, "co")
            spec.act_on(f"{lp}{out}.bias", RESIDUAL, 0, "co")
        ff = f"ff.{i}"
        spec.add_space(ff, ff_group(getattr(config, "activation_function", None), d_ff), "ff", i)
        spec.act_on(f"{lp}mlp.c_fc.weight", ff, 1)
        spec.act_on(f"{lp}mlp.c_fc.bias", ff, 0)
        spec.act_on(f"{lp}mlp.c_proj.weight", ff, 0, "contra")
    gf, bf = s[p + "ln_f.weight"], s[p + "ln_f.bias"]
    if bool((gf == 0).any()):
        raise MatchError("--scope model: ln_f has a zero gain; its bias cannot be moved behind the head exactly")
    notes = ["LayerNorm gains/biases of ln_1/ln_2 folded into c_attn/c_fc"]
    head = s.get("lm_head.weight", s[p + "wte.weight"])
    untied = bool(getattr(config, "tie_word_embeddings", True))
    if untied:
        notes.append("lm_head untied from wte (tie_word_embeddings=false) to fold ln_f's gain exactly")
    s["lm_head.weight"] = head * gf
    s[p + "ln_f.bias"] = bf / gf
    s[p + "ln_f.weight"] = torch.ones_like(gf)
    dt.setdefault("lm_head.weight", dt[p + "wte.weight"])
    spec.act_on("lm_head.weight", RESIDUAL, 1, "contra")
    spec.act_on(p + "ln_f.bias", RESIDUAL, 0, "co")
    return Prepared(back(s, dt, torch.float32), spec, untied, notes)
