r"""Measure a module's continuous symmetry group numerically: the Jacobian null space.

If a Lie group ``G`` acts on the parameters ``theta`` of a module and leaves its
outputs ``f(theta)`` on a fixed generic batch unchanged, every tangent vector of
the orbit lies in ``null(J)``, ``J = df/dtheta``; at generic weights with enough
outputs the **nullity** ``P - rank(J)`` is exactly the dimension of the largest such
group (plus parameter directions the outputs ignore). One job per module:

* :mod:`~symalign.probe.jacobian` -- the engine: float64 functional view, dense
  (forward- or reverse-mode) and matrix-free (Hutchinson + CGLS) Jacobians;
* :mod:`~symalign.probe.precision` -- float64 end to end (internal float32 casts upcast);
* :mod:`~symalign.probe.spectrum` -- rank cut, clean-gap check (refusal), near-null counts;
* :mod:`~symalign.probe.theory` -- predicted nullity of the reference layer, RoPE plane angles;
* :mod:`~symalign.probe.heads` -- the discrete part: head swaps;
* :mod:`~symalign.probe.measure` -- :func:`probe` and :class:`ProbeResult`;
* :mod:`~symalign.probe.tour` -- the reference layer over every positional encoding;
* :mod:`~symalign.probe.hf` -- a Hugging Face family's real attention layer vs its adapter.

``symalign.probe.probe(module, inputs)`` is the entry point for any ``nn.Module``.
"""

from symalign.probe.heads import HEAD_SWAP_RTOL, head_permutation_spec, head_permutations_preserved, head_swap
from symalign.probe.jacobian import (DEFAULT_CGLS_RTOL, cgls_min_norm, dense_jacobian, dense_nullity, double_copy,
                                     functional, linear_maps, matrix_free_nullity, plain_push, reverse_jacobian,
                                     tensor_scales)
from symalign.probe.measure import DENSE_MAX_BYTES, DENSE_MAX_PARAMS, ProbeResult, choose_method, probe
from symalign.probe.precision import Float64Mode
from symalign.probe.spectrum import DEFAULT_TOL, NEAR_NULL, AmbiguousSpectrumError, Spectrum, analyse
from symalign.probe.theory import (SLOW_PLANE_RAD, attention_parameter_count, degeneracy_warnings, predicted_nullity,
                                   reference_frequencies, rope_planes)
from symalign.probe.tour import TOUR, generic_attention, probe_attention, probe_batch, probe_tour

__all__ = ["AmbiguousSpectrumError", "DEFAULT_CGLS_RTOL", "DEFAULT_TOL", "DENSE_MAX_BYTES", "DENSE_MAX_PARAMS",
           "Float64Mode", "HEAD_SWAP_RTOL", "NEAR_NULL", "ProbeResult", "SLOW_PLANE_RAD", "Spectrum", "TOUR",
           "analyse", "attention_parameter_count", "cgls_min_norm", "choose_method", "degeneracy_warnings",
           "dense_jacobian", "dense_nullity", "double_copy", "functional", "generic_attention",
           "head_permutation_spec", "head_permutations_preserved", "head_swap", "linear_maps", "matrix_free_nullity",
           "plain_push", "predicted_nullity",
           "probe", "probe_attention", "probe_batch", "probe_tour", "reference_frequencies", "reverse_jacobian",
           "rope_planes", "tensor_scales"]
