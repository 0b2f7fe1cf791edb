"""Attention probes of the reference layer for the CLI, the demo and the docs: one config, and the tour."""

from __future__ import annotations

import math
from typing import Sequence

import torch

from symalign.errors import SymalignError
from symalign.nn.attention import AttentionConfig, MultiHeadAttention
from symalign.probe.measure import ProbeResult, probe
from symalign.probe.theory import attention_parameter_count


def generic_attention(cfg: AttentionConfig, seed: int = 0, weight_scale: float = 1.0) -> MultiHeadAttention:
    """A float64 layer with generic Gaussian weights (``std = weight_scale / sqrt(fan_in)``), biases and PE rows."""
    torch.manual_seed(seed)
    layer = MultiHeadAttention(cfg).double()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, prm in layer.named_parameters():
            fan_in = prm.shape[-1] if prm.dim() > 1 and not name.startswith("pos_emb") else 1
            std = weight_scale / math.sqrt(fan_in) if prm.dim() > 1 else 0.5
            prm.copy_(torch.randn(prm.shape, generator=gen, dtype=torch.float64) * std)
    return layer


def probe_batch(cfg: AttentionConfig, seq_len: int, ratio: float = 2.0) -> int:
    """Batch size giving at least ``ratio`` times as many outputs as parameters."""
    return max(1, math.ceil(ratio * attention_parameter_count(cfg) / (seq_len * cfg.d_model)))


def probe_attention(cfg: AttentionConfig, seq_len: int, batch: int | None = None, *, seed: int = 0,
                    method: str = "auto", probes: int = 16, tol: float | None = None,
                    maxiter: int = 2000, device: str | torch.device | None = None) -> ProbeResult:
    """Probe a generic :class:`MultiHeadAttention` with ``cfg`` on random ``(batch, seq_len, D)`` inputs (drawn on
    the CPU; ``device``: measured there, :func:`symalign.probe.measure.probe`)."""
    if seq_len <= 0:
        raise SymalignError(f"seq_len must be positive, got {seq_len}")
    if cfg.pe in ("sinusoidal", "learned") and seq_len > cfg.max_len:
        raise SymalignError(f"seq_len={seq_len} exceeds max_len={cfg.max_len}")
    batch = probe_batch(cfg, seq_len) if batch is None else batch
    if batch <= 0:
        raise SymalignError(f"batch must be positive, got {batch}")
    layer = generic_attention(cfg, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, seq_len, cfg.d_model, generator=gen, dtype=torch.float64)
    return probe(layer, x, method=method, probes=probes, seed=seed, tol=tol, maxiter=maxiter, device=device)


TOUR: tuple[tuple[str, dict], ...] = (
    ("none", dict(pe="none")),
    ("sinusoidal", dict(pe="sinusoidal")),
    ("learned", dict(pe="learned")),
    ("rope (half)", dict(pe="rope", rope_pairing="half")),
    ("rope (interleaved)", dict(pe="rope", rope_pairing="interleaved")),
    ("partial rope (r=2/4)", dict(pe="rope", rotary_fraction=0.5)),
    ("alibi", dict(pe="alibi")),
    ("gqa (h=4, h_kv=2)", dict(pe="none", n_heads=4, n_kv_heads=2)),
    ("gqa + rope", dict(pe="rope", n_heads=4, n_kv_heads=2)),
)
"""The probe tour's variants (overrides of a small base config)."""


def probe_tour(d_model: int = 8, n_heads: int = 2, head_dim: int = 4, seq_len: int = 6, seed: int = 0,
               biases: Sequence[bool] = (False, True), variants: Sequence[str] | None = None) -> list[dict]:
    """Dense probes of every tour variant, with and without biases (a few seconds at the defaults).

    Returns one dict per row: variant, bias, config, measured nullity, predicted,
    breakdown, group description, head permutations preserved, match, seconds.
    """
    rows = []
    for label, over in TOUR:
        if variants is not None and label not in variants:
            continue
        for bias in biases:
            kw = dict(d_model=d_model, n_heads=n_heads, head_dim=head_dim, bias=bias, max_len=seq_len)
            kw.update(over)
            cfg = AttentionConfig(**kw)
            res = probe_attention(cfg, seq_len, seed=seed, method="dense")
            rows.append({"variant": label, "bias": bias, "config": cfg.to_dict(), "nullity": int(res.nullity),
                         "predicted": res.predicted, "breakdown": res.breakdown, "parameters": res.parameters,
                         "outputs": res.outputs, "singular_value_gap": res.to_dict()["singular_value_gap"],
                         "group": res.group, "head_permutations_preserved": res.head_permutations_preserved,
                         "near_null": res.near_null, "smallest_kept": res.smallest_kept,
                         "largest_null": res.largest_null, "rope_planes": res.rope_planes,
                         "slow_planes": res.slow_planes, "match": res.match, "seconds": round(res.seconds, 3)})
    return rows
