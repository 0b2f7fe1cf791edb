r"""Measure a module's continuous symmetry group numerically: the Jacobian null space.

The maths
---------
Let ``f(theta)`` be the flattened outputs of a module on a fixed batch of generic
inputs, as a function of all its floating parameters ``theta in R^P``, and
``J = df/dtheta`` (``m x P``). If a Lie group ``G`` acts on parameters and leaves
``f`` unchanged, every tangent vector of the orbit ``G . theta`` lies in
``null(J)``; at generic ``theta`` and with enough generic inputs (``m`` well above
``P``) the null space is *exactly* the tangent space of the largest continuous
group of function-preserving transformations (plus any parameter directions the
outputs do not depend on at all). Its dimension, the **nullity** ``P - rank(J)``,
is therefore an experimental measurement of the continuous group dimension.

Two ways to measure it:

* **dense** -- form ``J`` (forward-mode, chunked), scale the columns of each
  parameter tensor by a constant (below), take singular values
  ``s_1 >= s_2 >= ...`` and count ``rank = #{s_i > tol * s_1}``;
  ``nullity = P - rank`` (this includes the ``P - min(m, P)`` singular values an
  ``m x P`` matrix with ``m < P`` does not have). ``tol`` defaults to ``1e-9`` in
  float64 (machine epsilon ``2.2e-16``: null singular values come out near
  ``1e-15 s_1``, genuine ones far above ``1e-9 s_1`` for the sizes we probe);
  the ratio ``s_rank / s_{rank+1}`` is reported as evidence of a clean gap.
* **matrix-free** -- never form ``J``. The orthogonal projector onto the null
  space is ``Pi_0 = I - J^+ J``, and ``nullity = tr(Pi_0)``. Hutchinson's
  estimator with Rademacher vectors ``z`` (``E[z z^T] = I``) gives
  ``tr(Pi_0) = E[z^T Pi_0 z]``, and ``Pi_0 z = z - w`` where ``w = J^+ (J z)`` is the
  minimum-norm solution of the consistent system ``J w = J z``. CGLS (conjugate
  gradients on the normal equations) started at ``w_0 = 0`` keeps its iterates in
  ``range(J^T) = null(J)^perp`` and so converges to exactly that minimum-norm
  solution; each iteration costs one JVP (``J p``) and one VJP (``J^T r``), batched
  over all probes with ``torch.func.vmap``. Since ``w`` lies in
  ``range(J^T)``, ``z^T Pi_0 z = P - z^T w``. The estimate is the mean over
  probes, reported with its standard error (for a projector of rank ``k`` the
  per-probe variance is ``2 (k - sum_i Pi_ii^2) <= 2 k``).

**Preconditioning.** For an invertible diagonal ``S``, ``null(J S) = S^{-1} null(J)``
has the same dimension, and ``tr`` of the orthogonal projector onto it is that
same dimension. So the columns belonging to each parameter tensor may be scaled by
a constant ``s_t = 1 / rms column norm of J on tensor t`` (estimated with a few
random JVPs). This equilibration is what makes CGLS converge in reasonable time
when weights, biases and position tables have very different sensitivities, and
it makes the dense gap cleaner too.

:func:`predicted_nullity` gives the theory for the reference attention layer
(see ``docs/symmetry.md``), and :func:`head_permutations_preserved` checks the
discrete part (a head swap) exactly.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call, jvp, linearize, vjp, vmap

from symalign.errors import SymalignError
from symalign.groups import HeadPermutation
from symalign.nn.attention import AttentionConfig, MultiHeadAttention, attention_spec
from symalign.spec import SymmetrySpec, apply

DEFAULT_TOL = 1e-9
"""Relative singular-value tolerance of the dense path (float64)."""

DEFAULT_CGLS_RTOL = 1e-6
"""Relative residual at which the matrix-free path stops CGLS."""

DENSE_MAX_BYTES = 2 * 1024 ** 3
"""``auto`` picks the dense path when the Jacobian (``m * P * 8`` bytes) fits in this ..."""
DENSE_MAX_PARAMS = 20_000
"""... and ``P`` is at most this (the SVD costs ``O(m P^2)``)."""

HEAD_SWAP_RTOL = 1e-10
"""A head swap "preserves" the function when the relative output change is at most this (float64)."""


# ----------------------------------------------------------------------------
# Result
# ----------------------------------------------------------------------------


@dataclass
class ProbeResult:
    """What :func:`probe` measured.

    ``nullity`` is an int for the dense path and a float estimate (with
    ``stderr``) for the matrix-free path. ``predicted`` is the theory (or None),
    ``breakdown`` its terms. ``tol`` is the relative tolerance used: singular
    values below ``tol * s_max`` (dense) or the CGLS relative residual
    (matrix-free; ``residual`` is the worst relative CGLS residual reached, above
    ``tol`` only when ``maxiter`` stopped it). ``singular_value_gap`` is ``s_rank / s_{rank+1}`` (dense only;
    ``inf`` when there is no null singular value to compare with).
    """

    nullity: float
    predicted: int | None
    parameters: int
    outputs: int
    rank: float
    tol: float
    method: str
    singular_value_gap: float | None = None
    head_permutations_preserved: bool | None = None
    stderr: float | None = None
    probes: int | None = None
    iterations: int | None = None
    residual: float | None = None
    seconds: float = 0.0
    breakdown: dict[str, int] | None = None
    group: dict[str, str] | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def match(self) -> bool | None:
        """Whether the measurement agrees with ``predicted`` (exactly for dense, 4 sigma + 1 otherwise)."""
        if self.predicted is None:
            return None
        if self.method == "dense":
            return int(self.nullity) == int(self.predicted)
        return abs(self.nullity - self.predicted) <= 4 * (self.stderr or 0.0) + 1.0

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["match"] = self.match
        gap = d.get("singular_value_gap")
        if gap is not None and not math.isfinite(gap):
            d["singular_value_gap"] = None  # JSON has no inf
        return d


# ----------------------------------------------------------------------------
# Theory for the reference attention layer
# ----------------------------------------------------------------------------


def predicted_nullity(cfg: AttentionConfig, seq_len: int) -> tuple[int, dict[str, int]]:
    r"""Predicted Jacobian nullity of :class:`MultiHeadAttention` (generic weights and inputs).

    Terms (``d = d_h``, ``r`` the rotated width, ``h_kv`` the K/V heads):

    * ``qk``: the declared Q-K group, ``h_kv * d^2`` (``GL(d)`` per K/V group) or
      ``h_kv * (r + (d - r)^2)`` under RoPE (``H(r) (+) GL(d - r)``);
    * ``vo``: the declared V-O group, ``h_kv * d^2``;
    * ``key_bias`` (bias only): ``q_m^T b_K`` is the same for every key ``n``, and
      softmax ignores a per-row constant; under RoPE only the unrotated part of
      ``b_K`` has that property: ``h_kv * (d - r)``;
    * ``value_output_bias`` (bias only): attention rows sum to one, so
      ``b_V -> b_V + delta``, ``b_O -> b_O - sum_i W_O^i delta_{j(i)}`` is exact:
      ``h_kv * d``;
    * ``pe_shift`` (learned PE with bias): ``p_t -> p_t + u`` for every ``t`` is
      absorbed by ``b_{Q,K,V} -> b - W u``: ``D``;
    * ``unused_pe_rows`` (learned PE): rows ``t >= seq_len`` of the table never
      reach the output: ``(max_len - seq_len) * D``.

    The first two are the continuous group the layer's spec declares
    (:func:`symalign.nn.attention.attention_spec`); the others are *not* in its orbit.
    Assumes a non-degenerate probe (see :func:`degeneracy_warnings`).
    """
    spec = attention_spec(cfg)
    d, hkv, r, D = cfg.head_dim, cfg.n_kv_heads, cfg.rotary_dims, cfg.d_model
    terms: dict[str, int] = {"qk": spec.spaces["qk.0"].dim, "vo": spec.spaces["vo.0"].dim}
    if cfg.bias:
        terms["key_bias"] = hkv * (d - r)
        terms["value_output_bias"] = hkv * d
    if cfg.pe == "learned":
        if cfg.bias:
            terms["pe_shift"] = D
        terms["unused_pe_rows"] = max(cfg.max_len - seq_len, 0) * D
    return sum(terms.values()), terms


def attention_parameter_count(cfg: AttentionConfig) -> int:
    """Number of parameters of :class:`MultiHeadAttention` with this config."""
    h, hkv, d, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_model
    n = 2 * h * d * D + 2 * hkv * d * D
    if cfg.bias:
        n += h * d + 2 * hkv * d + D
    if cfg.pe == "learned":
        n += cfg.max_len * D
    return n


def degeneracy_warnings(cfg: AttentionConfig, seq_len: int, outputs: int, parameters: int) -> list[str]:
    """Reasons the measured nullity may exceed :func:`predicted_nullity` (empty when the setup is generic)."""
    out = []
    d, D, h, hkv = cfg.head_dim, cfg.d_model, cfg.n_heads, cfg.n_kv_heads
    if seq_len < 2:
        out.append("seq_len < 2: softmax over one key is constant, Q and K do not matter")
    if d > D:
        out.append(f"head_dim={d} > d_model={D}: W_Q W_K^T has rank <= D < d_h, the fibres are larger than GL(d_h)")
    if cfg.pe == "learned" and (h + 2 * hkv) * d < D:
        out.append("the stacked Q/K/V maps have a null space: learned PE rows may move inside it for free")
    if outputs < parameters:
        out.append(f"only {outputs} outputs for {parameters} parameters: rank is capped by the outputs")
    return out


# ----------------------------------------------------------------------------
# Plumbing: a float64 functional view of any module
# ----------------------------------------------------------------------------


def _as_tuple(inputs: Any) -> tuple:
    return tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def _to_double(x: Any) -> Any:
    if isinstance(x, Tensor) and x.is_floating_point():
        return x.detach().to(torch.float64)
    return x


def _flatten_outputs(y: Any) -> Tensor:
    if isinstance(y, Tensor):
        return y.reshape(-1)
    if isinstance(y, Mapping):
        y = [y[k] for k in sorted(y)]
    if isinstance(y, (tuple, list)):
        parts = [t.reshape(-1) for t in y if isinstance(t, Tensor) and t.is_floating_point()]
        if parts:
            return torch.cat(parts)
    raise SymalignError(f"the module returned {type(y).__name__}; the probe needs a tensor (or a tuple/dict of them)")


def double_copy(module: nn.Module) -> nn.Module:
    """A float64, eval-mode copy with fused kernels disabled (functorch-friendly)."""
    m = copy.deepcopy(module).to(torch.float64).eval()
    for sub in m.modules():
        if hasattr(sub, "use_sdpa"):
            sub.use_sdpa = False
    return m


@dataclass
class _Functional:
    """``f(theta)``: flattened float64 outputs as a function of one flat parameter vector."""

    model: nn.Module
    names: list[str]
    shapes: list[torch.Size]
    theta: Tensor
    inputs: tuple

    @property
    def sizes(self) -> list[int]:
        return [math.prod(s) for s in self.shapes]

    def unflatten(self, theta: Tensor) -> dict[str, Tensor]:
        return {n: t.view(s) for n, t, s in zip(self.names, theta.split(self.sizes), self.shapes)}

    def __call__(self, theta: Tensor) -> Tensor:
        return _flatten_outputs(functional_call(self.model, self.unflatten(theta), self.inputs))


def linear_maps(f: _Functional) -> tuple[Callable[[Tensor], Tensor], Callable[[Tensor], Tensor]]:
    """Batched ``V -> (J V^T)^T`` and ``U -> (J^T U^T)^T`` (rows are vectors), linearised once at ``theta``.

    ``torch.func.linearize`` traces the tangent map once; vmapping it is far cheaper
    than re-running ``jvp`` (which recomputes the primal) every iteration.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, jvp_fn = linearize(f, f.theta)
    _, vjp_fn = vjp(f, f.theta)
    push = vmap(jvp_fn)
    pull = vmap(vjp_fn)
    return push, lambda u: pull(u)[0]


