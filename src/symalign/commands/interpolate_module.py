"""``symalign interpolate --module pkg.mod:factory A.pt B.pt --data DATA``: LMC curve of any torch module.

``factory()`` is the one of ``symalign align --module`` (:func:`symalign.commands.align_module.load_factory`);
A.pt and B.pt are state dicts of its module (B.pt e.g. the output of ``align --module``). ``--data`` is a built-in
classification dataset (:func:`symalign.data.load_dataset`: ``digits``, ``fashion-mnist``, ...); each example is
reshaped to the module's example input (``(N, 1, 8, 8)`` digits become ``(N, 64)`` for an MLP whose example input is
``(n, 64)``). The curve is measured on ``--split`` (default test) by :func:`symalign.jobs.module_curve.module_curve`:
BatchNorm statistics recomputed on the training split at every point where the module has BatchNorm (on by default,
``--no-bn-reset`` to measure the stored statistics), REPAIR with ``--repair``. The command writes
``OUT/results.json`` (with how the curve was measured) and ``OUT/curves.png``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from symalign.errors import ConfigError, DatasetError


def _fit(x: Tensor, example: Any, what: str) -> Tensor:
    """``x`` reshaped so each example has the shape of one item of the module's example input."""
    ex = example[0] if isinstance(example, (tuple, list)) else example
    if not isinstance(ex, Tensor) or ex.dim() < 1:
        raise ConfigError("interpolate --module needs the factory's example input to be a batched tensor")
    item = tuple(ex.shape[1:])
    per = int(torch.Size(item).numel())
    if x[0].numel() != per:
        raise DatasetError(f"{what}: an example has {x[0].numel()} values but the module's input takes {per} "
                           f"(shape {item}); pick a dataset of that size")
    return x.reshape(len(x), *item).to(ex.dtype)


def _batches(x: Tensor, y: Tensor, size: int):
    def gen():
        for lo in range(0, len(y), size):
            yield x[lo:lo + size], y[lo:lo + size]
    return gen


def run_interpolate_module(module: str, a_path: Path, b_path: Path, data: str, *,
                           data_options: dict | None = None, split: str | None = None, points: int = 25,
                           batch_size: int = 256, eval_items: int | None = None, bn_reset: bool | None = None,
                           repair: bool = False, baseline: Path | None = None, progress=None) -> dict:
    """Measure the curve(s); returns the results (``symalign interpolate`` writes them into OUT with
    :func:`symalign.commands.interpolate.write_results`: ``results.json``, ``curves.png``, the marker)."""
    from symalign.commands.align_module import load_factory, load_state
    from symalign.data import load_dataset
    from symalign.jobs.module_curve import module_curve
    from symalign.lmc import barrier_ratio
    from symalign.provenance import provenance
    from symalign.tracing.align import check_state

    model, inputs = load_factory(module)
    states = {"A": check_state(model, load_state(a_path, "checkpoint A"), "checkpoint A"),
              "B": check_state(model, load_state(b_path, "checkpoint B"), "checkpoint B")}
    if baseline is not None:
        states["baseline"] = check_state(model, load_state(baseline, "the baseline"), "the baseline")
    ds = load_dataset(data, **(data_options or {}))
    if ds.task != "classification" or ds.y_train is None:
        raise DatasetError(f"interpolate --module measures classifiers; {data!r} is a {ds.task} dataset")
    which = split or "test"
    if which not in ("train", "val", "test"):
        raise ConfigError(f"unknown --split {which!r}; use train, val or test")
    xe, ye = ds.split(which)
    if eval_items is not None:
        xe, ye = xe[:eval_items], ye[:eval_items]
    if len(ye) == 0:
        raise DatasetError(f"the {which} split of {data!r} is empty")
    test = _batches(_fit(xe, inputs, data), ye, batch_size)
    train = _batches(_fit(ds.x_train, inputs, data), ds.y_train, batch_size)
    with torch.no_grad():
        main = module_curve(model, states["A"], states["B"], test, train, points, bn_reset, repair, progress)
        later = None if progress is None else (lambda i, t: progress(points + i, t))  # one bar over both curves
        base = (module_curve(model, states["A"], states["baseline"], test, train, points, bn_reset, repair, later)
                if baseline is not None else None)
    res: dict = {"module": module, "A": str(a_path), "B": str(b_path), "family": f"module {module}", "pe": "",
                 "scope": f"{Path(a_path).name} → {Path(b_path).name}", "data": data, "split": which,
                 "evaluation": {"items": int(len(ye)), "train_items": int(len(ds.y_train)), "batch_size": batch_size},
                 "bn_reset": main.bn_reset, "batchnorm": main.batchnorm, "repair": main.repair is not None,
                 "repair_sites": main.repair or [], "curve": main.to_dict(),
                 "provenance": provenance(threads=torch.get_num_threads())}
    if base is not None:
        res.update(naive=base.to_dict(), naive_label=f"A → {Path(baseline).name}",
                   variants={Path(b_path).name: {"curve": main.to_dict()}},
                   barrier_ratio_percent=barrier_ratio(main.curve.loss_barrier, base.curve.loss_barrier))
    else:
        res.update(naive=main.to_dict(), naive_label=f"A → {Path(b_path).name}", variants={})
    return res


def summary_lines(res: dict) -> list[str]:
    c = res["curve"]
    how = ("BatchNorm statistics recomputed at every point" if res["bn_reset"] else
           "stored BatchNorm statistics" if res["batchnorm"] else "no BatchNorm")
    lines = [f"loss A {c['loss'][0]:.4f}, B {c['loss'][-1]:.4f} (nats); {how}"
             + ("; REPAIR" if res["repair"] else "")]
    lines.append(f"loss barrier {c['loss_barrier']:.4f}, accuracy barrier {c['acc_barrier']:.4f}, "
                 f"midpoint loss barrier {c['midpoint_loss_barrier']:.4f}"
                 + (f"; ratio vs baseline {res['barrier_ratio_percent']:.1f}%" if "barrier_ratio_percent" in res
                    else ""))
    return lines


def dumps(res: dict) -> str:
    return json.dumps(res, indent=2, default=float)
