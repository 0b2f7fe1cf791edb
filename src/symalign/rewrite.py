r"""Exact LayerNorm -> gainless RMSNorm rewrite of a built-in (pre-LN) model.

Let ``C = I - 1 1^T / D`` (centring) and ``RMS(z) = z / sqrt(mean(z^2) + eps)``.
LayerNorm is

    LN(x) = gamma * (C x) / sqrt(mean((C x)^2) + eps) + beta = diag(gamma) RMS(C x) + beta,

since the biased variance of ``x`` is the mean square of ``C x`` (so ``eps`` carries
over unchanged). The rewrite:

1. **centre every writer** of the residual stream (token embeddings, learned
   positions, CLS token, patch embedding, ``o_proj`` and ``fc_out`` weights and
   biases): ``W <- C W``, ``b <- C b`` (embedding rows ``e <- C e``). The stream is
   then mean-free, ``C x = x``, and ``LN(x) = diag(gamma) RMS(x) + beta``;
2. **fold** ``gamma``/``beta`` into every linear map reading a norm's output
   (Q/K/V after ``norm1``, ``fc_in`` after ``norm2``, the head after ``norm_f``):
   ``W (gamma * r + beta) + b = (W diag(gamma) C) r + (W beta + b)`` (``r`` is
   mean-free, so the extra ``C`` changes nothing and removes the free direction);
3. every norm becomes ``RMSNorm`` **without gain**, with the same ``eps``.

The rewritten stream has the exact symmetry ``O(D)``: ``RMS(O x) = O RMS(x)``,
writers ``W <- O W``, readers ``W <- W O^T``.

Special cases (all exact, checked in ``tests/test_whole_rewrite.py`` and ``tests/test_whole_sinusoidal.py``):

* ``norm="rmsnorm"`` models: nothing to centre; the gains are folded.
* ``pe="sinusoidal"``: the fixed table ``P`` is a buffer, not a parameter, so the
  stream ``sqrt(D) e + P`` cannot be made mean-free and the table does not rotate.
  The norms become LayerNorm **without affine** (``RMS(C x)``) after folding. Only
  the rotations that fix every row ``p_t`` of the table (the model can use every
  row), and ``1`` for the centred norm, are exact:
  ``O (sqrt(D) e + p_t) = sqrt(D) O e + p_t`` and ``O C = C O``. They form
  ``O(k)`` on the complement of ``S = span{p_t} (+ span{1})``
  (:func:`symalign.groups.stabiliser`, with its numerical-rank rule: every
  element moves every ``p_t`` by at most ``1e-12 ||p_t||``). The spec declares that
  group as ``residual`` when ``k >= 1`` (ViT with 17 positions at ``D = 64``:
  ``k = 46``); with a context of at least ``D`` positions ``k`` is 0 and no residual
  space is declared. ``plan(cfg).reason`` says which and how many dimensions remain free.
* GPT with tied embeddings: the head reads ``norm_f``'s output, so
  ``head = E diag(gamma_f) C`` differs from the (centred) embedding ``E C``; the
  rewritten GPT is always **untied** and has a head bias ``W beta_f`` when
  ``bias=True``.
* post-LN blocks are refused: the gain sits on the residual path itself
  (``x <- gamma * RMS(C z) + beta`` feeds the next block's skip connection), so it
  cannot be folded into readers.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Mapping

import torch
from torch import Tensor, nn

from symalign.errors import ConfigError
from symalign.groups import FixingOrthogonal, Orthogonal, stabiliser
from symalign.models import MODEL_CLASSES
from symalign.models.blocks import RESIDUAL, blocks_spec
from symalign.models.config import ModelConfig
from symalign.nn.positional import sinusoidal_table
from symalign.spec import SymmetrySpec


@dataclass(frozen=True)
class RewritePlan:
    """What the rewrite does to a config.

    ``norm``: ``"rms"`` (gainless RMSNorm) or ``"centred"`` (LayerNorm without affine).
    ``centre``: whether writers are centred. ``residual``: whether the rewritten
    stream has the full rotation group ``O(D)``; ``residual_dims``: the dimension ``k``
    of the subspace on which the declared residual rotations act (``D``; under a fixed
    sinusoidal table the free complement of the table, possibly 0 = no residual space);
    ``reason`` says why the group is smaller than ``O(D)``.
    """

    family: str
    norm: str
    centre: bool
    residual: bool
    reason: str | None
    untied_head: bool
    residual_dims: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


@lru_cache(maxsize=32)
def _table_group(n_positions: int, d_model: int, centred: bool) -> FixingOrthogonal | None:
    """The rotations fixing the sinusoidal table (exactly the buffer's float32 values) and ``1`` if ``centred``."""
    table = sinusoidal_table(n_positions, d_model).to(torch.float64)
    label = f"sinusoidal table {n_positions}x{d_model}" + (" and 1" if centred else "")
    return stabiliser(table, fix_ones=centred, label=label)


def residual_group(cfg: ModelConfig) -> Orthogonal | None:
    """The residual rotations of the rewritten model: ``O(D)``, the subgroup fixing a sinusoidal
    table (:func:`symalign.groups.stabiliser`), or ``None`` when that subgroup is trivial."""
    if cfg.pe != "sinusoidal":
        return Orthogonal(cfg.d_model)
    centred = cfg.norm == "layernorm"
    return _table_group(cfg.n_positions, cfg.d_model, centred)


def plan(cfg: ModelConfig) -> RewritePlan:
    """The rewrite for ``cfg`` (raises :class:`ConfigError` for post-LN)."""
    if not cfg.pre_norm:
        raise ConfigError("the RMSNorm rewrite needs pre-LN blocks (pre_norm=True): in a post-LN block the norm "
                          "gain sits on the residual path and cannot be folded into the next linear maps")
    sinus = cfg.pe == "sinusoidal"
    centre = cfg.norm == "layernorm" and not sinus
    norm = "centred" if (sinus and cfg.norm == "layernorm") else "rms"
    group = residual_group(cfg)
    dims = 0 if group is None else group.free_dims
    reason = None
    if sinus:
        fixed = cfg.d_model - dims
        reason = (f"a fixed sinusoidal table ({cfg.n_positions} positions) is added to the residual stream; it is a "
                  "buffer, not a parameter, so only rotations fixing every table row"
                  + (" and the all-ones vector (centred norm)" if norm == "centred" else "")
                  + f" are symmetries: {dims} of {cfg.d_model} dimensions remain free"
                  + (f" (O({dims}) on the complement of the {fixed}-dimensional fixed span)" if dims else
                     " (no residual rotation is declared)"))
    return RewritePlan(cfg.family, norm, centre, not sinus, reason, cfg.family == "gpt", dims)


def _gainless(cfg: ModelConfig, norm: str) -> nn.Module:
    if norm == "rms":
        return nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps, elementwise_affine=False)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, elementwise_affine=False)


