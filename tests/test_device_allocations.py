"""Every tensor a matcher allocates names its device, so a GPU run never mixes devices.

Runs on the CPU: :class:`FactoryCalls` (a :class:`torch.overrides.TorchFunctionMode`) records each factory call
(``torch.zeros``, ``eye``, ...) made *from a watched module's own lines* without a ``device=`` argument. On a
CPU-only machine such a call is harmless; on a GPU it puts an accumulator on the CPU beside CUDA weights.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

FACTORIES = {torch.zeros, torch.ones, torch.eye, torch.empty, torch.full, torch.arange, torch.linspace,
             torch.tensor, torch.randn, torch.rand, torch.randint}


class FactoryCalls(TorchFunctionMode):
    """Collect ``(file:line, factory)`` for device-less factory calls whose caller is in ``files``."""

    def __init__(self, files: set[str]):
        super().__init__()
        self.files, self.found = files, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and "device" not in kwargs:
            caller = inspect.stack(context=0)[1]
            if caller.filename in self.files:
                self.found.append(f"{Path(caller.filename).name}:{caller.lineno} {func.__name__}")
        return func(*args, **kwargs)


def _watched(*modules) -> set[str]:
    return {inspect.getsourcefile(m) for m in modules}


def test_the_mode_catches_a_device_less_allocation():
    """The guard can fire: a call from this file without ``device=`` is recorded, one with it is not."""
    with FactoryCalls({__file__}) as mode:
        torch.zeros(2)
        torch.zeros(2, device="cpu")
    assert len(mode.found) == 1 and "zeros" in mode.found[0]


def test_qk_norm_solvers_allocate_on_the_weights_device():
    """The exact QK-norm steps (signs and scales) of the first QK-normed causal family's attention match."""
    pytest.importorskip("transformers")
    from hf_families import make, registered
    from symalign.families import get_adapter
    from symalign.match import match_attention, qknorm
    from symalign.spec import apply, sample

    fam = next(f for f, d in registered() if d.decl.q_norm and d.tiny.model.endswith("ForCausalLM") and d.cases)
    a = make(fam).double()
    spec = get_adapter(a).spec(a)
    sa = a.state_dict()
    sb = apply(spec, sample(spec, 3), sa)
    assert any(qknorm.exact_step(g) for g in spec.spaces.values()), fam  # the QK-norm path runs
    with FactoryCalls(_watched(qknorm)) as mode:
        match_attention(spec, sa, sb)
    assert mode.found == []


def test_slow_planes_allocate_on_the_weights_device():
    from _whole_util import model
    from symalign.match import slow_planes

    a = model("vit", "rope", seed=1, d_model=32, n_heads=2)
    b = model("vit", "rope", seed=2, d_model=32, n_heads=2)
    spec = a.symmetry_spec().restrict([s for s in a.symmetry_spec().spaces if s.split(".")[0] in ("heads", "qk", "vo")])
    sa = {k: v.detach().clone() for k, v in a.state_dict().items()}
    sb = {k: v.detach().clone() for k, v in b.state_dict().items()}
    with FactoryCalls(_watched(slow_planes)) as mode:
        slow_planes.align_slow_planes(spec, sa, sb, [6, 7], max_iter=20)
    assert mode.found == []
