r"""Activation matching: the whole-model assignments from activation statistics on data.

On a data sample, record for both models (forward pre-hooks on the modules the model
lists as its activation sites, ``model.activation_sites()``, :mod:`symalign.nn.sites`;
flattened over batch and positions, ``N`` rows) and solve each space with its group
(:meth:`symalign.groups.Group.nearest_activations`, :meth:`~symalign.groups.Group.nearest`),
choosing what to compute by the space's role in the spec:

* ``residual``: the stream ``h`` at the input of every block and of the final norm:
  ``M = sum_n h_A h_B^T`` and ``O = polar(M)`` (Procrustes; the centred subgroup
  when the spec says so) -- ``h_A ~ O h_B`` (a permuted stream: the assignment on the
  summed Pearson correlations);
* ``ff``: the FF hidden activations ``a`` (after the nonlinearity) of each layer:
  ``perm = argmax_perm sum_i corr(a_A[:, i], a_B[:, perm[i]])`` (linear assignment on
  the Pearson cross-correlation);
* ``heads``: each head's contribution to the stream ``y_i = W_O^i z_i`` (from the input of
  the attention output projection): head permutation minimising
  ``sum_i sum_n ||y_A^i - O y_B^{pi(i)}||^2`` (GQA-aware, :meth:`HeadPermutation.nearest`).

The matcher names no module, so it runs on any model with sites: the built-in models and the
``hf:`` families whose adapter declares them (decoders, GPT-2).

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
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import Tensor, nn

from symalign.errors import MatchError
from symalign.match.distance import distance
from symalign.match.whole import Partition, WholeMatch, attention_step, model_states, partition, validate_states
from symalign.nn.sites import ActivationSite, HasActivationSites, module_input
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


class StatsSum:
    """The statistics of one space read at several sites (the residual stream at every block):
    the summed cross products and the summed per-site correlations."""

    def __init__(self, parts: list[PairStats]):
        self.parts = parts

    @property
    def cross(self) -> Tensor:
        return sum(p.cross for p in self.parts)  # type: ignore[return-value]

    def correlation(self) -> Tensor:
        return sum(p.correlation() for p in self.parts)  # type: ignore[return-value]


def activation_sites(model: nn.Module) -> list[ActivationSite]:
    """``model.activation_sites()`` (:mod:`symalign.nn.sites`), or a :class:`MatchError` for a model
    that declares none."""
    sites = model.activation_sites() if isinstance(model, HasActivationSites) else None
    if not sites:
        raise MatchError(f"{type(model).__name__} declares no activation sites, so activation matching cannot "
                         "read its activations; use weight or learned matching")
    return sites


class _Recorder:
    """Forward pre-hooks on ``sites`` keeping the current batch's rows, by site index."""

    def __init__(self, sites: list[tuple[int, ActivationSite]]):
        self.acts: dict[int, Tensor] = {}
        self.hooks = [site.module.register_forward_pre_hook(
            lambda m, args, kwargs, k=k, site=site: self._put(k, site, args, kwargs), with_kwargs=True)
            for k, site in sites]

    def _put(self, k: int, site: ActivationSite, args: tuple, kwargs: dict) -> None:
        self.acts[k] = site.rows(module_input(args, kwargs))

    def close(self) -> None:
        for h in self.hooks:
            h.remove()


@torch.no_grad()
def _passes(model_a: nn.Module, model_b: nn.Module, sites_a: list[tuple[int, ActivationSite]],
            sites_b: list[tuple[int, ActivationSite]], batches: list[Tensor]):
    """Yield the two models' site rows (:class:`_Recorder`) batch by batch, in eval mode."""
    rec_a, rec_b = _Recorder(sites_a), _Recorder(sites_b)
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
    batches = _batch_list(batches)
    spec, sa, sb = model_states(model_a, model_b)
    validate_states(spec, sa, sb)
    part = partition(spec)
    sites = _Sites.of(spec, model_a, model_b)
    transform = _match_statistics(spec, model_a, model_b, sites, batches)
    if sites.heads:
        stream = [s for s in transform if spec.role(s) == "residual"]
        o = spec.spaces[stream[0]].matrix(transform[stream[0]]) if stream else None
        transform.update(_match_heads(spec, model_a, model_b, sites, batches, o))
    d0 = distance(spec, sa, sb)
    att = _match_attention_given(spec, part, sa, sb, transform, stage2)
    d1 = distance(spec, sa, apply(spec, transform, sb))
    return WholeMatch(transform, spec, [d0, d1], True, "activation", att, time.perf_counter() - t0)


