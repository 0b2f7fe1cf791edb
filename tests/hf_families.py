"""Tiny random models of the registered families (declared by each family module), the cases the generic
tests run, and planted pairs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hf_tiny import family, randomize

transformers = __import__("pytest").importorskip("transformers")
T = transformers


def registered():
    """``(model_type, family)`` of every registered family with a tiny model, in registry order."""
    from symalign.families import FAMILIES as REGISTERED

    return [(f.model_types[0], f) for f in REGISTERED if f.tiny is not None]


def cases(keep=lambda case: True):
    """``(model_type, case)`` of every declared :class:`~symalign.families.declared.Case` that ``keep`` keeps."""
    return [(mt, c) for mt, f in registered() for c in f.cases if keep(c)]


def case_id(name: str, kw) -> str:
    return name + "".join(f"-{k}={v if not isinstance(v, dict) else v.get('rope_type', 'dict')}" for k, v in kw.items())


# the families the generic tests of test_families.py run (a case checked for exactness)
FAMILIES = tuple(mt for mt, f in registered() if any(c.exact for c in f.cases))


def make(name: str, dtype=torch.float64, seed: int = 0, attn: str = "eager", **overrides):
    """The family's tiny model (:attr:`~symalign.families.base.Family.tiny`; ``overrides`` given to the config
    class), random O(1) weights of ``seed``, ``dtype``, eager attention."""
    cls, cfg_cls = family(name).tiny.classes()
    cfg = cfg_cls(**{**family(name).tiny.kwargs, **overrides})
    torch.manual_seed(seed)
    model = cls._from_config(cfg, attn_implementation=attn).to(dtype)
    randomize(model, seed)
    return model.eval()


from symalign.probe.families import float64_numerics  # noqa: E402,F401  (re-exported for the tests)


@dataclass
class Planted:
    """A planted pair on disk: ``B = element . A`` (``scope`` "model": on A's exact rewrite ``prepare``)."""

    spec: Any
    target: dict  # A's state (or its rewrite): what ``element`` was applied to
    element: dict
    untied: bool  # the rewrite untied the head (model scope only)


def plant_checkpoints(a, scope: str, dtype, tmp_path, seed: int = 7) -> Planted:
    """Save ``a`` in ``dtype`` as ``tmp_path/A`` and ``B = g . A`` (``g = sample(spec, seed)`` of A's spec for
    ``scope``) in A's layout as ``tmp_path/B``; the planted-recovery tests align B to A and expect ``target``."""
    from symalign.checkpoint.hf import load_checkpoint
    from symalign.checkpoint.output import write_checkpoint
    from symalign.families import prepare
    from symalign.spec import apply, sample

    a.to(dtype).save_pretrained(tmp_path / "A")
    ck = load_checkpoint(tmp_path / "A")
    spec, target, untied = ck.adapter.spec(ck.config, ck.state.keys()), ck.state, False
    if scope == "model":
        prep = prepare(ck.config, ck.state, spec, type(a).__name__)
        spec, target, untied = prep.spec, prep.state, prep.untied
    t = sample(spec, seed)
    write_checkpoint(tmp_path / "B", {k: v.to(dtype) for k, v in apply(spec, t, target).items()},
                           tmp_path / "A")
    return Planted(spec, target, t, untied)
