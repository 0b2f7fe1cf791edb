r"""The probe: the Jacobian nullity of a module, read with a clean gap, beside the theory.

:func:`probe` builds the float64 functional view of a module
(:mod:`symalign.probe.jacobian`), measures the nullity densely (SVD; refused when
the spectrum has no clean gap, :mod:`symalign.probe.spectrum`) or matrix-free
(Hutchinson + CGLS), compares it with the predicted dimension (for the reference
layer :func:`symalign.probe.theory.predicted_nullity`), reports the near-null
spectrum and, for RoPE, the rotation of every plane over the context, and checks
the discrete part (a head swap, :mod:`symalign.probe.heads`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import nn

from symalign.errors import SymalignError
from symalign.nn.attention import MultiHeadAttention
from symalign.probe.heads import head_permutations_preserved
from symalign.probe.jacobian import (DEFAULT_CGLS_RTOL, dense_jacobian, functional, linear_maps, matrix_free_nullity,
                                     plain_push, tensor_scales)
from symalign.probe.spectrum import DEFAULT_TOL, AmbiguousSpectrumError, analyse
from symalign.probe.theory import degeneracy_warnings, predicted_nullity, reference_frequencies, rope_planes
from symalign.spec import SymmetrySpec

DENSE_MAX_BYTES = 2 * 1024 ** 3
"""``auto`` picks the dense path when the Jacobian (``m * P * 8`` bytes) fits in this ..."""
DENSE_MAX_PARAMS = 20_000
"""... and ``P`` is at most this (the SVD costs ``O(m P^2)``)."""

AD_MODES = ("forward", "reverse", "both")


@dataclass
class ProbeResult:
    """What :func:`probe` measured.

    ``nullity`` is an int for the dense path and a float estimate (with
    ``stderr``) for the matrix-free path. ``predicted`` is the theory (or None),
    ``breakdown`` its terms. ``tol`` is the relative tolerance used: singular
    values below ``tol * s_max`` (dense) or the CGLS relative residual
    (matrix-free; ``residual`` is the worst relative CGLS residual reached, above
    ``tol`` only when ``maxiter`` stopped it). Dense only: ``singular_value_gap`` is
    ``s_rank / s_{rank+1}`` (``inf`` when nothing is null), ``smallest_kept`` and
    ``largest_null`` are ``s_rank / s_1`` and ``s_{rank+1} / s_1``, ``near_null``
    counts the non-null singular values below ``1e-3`` and ``1e-4`` of the largest
    (approximate symmetries), ``ad`` the differentiation mode(s) the Jacobian was
    formed with. ``upcasts``: lower-precision casts inside the module that were
    computed in float64. ``rope_planes``: per RoPE plane, its total rotation over the
    context (:func:`symalign.probe.theory.rope_planes`), when known.
    """

    nullity: float
    predicted: int | None
    parameters: int
    outputs: int
    rank: float
    tol: float
    method: str
    singular_value_gap: float | None = None
    smallest_kept: float | None = None
    largest_null: float | None = None
    near_null: dict[str, int] | None = None
    ad: str | None = None
    head_permutations_preserved: bool | None = None
    stderr: float | None = None
    probes: int | None = None
    iterations: int | None = None
    residual: float | None = None
    seconds: float = 0.0
    breakdown: dict[str, int] | None = None
    group: dict[str, str] | None = None
    upcasts: list[str] = field(default_factory=list)
    rope_planes: list[dict] | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def match(self) -> bool | None:
        """Whether the measurement agrees with ``predicted`` (exactly for dense, 4 sigma + 1 otherwise)."""
        if self.predicted is None:
            return None
        if self.method == "dense":
            return int(self.nullity) == int(self.predicted)
        return abs(self.nullity - self.predicted) <= 4 * (self.stderr or 0.0) + 1.0

    @property
    def slow_planes(self) -> int | None:
        """How many RoPE planes rotate by less than the slow threshold over the context (None when unknown)."""
        return None if self.rope_planes is None else sum(p["slow"] for p in self.rope_planes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["match"] = self.match
        d["slow_planes"] = self.slow_planes
        gap = d.get("singular_value_gap")
        if gap is not None and not math.isfinite(gap):
            d["singular_value_gap"] = None  # JSON has no inf
        return d


def choose_method(outputs: int, parameters: int) -> str:
    """``dense`` when the Jacobian fits comfortably (see :data:`DENSE_MAX_BYTES`), else ``matrix-free``."""
    if outputs * parameters * 8 <= DENSE_MAX_BYTES and parameters <= DENSE_MAX_PARAMS:
        return "dense"
    return "matrix-free"


def probe(module: nn.Module, inputs: Any = (), *, spec: SymmetrySpec | None = None, predicted: int | None = None,
          method: str = "auto", tol: float | None = None, probes: int = 16, seed: int = 0,
          equilibrate: bool = True, maxiter: int = 2000, check_heads: bool = True, ad: str = "forward",
          parameters: Sequence[str] | None = None, frequencies: Sequence[float] | torch.Tensor | None = None,
          seq_len: int | None = None, device: str | torch.device | None = None) -> ProbeResult:
    r"""Measure the Jacobian nullity of ``module`` at its parameters on ``inputs`` (see :mod:`symalign.probe`).

    ``inputs``: a tensor or tuple of positional arguments (floating ones cast to
    float64). ``predicted``: the theory to compare with; for
    :class:`MultiHeadAttention` it defaults to
    :func:`~symalign.probe.theory.predicted_nullity`. ``method``: ``auto`` | ``dense``
    | ``matrix-free``. ``tol``: relative singular value threshold (dense, default
    ``1e-9``) or CGLS relative residual (matrix-free, default ``1e-6``). ``probes``:
    Hutchinson probes (matrix-free). ``ad``: how the dense Jacobian is formed,
    ``forward`` (columns), ``reverse`` (rows) or ``both`` (each must give the same
    nullity, else :class:`~symalign.probe.spectrum.AmbiguousSpectrumError`).
    ``parameters``: names of the parameters to differentiate by (default all; the
    rest stay fixed). ``frequencies`` and ``seq_len``: the RoPE plane frequencies and
    context length for the plane report (the reference layer supplies its own).

    ``device``: measure there (:mod:`symalign.device`): the module (its parameters and buffers, and the tensors
    of a captured call) and the inputs are moved there, every tensor the probe makes is made there, TF32 is off;
    the probes' random stream is the device's generator, so on a GPU the Hutchinson estimates (not the exact
    dense spectrum's cut) may differ from the CPU's in their last digits. ``None``: where the module is.

    Raises :class:`~symalign.probe.spectrum.AmbiguousSpectrumError` when the dense
    spectrum has no clean gap (never a nullity that depends on the cut).
    """
    if device is not None:
        return _probe_on(device, module, inputs, spec=spec, predicted=predicted, method=method, tol=tol,
                         probes=probes, seed=seed, equilibrate=equilibrate, maxiter=maxiter, check_heads=check_heads,
                         ad=ad, parameters=parameters, frequencies=frequencies, seq_len=seq_len)
    t0 = time.perf_counter()
    lin = _linearise(module, inputs, parameters, method, ad, seed, equilibrate)
    result, frequencies, seq_len = _theory(module, spec, lin.f, predicted, frequencies, seq_len, lin.method,
                                           lin.outputs, lin.parameters)
    if frequencies is not None and seq_len is not None:
        result.rope_planes = rope_planes(frequencies, seq_len)
    if lin.method == "dense":
        _measure_dense(result, module, lin.f, lin.push, lin.scale, tol, ad)
    else:
        _measure_matrix_free(result, lin, tol, probes, maxiter)
    if check_heads:
        result.head_permutations_preserved = head_permutations_preserved(module, inputs, spec)
    result.upcasts = sorted(lin.f.upcasts)
    result.seconds = time.perf_counter() - t0
    return result


@dataclass
class _Linearised:
    """The float64 functional view ``f`` of a module, its output and parameter counts, the method chosen, the
    probes' generator, the Jacobian-vector products (``pull`` only matrix-free) and the equilibration scales."""

    f: Any
    outputs: int
    parameters: int
    method: str
    gen: torch.Generator
    push: Any
    pull: Any
    scale: torch.Tensor


def _linearise(module: nn.Module, inputs: Any, parameters: Sequence[str] | None, method: str, ad: str, seed: int,
               equilibrate: bool) -> _Linearised:
    """Check ``method`` and ``ad``, build the functional view, choose the method (``auto``: :func:`choose_method`),
    seed the generator and form the products and the per-tensor scales (ones without ``equilibrate``)."""
    if method not in ("auto", "dense", "matrix-free"):
        raise SymalignError(f"unknown probe method {method!r}; use auto, dense or matrix-free")
    if ad not in AD_MODES:
        raise SymalignError(f"unknown differentiation mode {ad!r}; use {', '.join(AD_MODES)}")
    f = functional(module, inputs, parameters)
    p = f.theta.numel()
    with torch.no_grad():
        m = f(f.theta).numel()
    if method == "auto":
        method = choose_method(m, p)
    gen = torch.Generator(device=f.theta.device).manual_seed(int(seed))
    if method == "dense":
        push, pull = plain_push(f), None
    else:
        push, pull = linear_maps(f)
    scale = tensor_scales(f, push, gen) if equilibrate else torch.ones_like(f.theta)
    return _Linearised(f, m, p, method, gen, push, pull, scale)


def _measure_matrix_free(result: ProbeResult, lin: _Linearised, tol: float | None, probes: int,
                         maxiter: int) -> None:
    """The matrix-free nullity into ``result``: the Hutchinson mean over ``probes`` CGLS solves to the relative
    residual ``tol``, its standard error, iterations and worst residual."""
    result.tol = DEFAULT_CGLS_RTOL if tol is None else float(tol)
    mean, err, iters, _, worst = matrix_free_nullity(lin.f, lin.push, lin.pull, lin.scale, probes, lin.gen,
                                                     result.tol, maxiter)
    result.nullity, result.rank, result.stderr, result.residual = mean, lin.parameters - mean, err, worst
    result.probes, result.iterations = probes, iters


def _probe_on(device: str | torch.device, module: nn.Module, inputs: Any, **options) -> ProbeResult:
    """:func:`probe` on ``device``: the module and the tensor inputs moved there, tensors made there, TF32 off."""
    from symalign.device import exact_matmul, resolve

    dev = resolve(device)
    moved = tuple(x.to(dev) if isinstance(x, torch.Tensor) else x
                  for x in (inputs if isinstance(inputs, tuple) else (inputs,)))
    with torch.device(dev), exact_matmul():
        return probe(module.to(dev), moved if isinstance(inputs, tuple) else moved[0], **options)


def _theory(module: nn.Module, spec: SymmetrySpec | None, f, predicted: int | None,
            frequencies: Sequence[float] | torch.Tensor | None, seq_len: int | None, method: str, m: int,
            p: int) -> tuple[ProbeResult, Sequence[float] | torch.Tensor | None, int | None]:
    """The result before measuring: the predicted nullity and its breakdown, the symmetry group's description and
    the degeneracy warnings (for :class:`MultiHeadAttention`, from its config, the context length of the inputs and
    its RoPE frequencies; ``spec`` overrides the group). Returns it with the frequencies and context length to
    report the RoPE planes for."""
    breakdown = group = None
    warnings: list[str] = []
    if isinstance(module, MultiHeadAttention):
        seq_len = int(f.inputs[0].shape[1])
        if predicted is None:
            predicted, breakdown = predicted_nullity(module.cfg, seq_len)
        group = module.symmetry_spec().describe()
        warnings = degeneracy_warnings(module.cfg, seq_len, m, p)
        if frequencies is None:
            frequencies = reference_frequencies(module.cfg)
    if spec is not None:
        group = spec.describe()
    result = ProbeResult(nullity=0, predicted=predicted, parameters=p, outputs=m, rank=0, tol=0.0, method=method,
                         breakdown=breakdown, group=group, warnings=warnings)
    return result, frequencies, seq_len


def _measure_dense(result: ProbeResult, module: nn.Module, f, push, scale: torch.Tensor, tol: float | None,
                   ad: str) -> None:
    """The dense nullity into ``result``: the equilibrated Jacobian formed in ``ad`` mode (both modes for
    ``both``, which must agree), its singular values cut at the relative ``tol`` with a clean gap required."""
    result.tol = DEFAULT_TOL if tol is None else float(tol)
    p = result.parameters
    modes = ("forward", "reverse") if ad == "both" else (ad,)
    spectra = {}
    for mode in modes:
        jac = dense_jacobian(f, push, scale, ad=mode)
        spectra[mode] = analyse(torch.linalg.svdvals(jac), p, result.tol,
                                what=f"the {mode}-mode Jacobian of {type(module).__name__}")
    if len({sp.nullity for sp in spectra.values()}) > 1:
        raise AmbiguousSpectrumError(
            "forward- and reverse-mode Jacobians disagree on the nullity ("
            + ", ".join(f"{k} {v.nullity}" for k, v in spectra.items())
            + "): rounding decides it; not reporting one")
    sp = spectra[modes[0]]
    result.nullity, result.rank, result.singular_value_gap = sp.nullity, sp.rank, sp.gap
    result.smallest_kept, result.largest_null, result.near_null = sp.smallest_kept, sp.largest_null, sp.near_null
    result.ad = ad
