"""Helpers for the matcher tests: small attention stacks, planted transforms."""

from __future__ import annotations

import torch
from torch import nn

from symalign.nn.attention import AttentionConfig, MultiHeadAttention
from symalign.spec import SymmetrySpec


class Stack(nn.Module):
    """A residual stack of attention layers ``x <- x + attn_l(x)`` (for function checks)."""

    def __init__(self, n_layers: int = 2, **cfg):
        super().__init__()
        self.layers = nn.ModuleList(MultiHeadAttention(AttentionConfig(**cfg)) for _ in range(n_layers))

    def forward(self, x):
        for lay in self.layers:
            x = x + lay(x)
        return x

    def symmetry_spec(self) -> SymmetrySpec:
        spec = SymmetrySpec()
        for i, lay in enumerate(self.layers):
            spec = spec.merge(lay.symmetry_spec(prefix=f"layers.{i}.", tag=str(i)))
        return spec


def make_stack(seed: int = 0, n_layers: int = 2, dtype=torch.float64, **cfg) -> Stack:
    torch.manual_seed(seed)
    m = Stack(n_layers, **cfg).to(dtype)
    with torch.no_grad():  # make biases non-trivial
        for name, p in m.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.3)
    return m.eval()


def state(m: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def rel(a: dict, b: dict, keys=None) -> float:
    keys = keys or [k for k in a if a[k].is_floating_point()]
    num = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in keys)
    den = sum(float(a[k].double().pow(2).sum()) for k in keys)
    return (num / den) ** 0.5


