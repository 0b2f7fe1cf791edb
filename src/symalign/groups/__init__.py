r"""Symmetry groups and their exact actions on weight tensors.

One module per kind of group, above the numerics they use, above the abstract group:

* :mod:`~symalign.groups.base` -- :class:`Group` (the conventions: covariant and contravariant
  axes, composition, what solvers need of a group and what callers may ask it), ``Variance``, ``Latent``;
* numerics -- :mod:`~symalign.groups.actions` (a matrix on one axis of a tensor),
  :mod:`~symalign.groups.assignment` (Hungarian assignment, permutation matrices, Sinkhorn),
  :mod:`~symalign.groups.polar` (polar factor, condition numbers), :mod:`~symalign.groups.newton`
  (the positive-scale quartic), :mod:`~symalign.groups.rotary` (RoPE planes),
  :mod:`~symalign.groups.sampling` (random elements);
* kinds -- :mod:`~symalign.groups.permutation` (``S_n``, head permutations, block permutations),
  :mod:`~symalign.groups.linear` (``GL``, ``O``, signed permutations), :mod:`~symalign.groups.rope`
  (``H(r) (+) GL``), :mod:`~symalign.groups.scale` (positive monomials),
  :mod:`~symalign.groups.diagonal` (QK-norm plane signs, scales, identity),
  :mod:`~symalign.groups.fixing` (rotations fixing a subspace), :mod:`~symalign.groups.product`
  (one element per head), :mod:`~symalign.groups.semiperm` (splits of units and heads into copies, which
  change widths).

Callers import from ``symalign.groups``; the names below are its public interface.
"""

from symalign.groups.actions import apply_on_axis, variance_matrix
from symalign.groups.assignment import assign_grouped, assign_max, one_hot, sinkhorn, straight_through
from symalign.groups.base import PAIRINGS, Group, Latent, Pairing, Variance
from symalign.groups.diagonal import PlaneIdentity, PlaneScales, PlaneSigns
from symalign.groups.fixing import CenteredOrthogonal, FixingOrthogonal, centred_basis, stabiliser
from symalign.groups.linear import GeneralLinear, MatrixGroup, Orthogonal, SignedPermutations
from symalign.groups.newton import pair_costs, positive_scales, quartic_roots, scale_objective
from symalign.groups.permutation import BlockPermutations, HeadPermutation, Permutation
from symalign.groups.polar import condition, polar, polar_st
from symalign.groups.product import OffsetPerHead, PerHead
from symalign.groups.rope import RotaryPlanes
from symalign.groups.rotary import plane_of, rotary_block_matrix, rotary_pairs
from symalign.groups.sampling import as_generator, random_orthogonal, random_well_conditioned
from symalign.groups.scale import PositiveMonomial
from symalign.groups.semiperm import SemiPermutation

__all__ = [
    "PAIRINGS", "BlockPermutations", "CenteredOrthogonal", "FixingOrthogonal", "GeneralLinear", "Group",
    "HeadPermutation", "Latent", "MatrixGroup", "OffsetPerHead", "Orthogonal", "Pairing", "PerHead", "Permutation",
    "PlaneIdentity", "PlaneScales", "PlaneSigns", "PositiveMonomial", "RotaryPlanes", "SemiPermutation",
    "SignedPermutations",
    "Variance", "apply_on_axis", "as_generator", "assign_grouped", "assign_max", "centred_basis", "condition",
    "one_hot", "pair_costs", "plane_of", "polar", "polar_st", "positive_scales", "quartic_roots", "random_orthogonal",
    "random_well_conditioned", "rotary_block_matrix", "rotary_pairs", "scale_objective", "sinkhorn", "stabiliser",
    "straight_through", "variance_matrix",
]
