r"""What a family declares beyond its layout, as data: its tiny test models, the cases the generic tests run,
the scopes it supports and its ``hf:`` experiment model.

A family module (:mod:`symalign.families`) sets these on its :class:`~symalign.families.base.Family`
subclass; the tests (``tests/hf_tiny.py``, ``tests/hf_families.py``, ``tests/test_families.py``,
``tests/test_stream_families.py``), ``benchmarks/families_table.py`` (docs/symmetry.md's families table)
and :mod:`symalign.models.hf` (the ``hf:`` experiment families) iterate the registry
(:data:`symalign.families.FAMILIES`) and read them, so that a new family is one module plus one registry line.

* :class:`Tiny`: a tiny random model as data -- transformers model class, config class, keyword arguments.
* :class:`Case`: one configuration (overrides of the tiny config) and what the generic tests check on it:
  the declared groups are exact, the probe's nullity equals the declared dimension, the declared group of
  given sites (``describe()``), the residual group the whole-model rewrite declares and the streamed checks.
* :class:`Scopes`: the alignment scopes (``attention``, ``model``) in memory and streamed.
* :class:`Experiment`: the ``hf:`` experiment model (positional encoding, head class per data modality, the
  config field bounding the sequence length).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

TOKENS: Mapping[str, int] = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
"""Special-token ids inside the tiny vocabularies."""

DECODER: Mapping[str, Any] = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                              "intermediate_size": 32, "vocab_size": 64, "max_position_embeddings": 64, **TOKENS}
"""The tiny decoder every family's :class:`Tiny` starts from (D = 32, 2 layers, 4 heads, vocabulary 64)."""

PROBE: Mapping[str, Any] = {"hidden_size": 16, "num_attention_heads": 2, "intermediate_size": 16}
"""Probe widths (the Jacobian of layer 0 is dense): a family adds its own (``Family.probe_kw``). Under QK-norm
a family raises ``rms_norm_eps``: scaling one head's ``W_Q`` (or ``W_K``) rows is undone by the norm up to its
eps, a near-symmetry with singular values ~ eps that the probe rightly refuses to classify at eps = 1e-6; a
larger eps (1e-2) separates it."""

STREAM_CHECKS = ("float32", "big", "merge")
"""Streamed checks beyond float64 equality a :class:`Case` may ask for: one float32 file, the big-tensor
path (row chunks), ``merge --stream``."""


@dataclass(frozen=True)
class Tiny:
    """A tiny random transformers model of a family: ``model`` built from ``config(**kwargs)`` (class names in
    ``transformers``). The tests randomise its weights (O(1) scale, generic)."""

    model: str
    config: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def classes(self) -> tuple[type, type]:
        """``(model class, config class)`` from transformers."""
        import transformers

        return getattr(transformers, self.model), getattr(transformers, self.config)


@dataclass(frozen=True)
class Case:
    """One configuration of a family's tiny model and what the generic tests check on it.

    ``kw``: config overrides of the family's :class:`Tiny`. ``exact``: a random element of the attention and
    whole-model specs leaves the model's forward unchanged (and, on the family's first case, a larger Q-K
    group does not). ``probe``: layer ``layer``'s declared dimension (plus named gauges) equals the Jacobian
    nullity of the real layer at probe widths. ``groups``: ``describe()`` of sites of the attention spec.
    ``residual``: the residual group the whole-model rewrite declares, checked by the streamed float64
    equality test (``None``: not run); ``streamed``: further streamed checks (:data:`STREAM_CHECKS`).
    ``row``: the label of this case's row in docs/symmetry.md's families table (``benchmarks/families_table.py``,
    layer ``layer`` at probe widths; ``moe``: the mixture-of-experts block table).
    """

    kw: Mapping[str, Any] = field(default_factory=dict)
    exact: bool = True
    probe: bool = False
    groups: Mapping[str, str] = field(default_factory=dict)
    residual: str | None = None
    streamed: tuple[str, ...] = ()
    row: str | None = None
    layer: int = 0
    moe: bool = False

    def __post_init__(self) -> None:
        unknown = set(self.streamed) - set(STREAM_CHECKS)
        if unknown:
            raise ValueError(f"Case.streamed: unknown checks {sorted(unknown)}; use {', '.join(STREAM_CHECKS)}")


@dataclass(frozen=True)
class Scopes:
    """The alignment scopes a family supports in memory and streamed (``"attention"``, ``"model"``)."""

    memory: tuple[str, ...] = ("attention", "model")
    stream: tuple[str, ...] = ("attention", "model")


@dataclass(frozen=True)
class Experiment:
    """A family's ``hf:`` experiment model (:mod:`symalign.models.hf`): its positional encoding
    (``"learned"``/``"rope"``), its head class per data modality (``lm``, ``text``, ``image``) and the config
    field bounding the sequence length (``None``: images, bounded by patches)."""

    pe: str
    heads: Mapping[str, str]
    positions: str | None = "max_position_embeddings"


__all__ = ["Case", "DECODER", "Experiment", "PROBE", "STREAM_CHECKS", "Scopes", "TOKENS", "Tiny"]