def plain_push(f: _Functional) -> Callable[[Tensor], Tensor]:
    """Batched JVP without tracing (cheaper than :func:`linear_maps` for a handful of calls)."""
    return vmap(lambda t: jvp(f, (f.theta,), (t,))[1])


def functional(module: nn.Module, inputs: Any) -> _Functional:
    """Build the float64 functional view; raise if the module has no floating parameters."""
    model = double_copy(module)
    params = [(n, p) for n, p in model.named_parameters() if p.is_floating_point()]
    if not params:
        raise SymalignError(f"{type(module).__name__} has no floating-point parameters: there is no Jacobian to probe")
    theta = torch.cat([p.detach().reshape(-1) for _, p in params])
    return _Functional(model, [n for n, _ in params], [p.shape for _, p in params], theta,
                       tuple(_to_double(x) for x in _as_tuple(inputs)))


def tensor_scales(f: _Functional, push: Callable[[Tensor], Tensor], gen: torch.Generator, samples: int = 4,
                  floor: float = 1e-6) -> Tensor:
    r"""Per-column scaling ``S`` (constant per parameter tensor): ``s_t = 1 / rms_j ||J e_j||`` on tensor ``t``.

    ``||J_t||_F^2 = E ||J_t z||^2`` for Rademacher ``z`` supported on tensor ``t``; we
    average ``samples`` draws. A tensor whose rms is below ``floor`` times the largest
    (e.g. the key bias without RoPE, whose Jacobian is zero up to rounding) gets
    the scale of the largest, ``1 / max``, so it stays negligible: scaling rounding noise up to unit size would
    turn exact null directions into spurious non-null ones.
    """
    sizes = f.sizes
    offsets = [0] + list(torch.tensor(sizes).cumsum(0).tolist())
    tangents = []
    for t in range(len(sizes)):
        for _ in range(samples):
            z = torch.zeros_like(f.theta)
            z[offsets[t]:offsets[t + 1]] = _rademacher(sizes[t], gen)
            tangents.append(z)
    jz = push(torch.stack(tangents))
    sq = jz.pow(2).sum(1).view(len(sizes), samples).mean(1)  # ~ ||J_t||_F^2
    rms = (sq / torch.tensor(sizes, dtype=sq.dtype)).sqrt()
    top = float(rms.max())
    if top == 0:
        return torch.ones_like(f.theta)
    # a tensor the output (numerically) ignores keeps noise-level columns: never blow rounding noise up
    scale = torch.where(rms >= floor * top, 1.0 / rms.clamp_min(1e-300), torch.full_like(rms, 1.0 / top))
    return torch.cat([scale[t].expand(sizes[t]) for t in range(len(sizes))])


