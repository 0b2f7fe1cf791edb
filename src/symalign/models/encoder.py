r"""BERT-style bidirectional text classifier on fixed-length byte sequences.

``h = norm_f(blocks([cls; tok_emb[idx]] + P))``, pooled by the CLS token
(``h[:, 0]``) or the mean over positions, then ``logits = head(pooled)``. No
padding mask: inputs are fixed-length (padded with byte 0), and padding is
just another token.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from symalign.models.base import Trunk
from symalign.models.config import ModelConfig


class EncoderClassifier(Trunk):
    """``forward(idx (B, T)) -> logits (B, n_classes)``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        if cfg.has_cls:
            self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.d_model))
        self.head = nn.Linear(cfg.d_model, cfg.n_classes, bias=cfg.bias)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.tok_emb(idx)
        if self.cfg.has_cls:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        h = self.trunk(x)
        return self.head(h[:, 0] if self.cfg.has_cls else h.mean(dim=1))

    def residual_tensors(self) -> list[tuple[str, int, str]]:
        out = [("tok_emb.weight", 1, "co"), ("head.weight", 1, "contra")]
        if self.cfg.has_cls:
            out.append(("cls_token", 2, "co"))
        return out
