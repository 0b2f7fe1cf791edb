"""Tiny random Hugging Face models of the registered families (shared by the HF tests): each family module
declares its tiny config (``Family.tiny``); ``config``/``make_model`` set overrides on the built config."""

from __future__ import annotations

import torch

transformers = __import__("pytest").importorskip("transformers")
T = transformers
T.utils.logging.disable_progress_bar()
T.utils.logging.set_verbosity_error()

def family(name: str):
    """The registered family of ``model_type`` ``name`` (:data:`symalign.families.FAMILIES`)."""
    from symalign.families import get_adapter

    try:
        fam = get_adapter({"model_type": name})
    except Exception:
        fam = None
    if fam is None or fam.tiny is None:
        raise KeyError(f"no registered family with a tiny model for model_type {name!r}")
    return fam


def _registered():
    from symalign.families import FAMILIES as REGISTERED

    return REGISTERED


# the hf: experiment families (the first adapters): the adapter tests of test_arch.py and test_align_cli.py
FAMILIES = tuple(f.model_types[0] for f in _registered() if f.tiny is not None and f.experiment is not None)


def config(name: str, **overrides):
    """The family's tiny config (:attr:`symalign.families.base.Family.tiny`), ``overrides`` set afterwards."""
    tiny = family(name).tiny
    cfg = tiny.classes()[1](**tiny.kwargs)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def randomize(model: torch.nn.Module, seed: int) -> None:
    """O(1)-scale random weights so attention patterns are far from uniform (symmetry breaks show)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                fan_in = p.shape[0] if "c_attn" in name or "c_proj" in name or "c_fc" in name else p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * (1.5 / fan_in ** 0.5))
            else:
                base = 1.0 if ("norm" in name.lower() or "ln_" in name) and name.endswith("weight") else 0.0
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=g, dtype=torch.float64))


def make_model(name: str, dtype=torch.float64, seed: int = 0, attn: str = "eager", **overrides):
    cls = family(name).tiny.classes()[0]
    cfg = config(name, **overrides)
    torch.manual_seed(seed)
    model = cls._from_config(cfg, attn_implementation=attn)
    model = model.to(dtype)
    randomize(model, seed)
    return model.eval()


def inputs(model, seed: int = 0, batch: int = 2, seq: int = 8) -> dict:
    from symalign.families import get_adapter

    x = get_adapter(model).dummy_inputs(model.config, batch=batch, seq=seq, seed=seed)
    return {k: (v.to(model.dtype) if v.is_floating_point() else v) for k, v in x.items()}


def output(model, x) -> torch.Tensor:
    with torch.no_grad():
        out = model(**x)
    return (out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state).double()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())
