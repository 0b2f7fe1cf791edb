r"""Activation matching: the whole-model assignments from activation statistics on data.

On a data sample, record for both models (forward hooks on the built-in
modules, flattened over batch and positions, ``N`` rows):

* the residual stream ``h`` at the input of every block and at ``norm_f``'s input:
  ``M = sum_n h_A h_B^T`` and ``O = polar(M)`` (Procrustes; the centred subgroup
  when the spec says so) -- ``h_A ~ O h_B``;
* the FF hidden activations ``a`` (output of ``mlp.act``) of each layer:
  ``perm = argmax_perm sum_i corr(a_A[:, i], a_B[:, perm[i]])`` (linear assignment on
  the Pearson cross-correlation);
* each head's contribution to the stream ``y_i = W_O^i z_i`` (input of ``o_proj``):
  head permutation minimising ``sum_i sum_n ||y_A^i - O y_B^{pi(i)}||^2`` (GQA-aware
  :func:`symalign.match.heads.assign_heads`).

The inside-head ``qk``/``vo`` elements are not identified by activations (the
``GL`` freedom leaves every activation unchanged); they are found from the
weights by :func:`match_attention` (stage 2 only) on B with the above applied.
A space the spec does not declare (e.g. ``residual`` under a sinusoidal PE) is
skipped.
"""

from __future__ import annotations

import time
from typing import Iterable

import torch
from torch import Tensor, nn

from symalign.errors import MatchError
from symalign.groups import Orthogonal, Permutation
from symalign.match.ff import assign, correlation
from symalign.match.heads import assign_heads
from symalign.match.residual import procrustes
from symalign.match.distance import distance
from symalign.match.whole import WholeMatch, attention_step, model_states, partition, validate_states
from symalign.spec import Transform, apply


@torch.no_grad()
def record(model: nn.Module, batches: Iterable[Tensor]) -> dict[str, Tensor]:
    """Activations of a built-in model: ``stream.{i}`` (input of block i; ``i = L``: final),
    ``ff.{i}`` (FF hidden), ``heads.{i}`` (``(N, h, D)`` per-head stream contributions)."""
    acts: dict[str, list[Tensor]] = {}
    hooks = []
    blocks = model.blocks  # type: ignore[attr-defined]
    n_layers = len(blocks)

    def put(key: str, x: Tensor) -> None:
        acts.setdefault(key, []).append(x.detach().to(torch.float64).reshape(-1, *x.shape[2:]))

    for i, blk in enumerate(blocks):
        hooks.append(blk.register_forward_pre_hook(lambda m, inp, i=i: put(f"stream.{i}", inp[0])))
        hooks.append(blk.mlp.act.register_forward_hook(lambda m, inp, out, i=i: put(f"ff.{i}", out)))

        def heads_hook(m, inp, i=i):
            z = inp[0]
            h, d = m.weight.shape[1] // blk.attn.cfg.head_dim, blk.attn.cfg.head_dim
            zz = z.reshape(*z.shape[:2], h, d).to(torch.float64)
            w = m.weight.detach().to(torch.float64).reshape(-1, h, d)
            put(f"heads.{i}", torch.einsum("btkd,Dkd->btkD", zz, w))

        hooks.append(blk.attn.o_proj.register_forward_pre_hook(heads_hook))
    hooks.append(model.norm_f.register_forward_pre_hook(  # type: ignore[attr-defined]
        lambda m, inp: put(f"stream.{n_layers}", inp[0])))
    try:
        was = model.training
        model.eval()
        for x in batches:
            model(x)
        model.train(was)
    finally:
        for h in hooks:
            h.remove()
    if not acts:
        raise MatchError("activation matching needs data: the sample was empty")
    return {k: torch.cat(v) for k, v in acts.items()}


def match_activations(model_a: nn.Module, model_b: nn.Module, batches: Iterable[Tensor] | Tensor | None, *,
                      stage2: str = "full") -> WholeMatch:
    """Whole-model transform of B from activation statistics on ``batches`` (see the module docstring).

    ``batches``: one input tensor or an iterable of them (same inputs for both models).
    Raises :class:`MatchError` without data or for incompatible models.
    """
    t0 = time.perf_counter()
    if batches is None:
        raise MatchError("activation matching needs data: pass a batch (or an iterable of batches) of inputs")
    if isinstance(batches, Tensor):
        batches = [batches]
    batches = list(batches)
    if not batches:
        raise MatchError("activation matching needs data: the sample was empty")
    spec, sa, sb = model_states(model_a, model_b)
    validate_states(spec, sa, sb)
    part = partition(spec)
    ra, rb = record(model_a, batches), record(model_b, batches)
    n_layers = len(model_a.blocks)  # type: ignore[attr-defined]
    transform: Transform = {}
    res = spec.spaces.get("residual")
    o = None
    if isinstance(res, Orthogonal):
        m = sum(ra[f"stream.{i}"].T @ rb[f"stream.{i}"] for i in range(n_layers + 1))
        o = procrustes(m, res)
        transform["residual"] = o
    elif isinstance(res, Permutation):
        c = sum(correlation(ra[f"stream.{i}"], rb[f"stream.{i}"]) for i in range(n_layers + 1))
        transform["residual"] = assign(c)
        o = Permutation(res.n).matrix(transform["residual"])
    for i in range(n_layers):
        if f"ff.{i}" in spec.spaces:
            transform[f"ff.{i}"] = assign(correlation(ra[f"ff.{i}"], rb[f"ff.{i}"]))
        hs = f"heads.{i}"
        if hs in spec.spaces:
            ya, yb = ra[hs], rb[hs]
            if o is not None:
                yb = yb @ o.T
            # cost[i, j] = sum_n ||ya_i - yb_j||^2
            cost = (ya.pow(2).sum((0, 2))[:, None] + yb.pow(2).sum((0, 2))[None, :]
                    - 2 * torch.einsum("nid,njd->ij", ya, yb))
            transform[hs] = assign_heads(cost, spec.spaces[hs])
    d0 = distance(spec, sa, sb)
    att = None
    if part.attention:
        head_spaces = [s for s in part.attention if s.startswith("heads.")]
        fixed = {k: v for k, v in transform.items() if k not in part.attention or k in head_spaces}
        cur = apply(spec, fixed, sb)
        att = attention_step(spec, part.attention, sa, cur, stage1=False, stage2=stage2)
        for k, v in att.transform.items():
            if k not in head_spaces:
                transform[k] = v
    d1 = distance(spec, sa, apply(spec, transform, sb))
    return WholeMatch(transform, spec, [d0, d1], True, "activation", att, time.perf_counter() - t0)
