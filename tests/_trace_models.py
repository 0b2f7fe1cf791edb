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


class BasicBlock(nn.Module):
    """torchvision's ResNet BasicBlock: conv-BN-ReLU-conv-BN, plus the identity or a 1x1-conv-BN projection
    (in-place ReLU and ``out += identity``, as torchvision writes it)."""

    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    """A small torchvision-style ResNet: stem, three stages of BasicBlocks (widths 16/32/64), pooled head."""

    def __init__(self, widths=(16, 32, 64), blocks=(1, 1, 1), in_ch=1, classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, widths[0], 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        layers, cin = [], widths[0]
        for i, (w, n) in enumerate(zip(widths, blocks)):
            stage = []
            for j in range(n):
                stage.append(BasicBlock(cin, w, 2 if (i > 0 and j == 0) else 1))
                cin = w
            layers.append(nn.Sequential(*stage))
        self.layer1, self.layer2, self.layer3 = layers
        self.fc = nn.Linear(widths[-1], classes)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class VGG(nn.Module):
    """(conv-ReLU x2, max pool) twice, flatten, two Linear layers (8x8 inputs: a 2x2 map per channel)."""

    def __init__(self, c=(8, 16), hidden=32, in_ch=1, image=8, classes=10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_ch, c[0], 3, padding=1), nn.ReLU(), nn.Conv2d(c[0], c[0], 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(c[0], c[1], 3, padding=1), nn.ReLU(), nn.Conv2d(c[1], c[1], 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2))
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(c[1] * (image // 4) ** 2, hidden), nn.ReLU(),
                                        nn.Linear(hidden, classes))

    def forward(self, x):
        return self.classifier(self.features(x))


class ConvViT(nn.Module):
    """A ViT with a convolutional patch embedding, a class token and learned positions (timm layout)."""

    def __init__(self, d=16, heads=2, layers=2, d_ff=32, patch=4, image=8, in_ch=1, classes=3):
        super().__init__()
        self.patch_embed = nn.Conv2d(in_ch, d, patch, patch)
        self.cls_token = nn.Parameter(torch.randn(1, 1, d) * 0.5)
        self.pos_embed = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, d) * 0.5)
        layer = nn.TransformerEncoderLayer(d, heads, d_ff, dropout=0.0, batch_first=True, norm_first=True,
                                           activation="gelu")
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return self.head(self.norm(self.encoder(x))[:, 0])


class ConvNeXtBlock(nn.Module):
    """ConvNeXt: depthwise 7x7 conv, channels-last LayerNorm, inverted MLP (GELU), residual add."""

    def __init__(self, d=8):
        super().__init__()
        self.dwconv = nn.Conv2d(d, d, 7, padding=3, groups=d)
        self.norm = nn.LayerNorm(d)
        self.pw1, self.pw2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        h = self.norm(self.dwconv(x).permute(0, 2, 3, 1))
        return x + self.pw2(F.gelu(self.pw1(h))).permute(0, 3, 1, 2)


class ConvNeXtTiny(nn.Module):
    """A stem (patchify conv + channel LayerNorm), two ConvNeXt blocks; a 1x1 conv, a GroupNorm'd grouped conv
    and a head."""

    def __init__(self, d=8, in_ch=1, classes=3, groups=2):
        super().__init__()
        self.stem = nn.Conv2d(in_ch, d, 2, 2)
        self.stem_norm = nn.GroupNorm(1, d)  # a LayerNorm over (C, H, W) with per-channel affine
        self.blocks = nn.Sequential(ConvNeXtBlock(d), ConvNeXtBlock(d))
        self.expand = nn.Conv2d(d, 2 * d, 1)
        self.grouped = nn.Conv2d(2 * d, 2 * d, 3, padding=1, groups=groups)
        self.gn = nn.GroupNorm(4, 2 * d)
        self.head = nn.Linear(2 * d, classes)

    def forward(self, x):
        x = self.blocks(self.stem_norm(self.stem(x)))
        x = F.silu(self.gn(F.relu(self.grouped(F.relu(self.expand(x))))))
        return self.head(x.mean((2, 3)))


def randomise(model: nn.Module, seed: int) -> nn.Module:
    """Random weights (and, for BatchNorm, random running statistics: eval mode then is a nontrivial
    per-channel affine map)."""
    g = torch.Generator().manual_seed(seed)
    conv = {id(m.weight) for m in model.modules() if isinstance(m, nn.modules.conv._ConvNd)}
    with torch.no_grad():
        for p in model.parameters():
            fan_in = p[0].numel() if id(p) in conv else p.shape[-1]  # a conv filter reads C_in x kernel entries
            scale = 1.2 / fan_in ** 0.5 if p.dim() > 1 else 0.3
            p.copy_(torch.randn(p.shape, generator=g) * scale)
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None:
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=g) * 0.3)
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)
    return model
