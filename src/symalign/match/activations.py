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

The statistics are accumulated batch by batch (:class:`PairStats`: sums, sums of squares and
cross products), in two passes over the sample -- the stream and FF statistics, then the head
costs with ``O`` known -- so memory is ``O(L (D^2 + d_ff^2 + h^2))`` whatever the sample size
(recording every activation, ``~ 9 N D`` float64 values per layer and model, ran a 6-layer
``D = 256`` GPT out of 24 GB at ``N = 164k`` tokens).

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
from symalign.match.ff import assign
from symalign.match.heads import assign_heads
from symalign.match.residual import procrustes
from symalign.match.distance import distance
from symalign.match.whole import WholeMatch, attention_step, model_states, partition, validate_states
from symalign.spec import Transform, apply


class PairStats:
    """Running sums over ``N`` rows of paired activations ``a`` ``(N, p)`` of A and ``b`` ``(N, q)`` of B
    (float64): ``n``, column sums, column sums of squares and the cross product ``sum_n a_n b_n^T``.

    Memory ``O(p q)`` whatever ``N``: the statistics of a sample are accumulated batch by batch.
    """

    def __init__(self) -> None:
        self.n = 0
        self.sum_a = self.sum_b = self.sq_a = self.sq_b = self.cross = None  # type: ignore[assignment]

    def add(self, a: Tensor, b: Tensor) -> None:
        a, b = a.to(torch.float64), b.to(torch.float64)
        if self.n == 0:
            self.sum_a, self.sum_b = a.sum(0), b.sum(0)
            self.sq_a, self.sq_b = a.pow(2).sum(0), b.pow(2).sum(0)
            self.cross = a.T @ b
        else:
            self.sum_a += a.sum(0)
            self.sum_b += b.sum(0)
            self.sq_a += a.pow(2).sum(0)
            self.sq_b += b.pow(2).sum(0)
            self.cross += a.T @ b
        self.n += a.shape[0]

    def correlation(self, eps: float = 1e-12) -> Tensor:
        """Pearson ``corr[i, j]`` of column ``i`` of A and ``j`` of B:
        ``(S_ab - n mu_a mu_b^T) / (sigma_a sigma_b^T)``, ``sigma = sqrt(S_aa - n mu^2)``."""
        mu_a, mu_b = self.sum_a / self.n, self.sum_b / self.n
        cov = self.cross - self.n * torch.outer(mu_a, mu_b)
        sd_a = (self.sq_a - self.n * mu_a.pow(2)).clamp_min(0).sqrt().clamp_min(eps)
        sd_b = (self.sq_b - self.n * mu_b.pow(2)).clamp_min(0).sqrt().clamp_min(eps)
        return cov / (sd_a[:, None] * sd_b[None, :])


class _Recorder:
    """Forward hooks on a built-in model that keep the current batch's activations: ``stream.{i}``
    (input of block ``i``; ``i = L``: of ``norm_f``), ``ff.{i}`` (FF hidden) and, with ``heads=True``,
    ``heads.{i}`` (``(N, h, D)``: head ``k``'s contribution ``W_O^k z_k`` to the stream)."""

    def __init__(self, model: nn.Module, heads: bool):
        self.model, self.acts, self.hooks = model, {}, []
        blocks = model.blocks  # type: ignore[attr-defined]
        for i, blk in enumerate(blocks):
            if heads:
                self.hooks.append(blk.attn.o_proj.register_forward_pre_hook(
                    lambda m, inp, i=i, blk=blk: self._heads(i, blk, m, inp[0])))
            else:
                self.hooks.append(blk.register_forward_pre_hook(lambda m, inp, i=i: self._put(f"stream.{i}", inp[0])))
                self.hooks.append(blk.mlp.act.register_forward_hook(lambda m, inp, out, i=i: self._put(f"ff.{i}", out)))
        if not heads:
            self.hooks.append(model.norm_f.register_forward_pre_hook(  # type: ignore[attr-defined]
                lambda m, inp: self._put(f"stream.{len(blocks)}", inp[0])))

    def _put(self, key: str, x: Tensor) -> None:
        self.acts[key] = x.detach().to(torch.float64).reshape(-1, *x.shape[2:])

    def _heads(self, i: int, blk: nn.Module, m: nn.Module, z: Tensor) -> None:
        d = blk.attn.cfg.head_dim
        h = m.weight.shape[1] // d
        zz = z.reshape(*z.shape[:2], h, d).to(torch.float64)
        w = m.weight.detach().to(torch.float64).reshape(-1, h, d)
        self._put(f"heads.{i}", torch.einsum("btkd,Dkd->btkD", zz, w))

    def close(self) -> None:
        for h in self.hooks:
            h.remove()


