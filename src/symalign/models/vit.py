r"""Vision Transformer classifier.

An image ``(B, C, H, W)`` is cut into ``N = (H/p)^2`` non-overlapping ``p x p``
patches, each flattened (``C p p`` values, channel-major) and embedded by the
Linear ``patch_embed``; a CLS token is prepended (``pooling="cls"``) and the
pooled output (CLS or mean) goes through ``head``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from symalign.models.base import Trunk
from symalign.models.config import ModelConfig


def patchify(images: Tensor, patch: int) -> Tensor:
    """``(B, C, H, W) -> (B, N, C p p)``, patches in row-major order."""
    B, C, H, W = images.shape
    x = images.reshape(B, C, H // patch, patch, W // patch, patch)
    return x.permute(0, 2, 4, 1, 3, 5).reshape(B, (H // patch) * (W // patch), C * patch * patch)


class ViT(Trunk):
    """``forward(images (B, C, H, W)) -> logits (B, n_classes)``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.patch_embed = nn.Linear(cfg.channels * cfg.patch_size ** 2, cfg.d_model, bias=cfg.bias)
        if cfg.has_cls:
            self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.d_model))
        self.head = nn.Linear(cfg.d_model, cfg.n_classes, bias=cfg.bias)

    def forward(self, images: Tensor) -> Tensor:
        x = self.patch_embed(patchify(images, self.cfg.patch_size))
        if self.cfg.has_cls:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        h = self.trunk(x)
        return self.head(h[:, 0] if self.cfg.has_cls else h.mean(dim=1))

    def residual_tensors(self) -> list[tuple[str, int, str]]:
        out = [("patch_embed.weight", 0, "co"), ("head.weight", 1, "contra")]
        if self.cfg.bias:
            out.append(("patch_embed.bias", 0, "co"))
        if self.cfg.has_cls:
            out.append(("cls_token", 2, "co"))
        return out
