r""":func:`trace`: the exact :class:`~symalign.spec.SymmetrySpec` of a PyTorch module, from its graph.

The module is exported with :func:`torch.export.export` (a float64 copy, in eval
mode, on the example inputs) and every axis of every tensor is labelled
(:mod:`symalign.tracing.graph`). The spec then holds

* per ``scaled_dot_product_attention`` call ``i`` (``nn.MultiheadAttention`` with
  ``need_weights=False``, ``nn.TransformerEncoderLayer``, hand-written attention):
  ``heads.i`` (``S_h``, ``S_{h_kv} wr S_g`` under GQA), ``qk.i`` (``GL(d_h)`` per K/V
  head, or ``H(r) (+) GL(d_h - r)`` when a RoPE rotation is found between the
  projections and the attention) and ``vo.i`` (``GL(d_h)``), labelled exactly as
  :func:`symalign.arch.base.layout_spec` labels them (fused projections as segments);
* ``ff.k``: the hidden units of a Linear, or the output channels of a convolution, between
  elementwise nonlinearities, norms and pooling (``S_n``; positive monomials for ReLU/LeakyReLU
  and max pooling; the channel-group-preserving groups of :mod:`symalign.tracing.blocks` for
  grouped convolutions and GroupNorm; see :mod:`symalign.tracing.conv`);
* ``residual`` (``residual.k`` if several, e.g. one per ResNet stage): a stream that additions,
  concatenations or embeddings tie together, with its norms' gains and biases (``S_D`` under affine
  norms and BatchNorm, ``O(D)`` under gainless RMSNorm, ``O_1(D)`` under LayerNorm without affine);
* tied weights under every name the state dict uses for them.

What the tracer cannot prove exact is left out and listed in
:attr:`TraceResult.skipped`; :attr:`TraceResult.coverage` (:class:`Coverage`) gives the
fraction of the parameters the spec moves and the parts left unchanged. Before returning,
a random element of the spec is
applied to the float64 copy: if the output moves by more than ``tol`` (relative),
:class:`~symalign.errors.SpecError` names the space and its layer.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

import torch
from torch import Tensor, nn

from symalign.errors import ConfigError, SpecError
from symalign.groups import GeneralLinear, HeadPermutation, Orthogonal, PerHead, Permutation, PositiveMonomial
from symalign.groups import CenteredOrthogonal
from symalign.spec import SymmetrySpec, apply, sample
from symalign.tracing.blocks import BlockWreath, WithinBlocks, WithinBlocksMonomial
from symalign.tracing.common import layer_of, op_name
from symalign.tracing.graph import Walker
from symalign.tracing.labels import OUTPUT, OUTPUT_REASON
from symalign.tolerance import TOLERANCE, tolerance

F64_TOL = TOLERANCE[torch.float64]


@dataclass
class Skipped:
    """A part of the model left out of the spec: ``layer`` (module path) and why.

    ``kind``: ``"output"`` for a feature axis that is the model's output (no symmetry can move
    it: the function is observed there), ``"left"`` for everything else (an operation the
    tracer does not recognise, a fixed buffer along the features, a layer it cannot express).
    """

    layer: str
    reason: str
    kind: str = "left"

    def __str__(self) -> str:
        return f"{self.layer}: {self.reason}"


@dataclass
class Coverage:
    """How much of the model an alignment moves.

    ``aligned`` of ``total`` floating state-dict entries (parameters and buffers such as
    BatchNorm statistics) lie in tensors that some declared space acts on; ``unchanged``
    names the floating tensors no space acts on; ``left`` lists the parts left unchanged
    that are not the model's output (:class:`Skipped` of kind ``"left"``, and spaces left
    out by the chosen scope). Nothing is *left* when ``left`` is empty: what stays unchanged
    then only touches the model's output axes (e.g. the last layer's bias).
    """

    aligned: int
    total: int
    unchanged: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)

    @property
    def fraction(self) -> float:
        return self.aligned / self.total if self.total else 1.0

    def summary(self) -> str:
        """One line: the aligned fraction and the parts left unchanged."""
        pct = math.floor(10000 * self.fraction) / 100  # rounded down: 100% only when everything moves
        head = f"aligned {pct:.2f}% of the parameters ({self.aligned} of {self.total} entries); "
        if not self.left:
            return head + "left unchanged: nothing" + (" but the model's output axes" if self.unchanged else "")
        shown = "; ".join(self.left[:3]) + (f"; and {len(self.left) - 3} more" if len(self.left) > 3 else "")
        return head + f"left unchanged: {len(self.left)} part{'s' if len(self.left) > 1 else ''}: {shown}"

    def to_dict(self) -> dict[str, Any]:
        return {"aligned": self.aligned, "total": self.total, "fraction": self.fraction,
                "unchanged": list(self.unchanged), "left": list(self.left), "summary": self.summary()}


def coverage_of(spec: SymmetrySpec, state: Mapping[str, Tensor], skipped: list[Skipped],
                extra_left: list[str] | None = None) -> Coverage:
    """The :class:`Coverage` of ``spec`` on ``state`` (``extra_left``: further parts left, e.g. by a scope)."""
    acted = set(spec.tensors)
    floating = {k: v for k, v in state.items() if isinstance(v, Tensor) and v.is_floating_point()}
    aligned = sum(v.numel() for k, v in floating.items() if k in acted)
    unchanged = sorted(k for k in floating if k not in acted)
    left = [str(s) for s in skipped if s.kind != "output"] + list(extra_left or [])
    return Coverage(aligned, sum(v.numel() for v in floating.values()), unchanged, left)


@dataclass
class TraceResult:
    """The traced spec, what was left out, and the functional check."""

    spec: SymmetrySpec
    skipped: list[Skipped]
    layers: dict[str, str]  # space name -> module path
    notes: list[str] = field(default_factory=list)
    function_change: float = 0.0  # relative output change under a random element (float64)
    tolerance: float = F64_TOL  # what the check accepted (raised when the model computes in lower precision)
    coverage: Coverage | None = None  # how much of the model the spec moves (Coverage)

    def to_dict(self) -> dict[str, Any]:
        return {"spaces": self.spec.describe(), "layers": dict(self.layers),
                "skipped": [asdict(s) for s in self.skipped], "notes": list(self.notes),
                "function_change": self.function_change, "tolerance": self.tolerance,
                "coverage": self.coverage.to_dict() if self.coverage is not None else None}


def split_inputs(example_inputs, example_kwargs: dict | None = None) -> tuple[tuple, dict]:
    """``(args, kwargs)``: a dict of example inputs is taken as keyword inputs (``{"input_ids": ids}``)."""
    if isinstance(example_inputs, Mapping):
        return (), {**dict(example_inputs), **dict(example_kwargs or {})}
    return _as_args(example_inputs), dict(example_kwargs or {})


def _as_args(example_inputs) -> tuple:
    if isinstance(example_inputs, tuple):
        return example_inputs
    if isinstance(example_inputs, list):
        return tuple(example_inputs)
    return (example_inputs,)


def _to64(x):
    if isinstance(x, Tensor) and x.is_floating_point():
        return x.to(torch.float64)
    if isinstance(x, (tuple, list)):
        return type(x)(_to64(y) for y in x)
    if isinstance(x, dict):
        return {k: _to64(v) for k, v in x.items()}
    return x


def flat_tensors(out) -> list[Tensor]:
    """Every floating tensor in a model output (tensors, tuples, dicts, ``ModelOutput``)."""
    if isinstance(out, Tensor):
        return [out] if out.is_floating_point() else []
    if isinstance(out, Mapping):
        return [t for v in out.values() for t in flat_tensors(v)]
    if isinstance(out, (tuple, list)):
        return [t for v in out for t in flat_tensors(v)]
    return []


def aliases(model: nn.Module) -> dict[str, list[str]]:
    """Every state-dict name of each parameter, keyed by each of its names (tied weights)."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return {n: names for names in by_id.values() for n in names}


