r"""Transformer building blocks shared by the built-in models.

A pre-LN block computes (nanoGPT)::

    x = x + Attn(Norm_1(x))
    x = x + MLP(Norm_2(x)),      MLP(x) = fc_out(act(fc_in(x)))

and a post-LN block ``x = Norm_1(x + Attn(x)); x = Norm_2(x + MLP(x))``.
Attention is :class:`symalign.nn.attention.MultiHeadAttention` (RoPE/ALiBi are
handled inside it; sinusoidal/learned tables are added once at the model input
by :class:`PositionalInput`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from symalign.groups import Permutation, PositiveMonomial
from symalign.models.config import ModelConfig
from symalign.nn.attention import MultiHeadAttention, attention_spec
from symalign.nn.positional import sinusoidal_table
from symalign.spec import SymmetrySpec

RESIDUAL = "residual"


def make_norm(cfg: ModelConfig) -> nn.Module:
    """LayerNorm ``g (x - mean) / std + b`` or RMSNorm ``g x / rms(x)`` over the last axis."""
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)


class MLP(nn.Module):
    """``fc_out(act(fc_in(x)))`` with hidden width ``d_ff`` (GELU or ReLU)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc_in = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias)
        self.act = nn.GELU() if cfg.activation == "gelu" else nn.ReLU()
        self.fc_out = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.fc_out(self.act(self.fc_in(x))))


class Block(nn.Module):
    """One Transformer layer: attention and MLP sub-layers with residual connections."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.pre_norm = cfg.pre_norm
        self.norm1 = make_norm(cfg)
        self.attn = MultiHeadAttention(cfg.attention_config())
        self.norm2 = make_norm(cfg)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        if self.pre_norm:
            x = x + self.drop(self.attn(self.norm1(x)))
            return x + self.mlp(self.norm2(x))
        x = self.norm1(x + self.drop(self.attn(x)))
        return self.norm2(x + self.mlp(x))


class PositionalInput(nn.Module):
    """Adds the absolute position table once: ``x[:, t] + P[t]`` (no-op for none/RoPE/ALiBi).

    ``sinusoidal``: ``sqrt(D) x[:, t] + P[t]`` with the fixed table of
    :func:`symalign.nn.positional.sinusoidal_table` (a non-persistent buffer, not a
    parameter). The ``sqrt(D)`` embedding scale is Vaswani et al.'s (sec. 3.4): with
    embeddings initialised at std 0.02 the unit-amplitude table would otherwise
    swamp the token signal (measured: a char-LM stalls at the unigram loss).
    ``learned``: the parameter ``pos_emb`` (std 0.02, like the embeddings).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.kind = cfg.pe
        self.n_positions = cfg.n_positions
        if cfg.pe == "sinusoidal":
            self.register_buffer("table", sinusoidal_table(cfg.n_positions, cfg.d_model), persistent=False)
        elif cfg.pe == "learned":
            self.pos_emb = nn.Parameter(torch.zeros(cfg.n_positions, cfg.d_model))

    def forward(self, x: Tensor) -> Tensor:
        T = x.shape[1]
        if self.kind in ("sinusoidal", "learned") and T > self.n_positions:
            from symalign.errors import ConfigError

            raise ConfigError(f"sequence length {T} exceeds the position table ({self.n_positions}); raise max_len")
        if self.kind == "sinusoidal":
            return x * self.table.shape[1] ** 0.5 + self.table[:T].to(x.dtype)
        if self.kind == "learned":
            return x + self.pos_emb[:T]
        return x


def has_residual_symmetry(cfg: ModelConfig) -> bool:
    """Whether permuting the residual stream is an exact symmetry.

    It is for every PE except ``sinusoidal``: a fixed additive buffer is not a
    parameter, so it cannot be permuted along with the stream
    (``P(x + p) != Px + p``). LayerNorm and RMSNorm commute with coordinate
    permutations once their gains/biases are permuted too (mean and RMS are
    permutation invariant). Orthogonal residual maps are *not* declared: they do
    not commute with per-coordinate gains or the LayerNorm mean.
    """
    return cfg.pe != "sinusoidal"


