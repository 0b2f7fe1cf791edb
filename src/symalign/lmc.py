r"""Linear mode connectivity: interpolation curves and barriers.

For two parameter sets ``theta_A`` and ``theta_B'`` (B aligned to A, or B itself
for the naive curve) the path is ``theta(t) = (1 - t) theta_A + t theta_B'`` at
``points`` evenly spaced ``t`` in ``[0, 1]`` (25 by default, the paper's grid).
Only floating-point parameters and buffers are interpolated; integer buffers are
taken from A. The model is evaluated with :func:`torch.func.functional_call`, so
at any time memory holds the two endpoint state dicts plus one interpolated set
-- never a model copy per point.

Barriers, with ``L_t`` the held-out loss and ``a_t``
the accuracy at ``t``:

* loss barrier ``B_L = max_t [L_t - ((1 - t) L_0 + t L_1)]``;
* accuracy barrier ``B_a = max_t [((1 - t) a_0 + t a_1) - a_t]``;
* git-re-basin's midpoint variant ``max_t L_t - (L_0 + L_1) / 2``;
* barrier ratio ``100 * B(aligned) / B(naive)`` percent.

Classifiers use mean cross-entropy (nats) and accuracy; language models use
nats per token and next-token accuracy.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from symalign.errors import SymalignError

Batches = Callable[[], Iterable[tuple[Tensor, Tensor]]]


@dataclass
class Curve:
    """Loss and accuracy along ``theta(t)``; ``t[0] = 0`` is A and ``t[-1] = 1`` is B."""

    t: list[float]
    loss: list[float]
    acc: list[float]

    @property
    def loss_barrier(self) -> float:
        l0, l1 = self.loss[0], self.loss[-1]
        return max(lt - ((1 - t) * l0 + t * l1) for t, lt in zip(self.t, self.loss))

    @property
    def acc_barrier(self) -> float:
        a0, a1 = self.acc[0], self.acc[-1]
        return max(((1 - t) * a0 + t * a1) - at for t, at in zip(self.t, self.acc))

    @property
    def midpoint_loss_barrier(self) -> float:
        """git-re-basin's variant: ``max_t L_t - (L_0 + L_1) / 2``."""
        return max(self.loss) - 0.5 * (self.loss[0] + self.loss[-1])

    def to_dict(self) -> dict:
        return {**asdict(self), "loss_barrier": self.loss_barrier, "acc_barrier": self.acc_barrier,
                "midpoint_loss_barrier": self.midpoint_loss_barrier}


def barrier_ratio(aligned: float, naive: float) -> float:
    """``100 * aligned / naive`` (percent); ``nan`` when the naive barrier is ~0."""
    return float("nan") if abs(naive) < 1e-12 else 100.0 * aligned / naive


def interpolate(state_a: Mapping[str, Tensor], state_b: Mapping[str, Tensor], t: float) -> dict[str, Tensor]:
    """``(1 - t) A + t B`` for floating tensors; other entries are taken from A."""
    out = {}
    for k, a in state_a.items():
        b = state_b[k]
        out[k] = torch.lerp(a, b.to(a.dtype), t) if a.is_floating_point() else a
    return out


def check_compatible(state_a: Mapping[str, Tensor], state_b: Mapping[str, Tensor]) -> None:
    """Raise naming the first tensor where the two state dicts differ in name or shape."""
    ka, kb = set(state_a), set(state_b)
    if ka != kb:
        diff = sorted(ka ^ kb)[:3]
        raise SymalignError(f"the two models have different parameters (e.g. {diff}); "
                            "interpolation needs two models of the same architecture")
    for k in state_a:
        if state_a[k].shape != state_b[k].shape:
            raise SymalignError(f"tensor {k!r} has shape {tuple(state_a[k].shape)} in A but "
                                f"{tuple(state_b[k].shape)} in B; the architectures differ")


def _logits(out) -> Tensor:
    if isinstance(out, Tensor):
        return out
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, (tuple, list)):
        return out[0]
    raise SymalignError(f"cannot find logits in a model output of type {type(out).__name__}")


@torch.no_grad()
def evaluate(model: nn.Module, state: Mapping[str, Tensor], batches: Batches, task: str = "classification"
             ) -> tuple[float, float]:
    """Mean loss (nats per example or per token) and accuracy of ``model`` with ``state``.

    ``batches()`` yields ``(inputs, targets)``; for ``task="lm"`` targets are
    ``(B, T)`` next-token ids and the logits ``(B, T, V)``.
    """
    total_loss, total_correct, total = 0.0, 0, 0
    for x, y in batches():
        logits = _logits(functional_call(model, dict(state), (x,)))
        if task == "lm":
            logits = logits.reshape(-1, logits.shape[-1])
            y = y.reshape(-1)
        total_loss += F.cross_entropy(logits.double(), y, reduction="sum").item()
        total_correct += (logits.argmax(-1) == y).sum().item()
        total += y.numel()
    if total == 0:
        raise SymalignError("the evaluation set is empty")
    return total_loss / total, total_correct / total


def curve(model: nn.Module, state_a: Mapping[str, Tensor], state_b: Mapping[str, Tensor], batches: Batches,
          task: str = "classification", points: int = 25, progress: Callable[[int], None] | None = None,
          device: str | torch.device | None = None) -> Curve:
    """Evaluate ``theta(t)`` at ``points`` evenly spaced ``t`` (see the module docstring).

    ``model`` only provides the architecture (its own weights are not used). ``device``: evaluate there
    (:mod:`symalign.device`): the model, both states and every batch are moved there, TF32 off; ``None``: where
    they are.
    """
    if points < 2:
        raise SymalignError(f"an interpolation curve needs at least 2 points, got {points}")
    if device is not None:
        from symalign.device import exact_matmul, resolve, to_device

        dev = resolve(device)

        def moved() -> Iterable[tuple[Tensor, Tensor]]:
            for x, y in batches():
                yield x.to(dev), y.to(dev)

        with exact_matmul():
            return curve(model.to(dev), to_device(dict(state_a), dev), to_device(dict(state_b), dev), moved, task,
                         points, progress)
    check_compatible(state_a, state_b)
    was_training = model.training
    model.eval()
    ts = [i / (points - 1) for i in range(points)]
    losses, accs = [], []
    try:
        for i, t in enumerate(ts):
            if t == 0.0:
                st = state_a
            elif t == 1.0:
                st = state_b
            else:
                st = interpolate(state_a, state_b, t)
            loss, acc = evaluate(model, st, batches, task)
            del st  # free this point's parameters before building the next one
            losses.append(loss)
            accs.append(acc)
            if progress is not None:
                progress(i)
    finally:
        model.train(was_training)
    return Curve(ts, losses, accs)


def full_state(model: nn.Module) -> dict[str, Tensor]:
    """Parameters and buffers (detached), the state ``functional_call`` needs."""
    return {k: v.detach() for k, v in {**dict(model.named_parameters()), **dict(model.named_buffers())}.items()}
