"""``symalign align --module pkg.mod:factory A.pt B.pt -o OUT.pt``: align state dicts of any traceable module.

``factory()`` (imported from the current directory or the Python path) returns the
module, or ``(module, example_inputs)``; without the tuple the module must have an
``example_inputs`` attribute (a tensor, a tuple, or a method returning one). A.pt and
B.pt are ``torch.save(model.state_dict(), path)`` files of that module.

Steps: load both state dicts (checked against the module's keys and shapes), trace
the module's exact symmetry spec (:func:`symalign.trace`, checked in float64), match B
to A (:func:`symalign.tracing.align.align_states`: every traced space with
``--scope model``, attention only with ``--scope attention``), check on the example
inputs that B' computes B's function (float64 and B's dtype), then write OUT.pt
atomically (a temporary file renamed into place; nothing is written on failure).
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from symalign.align_result import AlignResult, PhaseClock
from symalign.io.statedict import load_state_file, save_state_file
from symalign.errors import CheckpointError, ConfigError
from symalign.provenance import provenance
from symalign.tolerance import dtype_name


def load_factory(spec: str, width: int | None = None) -> tuple[nn.Module, Any]:
    """``(module, example_inputs)`` from ``"pkg.mod:factory"`` (see the module docstring); with ``width``,
    ``factory(width)``: the module at that hidden width (``symalign merge --module ... --widths``)."""
    if spec.count(":") != 1 or not all(spec.split(":")):
        raise ConfigError(f"--module {spec!r} must be 'package.module:factory' (a function returning an nn.Module)")
    mod_name, fn_name = spec.split(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ConfigError(f"cannot import {mod_name!r} for --module ({e}); run from its folder or put it on "
                          "PYTHONPATH") from None
    factory = getattr(mod, fn_name, None)
    if not callable(factory):
        raise ConfigError(f"{mod_name} has no function {fn_name!r} (--module {spec})")
    if width is None:
        made = factory()
    else:
        import inspect

        try:
            inspect.signature(factory).bind(width)
        except TypeError:
            raise ConfigError(f"{spec} takes no width; with --widths the factory is called as factory(width) "
                              "and must build the model at that hidden width") from None
        except ValueError:  # no signature to inspect (a builtin): call it and see
            pass
        made = factory(width)
    model, inputs = (made if isinstance(made, tuple) and len(made) == 2 else (made, None))
    if not isinstance(model, nn.Module):
        called = f"{spec}({'' if width is None else width})"
        raise ConfigError(f"{called} returned {type(model).__name__}, not an nn.Module (or (module, example_inputs))")
    if inputs is None:
        inputs = getattr(model, "example_inputs", None)
        inputs = inputs() if callable(inputs) else inputs
    if inputs is None:
        raise ConfigError(f"{spec}() gave no example inputs: return (model, example_inputs) or give the module an "
                          "example_inputs attribute")
    return model, inputs


def load_state(path: Path, who: str) -> dict[str, torch.Tensor]:
    """A ``torch.save``d state dict (:func:`symalign.io.statedict.load_state_file`)."""
    return load_state_file(path, who)


def check_output_file(out: Path, inputs: tuple[Path, ...], force: bool) -> None:
    """Refuse (:class:`CheckpointError`) an output file that is one of ``inputs``, or exists without ``force``."""
    for src in inputs:
        if Path(out).resolve() == Path(src).resolve():
            raise CheckpointError(f"the output {out} is an input; pick another path")
    if Path(out).exists() and not force:
        raise CheckpointError(f"{out} already exists; pass --force to replace it")


def run_align_module(module: str, a_path: Path, b_path: Path, out: Path, scope: str = "model",
                     stage2: str = "full", stage1: bool = True, force: bool = False,
                     max_sweeps: int = 20, strict: bool = False, device: Any = None) -> AlignResult:
    """Align B.pt to A.pt through the traced symmetries of ``module``'s model and write OUT (module docstring);
    the result has the shape of every ``align`` (:class:`~symalign.align_result.AlignResult`, ``path="module"``,
    with ``coverage``); ``strict``: refuse when any part would be left unchanged (nothing is written); ``device``:
    where the matching computes."""
    from symalign.tracing.align import align_states

    clock = PhaseClock()
    out = Path(out)
    check_output_file(out, (a_path, b_path), force)
    if stage2 not in ("none", "orthogonal", "full"):
        raise ConfigError(f"unknown --stage2 {stage2!r}; use one of none, orthogonal, full")
    with clock("read"):
        model, inputs = load_factory(module)
        state_a, state_b = load_state(a_path, "checkpoint A"), load_state(b_path, "checkpoint B")
    with clock("match"):  # trace (prepare), match and the function check (verify): one call
        res = align_states(model, state_a, state_b, inputs, scope=scope, stage1=stage1, stage2=stage2,
                           max_sweeps=max_sweeps, strict=strict, device=device)
    with clock("write"):
        save_state_file(res.state, out)
    m = res.match
    sweeps, converged = (getattr(m, "iterations", 1), getattr(m, "converged", True))
    dtype = next((v.dtype for v in state_b.values() if v.is_floating_point()), torch.float32)
    threads = torch.get_num_threads()
    return AlignResult(
        a=str(a_path), b=str(b_path), out=str(out), scope=scope, path="module", family=f"module {module}",
        architecture=type(model).__name__, dtype=dtype_name(dtype), stage1=stage1, stage2=stage2,
        group={"dim": res.trace.spec.dim, "spaces": res.trace.spec.describe()},
        distance={"before": {"total": res.distance_before}, "after": {"total": res.distance_after}},
        sweeps=int(sweeps), converged=bool(converged), check=res.verify,
        max_sweeps=max_sweeps if scope == "model" else None, timings=clock.timings(), threads=threads,
        provenance=provenance(threads=threads), notes=[str(s) for s in res.trace.skipped] + res.trace.notes,
        coverage=res.coverage.to_dict() if res.coverage is not None else None,
        match={"trace": res.trace.to_dict(), **(m.to_dict() if hasattr(m, "to_dict") else {})})