def ff_group(cfg: ModelConfig) -> Permutation:
    """The group of the FF hidden units: ``S_{d_ff}``, or for ReLU the positive monomials
    ``S_{d_ff} x R_{>0}^{d_ff}`` (``relu(s z) = s relu(z)`` for ``s > 0``; GELU has no such scaling)."""
    return PositiveMonomial(cfg.d_ff) if cfg.activation == "relu" else Permutation(cfg.d_ff)


def blocks_spec(cfg: ModelConfig, prefix: str = "blocks.", residual: bool = True) -> SymmetrySpec:
    r"""Symmetries of the stacked blocks ``{prefix}{i}.``.

    Per layer ``i``: the attention spaces ``heads.i``, ``qk.i``, ``vo.i``
    (:func:`symalign.nn.attention.attention_spec`) and the FF hidden units
    ``ff.i`` = ``S_{d_ff}`` (ReLU: ``S_{d_ff} x R_{>0}^{d_ff}``, see :func:`ff_group`) on
    ``fc_in.weight`` axis 0 (+ bias) and ``fc_out.weight`` axis 1. With ``residual``, the space ``residual``
    (``S_D``, declared by the caller) also acts on every tensor that reads or
    writes the stream: norm gains/biases, Q/K/V and ``fc_in`` inputs (axis 1),
    ``o_proj``/``fc_out`` outputs (axis 0, + bias).
    """
    spec = SymmetrySpec()
    if residual:
        spec.add_space(RESIDUAL, Permutation(cfg.d_model), "residual")
    acfg = cfg.attention_config()
    for i in range(cfg.n_layers):
        p = f"{prefix}{i}."
        spec = spec.merge(attention_spec(acfg, prefix=p + "attn.", tag=str(i), layer=i))
        ff = f"ff.{i}"
        spec.add_space(ff, ff_group(cfg), "ff", i)
        spec.act_on(p + "mlp.fc_in.weight", ff, 0)
        if cfg.bias:
            spec.act_on(p + "mlp.fc_in.bias", ff, 0)
        spec.act_on(p + "mlp.fc_out.weight", ff, 1, "contra")
        if residual:
            for norm in ("norm1", "norm2"):
                act_on_norm(spec, cfg, p + norm)
            for proj in ("q_proj", "k_proj", "v_proj"):
                spec.act_on(f"{p}attn.{proj}.weight", RESIDUAL, 1, "contra")
            spec.act_on(p + "mlp.fc_in.weight", RESIDUAL, 1, "contra")
            for out in ("attn.o_proj", "mlp.fc_out"):
                spec.act_on(f"{p}{out}.weight", RESIDUAL, 0)
                if cfg.bias:
                    spec.act_on(f"{p}{out}.bias", RESIDUAL, 0)
    return spec


def act_on_norm(spec: SymmetrySpec, cfg: ModelConfig, name: str) -> None:
    """The residual permutation acts on a norm's gain (and LayerNorm bias)."""
    spec.act_on(f"{name}.weight", RESIDUAL, 0)
    if cfg.norm == "layernorm" and cfg.bias:
        spec.act_on(f"{name}.bias", RESIDUAL, 0)


@torch.no_grad()
def init_weights(model: nn.Module, gen: torch.Generator, n_layers: int, names: set[str] | None = None) -> None:
    """nanoGPT initialisation, drawn from ``gen`` in ``named_parameters`` order.

    Linear/embedding weights ``~ N(0, 0.02^2)``, output projections of the
    residual branches (``o_proj``, ``fc_out``) ``~ N(0, (0.02/sqrt(2L))^2)``,
    biases 0, norm gains 1, position tables and CLS token ``~ N(0, 0.02^2)``.
    ``names`` restricts the re-initialisation to those parameters (others are
    untouched, but the draws are the same as for a full initialisation).
    """
    std_out = 0.02 / (2 * n_layers) ** 0.5
    for name, p in model.named_parameters():
        if ".norm" in name or name.startswith("norm") or "norm_f" in name:
            val = torch.ones_like(p) if name.endswith("weight") else torch.zeros_like(p)
        elif name.endswith("bias"):
            val = torch.zeros_like(p)
        else:
            std = std_out if (name.endswith("o_proj.weight") or name.endswith("fc_out.weight")) else 0.02
            val = torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype) * std
        if names is None or name in names:
            p.copy_(val)
