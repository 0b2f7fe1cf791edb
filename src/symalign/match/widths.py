r"""Different widths: embed a narrower rewritten model exactly into a wider residual stream.

For a rewritten model of width ``D_B`` (gainless RMSNorm, ``eps``) and ``D_A > D_B``
let ``E`` (``D_A x D_B``) have orthonormal columns (``E^T E = I``) and
``s = sqrt(D_A / D_B)``. Writers become ``W <- s E W`` (stream ``x -> s E x``), so the
mean square over the ``D_A`` entries is unchanged, ``|s E x|^2 / D_A = |x|^2 / D_B``,
and with the **same** ``eps``:

    RMS_A(s E x) = s E x / sqrt(|x|^2 / D_B + eps) = s E RMS_B(x).

Readers become ``W <- W E^T / s``; then every reader sees exactly what it saw in B.
The embedded model has ``d_model = D_A`` and B's ``norm_eps``, ``head_dim`` and
``d_ff`` -- the architecture of a width-``D_A`` model A with those settings, so the
two can be interpolated exactly at both ends. Aligning it to A with
:func:`match_whole` then finds ``O in O(D_A)``: the overall residual map ``s O E`` is
a multiple of a matrix with orthonormal columns (seed 002's heterogeneous-width
alignment). Requires the residual ``O(D)`` space (not available with a sinusoidal PE).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor, nn

from symalign.errors import MatchError
from symalign.match.whole import WholeMatch, match_whole
from symalign.models.config import ModelConfig


def embed_wider(model: nn.Module, d_model: int, embedding: Tensor | None = None) -> nn.Module:
    """A rewritten model of width ``d_model`` computing ``model``'s function exactly.

    ``embedding``: ``E`` (``d_model x D_B``, orthonormal columns); default ``[I; 0]``.
    """
    from symalign.rewrite import plan, rewritten_model

    cfg: ModelConfig = model.cfg  # type: ignore[attr-defined]
    p = plan(cfg)
    if not p.residual:
        raise MatchError(f"cannot embed into a wider stream: {p.reason}")
    db, da = cfg.d_model, int(d_model)
    if da < db:
        raise MatchError(f"the target width {da} is narrower than the model ({db})")
    e = torch.eye(da, db, dtype=torch.float64) if embedding is None else embedding.to(torch.float64)
    if e.shape != (da, db) or float((e.T @ e - torch.eye(db, dtype=torch.float64)).abs().max()) > 1e-10:
        raise MatchError(f"the embedding must be {da} x {db} with orthonormal columns")
    spec = model.symmetry_spec()
    new_cfg = replace(cfg, d_model=da, head_dim=cfg.head_dim, d_ff=cfg.d_ff)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    out = dict(state)
    s = (da / db) ** 0.5  # writers * s, readers / s: the stream's mean square is unchanged
    for t, a in spec.tensors_of("residual"):
        x = state[t]
        xd = torch.movedim(x.to(torch.float64), a.axis, 0)
        y = torch.movedim((e @ xd.reshape(db, -1)).reshape(da, *xd.shape[1:]), 0, a.axis)  # db -> da
        out[t] = (y / s if a.variance == "contra" else y * s).to(x.dtype)
    wide = rewritten_model(new_cfg).to(next(model.parameters()).dtype)
    wide.load_state_dict(out)
    return wide.train(model.training)


def match_widths(model_a: nn.Module, model_b: nn.Module, **kw) -> tuple[WholeMatch, nn.Module]:
    """Align a narrower rewritten B to A: embed B into A's width, then whole-model matching.

    Returns the match and the embedded B (apply the match to its state dict).
    """
    ca, cb = model_a.cfg, model_b.cfg  # type: ignore[attr-defined]
    if cb.d_model > ca.d_model:
        raise MatchError(f"B ({cb.d_model}) is wider than A ({ca.d_model}); swap them")
    if (ca.n_layers, ca.d_ff, ca.n_heads, ca.head_dim) != (cb.n_layers, cb.d_ff, cb.n_heads, cb.head_dim):
        raise MatchError("models of different widths can be matched only with equal depth, FF width, heads "
                         "and head_dim")
    wide = embed_wider(model_b, ca.d_model)
    spec = model_a.symmetry_spec()
    sa = {k: v.detach() for k, v in model_a.state_dict().items()}
    sb = {k: v.detach() for k, v in wide.state_dict().items()}
    return match_whole(spec, sa, sb, **kw), wide
