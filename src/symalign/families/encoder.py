r"""Encoder families (BERT, RoFormer, ViT, ModernBERT) as declared data: :class:`Encoder`, :class:`Head`,
:class:`EncoderFamily`.

An encoder module declares an :class:`Encoder` -- the attention, FF and norm names of
a :class:`~symalign.families.base.Decoder`, plus what writes the stream at the input
(``embeds``, each with the axis that lies on the stream), a norm *on* the stream
(``embed_norm``), an optional projection from a narrower embedding (``embed_project``)
and, per model class, the :class:`Head` that reads the stream. Attention scope and the
probe are :class:`~symalign.families.base.Family`'s; :meth:`EncoderFamily.prepare`
derives the whole model from the declaration:

* **Where the residual group comes from.** A norm whose gain sits on the stream path
  itself -- post-LN (BERT, RoFormer: ``LN(x + branch(x))``, declared as
  ``post_attn_norm``/``post_ff_norm``) or a norm of the embeddings (``embed_norm``,
  ModernBERT's ``embeddings.norm`` even though its layers are pre-LN) -- cannot be
  folded into a reader. A rotation ``O`` of the stream would need a new gain with
  ``diag(g') O = O diag(g)`` (on the centred subspace), which for a generic gain only
  permutations satisfy. So such a family gets ``S_D`` (:class:`~symalign.groups.Permutation`):
  a LayerNorm commutes with coordinate permutations once its gain and bias are permuted
  too; nothing is folded.
* Otherwise (pre-LN only, ViT) every LayerNorm is folded into its readers
  (:func:`~symalign.families.common.fold_layernorm`) and the stream has the centred
  rotations ``O_1(D)`` (:class:`~symalign.groups.CenteredOrthogonal`), which keep
  ``LN(O x) = O LN(x)`` with a unit gain.
* Either way the group acts covariantly on every writer (``embeds`` on their declared
  axis, ``o`` and ``down`` rows and biases) and contravariantly on every reader (Q/K/V,
  the FF input, the head's readers, axis 1).
* **Heads** (by ``config.architectures[0]``): ``reads`` are ``nn.Linear`` maps (or
  ``1 x 1`` convolutions) reading the stream; a ``transform`` reads the stream and
  writes into the embedding's coordinates (an MLM transform in front of a decoder tied
  to the word embeddings), so its output axis, bias and ``transform_norm`` get the same
  permutation as the embedding columns, and the ``decoder`` reads them. With
  ``embed_project`` present (RoFormer's ``embedding_size != hidden_size``) the
  embeddings live in their own width: the projection writes the stream and the
  embedding side (tables, their norm, the transform's output, the decoder) is left as
  it is. A model class without a declared head (or a bare ``...Model``, whose output
  *is* the stream) gets no residual space, and neither does one with cross-attention.
* FF ``ff.i``: ``ff_in`` rows (+ bias) and ``down`` columns, ``S_{d_ff}`` (ReLU: positive
  scales); a fused GLU ``gate_up`` (ModernBERT's ``Wi = [u; v]``) gets one permutation
  on both halves.

Names of :class:`Head` parts are top-level module names; ``{base}`` stands for the base
model's prefix (BERT's ``pooler`` lives under ``bert.``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

import torch
from torch import Tensor

from symalign.arch.base import Adapter
from symalign.errors import ConfigError
from symalign.families.base import CROSS_NOTE, Decoder, Family
from symalign.families.common import (RESIDUAL, Prepared, act_if, back, copy_spec, ff_group, fold_layernorm,
                                      headless_note, to_f64)
from symalign.groups import CenteredOrthogonal, Permutation
from symalign.spec import SymmetrySpec


@dataclass(frozen=True)
class Head:
    """What one model class reads from the stream (module names; ``{base}``: the base model's prefix)."""

    reads: tuple[str, ...] = ()
    transform: str | None = None
    transform_norm: str | None = None
    decoder: str | None = None

    def modules(self) -> list[str]:
        """The head's modules that must exist for it to be mapped (the norm and decoder may be absent/tied)."""
        return list(self.reads) + ([self.transform] if self.transform else [])


@dataclass(frozen=True)
class Encoder(Decoder):
    """Declared layout of an encoder family (see the module docstring); unused decoder fields are ignored.

    ``embeds``: ``(tensor, stream axis)`` of every input table or parameter written into
    the stream (names relative to the base prefix, with ``.weight``/``.bias``);
    ``embed_norm``: the norm applied to the embeddings' sum; ``embed_project``: a
    projection ``embedding_size -> hidden_size`` (used when present); ``archs``: model
    class -> :class:`Head`; ``bare``: the classes without a head.
    """

    embeds: tuple[tuple[str, int], ...] = ()
    embed_norm: str | None = None
    embed_project: str | None = None
    archs: Mapping[str, Head] = field(default_factory=dict)
    bare: tuple[str, ...] = ()
    final_norm: str | None = None  # type: ignore[assignment]

    def norms(self) -> tuple[str, ...]:
        return tuple(n for n in (self.pre_attn_norm, self.post_attn_norm, self.pre_ff_norm, self.post_ff_norm) if n)

    @property
    def permuted(self) -> bool:
        """Whether a norm sits on the stream path itself (then the residual group is ``S_D``)."""
        return bool(self.embed_norm or self.post_attn_norm or self.post_ff_norm)


class EncoderFamily(Family):
    """A :class:`~symalign.families.base.Family` whose whole model is read from an :class:`Encoder`."""

    decl: ClassVar[Encoder] = Encoder()  # type: ignore[assignment]
    pairing: ClassVar[str | None] = None
    auto_classes: ClassVar[tuple[str, ...]] = ("AutoModel",)
    # No activation sites yet: post-norm encoders (BERT, RoFormer, ModernBERT) show the stream after a
    # norm that carries the gains, and ViT's head reads a pooled token; the decoder sites would read the
    # wrong tensors, so activation matching is refused for them at config time (models.hf.activation_refusal).
    activation_sites = Adapter.activation_sites

    @property
    def precision_floor(self) -> float:  # type: ignore[override]
        return 0.0

    def prepare(self, config: Any, state: Mapping[str, Tensor], att: SymmetrySpec,
                arch: str | None = None) -> Prepared:
        """Rewrite ``state`` exactly and build the whole-model spec (module docstring)."""
        s, dt = to_f64(state)
        keys = set(s)
        p = self.prefix(keys)
        dec: Encoder = self.named(self.declaration(config), p, keys)  # type: ignore[assignment]
        spec = copy_spec(att)
        notes: list[str] = []
        head = dec.archs.get(arch or "")
        if head is not None and any(self._name(m, p) + ".weight" not in s for m in head.modules()):
            head = None
        if head is not None and getattr(config, "add_cross_attention", False):
            notes.append(CROSS_NOTE)
        elif head is None:
            notes.append(headless_note(arch, self.family, list(dec.archs) + list(dec.bare)))
        elif dec.permuted:
            self._permuted(spec, dec, config, s, p, head)
            notes.append("a norm sits on the stream itself (post-LN or the embeddings' norm) and cannot be folded, "
                         "so residual rotations are not symmetries; residual group S_D (permutations, norm "
                         "gains/biases permuted with the stream)")
        else:
            self._folded(spec, dec, config, s, p, head)
            notes.append("LayerNorm gains/biases folded into their readers; residual group O_1(D) (rotations fixing "
                         "the all-ones direction)")
        self._ff(spec, dec, config, s, p)
        return Prepared(back(s, dt, torch.float32), spec, False, notes)

    # -- pieces -----------------------------------------------------------
    @staticmethod
    def _name(module: str, p: str) -> str:
        return module.replace("{base}", p)

    def _layers(self, dec: Encoder, config: Any, p: str) -> list[str]:
        return [p + dec.layer.format(i=i) for i in range(int(config.num_hidden_layers))]

    def _ff(self, spec: SymmetrySpec, dec: Encoder, config: Any, s: Mapping[str, Tensor], p: str) -> None:
        for i, lp in enumerate(self._layers(dec, config, p)):
            down = lp + dec.down + ".weight"
            f = int(s[down].shape[1])
            ff = f"ff.{i}"
            if dec.gate_up:  # GLU act(u) * v: unit j of u and unit j of v move together
                spec.add_space(ff, Permutation(f), "ff", i)
                for seg in ((0, f), (f, f)):
                    spec.act_on(lp + dec.gate_up + ".weight", ff, 0, "co", None, seg)
                    act_if(spec, s, lp + dec.gate_up + ".bias", ff, 0, "co", seg)
            else:
                spec.add_space(ff, ff_group(getattr(config, dec.ff_act, None), f), "ff", i)
                spec.act_on(lp + dec.ff_in + ".weight", ff, 0)  # type: ignore[operator]
                act_if(spec, s, lp + dec.ff_in + ".bias", ff, 0)  # type: ignore[operator]
            spec.act_on(down, ff, 1, "contra")

    @staticmethod
    def _stream_writers(s: Mapping[str, Tensor], lp: str, dec: Encoder) -> list[str]:
        return [t for n in (dec.o, dec.down) for t in (lp + n + ".weight", lp + n + ".bias") if t in s]

    def _inputs(self, spec: SymmetrySpec, dec: Encoder, s: Mapping[str, Tensor], p: str) -> bool:
        """The input writers; returns whether the embeddings are in the stream's coordinates (no projection)."""
        if dec.embed_project and p + dec.embed_project + ".weight" in s:
            spec.act_on(p + dec.embed_project + ".weight", RESIDUAL, 0)
            act_if(spec, s, p + dec.embed_project + ".bias", RESIDUAL, 0)
            return False
        for t, axis in dec.embeds:
            act_if(spec, s, p + t, RESIDUAL, axis)
        return True

    def _permuted(self, spec: SymmetrySpec, dec: Encoder, config: Any, s: Mapping[str, Tensor], p: str,
                  head: Head) -> None:
        spec.add_space(RESIDUAL, Permutation(int(config.hidden_size)), "residual")
        on_stream = self._inputs(spec, dec, s, p)
        norms = ([p + dec.embed_norm] if dec.embed_norm and on_stream else []) + \
            ([p + dec.final_norm] if dec.final_norm else [])
        for lp in self._layers(dec, config, p):
            for n in dec.readers_attn() + dec.readers_ff():
                spec.act_on(lp + n + ".weight", RESIDUAL, 1, "contra")
            for t in self._stream_writers(s, lp, dec):
                spec.act_on(t, RESIDUAL, 0)
            norms += [lp + n for n in dec.norms()]
        for n in dict.fromkeys(norms):
            for t in (n + ".weight", n + ".bias"):
                act_if(spec, s, t, RESIDUAL, 0)  # absent where the layer has an Identity (ModernBERT layer 0)
        for r in head.reads:
            spec.act_on(self._name(r, p) + ".weight", RESIDUAL, 1, "contra")
        if head.transform:
            t = self._name(head.transform, p)
            spec.act_on(t + ".weight", RESIDUAL, 1, "contra")
            if on_stream:  # its output is in the (tied) embedding's coordinates = the stream's
                spec.act_on(t + ".weight", RESIDUAL, 0)
                act_if(spec, s, t + ".bias", RESIDUAL, 0)
                if head.transform_norm:
                    for x in (".weight", ".bias"):
                        act_if(spec, s, self._name(head.transform_norm, p) + x, RESIDUAL, 0)
                if head.decoder:
                    act_if(spec, s, self._name(head.decoder, p) + ".weight", RESIDUAL, 1, "contra")

    def _folded(self, spec: SymmetrySpec, dec: Encoder, config: Any, s: dict[str, Tensor], p: str,
                head: Head) -> None:
        if dec.norm != "layer" or head.transform:
            raise ConfigError(f"{self.family}: only LayerNorm pre-norm encoders with plain readers on the stream "
                              "can be folded")
        spec.add_space(RESIDUAL, CenteredOrthogonal(int(config.hidden_size)), "residual")
        self._inputs(spec, dec, s, p)
        folds = []
        for lp in self._layers(dec, config, p):
            attn, ff = [lp + n for n in dec.readers_attn()], [lp + n for n in dec.readers_ff()]
            if dec.pre_attn_norm == dec.pre_ff_norm:
                folds.append((lp + dec.pre_attn_norm, attn + ff))  # type: ignore[operator]
            else:
                folds += [(lp + dec.pre_attn_norm, attn), (lp + dec.pre_ff_norm, ff)]  # type: ignore[operator]
            for t in self._stream_writers(s, lp, dec):
                spec.act_on(t, RESIDUAL, 0, "co")
        folds.append((p + dec.final_norm, [self._name(r, p) for r in head.reads]))  # type: ignore[operator]
        for norm, readers in folds:
            if fold_layernorm(s, norm, readers):
                spec.act_on(norm + ".bias", RESIDUAL, 0, "co")
            for r in readers:
                spec.act_on(r + ".weight", RESIDUAL, 1, "contra")


__all__ = ["Encoder", "EncoderFamily", "Head"]
