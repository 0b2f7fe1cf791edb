r"""Decoder-only causal language model (nanoGPT layout).

``logits = head(norm_f(blocks(tok_emb[idx] + P)))``; with ``tie_embeddings`` the
head weight *is* ``tok_emb.weight`` (``logits = h E^T``).
"""

from __future__ import annotations

from torch import Tensor, nn

from symalign.models.base import Trunk
from symalign.models.config import ModelConfig


class GPT(Trunk):
    """Causal LM over ``vocab_size`` tokens: ``forward(idx (B, T)) -> logits (B, T, V)``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight

    def forward(self, idx: Tensor) -> Tensor:
        return self.head(self.trunk(self.tok_emb(idx)))

    def residual_tensors(self) -> list[tuple[str, int, str]]:
        return [("tok_emb.weight", 1, "co"), ("head.weight", 1, "contra")]
