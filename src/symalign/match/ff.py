r"""The permutation step of whole-model matching: one linear assignment per space.

For a permutation space (FF hidden units ``ff.i``, or a permuted residual stream)
stack, for each unit, every row it owns across the tensors the space acts on
(``[W_in ; b_in ; W_out^T]`` for an MLP). With ``C = sum X_A X_B^T`` (``C[i, j] =
<unit i of A, unit j of B>``), the permutation maximising ``sum_i C[i, perm[i]]``
minimises ``sum ||A - P B||^2`` (norms are permutation invariant); it is found
exactly by ``scipy.optimize.linear_sum_assignment``. Convention: new unit ``i`` of
B' is old unit ``perm[i]`` of B (:class:`symalign.groups.Permutation`).

ReLU units also scale (``relu(s z) = s relu(z)``, ``s > 0``): their group is the
positive monomials :class:`symalign.groups.PositiveMonomial`, solved by
:func:`match_monomial` (exactly: one assignment on the per-pair costs with each
pair's best scale).
"""

from __future__ import annotations

from torch import Tensor

from symalign.groups import PositiveMonomial
from symalign.match.residual import axis_rows


# ----------------------------------------------------------------------------
# ReLU units: permutation and positive per-unit scaling (the maths: symalign.groups.PositiveMonomial.fit,
# pair_costs, positive_scales, scale_objective)
# ----------------------------------------------------------------------------


def match_monomial(pairs, state_a, state_b, n: int, max_scale: float = 1e4) -> Tensor:
    r"""``argmin_{(perm, s)} sum_t ||A_t - T B_t||^2`` over positive monomials ``T = diag(s) P`` (ReLU units),
    solved exactly.

    For the given ``(tensor, action)`` pairs of one space, unit ``i`` of B' is
    ``s_i`` times unit ``perm[i]`` of B on covariant axes (``fc_in`` rows, bias) and
    ``1/s_i`` times it on contravariant ones (``fc_out`` columns). With
    ``Q = sum_co X_A X_B^T``, ``T = sum_contra X_A X_B^T`` and the row norms
    ``p_j = sum_co |X_B^j|^2``, ``r_j = sum_contra |X_B^j|^2``, the distance is, up to a
    constant, ``sum_i f_{i, perm[i]}(s_i)`` with
    ``f_ij(s) = p_j s^2 - 2 Q_ij s + r_j s^{-2} - 2 T_ij s^{-1}``. Given the pairing, the
    scales separate, so
    ``min_{perm, s} = min_perm sum_i c_{i, perm[i]}`` with ``c_ij = min_{s > 0} f_ij(s)``
    (:func:`pair_costs`): one linear assignment on ``c`` gives the exact joint minimiser,
    and ``s_i`` is the minimiser of the chosen pair. (Alternating assignment and scales
    instead stops at a block-wise fixed point that is not, in general, the minimum.)

    Returns the element ``[perm; s]`` of :class:`symalign.groups.PositiveMonomial`
    (:meth:`~symalign.groups.PositiveMonomial.fit` on the axis rows).
    """
    rows = [(axis_rows(state_a[name], a), axis_rows(state_b[name], a), a.variance) for name, a in pairs]
    return PositiveMonomial(n).fit(rows, max_scale)


__all__ = ["match_monomial"]