@torch.no_grad()
def _passes(model_a: nn.Module, model_b: nn.Module, batches: list[Tensor], heads: bool):
    """Yield the two models' activations (:class:`_Recorder`) batch by batch, in eval mode."""
    rec_a, rec_b = _Recorder(model_a, heads), _Recorder(model_b, heads)
    modes = (model_a.training, model_b.training)
    try:
        model_a.eval()
        model_b.eval()
        for x in batches:
            model_a(x)
            model_b(x)
            yield rec_a.acts, rec_b.acts
    finally:
        rec_a.close()
        rec_b.close()
        model_a.train(modes[0])
        model_b.train(modes[1])


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
    n_layers = len(model_a.blocks)  # type: ignore[attr-defined]
    # pass 1: residual stream and FF statistics (memory O(D^2 + d_ff^2) per layer, whatever the sample size)
    stats: dict[str, PairStats] = {}
    for acts_a, acts_b in _passes(model_a, model_b, batches, heads=False):
        for k, xa in acts_a.items():
            stats.setdefault(k, PairStats()).add(xa, acts_b[k])
    transform: Transform = {}
    res = spec.spaces.get("residual")
    streams = [stats[f"stream.{i}"] for i in range(n_layers + 1)]
    o = None
    if isinstance(res, Orthogonal):
        o = procrustes(sum(st.cross for st in streams), res)
        transform["residual"] = o
    elif isinstance(res, Permutation):
        transform["residual"] = assign(sum(st.correlation() for st in streams))
        o = Permutation(res.n).matrix(transform["residual"])
    for i in range(n_layers):
        if f"ff.{i}" in spec.spaces:
            transform[f"ff.{i}"] = assign(stats[f"ff.{i}"].correlation())
    # pass 2 (B's stream now aligned by O): cost[i, j] = sum_n ||y_A^i - O y_B^j||^2 per layer, (h, h)
    head_layers = [i for i in range(n_layers) if f"heads.{i}" in spec.spaces]
    if head_layers:
        costs: dict[int, Tensor] = {}
        for acts_a, acts_b in _passes(model_a, model_b, batches, heads=True):
            for i in head_layers:
                ya, yb = acts_a[f"heads.{i}"], acts_b[f"heads.{i}"]
                if o is not None:
                    yb = yb @ o.T
                c = (ya.pow(2).sum((0, 2))[:, None] + yb.pow(2).sum((0, 2))[None, :]
                     - 2 * torch.einsum("nid,njd->ij", ya, yb))
                costs[i] = costs[i] + c if i in costs else c
        for i in head_layers:
            transform[f"heads.{i}"] = assign_heads(costs[i], spec.spaces[f"heads.{i}"])
    d0 = distance(spec, sa, sb)
    att = None
    if part.attention:
        head_spaces = [s for s in part.attention if spec.role(s) == "heads"]
        fixed = {k: v for k, v in transform.items() if k not in part.attention or k in head_spaces}
        cur = apply(spec, fixed, sb)
        att = attention_step(spec, part.attention, sa, cur, stage1=False, stage2=stage2)
        for k, v in att.transform.items():
            if k not in head_spaces:
                transform[k] = v
    d1 = distance(spec, sa, apply(spec, transform, sb))
    return WholeMatch(transform, spec, [d0, d1], True, "activation", att, time.perf_counter() - t0)
