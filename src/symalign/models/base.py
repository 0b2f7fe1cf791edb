"""Shared trunk of the built-in models: position input, blocks, final norm, spec."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from symalign.models.blocks import RESIDUAL, Block, PositionalInput, act_on_norm, blocks_spec, has_residual_symmetry, \
    init_weights, make_norm
from symalign.models.config import ModelConfig
from symalign.nn.sites import ActivationSite, linear_heads_site
from symalign.spec import SymmetrySpec


class Trunk(nn.Module):
    """Base class: ``pos`` (absolute PE, once), ``blocks``, ``norm_f`` (pre-LN only).

    Subclasses embed their input to ``(B, T, D)`` and read the output.
    ``residual_tensors()`` lists ``(name, axis, variance)`` of their own tensors
    that read or write the residual stream.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.pos = PositionalInput(cfg)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm_f = make_norm(cfg) if cfg.pre_norm else nn.Identity()

    def trunk(self, x: Tensor) -> Tensor:
        """``norm_f(blocks(drop(x + P)))`` for embedded tokens ``x`` of shape ``(B, T, D)``."""
        x = self.drop(self.pos(x))
        for block in self.blocks:
            x = block(x)
        return self.norm_f(x)

    def reset_parameters(self, seed: int) -> None:
        """Re-draw every parameter from ``torch.Generator().manual_seed(seed)`` (see ``init_weights``)."""
        init_weights(self, torch.Generator().manual_seed(int(seed)), self.cfg.n_layers)

    def residual_tensors(self) -> list[tuple[str, int, str]]:
        raise NotImplementedError

    def activation_sites(self) -> list[ActivationSite]:
        """Where activation matching reads each space (:mod:`symalign.nn.sites`): ``residual`` at the
        input of every block and of ``norm_f``, ``ff.i`` at the input of ``fc_out`` (the hidden units
        after the nonlinearity), ``heads.i`` at the input of ``o_proj`` (per-head contributions)."""
        sites = []
        for i, blk in enumerate(self.blocks):
            sites.append(ActivationSite(RESIDUAL, blk))
            sites.append(ActivationSite(f"ff.{i}", blk.mlp.fc_out))
            sites.append(linear_heads_site(f"heads.{i}", blk.attn.o_proj, self.cfg.n_heads))
        sites.append(ActivationSite(RESIDUAL, self.norm_f))
        return sites

    def symmetry_spec(self) -> SymmetrySpec:
        """Exact symmetries: per layer ``heads.i``, ``qk.i``, ``vo.i``, ``ff.i``; plus
        ``residual`` (``S_D``) unless the PE is sinusoidal (see ``has_residual_symmetry``)."""
        cfg = self.cfg
        residual = has_residual_symmetry(cfg)
        spec = blocks_spec(cfg, residual=residual)
        if residual:
            if cfg.pe == "learned":
                spec.act_on("pos.pos_emb", RESIDUAL, 1)
            if cfg.pre_norm:
                act_on_norm(spec, cfg, "norm_f")
            for name, axis, variance in self.residual_tensors():
                spec.act_on(name, RESIDUAL, axis, variance)
        return spec