def _evaluate(ep, args: tuple, kwargs: dict) -> dict:
    """Every node's value on the example inputs."""
    leaves = iter(torch.utils._pytree.tree_flatten((args, kwargs))[0])
    sd, consts = ep.state_dict, ep.constants
    flat = []
    for spec in ep.graph_signature.input_specs:
        kind = spec.kind.name
        if kind == "USER_INPUT":
            flat.append(next(leaves))
        elif spec.target in sd:
            flat.append(sd[spec.target])
        else:
            flat.append(consts[spec.target])

    class Capture(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            env[n] = out
            return out

    env: dict = {}
    with torch.no_grad():
        Capture(ep.graph_module, garbage_collect_values=False).run(*flat)
    return env


def export(model: nn.Module, args: tuple, kwargs: dict):
    try:
        return torch.export.export(model, args, kwargs, strict=False)
    except Exception as e:  # noqa: BLE001 -- torch raises many kinds; the user needs one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"torch.export could not trace {type(model).__name__} on the example inputs "
                          f"({type(e).__name__}: {first[:300]}); make the forward traceable (no data-dependent "
                          "Python control flow) or pass inputs it accepts") from e


def trace(model: nn.Module, example_inputs, example_kwargs: dict | None = None, *, check: bool = True,
          tol: float = F64_TOL, seed: int = 0) -> TraceResult:
    """The exact symmetry spec of ``model`` (see the module docstring).

    Args:
        model: any ``nn.Module`` built from standard layers (it is not modified).
        example_inputs: a tensor, a tuple of positional inputs or a dict of keyword inputs (small is
            enough); floating inputs are cast to float64.
        example_kwargs: keyword inputs (e.g. ``{"use_cache": False}`` for a HF model).
        check: apply a random element and compare outputs (float64), refusing on failure.
        tol: the largest relative output change accepted by the check.
        seed: seed of the random element and of the position-map probes.

    Raises:
        ConfigError: the module cannot be exported on these inputs.
        SpecError: the check failed (names the space and the layer).
    """
    m64 = copy.deepcopy(model).to(torch.float64).eval()
    args, kwargs = split_inputs(example_inputs, example_kwargs)
    args, kwargs = _to64(args), _to64(kwargs)
    ep = export(m64, args, kwargs)
    env = _evaluate(ep, args, kwargs)
    gen = torch.Generator().manual_seed(int(seed))
    walker = Walker(ep, aliases(m64), env, gen)
    walker.run()
    spec, skipped, layers, notes = build_spec(walker)
    result = TraceResult(spec, skipped, layers, notes)
    result.coverage = coverage_of(spec, m64.state_dict(), skipped)
    if walker.low_precision:
        floor = max(tolerance(d) for d in walker.low_precision)  # the table of symalign.tolerance
        if floor > tol:
            notes.append(f"the model casts features to {', '.join(sorted(str(d) for d in walker.low_precision))} "
                         f"inside its forward, so the float64 check resolves only {floor:.0e} (relative)")
            tol = floor
    result.tolerance = tol
    if check:
        result.function_change = check_spec(m64, spec, layers, args, kwargs, tol=tol, seed=seed)
    return result


