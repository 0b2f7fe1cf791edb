r"""The adapter protocol: one framework layout -> one :class:`~symalign.spec.SymmetrySpec`.

An adapter is the only code that knows where a model family keeps its attention
weights. It describes every self-attention layer as an :class:`AttentionLayout`
(which tensor holds Q, K, V and O, on which axis the heads lie, and which slice
of a fused tensor belongs to which projection) and :func:`layout_spec` turns the
layouts into spaces and axis labels, exactly as
:func:`symalign.nn.attention.attention_spec` labels the reference layer:

=======  ==========================  ======================  ==========================
tensor   space ``heads.{i}``          per-head space          variance, representation
=======  ==========================  ======================  ==========================
Q (+b)   head permutation, first     ``qk.{i}``              covariant, ``"query"``
K (+b)   head permutation, first     ``qk.{i}``              contravariant, ``"kv"``
V (+b)   head permutation, first     ``vo.{i}``              covariant, ``"kv"``
O        head permutation, first     ``vo.{i}``              contravariant, ``"query"``
=======  ==========================  ======================  ==========================

With ``T`` the per-head matrix: ``q_i -> T_i q_i``, ``k_j -> T_j^{-T} k_j`` so that
``q^T k`` is unchanged (and, for RoPE, ``T`` commutes with every rotation, so
``q^T R k`` is unchanged); ``v_j -> B_j v_j`` and ``W_O^i -> W_O^i B_i^{-1}``.
A bias is the homogeneous row of its weight, so it carries the same label.
The output bias ``b_O`` lives on the model axis and is untouched.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Iterable

import torch

from symalign.errors import CheckpointError, ConfigError, SpecError
from symalign.groups import GeneralLinear, HeadPermutation, MatrixGroup, PerHead
from symalign.spec import SymmetrySpec

DOCS = "docs/adapters.md"


class UnsupportedArchitectureError(ConfigError):
    """A model family symalign has no (exact) adapter for."""


@dataclass(frozen=True)
class Proj:
    """Where one projection's per-head axis lies.

    ``weight``: tensor name; ``axis``: the axis of ``weight`` indexing
    ``heads x head_dim`` (0 for an ``nn.Linear`` Q/K/V, 1 for an ``nn.Linear`` O or
    a GPT-2 ``Conv1D`` Q/K/V, 0 for a ``Conv1D`` O); ``segment``: the
    ``(start, length)`` slice of that axis for fused Q|K|V tensors; ``bias``: the
    bias tensor (its axis 0, same segment) or ``None``.
    """

    weight: str
    axis: int
    segment: tuple[int, int] | None = None
    bias: str | None = None


@dataclass(frozen=True)
class AttentionLayout:
    """One self-attention layer: its four projections, head shape and per-head groups.

    ``qk``: the group acting inside each K/V group on Q-K (``GeneralLinear(d)``, or
    ``RotaryPlanes(d, pairing, rotary_dims)`` under RoPE); ``vo``: on V-O.
    ``heads``: the name of a head-permutation space shared with other layers (one
    permutation for all of them: T5's stacks, whose layers all add the same per-head
    position bias); ``None``: the layer's own ``heads.{i}``. ``pinned``: every head
    keeps its index (a fixed score bias of its own, e.g. ALiBi's slope ``m_i``, tells
    the heads apart): no head-permutation space, only ``qk.{i}`` and ``vo.{i}``.
    """

    q: Proj
    k: Proj
    v: Proj
    o: Proj
    n_heads: int
    head_dim: int
    n_kv_heads: int
    qk: MatrixGroup
    vo: MatrixGroup
    heads: str | None = None
    pinned: bool = False


def layout_spec(layouts: Iterable[AttentionLayout]) -> SymmetrySpec:
    """Spaces ``heads.{i}``, ``qk.{i}``, ``vo.{i}`` per layer, coupled, labelled as in the table above.

    A layout naming a shared head space (:attr:`AttentionLayout.heads`) acts with that one
    space (declared once, model-wide: no layer) instead of its own ``heads.{i}``; a pinned
    layout (:attr:`AttentionLayout.pinned`) has none: its ``qk.{i}``/``vo.{i}`` stand alone
    (the matchers pair them by layer and skip the head assignment).
    """
    spec = SymmetrySpec()
    for i, lay in enumerate(layouts):
        heads = None if lay.pinned else lay.heads or f"heads.{i}"
        qk, vo = f"qk.{i}", f"vo.{i}"
        group = HeadPermutation(lay.n_heads, lay.head_dim, lay.n_kv_heads)
        if heads is not None and heads not in spec.spaces:
            spec.add_space(heads, group, "heads", None if lay.heads else i)
        elif heads is not None and spec.spaces[heads] != group:
            raise SpecError(f"layer {i} shares head space {heads!r} ({spec.spaces[heads].describe()}) but has "
                            f"{group.describe()} heads of width {lay.head_dim}")
        spec.add_space(qk, PerHead(lay.qk, lay.n_kv_heads), "qk", i)
        spec.add_space(vo, PerHead(lay.vo, lay.n_kv_heads), "vo", i)
        if heads is not None:
            spec.couple(heads, qk, vo)
        for proj, space, variance, rep in ((lay.q, qk, "co", "query"), (lay.k, qk, "contra", "kv"),
                                           (lay.v, vo, "co", "kv"), (lay.o, vo, "contra", "query")):
            targets = [(proj.weight, proj.axis)] + ([(proj.bias, 0)] if proj.bias else [])
            for tensor, axis in targets:
                if heads is not None:
                    spec.act_on(tensor, heads, axis, "co", rep, proj.segment)
                spec.act_on(tensor, space, axis, variance, rep, proj.segment)
    return spec


def find_prefix(keys: Iterable[str], probe: str, family: str) -> str:
    """The prefix (``""``, ``"transformer."``, ``"model."``...) before the base-model key ``probe``."""
    hits = [k[: len(k) - len(probe)] for k in keys if k.endswith(probe)]
    hits = [p for p in hits if p == "" or p.endswith(".")]
    if not hits:
        raise CheckpointError(f"no tensor named '*{probe}' in the weights: this is not a {family} checkpoint "
                              f"laid out as transformers 5.x writes it (see {DOCS})")
    return min(hits, key=len)


def heads_of(config: Any) -> tuple[int, int, int, int]:
    """``(hidden, n_heads, head_dim, n_kv_heads)`` from a transformers config."""
    hidden = int(config.hidden_size)
    h = int(config.num_attention_heads)
    d = getattr(config, "head_dim", None) or hidden // h
    kv = getattr(config, "num_key_value_heads", None) or h
    if h <= 0 or h % int(kv):
        raise ConfigError(f"num_key_value_heads={kv} must divide num_attention_heads={h}")
    return hidden, h, int(d), int(kv)


class Adapter(ABC):
    """Maps one model family's layout to its exact attention symmetry spec.

    Subclasses set the class attributes and implement :meth:`layouts`;
    :meth:`check_config` refuses settings that would make the declared group
    wrong (e.g. per-head norms on Q/K).
    """

    family: ClassVar[str]
    model_types: ClassVar[tuple[str, ...]]
    pairing: ClassVar[str | None] = None  # RoPE plane pairing, None without RoPE
    auto_classes: ClassVar[tuple[str, ...]] = ("AutoModel",)
    probe: ClassVar[str]  # layer-0 Q weight key relative to the base model
    alt_probes: ClassVar[tuple[str, ...]] = ()  # other namings of it (e.g. the legacy names save_pretrained writes)
    # Why ``align --stream`` (layer by layer) cannot align this family, or None when it can.
    no_stream: ClassVar[str | None] = None
    # Smallest relative output change a functional check can resolve, when the
    # family computes part of attention in float32 whatever the weights' dtype.
    precision_floor: ClassVar[float] = 0.0

    @property
    def model_type(self) -> str:
        return self.model_types[0]

    def check_config(self, config: Any) -> None:
        """Raise :class:`UnsupportedArchitectureError` for settings the adapter cannot make exact."""

    @abstractmethod
    def layouts(self, config: Any, prefix: str, keys: set[str]) -> list[AttentionLayout]:
        """One layout per self-attention layer; biases only where ``keys`` has them."""

    def spec(self, source: Any, keys: Iterable[str] | None = None) -> SymmetrySpec:
        """The attention-scope spec of a model, or of a config plus its weight names ``keys``.

        Without ``keys`` a config is taken to describe the bare base model
        (``AutoModel`` names, no prefix).
        """
        config = getattr(source, "config", source)
        if keys is None:
            keys = source.state_dict().keys() if hasattr(source, "state_dict") else None
        self.check_config(config)
        key_set = set(keys) if keys is not None else None
        prefix = self.prefix(key_set) if key_set is not None else ""
        lays = self.layouts(config, prefix, key_set if key_set is not None else _AllKeys())
        spec = layout_spec(lays)
        self.extra_spaces(spec, config, prefix, lays)
        return spec

    def activation_sites(self, model: Any) -> list | None:
        """Where activation matching reads each space of a transformers ``model``
        (:class:`symalign.nn.sites.ActivationSite`); ``None`` (the default): the family declares
        none, and activation matching is refused for it before anything runs."""
        return None

    def extra_spaces(self, spec: SymmetrySpec, config: Any, prefix: str, layouts: list[AttentionLayout]) -> None:
        """Add attention-scope spaces beyond heads, Q-K and V-O to ``spec`` (none by default; e.g. the
        QK-norm gain scales of :class:`symalign.families.base.Family`)."""

    def prefix(self, keys: set[str]) -> str:
        """The base-model prefix of ``keys`` (trying :attr:`probe`, then :attr:`alt_probes`)."""
        for probe in (self.probe, *self.alt_probes):
            try:
                return find_prefix(keys, probe, self.family)
            except CheckpointError:
                continue
        return find_prefix(keys, self.probe, self.family)  # raises, naming the main probe

    def model_class(self, config: Any) -> type:
        """The class that loads a saved checkpoint: ``config.architectures[0]``, else the first auto class."""
        import transformers

        for name in list(getattr(config, "architectures", None) or []) + list(self.auto_classes):
            cls = getattr(transformers, name, None)
            if cls is not None:
                return cls
        raise UnsupportedArchitectureError(f"transformers has none of the classes {self.auto_classes}")

    def function_check_config(self, config: Any) -> Any:
        """The config under which the function checks run a model -- the whole-model check
        (:func:`symalign.arch.check.run_checkpoint`) and the streamed per-layer check
        (:class:`symalign.stream.layercheck.LayerChecker`) --, changed in place and returned; unchanged by
        default. A family whose layers are discontinuous in their weights changes it so that the check
        measures the transform and the rounding, not the discontinuity (mixtures of experts: every expert
        routed). The written checkpoint keeps its own config."""
        return config

    def dummy_inputs(self, config: Any, batch: int = 2, seq: int = 8, seed: int = 0) -> dict[str, torch.Tensor]:
        """A small random batch for a functional check (token ids by default)."""
        g = torch.Generator().manual_seed(seed)
        limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None) or seq
        seq = max(1, min(seq, int(limit)))
        ids = torch.randint(0, int(config.vocab_size), (batch, seq), generator=g)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


class _AllKeys(set):
    """Key set used when only a config is known: every bias is assumed present iff the config says so."""

    def __contains__(self, item: object) -> bool:  # pragma: no cover - trivial
        return True


def gl(d: int) -> GeneralLinear:
    return GeneralLinear(d)
