"""The configuration of a built-in Transformer (ViT, GPT, text encoder).

:class:`ModelConfig` is validated on construction; every error is a
:class:`~symalign.errors.ConfigError` naming the field and how to fix it.
``to_dict``/``from_dict`` round-trip exactly (the checkpoint's ``config.json``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from symalign.errors import ConfigError
from symalign.groups import PAIRINGS
from symalign.nn.attention import POSITIONAL_ENCODINGS, AttentionConfig

SCOPES: tuple[str, ...] = ("first-attention", "all-attention", "first-block", "full")
"""Re-initialisation scopes of the protocol: which parameters of a model a scope names (see :mod:`symalign.reinit`)."""

FAMILIES: tuple[str, ...] = ("vit", "gpt", "encoder")
ACTIVATIONS: tuple[str, ...] = ("gelu", "relu")
NORMS: tuple[str, ...] = ("layernorm", "rmsnorm")
POOLINGS: tuple[str, ...] = ("cls", "mean")


def _choice(field: str, value: str, options: tuple[str, ...]) -> None:
    if value not in options:
        raise ConfigError(f"{field}={value!r} is not supported; use one of {', '.join(options)}")


def _positive(field: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{field} must be a positive integer, got {value!r}")


@dataclass
class ModelConfig:
    """Shape, positional encoding and task head of a built-in Transformer.

    ``family``: ``vit`` (image classifier on patches), ``gpt`` (causal LM) or
    ``encoder`` (bidirectional text classifier). ``head_dim`` defaults to
    ``d_model // n_heads``, ``n_kv_heads`` to ``n_heads``, ``d_ff`` to
    ``4 d_model``. ``pre_norm`` selects pre-LN blocks (post-LN otherwise).
    ``sinusoidal``/``learned`` tables are added once to the token embeddings;
    ``rope``/``alibi`` act inside every attention layer.
    """

    family: str = "gpt"
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None
    head_dim: int | None = None
    d_ff: int | None = None
    pe: str = "rope"
    rope_pairing: str = "half"
    rotary_fraction: float = 1.0
    rope_base: float = 10000.0
    activation: str = "gelu"
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    pre_norm: bool = True
    bias: bool = True
    dropout: float = 0.0
    vocab_size: int = 256
    n_classes: int = 10
    image_size: int = 28
    patch_size: int = 7
    channels: int = 1
    pooling: str = "cls"
    max_len: int = 128
    tie_embeddings: bool = True

    def __post_init__(self):
        _choice("family", self.family, FAMILIES)
        _choice("pe", self.pe, POSITIONAL_ENCODINGS)
        _choice("activation", self.activation, ACTIVATIONS)
        _choice("norm", self.norm, NORMS)
        _choice("pooling", self.pooling, POOLINGS)
        _choice("rope_pairing", self.rope_pairing, PAIRINGS)
        for name in ("d_model", "n_layers", "n_heads", "max_len"):
            _positive(name, getattr(self, name))
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                raise ConfigError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                                  "pick a number of heads that divides the width (or set head_dim)")
            self.head_dim = self.d_model // self.n_heads
        _positive("head_dim", self.head_dim)
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        _positive("n_kv_heads", self.n_kv_heads)
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}")
        if self.d_ff is None:
            self.d_ff = 4 * self.d_model
        _positive("d_ff", self.d_ff)
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.norm_eps <= 0:
            raise ConfigError(f"norm_eps must be positive, got {self.norm_eps}")
        if self.family in ("gpt", "encoder"):
            _positive("vocab_size", self.vocab_size)
        if self.family in ("vit", "encoder"):
            _positive("n_classes", self.n_classes)
        if self.family == "vit":
            for name in ("image_size", "patch_size", "channels"):
                _positive(name, getattr(self, name))
            if self.image_size % self.patch_size:
                raise ConfigError(f"patch_size={self.patch_size} must divide image_size={self.image_size}")
            if self.seq_len > self.max_len:
                raise ConfigError(f"a ViT on {self.image_size}px images with patch_size={self.patch_size} has "
                                  f"{self.seq_len} tokens but max_len={self.max_len}; raise max_len")
        self.attention_config()  # validates RoPE widths etc. with AttentionConfig's messages

    # -- derived --------------------------------------------------------------
    @property
    def n_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def seq_len(self) -> int:
        """Tokens a ViT sees: patches plus the CLS token (if pooling is ``cls``)."""
        return self.n_patches + (1 if self.pooling == "cls" else 0)

    @property
    def n_positions(self) -> int:
        """Rows of the position table: ViT tokens, or ``max_len`` text tokens (+1 for CLS)."""
        if self.family == "vit":
            return self.seq_len
        return self.max_len + (1 if self.has_cls else 0)

    @property
    def has_cls(self) -> bool:
        return self.family in ("vit", "encoder") and self.pooling == "cls"

    def attention_config(self) -> AttentionConfig:
        """The per-layer attention config: sinusoidal/learned become ``none`` (added at the input)."""
        pe = self.pe if self.pe in ("rope", "alibi") else "none"
        return AttentionConfig(d_model=self.d_model, n_heads=self.n_heads, head_dim=self.head_dim,
                               n_kv_heads=self.n_kv_heads, pe=pe, rope_pairing=self.rope_pairing,
                               rotary_fraction=self.rotary_fraction, rope_base=self.rope_base,
                               bias=self.bias, causal=self.family == "gpt",
                               max_len=self.n_positions)

    # -- serialisation --------------------------------------------------------
    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """Inverse of :meth:`to_dict`; an unknown key raises :class:`ConfigError` naming it."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown model config key(s) {unknown}; known keys are {sorted(known)}")
        return cls(**d)