# ----------------------------------------------------------------------------
# from labels to a spec
# ----------------------------------------------------------------------------


def _pin_all(walker: Walker) -> None:
    sp = walker.sp
    for node, touched in walker.opaque.items():
        if node in walker.explained and node not in walker.unexplainable:
            continue
        what = "the model's output" if node.op == "output" else f"{op_name(node)}"
        for sid in touched:
            sp.pin(sid, layer_of(node) if node.op != "output" else "(output)",
                   f"{what} acts on this feature axis in a way the tracer does not recognise as a symmetry")
    for pa, reason in sp.fixed.items():
        if pa in sp.bind:
            sp.pin(sp.bind[pa], sp.get(sp.bind[pa]).layer, f"{pa[0]} axis {pa[1]} {reason}")
    for pa, uses in sp.bind_uses.items():
        if pa in sp.bind and len({v for _, v in uses}) > 1:
            sp.restrict(sp.bind[pa], {"o", "o1", "perm"})
            sp.get(sp.bind[pa]).notes.append(f"{pa[0]} is tied and used on both sides (no scaling)")
    laid_out = {sp.find(sid) for pa, sid in sp.bind.items() if sp.layout.get(pa)}
    for s in sp.items.values():  # a segment of a space that is read flattened (blockwise): not expressible
        if s.parent is not None and sp.find(s.parent) in laid_out:
            sp.pin(s.sid, s.layer, "segment of a feature space that is also read flattened (blockwise)")
    changed = True
    while changed:  # segments of a space used whole, or of a pinned space, are pinned too
        changed = False
        for s in sp.items.values():
            if s.parent is None or sp.get(s.sid).pinned:
                continue
            parent = sp.get(s.parent)
            if parent.pinned or parent.uses:
                why = parent.pinned[0][1] if parent.pinned else "the fused projection is also used whole"
                sp.pin(s.sid, s.layer, f"segment of a fused projection: {why}")
                changed = True