class _Rewritten:
    """Mixin: a built-in model with gainless norms (and an untied GPT head) -- see :func:`rewritten_model`."""

    cfg: ModelConfig

    def _swap_modules(self) -> None:
        p = plan(self.cfg)
        for block in self.blocks:  # type: ignore[attr-defined]
            block.norm1 = _gainless(self.cfg, p.norm)
            block.norm2 = _gainless(self.cfg, p.norm)
        self.norm_f = _gainless(self.cfg, p.norm)
        if p.untied_head:
            self.head = nn.Linear(self.cfg.d_model, self.cfg.vocab_size, bias=self.cfg.bias)

    def symmetry_spec(self) -> SymmetrySpec:
        return whole_spec(self.cfg)


_CLASSES: dict[str, type] = {}


def _rewritten_class(family: str) -> type:
    if family not in _CLASSES:
        base = MODEL_CLASSES[family]

        def __init__(self, cfg: ModelConfig):
            base.__init__(self, cfg)
            self._swap_modules()

        _CLASSES[family] = type(f"RMS{base.__name__}", (_Rewritten, base), {"__init__": __init__})
    return _CLASSES[family]


def rewritten_model(cfg: ModelConfig | dict) -> nn.Module:
    """An (uninitialised) model whose state dict is the rewritten one: load :func:`rewrite_state` into it.

    Same family class as the original (its ``forward``), with gainless norms
    (``nn.RMSNorm``/``nn.LayerNorm`` with ``elementwise_affine=False``), GPT's head
    untied (with a bias iff ``cfg.bias``), and ``symmetry_spec()`` returning
    :func:`whole_spec`.
    """
    if isinstance(cfg, dict):
        cfg = ModelConfig.from_dict(cfg)
    plan(cfg)
    return _rewritten_class(cfg.family)(cfg)