def _rademacher(n: int, gen: torch.Generator, batch: int | None = None) -> Tensor:
    shape = (n,) if batch is None else (batch, n)
    return torch.randint(0, 2, shape, generator=gen).to(torch.float64) * 2 - 1


# ----------------------------------------------------------------------------
# Dense and matrix-free nullity
# ----------------------------------------------------------------------------


def dense_jacobian(f: _Functional, push: Callable[[Tensor], Tensor] | None = None, scale: Tensor | None = None,
                   chunk_size: int | None = None) -> Tensor:
    """``J S`` as an ``(m, P)`` float64 matrix (forward mode, ``chunk_size`` tangents at a time)."""
    push = plain_push(f) if push is None else push
    if chunk_size is None:
        m = f(f.theta).numel()
        chunk_size = max(1, min(f.theta.numel(), int(2e8 // max(m * 40, 1))))  # bound vmap intermediates
    p = f.theta.numel()
    scale = torch.ones_like(f.theta) if scale is None else scale
    cols = []
    for start in range(0, p, chunk_size):
        idx = torch.arange(start, min(start + chunk_size, p))
        tangents = torch.zeros(idx.numel(), p, dtype=f.theta.dtype)
        tangents[torch.arange(idx.numel()), idx] = scale[idx]
        cols.append(push(tangents))  # (chunk, m): rows are columns of J S
    return torch.cat(cols).T


def dense_nullity(jac: Tensor, tol: float = DEFAULT_TOL) -> tuple[int, int, float, Tensor]:
    """``(nullity, rank, gap, singular values)`` of a dense Jacobian (see the module docstring)."""
    m, p = jac.shape
    s = torch.linalg.svdvals(jac)
    if s.numel() == 0 or s[0] == 0:
        return p, 0, math.inf, s
    rank = int((s > tol * s[0]).sum())
    gap = float(s[rank - 1] / s[rank]) if 0 < rank < s.numel() and s[rank] > 0 else math.inf
    return p - rank, rank, gap, s


def cgls_min_norm(apply_j: Callable[[Tensor], Tensor], apply_jt: Callable[[Tensor], Tensor], b: Tensor,
                  p: int, rtol: float = 1e-8, maxiter: int = 2000) -> tuple[Tensor, int, Tensor]:
    r"""Batched CGLS for ``min ||A w - b||`` from ``w_0 = 0`` (rows of ``b`` are right-hand sides).

    Iterates stay in ``range(A^T)``, so the limit is the minimum-norm solution ``A^+ b``.
    Stops when every column's residual ``||b - A w|| <= rtol ||b||`` (our systems are
    consistent) or after ``maxiter`` iterations. Returns ``(w, iterations, rel_residual)``.
    """
    k = b.shape[0]
    w = torch.zeros(k, p, dtype=b.dtype)
    r = b.clone()
    s = apply_jt(r)
    q_dir = s.clone()
    gamma = s.pow(2).sum(1)
    bnorm = b.norm(dim=1).clamp_min(1e-300)
    rel = r.norm(dim=1) / bnorm
    it = 0
    while it < maxiter and bool((rel > rtol).any()):
        it += 1
        aq = apply_j(q_dir)
        denom = aq.pow(2).sum(1)
        alpha = torch.where(denom > 0, gamma / denom.clamp_min(1e-300), torch.zeros_like(gamma))
        w += alpha[:, None] * q_dir
        r -= alpha[:, None] * aq
        s = apply_jt(r)
        gamma_new = s.pow(2).sum(1)
        beta = torch.where(gamma > 0, gamma_new / gamma.clamp_min(1e-300), torch.zeros_like(gamma))
        q_dir = s + beta[:, None] * q_dir
        gamma = gamma_new
        rel = r.norm(dim=1) / bnorm
    return w, it, rel


def matrix_free_nullity(f: _Functional, push: Callable[[Tensor], Tensor], pull: Callable[[Tensor], Tensor],
                        scale: Tensor, probes: int = 16, gen: torch.Generator | None = None,
                        rtol: float = 1e-6, maxiter: int = 2000,
                        batch: int = 32) -> tuple[float, float, int, list[float], float]:
    r"""Hutchinson estimate of ``tr(Pi_0)`` for ``A = J S``: ``(mean, stderr, max iterations, samples, worst residual)``.

    Per probe ``z``: ``b = A z``, ``w = A^+ b`` by CGLS, sample ``P - z^T w``. Probes
    run ``batch`` at a time (vmapped JVPs/VJPs through one linearisation).
    Truncating CGLS early biases each sample *upwards* (``z^T w_k`` grows towards
    ``z^T w``); at ``rtol = 1e-6`` the bias measured on mid-size layers is below 0.01.
    """
    gen = gen if gen is not None else torch.Generator().manual_seed(0)
    p = f.theta.numel()

    def apply_j(v: Tensor) -> Tensor:
        return push(v * scale)

    def apply_jt(u: Tensor) -> Tensor:
        return pull(u) * scale

    samples: list[float] = []
    iters, worst = 0, 0.0
    for start in range(0, probes, batch):
        k = min(batch, probes - start)
        z = _rademacher(p, gen, k)
        w, it, rel = cgls_min_norm(apply_j, apply_jt, apply_j(z), p, rtol, maxiter)
        samples += (p - (z * w).sum(1)).tolist()
        iters, worst = max(iters, it), max(worst, float(rel.max()))
    t = torch.tensor(samples, dtype=torch.float64)
    stderr = float(t.std() / math.sqrt(len(samples))) if len(samples) > 1 else math.inf
    return float(t.mean()), stderr, iters, samples, worst


# ----------------------------------------------------------------------------
# The discrete part: head swaps
# ----------------------------------------------------------------------------


def head_permutation_spec(module: nn.Module, spec: SymmetrySpec | None = None) -> SymmetrySpec | None:
    """A spec with a head-permutation space for ``module`` (None if there is none to test).

    For :class:`MultiHeadAttention` under ALiBi the layer's own spec has no heads
    space (ALiBi pins the heads); the labelling of the same tensors is then taken
    from the spec of a copy of the config without ALiBi -- which is exactly the
    permutation whose (non-)invariance we want to test.
    """
    if spec is not None and any(isinstance(g, HeadPermutation) for g in spec.spaces.values()):
        return spec
    if isinstance(module, MultiHeadAttention):
        cfg = module.cfg
        if cfg.pe == "alibi":
            cfg = dataclasses.replace(cfg, pe="none")
        return attention_spec(cfg)
    return None


def head_swap(group: HeadPermutation) -> Tensor | None:
    """Swap two K/V groups (first two), or two query heads inside group 0 when ``h_kv = 1``."""
    kv, g = group.kv, group.group_size
    taus = torch.arange(g).repeat(kv, 1)
    if kv >= 2:
        sigma = torch.arange(kv)
        sigma[[0, 1]] = sigma[[1, 0]]
        return group.from_parts(sigma, taus)
    if g >= 2:
        taus[0, [0, 1]] = taus[0, [1, 0]]
        return group.from_parts(torch.arange(kv), taus)
    return None


def head_permutations_preserved(module: nn.Module, inputs: Any, spec: SymmetrySpec | None = None,
                                rtol: float = HEAD_SWAP_RTOL) -> bool | None:
    """Whether swapping two heads (via :func:`symalign.spec.apply`) leaves the float64 output unchanged.

    None when no head-permutation space is known or there is only one head.
    """
    hspec = head_permutation_spec(module, spec)
    if hspec is None:
        return None
    name, group = next((n, g) for n, g in hspec.spaces.items() if isinstance(g, HeadPermutation))
    pi = head_swap(group)
    if pi is None:
        return None
    model = double_copy(module)
    args = tuple(_to_double(x) for x in _as_tuple(inputs))
    state = {k: v.detach() for k, v in model.state_dict().items()}
    swapped = apply(hspec.restrict([name]), {name: pi}, state)
    with torch.no_grad():
        y0 = _flatten_outputs(model(*args))
        y1 = _flatten_outputs(functional_call(model, swapped, args))
    return bool((y1 - y0).norm() <= rtol * y0.norm())


# ----------------------------------------------------------------------------
# The probe
# ----------------------------------------------------------------------------


def choose_method(outputs: int, parameters: int) -> str:
    """``dense`` when the Jacobian fits comfortably (see :data:`DENSE_MAX_BYTES`), else ``matrix-free``."""
    if outputs * parameters * 8 <= DENSE_MAX_BYTES and parameters <= DENSE_MAX_PARAMS:
        return "dense"
    return "matrix-free"


def probe(module: nn.Module, inputs: Any, *, spec: SymmetrySpec | None = None, predicted: int | None = None,
          method: str = "auto", tol: float | None = None, probes: int = 16, seed: int = 0,
          equilibrate: bool = True, maxiter: int = 2000, check_heads: bool = True) -> ProbeResult:
    r"""Measure the Jacobian nullity of ``module`` at its parameters on ``inputs`` (see the module docstring).

    ``inputs``: a tensor or tuple of positional arguments (floating ones cast to
    float64). ``predicted``: the theory to compare with; for
    :class:`MultiHeadAttention` it defaults to :func:`predicted_nullity`.
    ``method``: ``auto`` | ``dense`` | ``matrix-free``. ``tol``: relative singular
    value threshold (dense, default ``1e-9``) or CGLS relative residual
    (matrix-free, default ``1e-6``). ``probes``: Hutchinson probes (matrix-free).
    """
    t0 = time.perf_counter()
    if method not in ("auto", "dense", "matrix-free"):
        raise SymalignError(f"unknown probe method {method!r}; use auto, dense or matrix-free")
    f = functional(module, inputs)
    p = f.theta.numel()
    with torch.no_grad():
        m = f(f.theta).numel()
    if method == "auto":
        method = choose_method(m, p)
    gen = torch.Generator().manual_seed(int(seed))
    if method == "dense":
        push, pull = plain_push(f), None
    else:
        push, pull = linear_maps(f)
    scale = tensor_scales(f, push, gen) if equilibrate else torch.ones_like(f.theta)

    breakdown = group = None
    warnings: list[str] = []
    if isinstance(module, MultiHeadAttention):
        seq_len = int(f.inputs[0].shape[1])
        if predicted is None:
            predicted, breakdown = predicted_nullity(module.cfg, seq_len)
        group = module.symmetry_spec().describe()
        warnings = degeneracy_warnings(module.cfg, seq_len, m, p)
    if spec is not None:
        group = spec.describe()

    result = ProbeResult(nullity=0, predicted=predicted, parameters=p, outputs=m, rank=0, tol=0.0, method=method,
                         breakdown=breakdown, group=group, warnings=warnings)
    if method == "dense":
        result.tol = DEFAULT_TOL if tol is None else float(tol)
        nullity, rank, gap, _ = dense_nullity(dense_jacobian(f, push, scale), result.tol)
        result.nullity, result.rank, result.singular_value_gap = nullity, rank, gap
    else:
        result.tol = DEFAULT_CGLS_RTOL if tol is None else float(tol)
        mean, err, iters, _, worst = matrix_free_nullity(f, push, pull, scale, probes, gen, result.tol, maxiter)
        result.nullity, result.rank, result.stderr, result.residual = mean, p - mean, err, worst
        result.probes, result.iterations = probes, iters
    if check_heads:
        result.head_permutations_preserved = head_permutations_preserved(module, inputs, spec)
    result.seconds = time.perf_counter() - t0
    return result


# ----------------------------------------------------------------------------
# Attention probes for the CLI, the demo and the docs
# ----------------------------------------------------------------------------


def generic_attention(cfg: AttentionConfig, seed: int = 0, weight_scale: float = 1.0) -> MultiHeadAttention:
    """A float64 layer with generic Gaussian weights (``std = weight_scale / sqrt(fan_in)``), biases and PE rows."""
    torch.manual_seed(seed)
    layer = MultiHeadAttention(cfg).double()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, prm in layer.named_parameters():
            fan_in = prm.shape[-1] if prm.dim() > 1 and not name.startswith("pos_emb") else 1
            std = weight_scale / math.sqrt(fan_in) if prm.dim() > 1 else 0.5
            prm.copy_(torch.randn(prm.shape, generator=gen, dtype=torch.float64) * std)
    return layer


def probe_batch(cfg: AttentionConfig, seq_len: int, ratio: float = 2.0) -> int:
    """Batch size giving at least ``ratio`` times as many outputs as parameters."""
    return max(1, math.ceil(ratio * attention_parameter_count(cfg) / (seq_len * cfg.d_model)))


def probe_attention(cfg: AttentionConfig, seq_len: int, batch: int | None = None, *, seed: int = 0,
                    method: str = "auto", probes: int = 16, tol: float | None = None,
                    maxiter: int = 2000) -> ProbeResult:
    """Probe a generic :class:`MultiHeadAttention` with ``cfg`` on random ``(batch, seq_len, D)`` inputs."""
    if seq_len <= 0:
        raise SymalignError(f"seq_len must be positive, got {seq_len}")
    if cfg.pe in ("sinusoidal", "learned") and seq_len > cfg.max_len:
        raise SymalignError(f"seq_len={seq_len} exceeds max_len={cfg.max_len}")
    batch = probe_batch(cfg, seq_len) if batch is None else batch
    if batch <= 0:
        raise SymalignError(f"batch must be positive, got {batch}")
    layer = generic_attention(cfg, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, seq_len, cfg.d_model, generator=gen, dtype=torch.float64)
    return probe(layer, x, method=method, probes=probes, seed=seed, tol=tol, maxiter=maxiter)


TOUR: tuple[tuple[str, dict], ...] = (
    ("none", dict(pe="none")),
    ("sinusoidal", dict(pe="sinusoidal")),
    ("learned", dict(pe="learned")),
    ("rope (half)", dict(pe="rope", rope_pairing="half")),
    ("rope (interleaved)", dict(pe="rope", rope_pairing="interleaved")),
    ("partial rope (r=2/4)", dict(pe="rope", rotary_fraction=0.5)),
    ("alibi", dict(pe="alibi")),
    ("gqa (h=4, h_kv=2)", dict(pe="none", n_heads=4, n_kv_heads=2)),
    ("gqa + rope", dict(pe="rope", n_heads=4, n_kv_heads=2)),
)
"""The probe tour's variants (overrides of a small base config)."""


def probe_tour(d_model: int = 8, n_heads: int = 2, head_dim: int = 4, seq_len: int = 6, seed: int = 0,
               biases: Sequence[bool] = (False, True), variants: Sequence[str] | None = None) -> list[dict]:
    """Dense probes of every tour variant, with and without biases (a few seconds at the defaults).

    Returns one dict per row: variant, bias, config, measured nullity, predicted,
    breakdown, group description, head permutations preserved, match, seconds.
    """
    rows = []
    for label, over in TOUR:
        if variants is not None and label not in variants:
            continue
        for bias in biases:
            kw = dict(d_model=d_model, n_heads=n_heads, head_dim=head_dim, bias=bias, max_len=seq_len)
            kw.update(over)
            cfg = AttentionConfig(**kw)
            res = probe_attention(cfg, seq_len, seed=seed, method="dense")
            rows.append({"variant": label, "bias": bias, "config": cfg.to_dict(), "nullity": int(res.nullity),
                         "predicted": res.predicted, "breakdown": res.breakdown, "parameters": res.parameters,
                         "outputs": res.outputs, "singular_value_gap": res.to_dict()["singular_value_gap"],
                         "group": res.group, "head_permutations_preserved": res.head_permutations_preserved,
                         "match": res.match, "seconds": round(res.seconds, 3)})
    return rows