def _actions(walker: Walker, root: int) -> list[tuple[str, int, str, tuple | None]]:
    sp = walker.sp
    out = []
    for pa, sid in sp.bind.items():
        if sp.find(sid) != root:
            continue
        uses = list(sp.bind_uses[pa])
        for name in walker.aliases.get(pa[0], [pa[0]]):
            if name not in {n for n, _ in uses}:
                uses.append((name, uses[0][1]))
        for name, var in uses:
            for seg in sp.layout.get(pa) or (None,):  # a flattened convolution output: one action per block
                out.append((name, pa[1], var, seg))
    for s in sp.items.values():  # every segment merged into this space (GLU: both halves of one projection)
        if s.parent is not None and sp.find(s.sid) == root and sp.find(s.parent) != root:
            for name, axis, var, seg in _actions(walker, sp.find(s.parent)):
                out.append((name, axis, var, (s.offset + (seg[0] if seg else 0), s.n)))
    seen, uniq = set(), []
    for a in out:
        if a not in seen:
            seen.add(a)
            uniq.append(a)
    return uniq


def _attention_ok(walker: Walker, att) -> str | None:
    sp = walker.sp
    fatal = [p for p in att.problems if not p.startswith(("heads not permuted", "Q-K not aligned"))]
    if fatal:
        return fatal[0]
    for role, sid in (("query", att.q), ("key", att.k), ("value", att.v)):
        s = sp.get(sid)
        if s.pinned:
            return f"the {role} projection: {s.pinned[0][1]}"
        if s.uses != ["sdpa"]:
            return f"the {role} projection is also used outside the attention ({', '.join(s.uses)})"
        if "gl" not in s.allowed or s.kind not in ("hidden", "segment") or s.stream:
            return f"the {role} projection is not a plain Linear output"
        if not _actions(walker, sp.find(sid)):
            return f"the {role} projection has no weight"
    o = sp.get(att.o)
    if o.pinned:
        return f"the attention output: {o.pinned[0][1]}"
    if not o.uses or set(o.uses) != {"linear_in"}:
        return f"the attention output is used by {', '.join(o.uses) or 'nothing'} (expected one Linear)"
    return None


def build_spec(walker: Walker) -> tuple[SymmetrySpec, list[Skipped], dict[str, str], list[str]]:
    """The spec, the skipped parts, the layer of each space and notes (see the module docstring)."""
    _pin_all(walker)
    spec = SymmetrySpec()
    skipped: list[Skipped] = []
    layers: dict[str, str] = {}
    notes: list[str] = []
    skipped.extend(Skipped(layer, reason) for layer, reason in walker.failed)
    claimed = _declare_attention(walker, spec, skipped, layers)
    _skip_unrecognised(walker.sp, skipped)
    streams, units = _free_axes(walker, claimed, skipped)
    _declare_axes(spec, streams, units, skipped, layers, notes)
    return spec, skipped, layers, notes


def _declare_attention(walker: Walker, spec: SymmetrySpec, skipped: list[Skipped], layers: dict[str, str]) -> set:
    """Declare the spaces of every attention layer the walker found (``heads.i``, ``qk.i``, ``vo.i``) and their
    actions; a layer that cannot be aligned is skipped with its reason. Returns the roots of the Q/K/V/O axes."""
    sp = walker.sp
    claimed: set[int] = set()
    for i, att in enumerate(walker.attention):
        bad = _attention_ok(walker, att)
        roots = [sp.find(s) for s in (att.q, att.k, att.v, att.o)]
        claimed |= set(roots)
        if bad is not None:
            skipped.append(Skipped(att.layer, f"attention not aligned: {bad}"
                                   + "".join(f"; {p}" for p in att.problems if p != bad)))
            continue
        for p in att.problems:
            skipped.append(Skipped(att.layer, p))
        _attention_spaces(walker, spec, att, i, layers)
    return claimed


