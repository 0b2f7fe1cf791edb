r"""Interpolation points built by streaming: one model resident, its weights rewritten in place per point.

``symalign interpolate`` evaluates ``theta(t) = lerp(A, B, t) = A + t (B - A)`` (``torch.lerp`` in
the model's dtype, :func:`symalign.lmc.interpolate`) at evenly spaced ``t``. Streamed, the
only model in memory is A's architecture loaded once (:func:`symalign.hf_lmc.load_hf_model`):
for each point every checkpoint tensor is read lazily from A and B in row chunks of at most
:data:`CHUNK_ELEMENTS` values (:class:`~symalign.stream.reader.LazyCheckpoint`), combined with
``torch.lerp`` and copied into the model's parameter of that name; then the model is evaluated
with its own weights. ``lerp`` is elementwise, so the chunks change nothing: each point's
weights, hence its metrics, are bit-identical to the in-memory curve's. Tensors the checkpoint
lacks (tied weights, buffers such as rotary frequencies) are the model's own and equal in A and B
(``lerp(x, x, t) = x``).

Memory: one model plus two row chunks, instead of A, B and one interpolated state.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from symalign.arithmetic import describe
from symalign.errors import CheckpointError
from symalign.stream.reader import LazyCheckpoint, check_same_architecture, open_checkpoint

CHUNK_ELEMENTS = 1 << 22


class StreamedPath:
    """The line ``A -> B`` over one resident model (module docstring)."""

    def __init__(self, model: nn.Module, a: LazyCheckpoint, b: LazyCheckpoint):
        check_same_architecture(a, b)
        self.model, self.a, self.b = model, a, b
        params = {k: v for k, v in model.state_dict(keep_vars=True).items()}
        for name, info in a.tensors.items():
            if name not in params or tuple(params[name].shape) != info.shape:
                raise CheckpointError(f"{a.path}: tensor {name!r} does not fit the model {type(model).__name__} "
                                      "loaded from it")
        self.params = {k: params[k] for k in a.tensors}

    @torch.no_grad()
    def set(self, t: float) -> None:
        """Write ``lerp(A, B, t)`` (A at ``t = 0``, B at ``t = 1``, bit for bit) into the model."""
        for name, p in self.params.items():
            info = self.a.tensors[name]
            if not p.is_floating_point() or t == 0.0:
                src = self.a
            elif t == 1.0:
                src = self.b
            else:
                src = None
            width = max(1, p[0].numel()) if p.dim() else 1
            rows = max(1, CHUNK_ELEMENTS // width)
            n = info.shape[0] if info.shape else 1
            for lo in range(0, n, rows):
                hi = min(n, lo + rows)
                if not info.shape:
                    x = (src or self.a).read([name], p.dtype)[name]
                    if src is None:
                        x = torch.lerp(x, self.b.read([name], p.dtype)[name], t)
                    p.copy_(x)
                    break
                if src is not None:
                    x = src.read_rows(name, lo, hi, p.dtype if p.is_floating_point() else None)
                else:
                    x = torch.lerp(self.a.read_rows(name, lo, hi, p.dtype), self.b.read_rows(name, lo, hi, p.dtype), t)
                p[lo:hi].copy_(x)


def streamed_curve(model: nn.Module, a_dir: Path, b_dir: Path, evalset: Any, points: int = 25,
                   progress: Callable[[int, float], None] | None = None):
    """:func:`symalign.evaluate.eval_curve` with the points built by streaming into ``model`` (A's
    architecture; its weights are overwritten): ``(curve, metrics)``, bit-identical to the in-memory curve."""
    from symalign import lmc
    from symalign.errors import SymalignError
    from symalign.evaluate import evaluate_model

    if points < 2:
        raise SymalignError(f"an interpolation curve needs at least 2 points, got {points}")
    path = StreamedPath(model, open_checkpoint(a_dir), open_checkpoint(b_dir))
    ts = [i / (points - 1) for i in range(points)]
    metrics = []
    for i, t in enumerate(ts):
        path.set(t)
        metrics.append(evaluate_model(model, evalset))
        if progress is not None:
            progress(i, t)
    return lmc.Curve(ts, [m.loss for m in metrics], [m.accuracy for m in metrics]), metrics


def streamed_pair(a_dir: Path, b_dir: Path, data: str, opts: Any = None, scope: str = "attention",
                  evalset: Any = None) -> tuple[nn.Module, Any, dict[str, Any]]:
    """A's model (the one resident model), the evaluation batches built from it and the run's info, after
    the checks of :func:`symalign.hf_lmc.load_pair` (same architecture from the headers, same vocabulary).
    Only the plain parametrisation streams: ``--scope model`` and folded B's are refused."""
    from symalign.errors import ConfigError
    from symalign.evaluate import build_eval, check_same_vocabulary, check_tokenizers
    from symalign.hf_fold import is_folded
    from symalign.hf_lmc import load_hf_model

    if scope != "attention" or is_folded(b_dir) or is_folded(a_dir):
        raise ConfigError("interpolate --stream measures the checkpoints as stored; a folded (--scope model) "
                          "checkpoint needs the in-memory rewrite: use --no-stream")
    check_same_architecture(open_checkpoint(a_dir), open_checkpoint(b_dir))
    check_same_vocabulary([a_dir, b_dir])
    model = load_hf_model(a_dir)
    if evalset is None:
        evalset = build_eval(a_dir, model, data, opts)
    check_tokenizers([a_dir, b_dir], evalset, opts)  # B is held to the rule A met
    info = {"task": evalset.objective, "data": data, "model_type": model.config.model_type, "scope": scope,
            "a_folded": False, "threads": torch.get_num_threads(), "arithmetic": describe(), "streamed": True}
    return model, evalset, info
