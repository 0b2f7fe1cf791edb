r"""Predicted Jacobian nullity of the reference attention layer, and the geometry of its RoPE planes.

The terms of :func:`predicted_nullity` are derived in ``docs/symmetry.md``; the
measured side is :func:`symalign.probe.probe`. :func:`rope_planes` gives, per RoPE
plane ``j`` with frequency ``theta_j``, the total rotation ``theta_j (T - 1)`` over a
context of ``T`` positions: a plane that barely rotates is almost unconstrained by
position, so the ``H`` block on it is *nearly* enlarged to ``GL(2)`` -- the near-null
singular values the probe reports (:mod:`symalign.probe.spectrum`).
"""

from __future__ import annotations

from typing import Sequence

import torch

from symalign.nn.attention import AttentionConfig, attention_spec

SLOW_PLANE_RAD = 0.1
"""A RoPE plane whose total rotation over the context is below this (radians) is flagged slow."""


def predicted_nullity(cfg: AttentionConfig, seq_len: int) -> tuple[int, dict[str, int]]:
    r"""Predicted Jacobian nullity of :class:`MultiHeadAttention` (generic weights and inputs).

    Terms (``d = d_h``, ``r`` the rotated width, ``h_kv`` the K/V heads):

    * ``qk``: the declared Q-K group, ``h_kv * d^2`` (``GL(d)`` per K/V group) or
      ``h_kv * (r + (d - r)^2)`` under RoPE (``H(r) (+) GL(d - r)``);
    * ``vo``: the declared V-O group, ``h_kv * d^2``;
    * ``key_bias`` (bias only): ``q_m^T b_K`` is the same for every key ``n``, and
      softmax ignores a per-row constant; under RoPE only the unrotated part of
      ``b_K`` has that property: ``h_kv * (d - r)``;
    * ``value_output_bias`` (bias only): attention rows sum to one, so
      ``b_V -> b_V + delta``, ``b_O -> b_O - sum_i W_O^i delta_{j(i)}`` is exact:
      ``h_kv * d``;
    * ``pe_shift`` (learned PE with bias): ``p_t -> p_t + u`` for every ``t`` is
      absorbed by ``b_{Q,K,V} -> b - W u``: ``D``;
    * ``unused_pe_rows`` (learned PE): rows ``t >= seq_len`` of the table never
      reach the output: ``(max_len - seq_len) * D``.

    The first two are the continuous group the layer's spec declares
    (:func:`symalign.nn.attention.attention_spec`); the others are *not* in its orbit.
    Assumes a non-degenerate probe (see :func:`degeneracy_warnings`).
    """
    spec = attention_spec(cfg)
    d, hkv, r, D = cfg.head_dim, cfg.n_kv_heads, cfg.rotary_dims, cfg.d_model
    terms: dict[str, int] = {"qk": spec.spaces["qk.0"].dim, "vo": spec.spaces["vo.0"].dim}
    if cfg.bias:
        terms["key_bias"] = hkv * (d - r)
        terms["value_output_bias"] = hkv * d
    if cfg.pe == "learned":
        if cfg.bias:
            terms["pe_shift"] = D
        terms["unused_pe_rows"] = max(cfg.max_len - seq_len, 0) * D
    return sum(terms.values()), terms


def attention_parameter_count(cfg: AttentionConfig) -> int:
    """Number of parameters of :class:`MultiHeadAttention` with this config."""
    h, hkv, d, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_model
    n = 2 * h * d * D + 2 * hkv * d * D
    if cfg.bias:
        n += h * d + 2 * hkv * d + D
    if cfg.pe == "learned":
        n += cfg.max_len * D
    return n


def degeneracy_warnings(cfg: AttentionConfig, seq_len: int, outputs: int, parameters: int) -> list[str]:
    """Reasons the measured nullity may exceed :func:`predicted_nullity` (empty when the setup is generic)."""
    out = []
    d, D, h, hkv = cfg.head_dim, cfg.d_model, cfg.n_heads, cfg.n_kv_heads
    if seq_len < 2:
        out.append("seq_len < 2: softmax over one key is constant, Q and K do not matter")
    if d > D:
        out.append(f"head_dim={d} > d_model={D}: W_Q W_K^T has rank <= D < d_h, the fibres are larger than GL(d_h)")
    if cfg.pe == "learned" and (h + 2 * hkv) * d < D:
        out.append("the stacked Q/K/V maps have a null space: learned PE rows may move inside it for free")
    if outputs < parameters:
        out.append(f"only {outputs} outputs for {parameters} parameters: rank is capped by the outputs")
    return out



def rope_planes(frequencies: Sequence[float] | torch.Tensor, seq_len: int,
                slow: float = SLOW_PLANE_RAD) -> list[dict]:
    """Per plane ``j``: ``{"plane": j, "frequency": theta_j, "angle": theta_j (T - 1), "slow": angle < slow}``.

    ``frequencies`` are the per-plane angular frequencies (radians per position; a
    Hugging Face rotary module's ``inv_freq``, or ``base^(-2j/r)`` for the reference
    layer). ``angle`` is the largest relative rotation between two positions of the
    context, ``theta_j (T - 1)`` radians (not reduced mod ``2 pi``: a fast plane is
    far from slow whatever its residue).
    """
    freqs = torch.as_tensor(frequencies, dtype=torch.float64).reshape(-1)
    span = max(int(seq_len) - 1, 0)
    return [{"plane": j, "frequency": float(f), "angle": float(f) * span, "slow": float(f) * span < slow}
            for j, f in enumerate(freqs)]


def reference_frequencies(cfg: AttentionConfig) -> torch.Tensor | None:
    """``theta_j = base^(-2j / r)``, ``j < r / 2``, of the reference layer (None without RoPE)."""
    if cfg.pe != "rope" or not cfg.rotary_dims:
        return None
    r = cfg.rotary_dims
    return cfg.rope_base ** (-torch.arange(0, r, 2, dtype=torch.float64) / r)