def _attention_spaces(walker: Walker, spec: SymmetrySpec, att, i: int, layers: dict[str, str]) -> None:
    """Layer ``i``'s head permutation (coupled to its blocks, when the heads may be permuted), its per-head Q/K
    block (when the walker found one) and V/O block ``GL(d)``, and their actions on the Q, K, V and O axes (K's
    contravariant to Q's)."""
    sp = walker.sp
    heads, qk, vo = f"heads.{i}", f"qk.{i}", f"vo.{i}"
    h, kv, d = att.n_heads, att.n_kv, att.head_dim
    if att.heads_ok:
        spec.add_space(heads, HeadPermutation(h, d, kv), role="heads", layer=i)
    if att.qk is not None:
        spec.add_space(qk, PerHead(att.qk, kv), role="qk", layer=i)
    spec.add_space(vo, PerHead(GeneralLinear(d), kv), role="vo", layer=i)
    if att.heads_ok:
        spec.couple(heads, *([qk] if att.qk is not None else []), vo)
    for name in (heads, qk, vo):
        if name in spec.spaces:
            layers[name] = att.layer
    for sid, block, flip, rep in ((att.q, qk, False, "query"), (att.k, qk, True, "kv"),
                                  (att.v, vo, False, "kv"), (att.o, vo, False, "query")):
        for tensor, axis, var, seg in _actions(walker, sp.find(sid)):
            if att.heads_ok:
                spec.act_on(tensor, heads, axis, "co", rep, seg)
            if block in spec.spaces:
                v = ("contra" if var == "co" else "co") if flip else var
                spec.act_on(tensor, block, axis, v, rep, seg)


def _skip_unrecognised(sp, skipped: list[Skipped]) -> None:
    """A parameter fixed because it reaches an operation the tracer does not recognise (and bound to no axis) is
    reported as skipped, once per parameter."""
    unrecognised = sorted({pa[0] for pa, why in sp.fixed.items() if why.startswith("reaches")
                           and not any(b[0] == pa[0] for b in sp.bind)})
    for name in unrecognised:
        skipped.append(Skipped(name.rsplit(".", 1)[0] if "." in name else "(model)",
                               f"{name} {sp.fixed[next(pa for pa in sp.fixed if pa[0] == name)]}: "
                               "an operation the tracer does not recognise; left unchanged"))


def _free_axes(walker: Walker, claimed: set, skipped: list[Skipped]) -> tuple[list, list]:
    """The feature axes outside attention that act on some parameter, in trace order, split into residual
    streams and unit (feed-forward) axes, each with its actions; a pinned axis is skipped with its reason."""
    streams, units = [], []
    for s in sorted(walker.sp.roots(), key=lambda s: s.order):
        if s.sid in claimed or s.split:
            continue
        acts = _actions(walker, s.sid)
        if not acts:
            continue
        if s.pinned:
            layer, reason = s.pinned[0]
            kind = "output" if all(p == (OUTPUT, OUTPUT_REASON) for p in s.pinned) else "left"
            skipped.append(Skipped(layer, f"feature axis of width {s.n} ({s.layer}) not declared: {reason}", kind))
            continue
        (streams if s.stream else units).append((s, acts))
    return streams, units