def _readers(cfg: ModelConfig) -> dict[str, list[str]]:
    """Norm name -> the Linear modules reading its output."""
    out: dict[str, list[str]] = {}
    for i in range(cfg.n_layers):
        p = f"blocks.{i}."
        out[p + "norm1"] = [p + f"attn.{n}_proj" for n in "qkv"]
        out[p + "norm2"] = [p + "mlp.fc_in"]
    out["norm_f"] = ["head"]
    return out


def _writers(cfg: ModelConfig) -> list[tuple[str, int]]:
    """``(tensor, axis)`` of every parameter writing the stream (``axis`` indexes the model width)."""
    out: list[tuple[str, int]] = []
    for i in range(cfg.n_layers):
        for m in ("attn.o_proj", "mlp.fc_out"):
            out.append((f"blocks.{i}.{m}.weight", 0))
            if cfg.bias:
                out.append((f"blocks.{i}.{m}.bias", 0))
    if cfg.family == "vit":
        out.append(("patch_embed.weight", 0))
        if cfg.bias:
            out.append(("patch_embed.bias", 0))
    else:
        out.append(("tok_emb.weight", 1))
    if cfg.has_cls:
        out.append(("cls_token", 2))
    if cfg.pe == "learned":
        out.append(("pos.pos_emb", 1))
    return out


def _centre(x: Tensor, axis: int) -> Tensor:
    return x - x.mean(dim=axis, keepdim=True)


@torch.no_grad()
def rewrite_state(cfg: ModelConfig | dict, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The rewritten state dict (same function; loads into :func:`rewritten_model`).

    Computed in float64 and cast back to each tensor's dtype. ``state`` is not modified.
    """
    if isinstance(cfg, dict):
        cfg = ModelConfig.from_dict(cfg)
    p = plan(cfg)
    s = {k: v.detach().to(torch.float64) for k, v in state.items()}
    dtypes = {k: v.dtype for k, v in state.items()}
    out = dict(s)
    for norm, readers in _readers(cfg).items():
        gamma = s.pop(f"{norm}.weight", None)
        beta = s.pop(f"{norm}.bias", None)
        out.pop(f"{norm}.weight", None)
        out.pop(f"{norm}.bias", None)
        for r in readers:
            w = s[f"{r}.weight"]
            b = s.get(f"{r}.bias")
            w_new = w * gamma if gamma is not None else w.clone()
            if p.centre:
                w_new = _centre(w_new, 1)
            out[f"{r}.weight"] = w_new
            if cfg.bias:
                b0 = b if b is not None else torch.zeros(w.shape[0], dtype=torch.float64)
                out[f"{r}.bias"] = b0 + (w @ beta if beta is not None else 0.0)
                dtypes.setdefault(f"{r}.bias", dtypes[f"{r}.weight"])
    if p.centre:
        for t, axis in _writers(cfg):
            out[t] = _centre(s[t], axis)
    return {k: v.to(dtypes[k]) for k, v in out.items()}


def rewrite_model(model: nn.Module) -> nn.Module:
    """A new rewritten model computing ``model``'s function (same dtype, eval/train mode copied)."""
    cfg = model.cfg
    new = rewritten_model(cfg)
    dtype = next(model.parameters()).dtype
    new = new.to(dtype)
    new.load_state_dict(rewrite_state(cfg, model.state_dict()))
    new.train(model.training)
    return new


def whole_spec(cfg: ModelConfig) -> SymmetrySpec:
    r"""Exact symmetries of the rewritten model.

    Per layer: ``heads.i``, ``qk.i``, ``vo.i`` (attention, as in the original spec) and
    ``ff.i`` = ``S_{d_ff}``; plus ``residual`` acting covariantly on every writer
    (embeddings, positions, CLS, patch embedding, ``o_proj``/``fc_out`` outputs and
    biases) and contravariantly on every reader (Q/K/V, ``fc_in``, head inputs). The
    residual group is ``O(D)``, or under a fixed sinusoidal table the rotations fixing
    it (:func:`residual_group`; no residual space when that group is trivial).
    """
    plan(cfg)
    spec = blocks_spec(cfg, residual=False)
    group = residual_group(cfg)
    if group is None:
        return spec
    spec.add_space(RESIDUAL, group, "residual")
    for t, axis in _writers(cfg):
        spec.act_on(t, RESIDUAL, axis, "co")
    for readers in _readers(cfg).values():
        for r in readers:
            spec.act_on(f"{r}.weight", RESIDUAL, 1, "contra")
    return spec
