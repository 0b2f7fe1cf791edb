r"""LMC curves of any torch module (``symalign interpolate --module``): BatchNorm reset and REPAIR.

The path is :func:`symalign.lmc.interpolate`'s ``theta(t) = (1 - t) theta_A + t theta_B'`` over every floating
parameter and buffer. Two corrections of the interpolated network are available at each point ``t``:

* **BatchNorm reset** (:func:`reset_batchnorm`, git re-basin's protocol): the running mean and variance of every
  BatchNorm layer are thrown away and recomputed on training batches with the interpolated weights (train-mode
  statistics accumulated as a cumulative average, ``momentum=None``; every other module stays in eval mode), then
  the network is evaluated in eval mode. The interpolated running statistics are not the statistics of the
  interpolated network, so without the reset a curve measures a network nobody would deploy. It is applied at
  every point, the endpoints included, so all points are measured alike; it is on by default wherever the model
  has BatchNorm (:func:`has_batchnorm`) and recorded in the result.
* **REPAIR** (Jordan et al., 2022; ``repair=True``): the per-channel mean and standard deviation of the outputs of
  every hidden linear, convolutional and BatchNorm module (:func:`repair_sites`: every such module but the last
  one called, the classifier) are recorded at the two endpoints on training batches, ``mu_A, sigma_A`` and
  ``mu_B, sigma_B``; at ``t`` each site's output is renormalised channelwise,
  ``y -> (y - mu_t) / sigma_t * sigma* + mu*`` with the goal ``mu* = (1 - t) mu_A + t mu_B``,
  ``sigma* = (1 - t) sigma_A + t sigma_B`` and ``mu_t, sigma_t`` the statistics of the interpolated network's own
  output at that site. Calibration runs once over the training batches with every site normalised by the batch's
  own statistics (as a BatchNorm layer in train mode; the statistics kept are the cumulative averages), so each
  site sees the already corrected sites before it; evaluation then uses the kept statistics. This changes the
  interpolated network (it is not a symmetry): it measures how much of the barrier is the variance collapse of
  averaged units rather than a misalignment. The endpoints are left unchanged (the goal is their own statistics).
  After a BatchNorm reset a BatchNorm layer's output already has the interpolated endpoints' statistics
  (mean ``beta_t``, deviation ``|gamma_t|``, both interpolated: the goal wherever a channel's gain keeps its sign
  along the path), so in a network whose hidden units all pass through BatchNorm (a ResNet) REPAIR adds next to
  nothing to the reset, as Jordan et al. note for BatchNorm networks.

Channels: axis 1 of a convolution's or BatchNorm's output, the last axis of a linear layer's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

import torch
from torch import Tensor, nn

from symalign import lmc
from symalign.errors import SymalignError

Batches = Callable[[], Iterable[tuple[Tensor, Tensor]]]
_SITES = (nn.Linear, nn.modules.conv._ConvNd, nn.modules.batchnorm._BatchNorm)


def batchnorm_layers(model: nn.Module) -> list[str]:
    """Names of the model's BatchNorm layers that keep running statistics."""
    return [n for n, m in model.named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]


def has_batchnorm(model: nn.Module) -> bool:
    return bool(batchnorm_layers(model))


@torch.no_grad()
def reset_batchnorm(model: nn.Module, batches: Batches) -> int:
    """Recompute every BatchNorm layer's running statistics on ``batches`` with the model's current weights
    (cumulative average over the batches; only the BatchNorm layers in train mode); returns the examples seen.
    The model is left in eval mode."""
    layers = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
    saved = [m.momentum for m in layers]
    model.eval()
    for m in layers:
        m.reset_running_stats()
        m.momentum = None
        m.train()
    seen = 0
    try:
        for x, _ in batches():
            model(x)
            seen += int(x.shape[0])
    finally:
        for m, mom in zip(layers, saved):
            m.momentum = mom
        model.eval()
    if layers and seen == 0:
        raise SymalignError("no training batches to recompute the BatchNorm statistics on")
    return seen


def _channel_axis(module: nn.Module, y: Tensor) -> int:
    return y.dim() - 1 if isinstance(module, nn.Linear) else 1