def _batch_list(batches: Iterable[Tensor] | Tensor | None) -> list[Tensor]:
    """The inputs as a non-empty list (one tensor: one batch); :class:`MatchError` without any."""
    if batches is None:
        raise MatchError("activation matching needs data: pass a batch (or an iterable of batches) of inputs")
    if isinstance(batches, Tensor):
        batches = [batches]
    batches = list(batches)
    if not batches:
        raise MatchError("activation matching needs data: the sample was empty")
    return batches


@dataclass
class _Sites:
    """Both models' activation sites (same spaces, in the same order) and the indices of those the spec has a
    space for: ``heads`` (per-head outputs, pass 2) and ``rest`` (residual stream and FF units, pass 1)."""

    a: list[ActivationSite]
    b: list[ActivationSite]
    heads: list[int]
    rest: list[int]

    @classmethod
    def of(cls, spec, model_a: nn.Module, model_b: nn.Module) -> _Sites:
        all_a, all_b = activation_sites(model_a), activation_sites(model_b)
        if [s.space for s in all_a] != [s.space for s in all_b]:
            raise MatchError("the two models declare different activation sites (different depth or structure)")
        used = [k for k, s in enumerate(all_a) if s.space in spec.spaces]
        heads = [k for k in used if spec.role(all_a[k].space) == "heads"]
        return cls(all_a, all_b, heads, [k for k in used if k not in heads])

    def pairs(self, ks: list[int]) -> tuple[list[tuple[int, ActivationSite]], list[tuple[int, ActivationSite]]]:
        """The sites ``ks`` of A and of B, as :func:`_passes` takes them."""
        return [(k, self.a[k]) for k in ks], [(k, self.b[k]) for k in ks]


def _match_statistics(spec, model_a: nn.Module, model_b: nn.Module, sites: _Sites, batches: list[Tensor]) -> Transform:
    """Pass 1: the residual stream and FF spaces from their activation statistics (memory ``O(D^2 + d_ff^2)`` per
    site, whatever the sample size), each space's element the group's nearest to its summed statistics
    (:meth:`Group.nearest_activations`); the residual stream first (its entries come first)."""
    stats: dict[int, PairStats] = {k: PairStats() for k in sites.rest}
    for acts_a, acts_b in _passes(model_a, model_b, *sites.pairs(sites.rest), batches):
        for k in sites.rest:
            stats[k].add(acts_a[k], acts_b[k])
    by_space: dict[str, list[PairStats]] = {}
    for k in sites.rest:
        by_space.setdefault(sites.a[k].space, []).append(stats[k])
    transform: Transform = {}
    # the residual stream first: the head costs of pass 2 compare B's heads in A's stream coordinates
    stream = [s for s in by_space if spec.role(s) == "residual"]
    for s in stream + [s for s in by_space if s not in stream]:
        transform[s] = spec.spaces[s].nearest_activations(StatsSum(by_space[s]))
    return transform


def _match_heads(spec, model_a: nn.Module, model_b: nn.Module, sites: _Sites, batches: list[Tensor],
                 o: Tensor | None) -> Transform:
    """Pass 2 (B's stream aligned by ``O``): per heads space, the assignment minimising
    ``cost[i, j] = sum_n ||y_A^i - O y_B^j||^2`` (an ``(h, h)`` matrix summed over the batches)."""
    costs: dict[int, Tensor] = {}
    for acts_a, acts_b in _passes(model_a, model_b, *sites.pairs(sites.heads), batches):
        for k in sites.heads:
            ya, yb = acts_a[k], acts_b[k]
            if o is not None:
                yb = yb @ o.T
            c = (ya.pow(2).sum((0, 2))[:, None] + yb.pow(2).sum((0, 2))[None, :]
                 - 2 * torch.einsum("nid,njd->ij", ya, yb))
            costs[k] = costs[k] + c if k in costs else c
    return {sites.a[k].space: spec.spaces[sites.a[k].space].nearest(-costs[k]) for k in sites.heads}


def _match_attention_given(spec, part: Partition, sa, sb, transform: Transform, stage2: str):
    """The attention spaces other than the head permutations (found from activations) by the weight matcher
    (:func:`attention_step`, no stage 1) on B with ``transform`` applied; updates ``transform`` in place and
    returns the attention match (``None`` without attention spaces)."""
    if not part.attention:
        return None
    head_spaces = [s for s in part.attention if spec.role(s) == "heads"]
    fixed = {k: v for k, v in transform.items() if k not in part.attention or k in head_spaces}
    cur = apply(spec, fixed, sb)
    att = attention_step(spec, part.attention, sa, cur, stage1=False, stage2=stage2)
    for k, v in att.transform.items():
        if k not in head_spaces:
            transform[k] = v
    return att
