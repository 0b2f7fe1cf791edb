r"""Whole-model alignment methods for the experiment protocol (``full`` scope): weight, activation, learned.

For two rewritten models (built-in: :func:`symalign.rewrite.rewrite_model`; ``hf:``:
:meth:`symalign.models.hf.HFModel.rewritten_model`; the ``full`` scope aligns in those
coordinates), :func:`align_methods` aligns B to A with each
method over every space of the whole-model spec and measures the LMC curve
``theta(t) = (1 - t) theta_A + t theta_B'`` on the evaluation batches:

* ``"weight"``: :func:`symalign.match.whole.match_whole` (data-free; ``stage2`` and
  ``max_sweeps`` as in the protocol's ``match_scope``);
* ``"activation"``: :func:`symalign.match.activations.match_activations` on the inputs
  of the **training** batches;
* ``"learned"``: :func:`symalign.match.learned.learn_matching` on the **training**
  batches, initialised from the weight-matching result (computed even when
  ``"weight"`` is not asked for), with its default recipe: a fresh training batch
  every step (pass a :class:`TrainStream`), 6000 Adam steps at ``lr = 1e-2`` with cosine
  decay, ``lambda ~ U(0.2, 0.8)``; the choice between the learned and the
  weight-matching transform is made on ``val_batches`` (the validation split) when given.
  On the F-MNIST ViT pairs (sinusoidal / RoPE) this took the learned test barrier from
  0.073 / 0.090 nats (40 cycled batches, 200 steps at a constant rate, ``lambda ~
  U(0.4, 0.6)``) to 0.015 / 0.013 (3000 steps: 0.024 / 0.023; ``docs/whole-model.md`` section 6).
* ``"sinkhorn"`` (not in the default list): learned matching with soft permutations
  (``relax="sinkhorn"``: doubly stochastic ``Sinkhorn(exp(Z / tau))`` in the forward pass, ``tau``
  annealed, projected to the Hungarian assignment at the end), otherwise as ``"learned"``; its
  checkpoint is ``learned_checkpoint`` with ``.sinkhorn`` appended.

The curve's batches come from ``protocol.eval_split``: the test split (default) is never used to
align or to select; ``"train"`` measures the curve on the split that the models, activation and
learned matching fit (the barrier on what the models fit), ``"val"`` on the split that learned
matching selects on. Every
entry has the shape of a ``variants`` entry of
:func:`symalign.experiments.protocol.align_and_measure` (``curve``, ``function_change``,
``loss_barrier_ratio_percent``, ``acc_barrier_ratio_percent``, ``match``) plus
``state`` (B' as a state dict in A's rewritten coordinates -- drop it before writing
JSON), ``loss_barrier``/``acc_barrier`` and ``seconds``. Each aligned B' is checked to
compute B's function (relative output change at most
:func:`symalign.tolerance.function_tolerance` of its dtype); a larger change raises :class:`SymalignError` (a bug).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

from torch import Tensor, nn

from symalign import lmc
from symalign.errors import MatchError, SymalignError
from symalign.tolerance import function_tolerance

METHODS = ("weight", "activation", "learned")  # the default list
KNOWN_METHODS = METHODS + ("sinkhorn",)
Batch = tuple[Tensor, Tensor]


def train_stream(ds, n_batches: int, batch_size: int = 128, seed: int = 0, context: int = 128) -> list[Batch]:
    """``n_batches`` training-split batches (:func:`symalign.data.batches.train_batch`, steps ``0..n-1``)."""
    return [TrainStream(ds, batch_size, seed, context)(step) for step in range(n_batches)]


@dataclass(frozen=True)
class TrainStream:
    """The training-split batch of step ``s``: :func:`symalign.data.batches.train_batch` ``(ds, s, ...)``.

    A pure function of ``(seed, s)``, so a resumed learned matching sees the same batches as an
    uninterrupted one. Classification: step ``s`` is slice ``s mod (N // B)`` of the epoch
    ``s // (N // B)`` permutation of the ``N`` training examples -- no example repeats within
    an epoch (``N // B`` steps); LM: ``B`` random windows of the training text per step.
    """

    ds: Any
    batch_size: int = 128
    seed: int = 0
    context: int = 128

    def __call__(self, step: int) -> Batch:
        from symalign.data.batches import train_batch

        return train_batch(self.ds, step, self.batch_size, self.seed, self.context)

    def take(self, n: int) -> list[Batch]:
        """The batches of steps ``0..n-1``."""
        return [self(step) for step in range(n)]


def _function_change(arch_a: nn.Module, state: dict, arch_b: nn.Module, state_b: dict, x: Tensor) -> float:
    from symalign.experiments.metrics import relative_output_change

    return relative_output_change(arch_a, state, state_b, x, arch_b)


def align_methods(arch_a: nn.Module, arch_b: nn.Module, batches: Callable[[], Iterable[Batch]] | Sequence[Batch],
                  task: str = "classification", methods: Sequence[str] = METHODS, points: int = 25,
                  learned_steps: int = 6000, seed: int = 0, *,
                  train_batches: Sequence[Batch] | Callable[[int], Batch] | None = None,
                  val_batches: Sequence[Batch] | None = None,
                  naive: lmc.Curve | dict | None = None, stage2: str = "full", max_sweeps: int = 10,
                  learned_lr: float = 1e-2, learned_checkpoint: str | None = None,
                  learned_options: Mapping[str, Any] | None = None, activation_batches: int | None = None,
                  progress: Callable[[str], None] | None = None) -> dict[str, dict[str, Any]]:
    """Align ``arch_b`` to ``arch_a`` with each method and measure the curves (see the module docstring).

    Args:
        arch_a, arch_b: rewritten models (same config); ``"activation"`` needs their activation
            sites (:mod:`symalign.nn.sites`).
        batches: the evaluation batches of the curves (a list or a callable returning an iterable).
        task: ``"classification"`` or ``"lm"`` (:func:`symalign.lmc.curve`).
        methods: any of ``"weight"``, ``"activation"``, ``"learned"``, ``"sinkhorn"``.
        points: curve points; learned_steps, learned_lr, seed, learned_checkpoint: learned matching.
        train_batches: training-split ``(inputs, targets)`` batches for activation statistics and
            learned matching (required by those two): a :class:`TrainStream` (learned matching
            gets a fresh batch every step) or a sequence (cycled; see :func:`train_stream`).
        val_batches: validation-split batches on which learned matching chooses between its
            result and weight matching (default: the training batches; never the test split).
        learned_options: further keyword arguments of :func:`~symalign.match.learned.learn_matching`
            (``lam``, ``schedule``, ``warmup``, ``betas``, ``spaces``, ...).
        naive: the naive curve for the barrier ratios (a :class:`~symalign.lmc.Curve` or its
            ``to_dict()``); default: the naive curve of the two rewritten models.
        stage2, max_sweeps: weight matching (as in the protocol).
        activation_batches: use only the first this many training batches for the activation
            statistics (they hold ``N h D`` float64 values per model for ``N`` tokens); from a
            stream, the batches of steps ``0..activation_batches - 1`` (default 40).

    Returns:
        ``{method: entry}`` in the order asked for.

    Raises:
        MatchError: an unknown method, or activation/learned matching without training batches.
        SymalignError: an aligned model that does not compute B's function (a bug).
    """
    from symalign.match.activations import match_activations
    from symalign.match.learned import learn_matching
    from symalign.match.whole import PROTOCOL_SETTINGS, match_whole, model_states

    unknown = [m for m in methods if m not in KNOWN_METHODS]
    if unknown:
        raise MatchError(f"unknown alignment method(s) {unknown}; use any of {', '.join(KNOWN_METHODS)}")
    if any(m in ("activation", "learned", "sinkhorn") for m in methods) and not train_batches:
        raise MatchError("activation and learned matching need data: pass train_batches (training-split "
                         "(inputs, targets) batches, e.g. symalign.experiments.methods.TrainStream(ds))")
    get = batches if callable(batches) else (lambda: batches)
    say = progress or (lambda s: None)
    spec, ra, rb = model_states(arch_a, arch_b)
    ra, rb = lmc.full_state(arch_a), lmc.full_state(arch_b)
    if naive is None:
        naive = lmc.curve(arch_a, ra, rb, get, task, points)
    naive_d = naive.to_dict() if isinstance(naive, lmc.Curve) else dict(naive)
    x0 = next(iter(get()))[0]
    tol = function_tolerance(next(iter(rb.values())).dtype)
    out: dict[str, dict[str, Any]] = {}
    weight = None
    for method in methods:
        say(f"aligning ({method})")
        t0 = time.perf_counter()
        if method in ("weight", "learned", "sinkhorn") and weight is None:
            weight = match_whole(spec, ra, rb, stage1=True, stage2=stage2, max_sweeps=max_sweeps,
                                 spec_b=arch_b.symmetry_spec(), **PROTOCOL_SETTINGS)
        if method == "weight":
            m = weight
        elif method == "activation":
            sample = [train_batches(s) for s in range(activation_batches or 40)] if callable(train_batches) \
                else list(train_batches)[:activation_batches]  # type: ignore[union-attr]
            inputs = [x for x, _ in sample]
            m = match_activations(arch_a, arch_b, inputs, stage2=stage2)
        else:
            opts = dict(learned_options or {})
            ckpt = learned_checkpoint
            if method == "sinkhorn":
                opts["relax"] = "sinkhorn"
                ckpt = None if learned_checkpoint is None else f"{learned_checkpoint}.sinkhorn"
            m = learn_matching(arch_a, arch_b, train_batches, steps=learned_steps, lr=learned_lr, init=weight,
                               seed=seed, checkpoint=ckpt, select_batches=val_batches, **opts)
        rb2 = {**rb, **m.apply(rb)}
        change = _function_change(arch_a, rb2, arch_b, rb, x0)
        if not change <= tol:
            raise SymalignError(f"{method} alignment changed model B's function (relative change {change:.2e} > "
                                f"{tol:g}); this is a bug -- please report it with the config")
        aligned = lmc.curve(arch_a, ra, rb2, get, task, points)
        out[method] = {
            "state": rb2, "curve": aligned.to_dict(), "function_change": change,
            "loss_barrier": aligned.loss_barrier, "acc_barrier": aligned.acc_barrier,
            "loss_barrier_ratio_percent": lmc.barrier_ratio(aligned.loss_barrier, naive_d["loss_barrier"]),
            "acc_barrier_ratio_percent": lmc.barrier_ratio(aligned.acc_barrier, naive_d["acc_barrier"]),
            "match": m.to_dict(), "seconds": time.perf_counter() - t0,
        }
    return out