def _moments(y: Tensor, axis: int) -> tuple[Tensor, Tensor, int]:
    """Per-channel sum and sum of squares (float64) of ``y`` and the number of values per channel."""
    yc = y.movedim(axis, -1).reshape(-1, y.shape[axis]).to(torch.float64)
    return yc.sum(0), yc.pow(2).sum(0), yc.shape[0]


class _Site:
    """A forward hook on one module: records channel statistics or renormalises its output."""

    def __init__(self, name: str, module: nn.Module):
        self.name, self.module = name, module
        self.mode = "off"  # off | record | calibrate | apply
        self.goal: tuple[Tensor, Tensor] | None = None
        self.reset()
        self.handle = module.register_forward_hook(self)

    def reset(self) -> None:
        self.s1 = self.s2 = None
        self.count = 0
        self.mean_sum = self.var_sum = None
        self.batches = 0

    def stats(self) -> tuple[Tensor, Tensor]:
        """Mean and standard deviation per channel of what was recorded."""
        mean = self.s1 / self.count
        return mean, (self.s2 / self.count - mean * mean).clamp_min(0).sqrt()

    def kept(self) -> tuple[Tensor, Tensor]:
        """The calibrated statistics (cumulative averages of the batch means and variances)."""
        return self.mean_sum / self.batches, (self.var_sum / self.batches).sqrt()

    def __call__(self, module, inputs, y):
        if self.mode == "off" or not isinstance(y, Tensor):
            return None
        axis = _channel_axis(module, y)
        shape = [1] * y.dim()
        shape[axis] = y.shape[axis]
        if self.mode == "record":
            s1, s2, c = _moments(y, axis)
            self.s1 = s1 if self.s1 is None else self.s1 + s1
            self.s2 = s2 if self.s2 is None else self.s2 + s2
            self.count += c
            return None
        if self.mode == "calibrate":
            s1, s2, c = _moments(y, axis)
            mean = s1 / c
            var = (s2 / c - mean * mean).clamp_min(0)
            self.mean_sum = mean if self.mean_sum is None else self.mean_sum + mean
            self.var_sum = var if self.var_sum is None else self.var_sum + var
            self.batches += 1
            std = var.sqrt()
        else:
            mean, std = self.kept()
        g_mean, g_std = self.goal
        scale = torch.where(std > 0, g_std / torch.where(std > 0, std, torch.ones_like(std)), torch.ones_like(std))
        out = (y.to(torch.float64) - mean.view(shape)) * scale.view(shape) + g_mean.view(shape)
        return out.to(y.dtype)


def repair_sites(model: nn.Module, example: Tensor) -> list[str]:
    """The modules REPAIR renormalises: every linear, convolutional and BatchNorm module called in a forward pass
    on ``example`` except the last one called (the classifier), in call order."""
    order: list[str] = []
    names = {id(m): n for n, m in model.named_modules()}
    handles = [m.register_forward_hook(lambda mod, i, o: order.append(names[id(mod)]))
               for m in model.modules() if isinstance(m, _SITES)]
    try:
        with torch.no_grad():
            model(example)
    finally:
        for h in handles:
            h.remove()
    seen = list(dict.fromkeys(order))
    return seen[:-1]


