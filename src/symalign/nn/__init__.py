"""Reference neural-network building blocks (attention, positional encodings)."""

from symalign.nn.attention import AttentionConfig, MultiHeadAttention

__all__ = ["AttentionConfig", "MultiHeadAttention"]