def _declare_axes(spec: SymmetrySpec, streams: list, units: list, skipped: list[Skipped], layers: dict[str, str],
                  notes: list[str]) -> None:
    """Declare each free axis as a space of its exact group (:func:`_group`): ``residual`` (or ``residual.k`` for
    several separate streams) and ``ff.k``, with its actions and notes; an axis without an exact group is
    skipped."""
    for kind, items in (("residual", streams), ("ff", units)):
        for k, (s, acts) in enumerate(items):
            name = "residual" if kind == "residual" and len(items) == 1 else f"{kind}.{k}"
            group = _group(s, notes, name)
            if group is None:
                skipped.append(Skipped(s.layer, f"feature axis of width {s.n}: no exact group"))
                continue
            if kind == "ff":
                spec.add_space(name, group, role="ff", layer=k)
            elif name == "residual":
                spec.add_space(name, group, role="residual")
            else:  # several separate streams: each solved as a space of its own (by its group)
                spec.add_space(name, group)
            layers[name] = s.layer
            declared = set()
            for tensor, axis, var, seg in acts:  # "perm": a BatchNorm's input side (tracing.conv): no scales
                if var == "perm":
                    var, rep = "co", ("perm" if group.scales_units else None)
                else:
                    rep = None
                if (tensor, axis, var, rep, seg) not in declared:
                    declared.add((tensor, axis, var, rep, seg))
                    spec.act_on(tensor, name, axis, var, rep, seg)
            notes.extend(f"{name}: {n}" for n in s.notes)


def _group(s, notes: list[str], name: str):
    a = s.allowed
    if s.blocks > 1:  # grouped convolutions / GroupNorm: permutations that keep the channel groups
        if s.blocks == s.n and s.in_place:
            return WithinBlocksMonomial(s.n, blocks=s.n) if "posmon" in a else None
        if "posmon" in a and s.in_place:
            return WithinBlocksMonomial(s.n, blocks=s.blocks)
        if "perm" in a or "posmon" in a:
            return WithinBlocks(s.n, blocks=s.blocks) if s.in_place else BlockWreath(s.n, blocks=s.blocks)
        return None
    if "gl" in a:
        notes.append(f"{name}: only linear maps act on it, so GL({s.n}) is exact; O({s.n}) is declared "
                     "(the matchers solve orthogonal and permutation spaces)")
        return Orthogonal(s.n)
    if "o" in a:
        return Orthogonal(s.n)
    if "o1" in a:
        return CenteredOrthogonal(s.n)
    if "posmon" in a:
        return PositiveMonomial(s.n)
    if "perm" in a:
        return Permutation(s.n)
    return None


# ----------------------------------------------------------------------------
# the functional check
# ----------------------------------------------------------------------------


def _run(model: nn.Module, args: tuple, kwargs: dict) -> list[Tensor]:
    with torch.no_grad():
        return [t.detach().clone() for t in flat_tensors(model(*args, **kwargs))]


def function_change(model: nn.Module, state: Mapping[str, Tensor], args: tuple, kwargs: dict,
                    reference: list[Tensor]) -> float:
    """``max |y' - y| / max |y|`` over every output tensor, with ``state`` loaded into ``model``."""
    model.load_state_dict(dict(state), strict=False)
    out = _run(model, args, kwargs)
    if len(out) != len(reference):
        return float("inf")
    num = max((float((a - b).abs().max()) for a, b in zip(out, reference) if a.numel()), default=0.0)
    den = max((float(b.abs().max()) for b in reference if b.numel()), default=0.0)
    return num / den if den > 0 else num


def check_spec(model: nn.Module, spec: SymmetrySpec, layers: Mapping[str, str], args: tuple, kwargs: dict, *,
               tol: float = F64_TOL, seed: int = 0) -> float:
    """Apply a random element of ``spec`` to the float64 ``model``; refuse (:class:`SpecError`) if its output moves.

    On failure each space is tried alone, and the error names the first one that moves
    the output and its layer. ``model`` is restored before returning.
    """
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ref = _run(model, args, kwargs)
    try:
        change = function_change(model, apply(spec, sample(spec, seed), state), args, kwargs, ref)
        if change <= tol:
            return change
        for name in spec.spaces:
            sub = spec.restrict([name] + list(spec.couplings.get(name, ())))
            c = function_change(model, apply(sub, sample(sub, seed + 1), state), args, kwargs, ref)
            if c > tol:
                raise SpecError(f"the traced symmetry {name!r} ({spec.spaces[name].describe()}) of layer "
                                f"{layers.get(name, '?')} changes the function by {c:.1e} (relative, float64): the "
                                "tracer misread this layer; exclude it or report the layer")
        raise SpecError(f"a random element of the traced spec changes the function by {change:.1e} (relative, "
                        "float64), although each space alone keeps it")
    finally:
        model.load_state_dict(state)