class Repair:
    """REPAIR hooks on ``sites`` of ``model`` (module docstring); :meth:`close` removes them."""

    def __init__(self, model: nn.Module, sites: list[str]):
        mods = dict(model.named_modules())
        self.model = model
        self.sites = [_Site(n, mods[n]) for n in sites]
        self.ends: dict[float, list[tuple[Tensor, Tensor]]] = {}

    def _mode(self, mode: str) -> None:
        for s in self.sites:
            s.mode = mode

    @torch.no_grad()
    def record_endpoint(self, t: float, batches: Batches) -> None:
        """Record the current model's per-channel statistics as the endpoint ``t`` (0 or 1)."""
        for s in self.sites:
            s.reset()
        self._mode("record")
        try:
            for x, _ in batches():
                self.model(x)
        finally:
            self._mode("off")
        self.ends[t] = [s.stats() for s in self.sites]

    @torch.no_grad()
    def calibrate(self, t: float, batches: Batches) -> None:
        """Set the goal statistics of ``t`` and calibrate the current (interpolated) model on ``batches``."""
        if set(self.ends) != {0.0, 1.0}:
            raise SymalignError("REPAIR needs both endpoints' statistics before an interior point")
        for s, (ma, sa), (mb, sb) in zip(self.sites, self.ends[0.0], self.ends[1.0]):
            s.reset()
            s.goal = ((1 - t) * ma + t * mb, (1 - t) * sa + t * sb)
        self._mode("calibrate")
        try:
            for x, _ in batches():
                self.model(x)
        finally:
            self._mode("off")
        self._mode("apply")

    def off(self) -> None:
        self._mode("off")

    def close(self) -> None:
        for s in self.sites:
            s.handle.remove()


@dataclass
class ModuleCurve:
    """A module's LMC curve and how it was measured (``batchnorm``: the BatchNorm layers; ``bn_reset``: their
    statistics recomputed at every point on ``reset_items`` training examples; ``repair``: the REPAIR sites)."""

    curve: lmc.Curve
    bn_reset: bool
    batchnorm: list[str] = field(default_factory=list)
    repair: list[str] | None = None
    reset_items: int = 0

    def to_dict(self) -> dict:
        return {**self.curve.to_dict(), "bn_reset": self.bn_reset, "batchnorm": list(self.batchnorm),
                "repair": self.repair is not None, "repair_sites": list(self.repair or []),
                "reset_items": self.reset_items}


def module_curve(model: nn.Module, state_a: Mapping[str, Tensor], state_b: Mapping[str, Tensor],
                 test: Batches, train: Batches | None = None, points: int = 25, bn_reset: bool | None = None,
                 repair: bool = False, progress: Callable[[int, float], None] | None = None) -> ModuleCurve:
    """The curve of ``model`` between two of its state dicts on ``test`` batches (module docstring).

    ``bn_reset``: ``None`` (default) recomputes BatchNorm statistics at every point when the model has BatchNorm;
    ``True``/``False`` force it. ``train``: the batches the statistics (BatchNorm, REPAIR) are computed on; needed
    by either. ``model`` provides the architecture; its weights are overwritten (A's at the end).
    """
    if points < 2:
        raise SymalignError(f"an interpolation curve needs at least 2 points, got {points}")
    lmc.check_compatible(state_a, state_b)
    bns = batchnorm_layers(model)
    reset = bool(bns) if bn_reset is None else bool(bn_reset)
    if (reset and bns or repair) and train is None:
        raise SymalignError("BatchNorm reset and REPAIR need training batches")
    rep = None
    if repair:
        first = next(iter(train()))[0]
        model.load_state_dict(dict(state_a))
        rep = Repair(model, repair_sites(model.eval(), first))
    ts = [i / (points - 1) for i in range(points)]
    losses, accs, seen = [], [], 0
    try:
        if rep is not None:  # the goal statistics: each endpoint as it is evaluated (after its own reset)
            for t, st in ((0.0, state_a), (1.0, state_b)):
                model.load_state_dict(dict(st))
                if reset and bns:
                    reset_batchnorm(model, train)
                rep.record_endpoint(t, train)
        for i, t in enumerate(ts):
            model.load_state_dict(lmc.interpolate(state_a, state_b, t))
            if reset and bns:
                seen = reset_batchnorm(model, train)
            if rep is not None and 0.0 < t < 1.0:
                rep.calibrate(t, train)
            loss, acc = lmc.evaluate(model.eval(), lmc.full_state(model), test)
            if rep is not None:
                rep.off()
            losses.append(loss)
            accs.append(acc)
            if progress is not None:
                progress(i, t)
    finally:
        if rep is not None:
            rep.close()
        model.load_state_dict(dict(state_a))
    return ModuleCurve(lmc.Curve(ts, losses, accs), reset and bool(bns), bns,
                       [s.name for s in rep.sites] if rep is not None else None, seen)
