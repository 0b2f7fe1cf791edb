r"""Deterministic batches: the batch of step ``s`` is a pure function of ``(seed, s)``.

That makes resuming bit-identical without saving a data-loader state.

* classification: epoch ``e = s // (N // B)`` uses the permutation
  ``randperm(N)`` of a generator seeded with ``mix(seed, e)``; step ``s`` takes
  its slice ``i B .. (i+1) B`` with ``i = s mod (N // B)`` (the ragged tail is dropped);
* LM: ``B`` random windows of ``context + 1`` bytes, offsets drawn from a
  generator seeded with ``mix(seed, s)``; inputs are the first ``context`` bytes,
  targets the last ``context``.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Iterator

import torch
from torch import Tensor

from symalign.data.base import Dataset


def mix(seed: int, k: int) -> int:
    """A 63-bit generator seed from ``(seed, k)`` (SplitMix64 finaliser)."""
    z = (int(seed) * 0x9E3779B97F4A7C15 + int(k) + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF


@lru_cache(maxsize=4)
def _epoch_perm(n: int, seed: int, epoch: int) -> Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(mix(seed, epoch)))


def _inputs(ds: Dataset, x: Tensor) -> Tensor:
    return x.long() if ds.modality != "image" else x


def train_batch(ds: Dataset, step: int, batch_size: int, seed: int, context: int = 128) -> tuple[Tensor, Tensor]:
    """``(inputs, targets)`` of training step ``step`` (see the module docstring)."""
    if ds.task == "lm":
        stream = ds.x_train
        hi = len(stream) - context - 1
        if hi <= 0:
            from symalign.errors import DatasetError

            raise DatasetError(f"the training text has {len(stream)} bytes, fewer than context+1={context + 1}")
        g = torch.Generator().manual_seed(mix(seed, step))
        off = torch.randint(0, hi + 1, (batch_size,), generator=g)
        win = stream[off.unsqueeze(1) + torch.arange(context + 1)].long()
        return win[:, :-1], win[:, 1:]
    n = ds.x_train.shape[0]
    bs = min(batch_size, n)
    per_epoch = n // bs
    epoch, i = divmod(step, per_epoch)
    idx = _epoch_perm(n, int(seed), epoch)[i * bs:(i + 1) * bs]
    return _inputs(ds, ds.x_train[idx]), ds.y_train[idx]


def eval_batches(ds: Dataset, split: str, batch_size: int, context: int = 128,
                 max_items: int | None = None) -> Iterator[tuple[Tensor, Tensor]]:
    """Fixed evaluation batches of ``split``: consecutive examples, or (LM) consecutive
    non-overlapping windows of ``context`` predictions; at most ``max_items`` examples/windows."""
    x, y = ds.split(split)
    if ds.task == "lm":
        n_win = (len(x) - 1) // context
        if max_items is not None:
            n_win = min(n_win, max_items)
        for s in range(0, n_win, batch_size):
            k = min(batch_size, n_win - s)
            off = (torch.arange(s, s + k) * context).unsqueeze(1) + torch.arange(context + 1)
            win = x[off].long()
            yield win[:, :-1], win[:, 1:]
        return
    n = x.shape[0] if max_items is None else min(max_items, x.shape[0])
    for s in range(0, n, batch_size):
        yield _inputs(ds, x[s:s + batch_size]), y[s:s + batch_size]
