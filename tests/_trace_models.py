"""Small user-style modules for the tracer's tests and benchmarks (not built-in symalign models)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def mlp(widths=(8, 16, 12, 10, 3), acts=("relu", "gelu", "leaky_relu")) -> nn.Sequential:
    layers: list[nn.Module] = []
    make = {"relu": nn.ReLU, "gelu": nn.GELU, "leaky_relu": lambda: nn.LeakyReLU(0.1), "tanh": nn.Tanh}
    for i in range(len(widths) - 1):
        layers.append(nn.Linear(widths[i], widths[i + 1]))
        if i < len(widths) - 2:
            layers.append(make[acts[i % len(acts)]]())
    return nn.Sequential(*layers)


class EncoderViT(nn.Module):
    """A ViT from ``nn.TransformerEncoderLayer`` (fused ``in_proj_weight``), CLS token and learned positions."""

    def __init__(self, d=16, heads=2, layers=2, d_ff=32, patch=4, image=8, classes=3, norm_first=True,
                 activation="relu"):
        super().__init__()
        self.patch = patch
        n = (image // patch) ** 2
        self.embed = nn.Linear(patch * patch, d)
        self.cls = nn.Parameter(torch.randn(1, 1, d) * 0.5)
        self.pos = nn.Parameter(torch.randn(1, n + 1, d) * 0.5)
        layer = nn.TransformerEncoderLayer(d, heads, d_ff, dropout=0.0, batch_first=True, norm_first=norm_first,
                                           activation=activation)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        B, C, H, W = x.shape
        p = self.patch
        x = x.reshape(B, C, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5).reshape(B, -1, C * p * p)
        x = torch.cat([self.cls.expand(B, -1, -1), self.embed(x)], dim=1) + self.pos
        return self.head(self.norm(self.encoder(x))[:, 0])


class MHAStack(nn.Module):
    """Pre-LN blocks of ``nn.MultiheadAttention`` (sequence-first) and a ReLU MLP."""

    def __init__(self, d=16, heads=4, layers=2, vocab=20, bias=True):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(layers))
        self.attn = nn.ModuleList(nn.MultiheadAttention(d, heads, bias=bias) for _ in range(layers))
        self.ff = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d), nn.ReLU(), nn.Linear(2 * d, d))
                                for _ in range(layers))
        self.out = nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.emb(idx).transpose(0, 1)  # (T, B, D)
        for norm, attn, ff in zip(self.norms, self.attn, self.ff):
            h = norm(x)
            x = x + attn(h, h, h, need_weights=False)[0]
            x = x + ff(x)
        return self.out(x)


def rope_interleaved(x, base=10000.0):
    """nanoGPT-style rotary embedding on ``(B, h, T, d)``, planes ``(2j, 2j+1)``."""
    T, d = x.shape[-2], x.shape[-1]
    theta = base ** (-torch.arange(0, d, 2, dtype=x.dtype) / d)
    ang = torch.arange(T, dtype=x.dtype)[:, None] * theta[None]
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


class NanoGPT(nn.Module):
    """nanoGPT layout (fused ``c_attn``, GELU MLP, pre-LN, tied ``wte``/``lm_head``) with interleaved RoPE."""

    def __init__(self, vocab=32, d=16, heads=2, layers=2):
        super().__init__()
        self.h, self.d = heads, d
        self.wte = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList()
        for _ in range(layers):
            blk = nn.Module()
            blk.ln_1, blk.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
            blk.c_attn, blk.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            blk.c_fc, blk.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
            self.blocks.append(blk)
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        x = self.wte(idx)
        B, T, D = x.shape
        for blk in self.blocks:
            q, k, v = blk.c_attn(blk.ln_1(x)).split(D, dim=2)
            q, k, v = (t.view(B, T, self.h, D // self.h).transpose(1, 2) for t in (q, k, v))
            q, k = rope_interleaved(q), rope_interleaved(k)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1 / math.sqrt(D // self.h))
            x = x + blk.c_proj(y.transpose(1, 2).reshape(B, T, D))
            x = x + blk.mlp_proj(F.gelu(blk.c_fc(blk.ln_2(x))))
        return self.lm_head(self.ln_f(x))


class Odd(nn.Module):
    """Non-standard parts: a BatchNorm'd hidden layer, a sort over features, a fixed buffer added."""

    def __init__(self):
        super().__init__()
        self.fc1, self.bn, self.fc2 = nn.Linear(6, 10), nn.BatchNorm1d(10), nn.Linear(10, 8)
        self.fc3, self.fc4 = nn.Linear(8, 12), nn.Linear(12, 7)
        self.fc5, self.fc6 = nn.Linear(7, 9), nn.Linear(9, 2)
        self.register_buffer("offset", torch.linspace(-1, 1, 7))

    def forward(self, x):
        h = self.fc2(torch.relu(self.bn(self.fc1(x))))  # fc1 units: BatchNorm statistics
        h = self.fc4(torch.sort(torch.tanh(self.fc3(h)), dim=-1).values)  # fc3 units: sorted
        return self.fc6(torch.relu(self.fc5(h + self.offset)))  # fc4 output: a fixed buffer added


def randomise(model: nn.Module, seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            scale = 1.2 / p.shape[-1] ** 0.5 if p.dim() > 1 else 0.3
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    return model
