"""``symalign merge --module pkg.mod:factory A.pt B.pt -o OUT.pt --widths 64,96``: merge models of different
hidden widths.

``factory(width)`` (imported as ``symalign align --module`` imports its factory) builds the module at a hidden
width and returns it, or ``(module, example_inputs)``; A.pt and B.pt are ``torch.save(model.state_dict())``
files of ``factory(w_A)`` and ``factory(w_B)``, ``--widths w_A,w_B``. The narrower is widened onto the wider's
widths by splitting its hidden units (``--split matched``: fitted to the wider model's units; ``uniform``: the
first units copied), aligned to it through the traced symmetries and averaged
(:func:`symalign.tracing.widths.merge_widths`); OUT.pt is a state dict of ``factory(max(w_A, w_B))``.

Every argument is checked first (one line, exit 2, nothing written): ``--widths`` must be two different
positive integers, each state dict must fit its factory's module; OUT.pt is written atomically (a temporary
file renamed into place) after the widened model was checked to compute the narrower's function.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from symalign.errors import ConfigError
from symalign.provenance import provenance


def parse_widths(text: str | None) -> tuple[int, int]:
    """``"64,96"`` -> ``(64, 96)``: two different positive integers (else :class:`ConfigError`)."""
    if text is None:
        raise ConfigError("--module merges models of different hidden widths: give --widths A,B (e.g. --widths "
                          "64,96); to align state dicts of one width use `symalign align --module`")
    parts = [p.strip() for p in text.replace(";", ",").split(",")]
    try:
        widths = [int(p) for p in parts]
    except ValueError:
        widths = []
    if len(widths) != 2 or min(widths) <= 0:
        raise ConfigError(f"--widths expects two positive integers, the hidden widths of A and B (e.g. --widths "
                          f"64,96); got {text!r}")
    if widths[0] == widths[1]:
        raise ConfigError(f"--widths {text}: both models have width {widths[0]}; merging different widths needs "
                          "two different ones (same-width state dicts: `symalign align --module`)")
    return widths[0], widths[1]


def run_merge_widths(module: str, a_path: Path, b_path: Path, out: Path, widths: tuple[int, int],
                     split: str = "matched", weights: list[float] | None = None, align: bool = True,
                     force: bool = False, max_sweeps: int = 20, device: Any = None) -> dict[str, Any]:
    """Merge A.pt and B.pt of ``factory(widths[0])`` and ``factory(widths[1])`` into OUT.pt (module docstring);
    returns the diagnostics."""
    from symalign.commands.align_module import check_output_file, load_factory, load_state
    from symalign.io.statedict import save_state_file
    from symalign.merge import normalise_weights
    from symalign.tracing.align import check_state
    from symalign.tracing.widths import SPLITS, merge_widths

    t0 = time.perf_counter()
    out = Path(out)
    check_output_file(out, (a_path, b_path), force)
    if split not in SPLITS:
        raise ConfigError(f"unknown --split {split!r}; use one of {', '.join(SPLITS)}")
    w = normalise_weights(weights, 2)
    (model_a, inputs), (model_b, _) = load_factory(module, widths[0]), load_factory(module, widths[1])
    state_a, state_b = load_state(a_path, "checkpoint A"), load_state(b_path, "checkpoint B")
    check_state(model_a, state_a, f"checkpoint A (width {widths[0]} by --widths)")
    check_state(model_b, state_b, f"checkpoint B (width {widths[1]} by --widths)")
    wide_first = widths[0] > widths[1]
    wide, narrow = (model_a, model_b) if wide_first else (model_b, model_a)
    s_wide, s_narrow = (state_a, state_b) if wide_first else (state_b, state_a)
    w_wide = w[0] if wide_first else w[1]
    res = merge_widths(wide, narrow, s_wide, s_narrow, inputs, split=split, align=align,
                       weights=(w_wide, 1 - w_wide), max_sweeps=max_sweeps, device=device)
    save_state_file(res.state, out)
    threads = torch.get_num_threads()
    al = res.alignment
    return {"a": str(a_path), "b": str(b_path), "out": str(out), "module": module, "widths": list(widths),
            "width": max(widths), "widened": "b" if wide_first else "a", "split": split, "aligned": align,
            "weights": w, "spaces": res.split.describe(),
            "widen_check": res.widen_check.to_dict() if res.widen_check is not None else None,
            "distance": None if al is None else {"before": al.distance_before, "after": al.distance_after},
            "check": None if al is None or al.verify is None else al.verify.to_dict(),
            "time_s": time.perf_counter() - t0, "provenance": provenance(threads=threads)}
