"""Fused tensors (GPT-2's ``c_attn``: columns ``[Q | K | V]``) are read by their segments in every solver.

The reference is :func:`symalign.arch.fused.split_segments` (one virtual tensor per segment) and
:func:`symalign.spec.apply` (the exact action); nothing here splits before calling a solver.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from hf_tiny import randomize  # noqa: E402
from _match_util import rel  # noqa: E402

from symalign.arch.fused import split_segments  # noqa: E402
from symalign.data import eval_batches, load_dataset  # noqa: E402
from symalign.experiments.protocol import relative_output_change, scope_spaces  # noqa: E402
from symalign.lmc import full_state  # noqa: E402
from symalign.match import match_attention  # noqa: E402
from symalign.match.latents import Latents  # noqa: E402
from symalign.match.learned import learn_matching  # noqa: E402
from symalign.match.whole import match_whole  # noqa: E402
from symalign.models import build_model  # noqa: E402
from symalign.models.hf import fit_hf_config  # noqa: E402
from symalign.spec import apply, sample  # noqa: E402

CONTEXT = 16


def gpt2(seed: int):
    ds = load_dataset("synthetic", kind="lm")
    cfg = fit_hf_config({"family": "hf:gpt2", "n_embd": 16, "n_layer": 2, "n_head": 4, "n_inner": 32}, ds, CONTEXT)
    model = build_model(cfg, 0)
    randomize(model.hf, seed)
    return model.double().eval(), ds


def fused(spec) -> bool:
    return any(a.segment is not None for acts in spec.tensors.values() for a in acts)


def test_attention_matcher_reads_segments():
    """Planted B = g . A on GPT-2's fused attention: the matcher on the fused tensors returns what it
    returns on the split view, and recovers A."""
    model, _ = gpt2(3)
    spec = model.symmetry_spec()
    spec = spec.restrict(scope_spaces(spec, "all-attention", 2))
    assert fused(spec)
    sa = full_state(model)
    sb = {**sa, **apply(spec, sample(spec, 11), sa)}
    res = match_attention(spec, sa, sb)
    view, (va, vb) = split_segments(spec, sa, sb)
    ref = match_attention(view, va, vb)
    assert set(res.transform) == set(ref.transform)
    for k, v in ref.transform.items():
        assert torch.allclose(res.transform[k].double(), v.double(), rtol=0, atol=1e-12), k
    assert res.totals["distance_after"] == pytest.approx(ref.totals["distance_after"], rel=1e-9, abs=1e-20)
    sb2 = {**sb, **res.apply(sb)}
    assert rel(sa, sb2, list(spec.tensors)) <= 1e-8


@pytest.mark.parametrize("spaces", [None, ["qk.0", "ff.1"], ["residual"]])
def test_soft_action_on_segments_is_the_exact_action(spaces):
    """At their starting point the latents act exactly as the group elements do, on the fused tensors too,
    whether the spaces acting on a segment are learned or fixed; the action is differentiable."""
    model, _ = gpt2(4)
    arch = model.rewritten_model()[0]
    spec = arch.symmetry_spec()
    assert fused(spec)
    state = full_state(arch)
    g = sample(spec, 5)
    lat = Latents(spec, g, spaces)
    soft = lat.soft_apply(state)
    want = apply(spec, g, state)
    for t in spec.tensors:
        assert torch.allclose(soft[t].detach(), want[t], rtol=1e-10, atol=1e-10), t
    sum(soft[t].pow(2).sum() for t in spec.tensors).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in lat.parameters())


def test_learn_matching_on_fused_tensors_restricted_spaces():
    """Learned matching on GPT-2 (fused ``c_attn``), learning only some spaces: runs, and B' computes B's
    function (it used to refuse fused tensors, and to fail with a shape error for fixed spaces)."""
    ma, ds = gpt2(5)
    mb, _ = gpt2(6)
    a, b = ma.rewritten_model()[0], mb.rewritten_model()[0]
    spec = a.symmetry_spec()
    sa, sb = full_state(a), full_state(b)
    init = match_whole(spec, sa, sb, max_sweeps=2)
    batches = list(eval_batches(ds, "train", 4, CONTEXT, 16))
    res = learn_matching(a, b, batches, steps=3, lr=0.05, init=init, spaces=["qk.0", "vo.1", "ff.0"])
    assert len(res.losses) == 3 and res.selected in ("learned", "weight")
    moved = {k for k in spec.spaces if not torch.equal(res.transform[k], init.transform[k])}
    assert moved <= {"qk.0", "vo.1", "ff.0"}
    x = batches[0][0]
    assert relative_output_change(a, {**sb, **apply(spec, res.transform, sb)}, sb, x) <= 1e-10
