r"""The reference multi-head attention layer, in one place.

Used by the built-in models, the tests and the probe. With input ``x`` of shape
``(B, T, D)`` (plus a fixed or learned position table ``p`` for ``sinusoidal`` /
``learned``):

    q_i = W_Q^i (x + p) + b_Q^i,  k_j = W_K^j (x + p) + b_K^j,  v_j likewise
    s_i[m, n] = q_i[m]^T R_{n-m} k_{j(i)}[n] / sqrt(d_h) + bias_i[m, n]
    y = sum_i softmax_n(s_i) v_{j(i)} W_O^{i T} + b_O

with ``j(i) = i // (h / h_kv)`` (grouped-query attention), ``R`` the RoPE
rotation on the first ``r = rotary_fraction * d_h`` dims (identity otherwise),
``bias_i`` the ALiBi bias ``-slope_i |m - n|`` and the causal mask. Weights are
``nn.Linear`` (PyTorch layout ``(out, in)``): ``q_proj`` is ``(h d_h, D)``, ``o_proj``
``(D, h d_h)``.

:meth:`MultiHeadAttention.symmetry_spec` declares its exact symmetry group:

* heads: ``S_h`` (``S_{h_kv} wr S_g`` under GQA) -- absent under ALiBi, whose
  distinct slopes pin every head;
* Q-K per K/V group: ``GL(d_h)``, or ``H(r) (+) GL(d_h - r)`` under RoPE;
* V-O per K/V head: ``GL(d_h)``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from symalign.errors import ConfigError
from symalign.groups import PAIRINGS, GeneralLinear, HeadPermutation, PerHead, RotaryPlanes
from symalign.nn.positional import alibi_bias, alibi_slopes, apply_rope, rope_angles, sinusoidal_table
from symalign.spec import SymmetrySpec

POSITIONAL_ENCODINGS: tuple[str, ...] = ("none", "sinusoidal", "learned", "rope", "alibi")


@dataclass
class AttentionConfig:
    """Shape and positional encoding of one attention layer (validated on construction)."""

    d_model: int
    n_heads: int
    head_dim: int | None = None  # default d_model // n_heads
    n_kv_heads: int | None = None  # default n_heads (no GQA)
    pe: str = "none"
    rope_pairing: str = "half"
    rotary_fraction: float = 1.0
    rope_base: float = 10000.0
    bias: bool = False
    causal: bool = False
    max_len: int = 256

    def __post_init__(self):
        if self.pe not in POSITIONAL_ENCODINGS:
            raise ConfigError(f"unknown positional encoding {self.pe!r}; use one of {', '.join(POSITIONAL_ENCODINGS)}")
        if self.d_model <= 0 or self.n_heads <= 0:
            raise ConfigError(f"d_model and n_heads must be positive, got {self.d_model} and {self.n_heads}")
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                raise ConfigError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                                  "pick a divisor or pass head_dim explicitly")
            self.head_dim = self.d_model // self.n_heads
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.n_kv_heads <= 0 or self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}")
        if self.pe == "rope":
            if self.rope_pairing not in PAIRINGS:
                raise ConfigError(f"unknown RoPE pairing {self.rope_pairing!r}; use 'half' or 'interleaved'")
            if not 0 < self.rotary_fraction <= 1:
                raise ConfigError(f"rotary_fraction must be in (0, 1], got {self.rotary_fraction}")
            r = self.head_dim * self.rotary_fraction
            if abs(r - round(r)) > 1e-9 or round(r) % 2 or round(r) == 0:
                raise ConfigError(f"RoPE rotates {r:g} of the head_dim={self.head_dim} dimensions; the rotated "
                                  "width must be a positive even integer (change head_dim or rotary_fraction)")
        if self.max_len <= 0:
            raise ConfigError(f"max_len must be positive, got {self.max_len}")

    @property
    def rotary_dims(self) -> int:
        """Rotated width ``r`` per head (0 without RoPE)."""
        return int(round(self.head_dim * self.rotary_fraction)) if self.pe == "rope" else 0

    @property
    def group_size(self) -> int:
        return self.n_heads // self.n_kv_heads

    def to_dict(self) -> dict:
        return asdict(self)


class MultiHeadAttention(nn.Module):
    """Multi-head (grouped-query) self-attention with a pluggable positional encoding."""

    def __init__(self, cfg: AttentionConfig | None = None, **kwargs):
        super().__init__()
        self.cfg = cfg = cfg if cfg is not None else AttentionConfig(**kwargs)
        self.use_sdpa = True  # fused kernel; set False for functorch transforms (the probe)
        h, hkv, d, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_model
        self.q_proj = nn.Linear(D, h * d, bias=cfg.bias)
        self.k_proj = nn.Linear(D, hkv * d, bias=cfg.bias)
        self.v_proj = nn.Linear(D, hkv * d, bias=cfg.bias)
        self.o_proj = nn.Linear(h * d, D, bias=cfg.bias)
        if cfg.pe == "sinusoidal":
            self.register_buffer("pos_table", sinusoidal_table(cfg.max_len, D), persistent=False)
        elif cfg.pe == "learned":
            self.pos_emb = nn.Parameter(0.02 * torch.randn(cfg.max_len, D))
        if cfg.pe == "alibi":
            self.register_buffer("slopes", alibi_slopes(h), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        cfg = self.cfg
        B, T, D = x.shape
        if T > cfg.max_len and cfg.pe in ("sinusoidal", "learned"):
            raise ConfigError(f"sequence length {T} exceeds max_len={cfg.max_len}")
        if cfg.pe == "sinusoidal":
            x = x + self.pos_table[:T].to(x.dtype)
        elif cfg.pe == "learned":
            x = x + self.pos_emb[:T]
        h, hkv, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        q = self.q_proj(x).view(B, T, h, d).transpose(1, 2)  # (B, h, T, d)
        k = self.k_proj(x).view(B, T, hkv, d).transpose(1, 2)
        v = self.v_proj(x).view(B, T, hkv, d).transpose(1, 2)
        if cfg.pe == "rope":
            ang = rope_angles(T, cfg.rotary_dims, cfg.rope_base).to(x.device)
            q = apply_rope(q, ang, cfg.rope_pairing)
            k = apply_rope(k, ang, cfg.rope_pairing)
        causal_only = self.use_sdpa and cfg.causal and cfg.pe != "alibi"  # fused causal kernel, no mask tensor
        mask = None if causal_only else self.score_bias(T, x.dtype, x.device)
        if self.use_sdpa:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal_only, enable_gqa=hkv != h,
                                               scale=1.0 / math.sqrt(d))
        else:  # plain tensor ops: functorch (jacrev/jvp/vmap) batches them without fallbacks
            if hkv != h:
                k = k.repeat_interleave(h // hkv, dim=1)
                v = v.repeat_interleave(h // hkv, dim=1)
            s = q @ k.transpose(-2, -1) / math.sqrt(d)
            if mask is not None:
                s = s + mask
            y = torch.softmax(s, dim=-1) @ v
        return self.o_proj(y.transpose(1, 2).reshape(B, T, h * d))

    def score_bias(self, T: int, dtype, device) -> Tensor | None:
        """Additive score bias ``(h or 1, T, T)``: ALiBi and/or the causal mask (None if neither)."""
        bias = None
        if self.cfg.pe == "alibi":
            bias = alibi_bias(self.slopes.double(), T).to(dtype=dtype, device=device)
        if self.cfg.causal:
            causal = torch.full((T, T), float("-inf"), dtype=dtype, device=device).triu(1)
            bias = causal.unsqueeze(0) if bias is None else bias + causal
        return bias

    def symmetry_spec(self, prefix: str = "", tag: str = "0") -> SymmetrySpec:
        """The exact symmetry group of this layer (see the module docstring).

        Spaces are ``heads.{tag}``, ``qk.{tag}``, ``vo.{tag}``; tensor names are
        ``prefix + "q_proj.weight"`` etc.
        """
        return attention_spec(self.cfg, prefix, tag)


def attention_spec(cfg: AttentionConfig, prefix: str = "", tag: str = "0",
                   names: dict[str, str] | None = None, layer: int | None = None) -> SymmetrySpec:
    """Symmetry spec of an attention layer with ``nn.Linear`` projections ``q/k/v/o_proj``.

    ``names`` may rename the projections (e.g. ``{"q": "attn.query"}``) for models
    whose modules are called differently; biases are included when ``cfg.bias``.
    The spaces carry the roles ``heads``/``qk``/``vo`` and ``layer`` (default: ``int(tag)``
    when the tag is a number).
    """
    n = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", **(names or {})}
    h, hkv, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    spec = SymmetrySpec()
    heads, qk, vo = f"heads.{tag}", f"qk.{tag}", f"vo.{tag}"
    if layer is None and tag.isdigit():
        layer = int(tag)
    has_heads = cfg.pe != "alibi"
    if has_heads:
        spec.add_space(heads, HeadPermutation(h, d, hkv), "heads", layer)
    inner = RotaryPlanes(d, cfg.rope_pairing, cfg.rotary_dims) if cfg.pe == "rope" else GeneralLinear(d)
    spec.add_space(qk, PerHead(inner, hkv), "qk", layer)
    spec.add_space(vo, PerHead(GeneralLinear(d), hkv), "vo", layer)
    if has_heads:
        spec.couple(heads, qk, vo)

    def label(tensor: str, axis: int, block_space: str, variance: str, rep: str):
        if has_heads:
            spec.act_on(tensor, heads, axis, "co", rep)
        spec.act_on(tensor, block_space, axis, variance, rep)

    suffixes = ["weight"] + (["bias"] if cfg.bias else [])
    for s in suffixes:
        label(f"{prefix}{n['q']}.{s}", 0, qk, "co", "query")
        label(f"{prefix}{n['k']}.{s}", 0, qk, "contra", "kv")
        label(f"{prefix}{n['v']}.{s}", 0, vo, "co", "kv")
    label(f"{prefix}{n['o']}.weight", 1, vo, "contra", "query")
    return spec
