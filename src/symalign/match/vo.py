r"""Stage 2 for the value-output pair: the ``GL(d_h)`` problem of :mod:`symalign.match.qk` with ``(V, O)``.

For every positional encoding the V-O symmetry of a K/V head is the full
``GL(d_h)``: ``W_V <- W_V B^T`` (covariant rows: V weight rows and bias),
``W_O <- W_O B^{-1}`` (contravariant rows: the ``D`` output rows of the O block;
under GQA the O blocks of all ``g`` query heads of the group are stacked).
Minimise ``||V_A - V_B B^T||^2 + ||O_A - O_B B^{-1}||^2`` exactly as for Q-K.
"""

from __future__ import annotations

from symalign.match.qk import GLSolution, Grams, solve_gl


def solve_vo(g: Grams, mode: str = "full", **kw) -> GLSolution:
    """Align V-O for every K/V head of every layer at once (see :func:`symalign.match.qk.solve_gl`)."""
    kw.setdefault("label", "V-O")
    return solve_gl(g, mode, **kw)
