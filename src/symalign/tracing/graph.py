r"""Walk an exported ATen graph and label every tensor axis (see :mod:`symalign.tracing.labels`).

Each node gets a :class:`Val`: its axis labels, or ``labels=None`` for an *opaque*
value (an operation the tracer does not recognise touched a feature axis). Opaque
values remember their *roots* (the last recognised values they came from) and the
opaque nodes on the way, so that a RoPE-like position map between a head split and
``scaled_dot_product_attention`` can be identified numerically
(:mod:`symalign.tracing.positions`) and its nodes *explained*; every opaque node left
unexplained pins the spaces it touched.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from symalign.tracing.attention import Attention, AttentionRule
from symalign.tracing.common import LOW, Opaque, Val, flat, layer_of, op_name, shape_of, tensor_args
from symalign.tracing.conv import SPATIAL, ConvRule
from symalign.tracing.labels import OUTPUT, OUTPUT_REASON, Labels, Spaces, axis_size, data, regroup

HOMOGENEOUS = {"relu", "leaky_relu"}  # f(s z) = s f(z) for s > 0
ELEMENTWISE = {"gelu", "silu", "tanh", "sigmoid", "elu", "selu", "celu", "softplus", "mish", "hardtanh", "relu6",
               "hardswish", "hardsigmoid", "exp", "log", "sqrt", "rsqrt", "pow", "abs", "sin", "cos", "erf",
               "reciprocal", "square", "clamp", "clamp_min", "clamp_max", "log_sigmoid", "softsign", "tanhshrink",
               "_softmax", "softmax", "log_softmax", "_log_softmax", "sign", "erfc", "expm1", "log1p", "sgn",
               "gelu_", "relu_", "silu_"}
IDENTITY = {"clone", "contiguous", "alias", "detach", "lift_fresh_copy", "_to_copy", "to", "type_as",
            "_assert_tensor_metadata"}
INPLACE = {f"{op}_" for op in ("add", "sub", "mul", "div", "relu", "leaky_relu", "hardtanh", "elu", "gelu", "silu",
                                "sigmoid", "tanh", "clamp", "clamp_min", "clamp_max")}
LAYOUT = {"view", "reshape", "_unsafe_view", "flatten", "unflatten", "view_as", "reshape_as"}


class Walker(AttentionRule, ConvRule):
    """Labels the graph of a :class:`torch.export.ExportedProgram` (``run``), then exposes the results."""

    def __init__(self, ep, aliases: dict[str, list[str]], env: dict, gen: torch.Generator):
        self.ep = ep
        self.aliases = aliases  # canonical parameter name -> every state-dict name of that tensor
        self.env = env  # node -> value on the example inputs (for position maps and masks)
        self.gen = gen
        self.sp = Spaces()
        self.vals: dict = {}
        self.opaque: dict = {}  # node -> set of spaces it touched
        self.explained: set = set()
        self.attention: list[Attention] = []
        self.low_precision: set = set()  # dtypes below float64 that feature values are cast to
        self.failed: list[tuple[str, str]] = []  # (layer, reason) of attention calls not recognised
        self.param_of: dict[str, str] = {}
        self.buffer_of: dict[str, tuple[str, bool]] = {}  # placeholder -> (state-dict name, persistent)
        self.unexplainable: set = set()  # in-place writes into a tensor that is also read elsewhere

    # -- helpers -------------------------------------------------------------
    def name_for(self, param: str, node) -> str:
        """The state-dict name of ``param`` as the module running ``node`` calls it (tied weights)."""
        names = self.aliases.get(param, [param])
        layer = layer_of(node)
        for nm in names:
            if nm.rsplit(".", 1)[0] == layer:
                return nm
        return names[0]

    def val(self, a) -> Val | None:
        if isinstance(a, torch.fx.Node):
            v = self.vals.get(a)
            return v if isinstance(v, Val) else None
        return None

    def sids(self, labels: Labels) -> set[int]:
        return {self.sp.find(a[1]) for ax in labels for a in ax if a[0] == "f"}

    def params(self, labels: Labels) -> set:
        return {pa for ax in labels for a in ax if a[0] == "p" for pa in a[1]}

    def make_opaque(self, node, inputs: list[Val], why: str | None = None) -> Val:
        roots, opq, touched = set(), {node}, set()
        for src, v in inputs:
            if v is None:
                continue
            if v.labels is None:
                roots |= v.roots
                opq |= v.opq
                for r in v.roots:
                    rv = self.vals.get(r)
                    if rv is not None and rv.labels is not None:
                        touched |= self.sids(rv.labels)
            else:
                s = self.sids(v.labels)
                if s:
                    roots.add(self.root_of(src))
                    touched |= s
                for pa in self.params(v.labels):
                    self.sp.fix(pa, f"reaches {op_name(node)} at {layer_of(node)}")
        self.opaque[node] = touched
        return Val(None, frozenset(roots), frozenset(opq))

    def root_of(self, node):
        while isinstance(node, torch.fx.Node) and op_name(node) in IDENTITY | {"dropout"} and node.args and \
                isinstance(node.args[0], torch.fx.Node) and shape_of(node.args[0]) == shape_of(node):
            node = node.args[0]
        return node

    def full_atom(self, ax) -> int | None:
        """The space ``ax`` indexes entirely (a single atom ``(sid, 1, n)``), else None."""
        if len(ax) == 1 and ax[0][0] == "f":
            s = self.sp.get(ax[0][1])
            if ax[0][2] == 1 and ax[0][3] == s.n:
                return s.sid
        return None

    def blockwise(self, ax) -> tuple[int, tuple] | None:
        """``(space, segments)`` when ``ax`` is one whole space times data axes on one side: the flattened
        ``(C, H, W)`` of a convolution output (C-major: channel ``c`` is the block ``c HW .. (c+1) HW - 1``,
        the segments ``(j, 1, HW)``, one per spatial position ``j``) or a channels-last ``(H, W, C)``
        (the segments ``(j C, C)``). Else None."""
        feats = [i for i, a in enumerate(ax) if a[0] != "d"]
        if len(feats) != 1 or ax[feats[0]][0] != "f":
            return None
        i = feats[0]
        a = ax[i]
        n = self.sp.get(a[1]).n
        if a[2] != 1 or a[3] != n:
            return None
        before = axis_size(ax[:i])
        after = axis_size(ax[i + 1:])
        if before == 1:
            return self.sp.find(a[1]), tuple((j, 1, after) for j in range(after))
        if after == 1:
            return self.sp.find(a[1]), tuple((j * n, n) for j in range(before))
        return None

    def param_atom(self, ax):
        if len(ax) == 1 and ax[0][0] == "p":
            return ax[0]
        return None

    # -- the walk ------------------------------------------------------------
    def run(self) -> None:
        sig = self.ep.graph_signature
        kinds = {s.arg.name: s for s in sig.input_specs if hasattr(s.arg, "name")}
        for node in self.ep.graph.nodes:
            try:
                self.vals[node] = self.visit(node, kinds)
            except Opaque as e:
                ins = [(a, self.val(a)) for a in tensor_args(node)]
                self.vals[node] = self.make_opaque(node, ins, str(e))

    def visit(self, node, kinds) -> Any:
        if node.op == "placeholder":
            spec = kinds.get(node.name)
            shape = shape_of(node)
            if shape is None:
                return None
            if spec is not None and spec.kind.name == "PARAMETER":
                self.param_of[node.name] = spec.target
                return Val(tuple((("p", frozenset({(spec.target, i)}), int(s)),) for i, s in enumerate(shape)))
            if spec is not None and spec.kind.name in ("BUFFER", "CONSTANT_TENSOR"):
                if spec.kind.name == "BUFFER":
                    self.buffer_of[node.name] = (spec.target, bool(getattr(spec, "persistent", True)))
                return Val(data(shape), const=True)
            return Val(data(shape))
        if node.op == "output":
            for a in flat(node.args):
                v = self.val(a)
                if v is None:
                    continue
                if v.labels is None:
                    self.opaque.setdefault(node, set()).update(
                        *[self.sids(self.vals[r].labels) for r in v.roots
                          if self.vals.get(r) is not None and self.vals[r].labels])
                    continue
                for sid in self.sids(v.labels):
                    self.sp.pin(sid, OUTPUT, OUTPUT_REASON)
                for pa in self.params(v.labels):
                    self.sp.fix(pa, "is returned by the model")
            return None
        if node.op != "call_function":
            return None
        name = op_name(node)
        if name in ("_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range_for_size"):
            return None  # checks only: no value
        ins = [(a, self.val(a)) for a in tensor_args(node)]
        if name.endswith("_") and node.args and isinstance(node.args[0], torch.fx.Node) and \
                len(node.args[0].users) > 1:  # the other readers of args[0] would see the write: never explained
            self.unexplainable.add(node)
        if any(v is not None and v.labels is None for _, v in ins) and name not in ("getitem",
                                                                                   "scaled_dot_product_attention"):
            if name in ("linear", "addmm", "matmul", "mm"):  # fresh output units; the input side stays fixed
                out = self.fresh_linear(node, name, ins)
                if out is not None:
                    return out
            return self.make_opaque(node, ins)
        if name in INPLACE:  # ``out += identity``, ``nn.ReLU(inplace=True)``: labelled as the out-of-place op
            name = name[:-1]
        handler = getattr(self, f"op_{name}", None)
        if name in HOMOGENEOUS or name in ELEMENTWISE:
            return self.elementwise(node, name)
        if name in IDENTITY:
            return self.identity(node)
        if name in LAYOUT:
            return self.layout(node)
        if name in SPATIAL:
            return self.spatial(node, name)
        if handler is not None:
            return handler(node)
        return self.generic(node, ins)

    def generic(self, node, ins) -> Any:
        """Anything unrecognised: data in -> data out; a feature or parameter axis in -> opaque."""
        if all(v is None or (not self.sids(v.labels) and not self.params(v.labels)) for _, v in ins):
            const = all(v is None or v.const for _, v in ins)
            mv = node.meta.get("val")
            if isinstance(mv, Tensor):
                return Val(data(mv.shape), const=const)
            if isinstance(mv, (tuple, list)):
                return [Val(data(x.shape), const=const) if isinstance(x, Tensor) else None for x in mv]
            return None
        raise Opaque(op_name(node))

    # -- elementwise and layout ----------------------------------------------
    def elementwise(self, node, name) -> Val:
        v = self.val(node.args[0])
        if v is None:
            return self.generic(node, [])
        kinds = {"posmon", "perm"} if name in HOMOGENEOUS else {"perm"}
        for sid in self.sids(v.labels):
            self.sp.restrict(sid, kinds)
            self.sp.use(sid, name)
        if self.params(v.labels):
            raise Opaque(name)
        return Val(v.labels, const=v.const)

    def identity(self, node) -> Val:
        if op_name(node) == "_assert_tensor_metadata":
            return None
        v = self.val(node.args[0])
        mv = node.meta.get("val")
        if isinstance(mv, Tensor) and mv.dtype in LOW and v is not None and self.sids(v.labels):
            self.low_precision.add(mv.dtype)
        if v is None:
            return None
        if shape_of(node) != shape_of(node.args[0]):
            raise Opaque(op_name(node))
        return Val(v.labels, const=v.const)

    def op_feature_dropout(self, node) -> Val:  # nn.Dropout2d/3d
        return self.op_dropout(node)

    op_alpha_dropout = op_feature_dropout
    op_feature_alpha_dropout = op_feature_dropout

    def op_dropout(self, node) -> Val:
        p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
        if train and p:
            raise Opaque("dropout in training mode")
        return self.identity(node)

    def layout(self, node) -> Val:
        v = self.val(node.args[0])
        lab = regroup(v.labels, shape_of(node))
        if lab is None:
            raise Opaque(op_name(node))
        return Val(lab, const=v.const)

    def op_transpose(self, node) -> Val:
        v = self.val(node.args[0])
        lab = list(v.labels)
        n = len(lab)
        a, b = node.args[1] % n, node.args[2] % n
        lab[a], lab[b] = lab[b], lab[a]
        return Val(tuple(lab), const=v.const)

    def op_t(self, node) -> Val:
        v = self.val(node.args[0])
        return Val(tuple(reversed(v.labels)), const=v.const)

    def op_permute(self, node) -> Val:
        v = self.val(node.args[0])
        n = len(v.labels)
        return Val(tuple(v.labels[d % n] for d in node.args[1]), const=v.const)

    def op_unsqueeze(self, node) -> Val:
        v = self.val(node.args[0])
        lab = list(v.labels)
        d = node.args[1]
        d = d % (len(lab) + 1)
        lab.insert(d, (("d", 1),))
        return Val(tuple(lab), const=v.const)

    def op_squeeze(self, node) -> Val:
        v = self.val(node.args[0])
        shape_in = shape_of(node.args[0])
        dims = node.args[1] if len(node.args) > 1 else None
        if dims is None:
            dims = [i for i, s in enumerate(shape_in) if s == 1]
        elif isinstance(dims, int):
            dims = [dims]
        dims = {d % len(shape_in) for d in dims if shape_in[d % len(shape_in)] == 1}
        return Val(tuple(ax for i, ax in enumerate(v.labels) if i not in dims), const=v.const)

    def op_expand(self, node) -> Val:
        v = self.val(node.args[0])
        shape = shape_of(node)
        lab = list(v.labels)
        lab = [(("d", 1),)] * (len(shape) - len(lab)) + lab
        out = []
        for ax, s in zip(lab, shape):
            if axis_size(ax) == s:
                out.append(ax)
            else:
                for pa in self.params((ax,)):
                    self.sp.fix(pa, "is broadcast")
                if self.sids((ax,)):
                    raise Opaque("expand")
                out.append((("d", int(s)),))
        return Val(tuple(out), const=v.const)

    def op_select(self, node) -> Val:
        v = self.val(node.args[0])
        dim, idx = node.args[1] % len(v.labels), node.args[2]
        ax = v.labels[dim]
        rest = tuple(a for i, a in enumerate(v.labels) if i != dim)
        if self.sids((ax,)):
            if len(ax) != 1:
                raise Opaque("select")
            _, sid, stride, m = ax[0]
            return Val(self.segment(rest, sid, stride, m, idx % m, node), const=v.const)
        for pa in self.params((ax,)):
            self.sp.fix(pa, f"is indexed at {layer_of(node)}")
        return Val(rest, const=v.const)

    def segment(self, rest: Labels, sid: int, stride: int, m: int, idx: int, node) -> Labels:
        """``rest``'s atoms of ``sid`` become atoms of the segment ``[idx stride, (idx+1) stride)``."""
        s = self.sp.get(sid)
        others = [a for ax in rest for a in ax if a[0] == "f" and self.sp.find(a[1]) == s.sid]
        size = 1
        for a in others:
            size *= a[3]
        if stride * m != s.n or size != stride:
            raise Opaque("select")
        child = self.child(s.sid, idx * stride, stride, node)
        return tuple(tuple(("f", child, a[2], a[3]) if a[0] == "f" and self.sp.find(a[1]) == s.sid else a
                           for a in ax) for ax in rest)

    def child(self, sid: int, offset: int, length: int, node) -> int:
        s = self.sp.get(sid)
        s.split = True
        return self.sp.new(length, layer_of(node), "segment", parent=s.sid, offset=offset)

    def op_slice(self, node) -> Val:
        v = self.val(node.args[0])
        shape_in = shape_of(node.args[0])
        dim = (node.args[1] if len(node.args) > 1 else 0) % len(shape_in)
        start = node.args[2] if len(node.args) > 2 else 0
        step = node.args[4] if len(node.args) > 4 else 1
        ax = v.labels[dim]
        new = shape_of(node)[dim]
        lab = list(v.labels)
        if new == shape_in[dim]:
            return Val(v.labels, const=v.const)
        if self.sids((ax,)):
            sid = self.full_atom(ax)
            if sid is None or step != 1:
                raise Opaque("slice")
            start = 0 if start is None else (start + shape_in[dim] if start < 0 else start)
            lab[dim] = (("f", self.child(sid, start, new, node), 1, new),)
            return Val(tuple(lab), const=v.const)
        for pa in self.params((ax,)):
            self.sp.fix(pa, f"is sliced at {layer_of(node)}")
        lab[dim] = (("d", new),)
        return Val(tuple(lab), const=v.const)

    def op_split(self, node) -> list:
        v = self.val(node.args[0])
        dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % len(v.labels)
        outs = node.meta["val"]
        ax = v.labels[dim]
        res, start = [], 0
        sid = self.full_atom(ax) if self.sids((ax,)) else None
        if self.sids((ax,)) and sid is None:
            raise Opaque("split")
        for o in outs:
            n = o.shape[dim]
            lab = list(v.labels)
            if sid is not None:
                lab[dim] = (("f", self.child(sid, start, n, node), 1, n),)
            else:
                for pa in self.params((ax,)):
                    self.sp.fix(pa, "is split")
                lab[dim] = (("d", n),)
            res.append(Val(tuple(lab), const=v.const))
            start += n
        return res

    op_split_with_sizes = op_split

    def op_chunk(self, node) -> list:
        return self.op_split(node)

    def op_unbind(self, node) -> list:
        v = self.val(node.args[0])
        dim = (node.args[1] if len(node.args) > 1 else 0) % len(v.labels)
        ax = v.labels[dim]
        rest = tuple(a for i, a in enumerate(v.labels) if i != dim)
        outs = node.meta["val"]
        if self.sids((ax,)):
            if len(ax) != 1:
                raise Opaque("unbind")
            _, sid, stride, m = ax[0]
            return [Val(self.segment(rest, sid, stride, m, i, node), const=v.const) for i in range(len(outs))]
        return [Val(rest, const=v.const) for _ in outs]

    def op_getitem(self, node) -> Any:
        src = self.vals.get(node.args[0])
        if isinstance(src, list):
            return src[node.args[1]]
        if isinstance(src, Val) and src.labels is None:
            return src
        return None

    # -- binary ----------------------------------------------------------------
    def broadcast(self, node, a: Val, b: Val, product: bool) -> Labels:
        """Unify two operands' labels axis by axis (right-aligned broadcasting)."""
        la, lb = list(a.labels), list(b.labels)
        n = max(len(la), len(lb))
        la = [(("d", 1),)] * (n - len(la)) + la
        lb = [(("d", 1),)] * (n - len(lb)) + lb
        out = []
        layer = layer_of(node)
        for xa, xb in zip(la, lb):
            sa, sb = self.sids((xa,)), self.sids((xb,))
            pa, pb = self.param_atom(xa), self.param_atom(xb)
            if sa and sb:
                fa, fb = self.full_atom(xa), self.full_atom(xb)
                if fa is not None and fb is not None:
                    sid = self.sp.union(fa, fb, stream=not product)
                    out.append((("f", sid, 1, self.sp.get(sid).n),))
                elif xa == xb or [a[2:] for a in xa] == [b[2:] for b in xb]:
                    for x, y in zip(xa, xb):
                        self.sp.union(x[1], y[1])
                    out.append(xa)
                else:
                    raise Opaque(op_name(node))
                if product:
                    for sid in self.sids((xa,)):
                        self.sp.restrict(sid, {"perm"})
                continue
            for feat, other, pother in ((xa, xb, pb), (xb, xa, pa)):
                if not self.sids((feat,)):
                    continue
                sid = self.full_atom(feat)
                if pother is not None and pother[2] > 1:
                    if sid is None:
                        raise Opaque(op_name(node))
                    for p in pother[1]:
                        self.sp.bind_param(p, sid, self.name_for(p[0], node), "co", pother[2], layer)
                    if product:
                        self.sp.restrict(sid, {"perm"})
                    else:
                        self.sp.get(sid).stream = True
                    out.append(feat)
                elif axis_size(other) == 1:  # the same value for every feature
                    if not product:
                        for s in self.sids((feat,)):
                            self.sp.restrict(s, {"o1", "perm"})
                    out.append(feat)
                else:
                    if sid is None:  # e.g. a position-dependent table times a head split (RoPE)
                        raise Opaque(op_name(node))
                    for s in self.sids((feat,)):
                        what = "a fixed tensor (buffer)" if (b.const if feat is xa else a.const) else "a tensor"
                        self.sp.pin(s, layer, f"{what} is {'multiplied' if product else 'added'} along the feature "
                                              f"axis ({op_name(node)})")
                    out.append(feat)
                break
            else:
                if pa is not None and pb is not None:
                    out.append((("p", pa[1] | pb[1], pa[2]),) if pa[2] == pb[2] else xa)
                    if pa[2] != pb[2]:
                        for p in pa[1] | pb[1]:
                            self.sp.fix(p, "is broadcast against another parameter")
                elif pa is not None or pb is not None:
                    p, other = (pa, xb) if pa is not None else (pb, xa)
                    if axis_size(other) > 1 or p[2] > 1:
                        for q in p[1]:
                            self.sp.fix(q, f"meets a data axis at {layer}")
                    out.append((("d", max(axis_size(xa), axis_size(xb))),))
                else:
                    out.append((("d", max(axis_size(xa), axis_size(xb))),))
        return tuple(out)

    def binary(self, node, product: bool) -> Val:
        a = self.val(node.args[0])
        b = self.val(node.args[1]) if len(node.args) > 1 else None
        if a is None and b is None:
            return self.generic(node, [])
        if a is None or b is None:  # tensor op scalar
            v = a if a is not None else b
            scalar = node.args[1] if a is not None else node.args[0]
            if not product and scalar != 0:
                for sid in self.sids(v.labels):
                    self.sp.restrict(sid, {"o1", "perm"})
            if product and op_name(node) == "div" and b is not None:  # scalar / tensor
                for sid in self.sids(v.labels):
                    self.sp.restrict(sid, {"perm"})
            return Val(v.labels, const=v.const)
        if product and op_name(node) == "div" and self.sids(b.labels):
            for sid in self.sids(b.labels):
                self.sp.restrict(sid, {"perm"})
        return Val(self.broadcast(node, a, b, product), const=a.const and b.const)

    def op_add(self, node) -> Val:
        return self.binary(node, False)

    op_sub = op_add
    op_rsub = op_add

    def op_mul(self, node) -> Val:
        return self.binary(node, True)

    op_div = op_mul

    def op_neg(self, node) -> Val:
        v = self.val(node.args[0])
        return Val(v.labels, const=v.const)

    def op_cat(self, node) -> Val:
        vals = [self.val(a) for a in node.args[0]]
        dim = node.args[1] if len(node.args) > 1 else 0
        shape = shape_of(node)
        dim %= len(shape)
        if any(v is None or v.labels is None for v in vals):
            raise Opaque("cat")
        out = None
        for v in vals:
            lab = list(v.labels)
            ax = lab[dim]
            if self.sids((ax,)):
                raise Opaque("cat")
            for pa in self.params((ax,)):
                self.sp.fix(pa, f"is concatenated at {layer_of(node)}")
            lab[dim] = (("d", shape[dim]),)
            cur = Val(tuple(lab), const=v.const)
            out = cur if out is None else Val(self.broadcast(node, out, cur, False), const=out.const and cur.const)
        return out

    # -- reductions ---------------------------------------------------------
    def op_mean(self, node) -> Val:
        v = self.val(node.args[0])
        n = len(v.labels)
        dims = node.args[1] if len(node.args) > 1 else None
        keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        dims = list(range(n)) if dims is None else ([dims] if isinstance(dims, int) else list(dims))
        dims = {d % n for d in dims}
        out = []
        for i, ax in enumerate(v.labels):
            if i not in dims:
                out.append(ax)
                continue
            if self.sids((ax,)):
                sid = self.full_atom(ax)
                if sid is None:
                    raise Opaque(op_name(node))
                self.sp.restrict(sid, {"perm"})
                self.sp.use(sid, "reduce")
            for pa in self.params((ax,)):
                self.sp.fix(pa, "is reduced")
            if keep:
                out.append((("d", 1),))
        return Val(tuple(out), const=v.const)

    op_sum = op_mean

    def op_amax(self, node) -> Val:
        """A maximum (minimum) over axes: as a sum for the reduced axes; a space kept on another axis sees a
        per-entry maximum, which commutes with permutations and positive scales only (as max pooling)."""
        out = self.op_mean(node)
        for sid in self.sids(out.labels):
            self.sp.restrict(sid, {"posmon", "perm"})
            self.sp.use(sid, "max")
        return out

    op_amin = op_amax

    def op_max(self, node):
        """``torch.max(x, dim)``: the values as :meth:`op_amax`; the indices carry the same labels (one index per
        kept entry, so they move with its spaces)."""
        if len(node.args) < 2 or not isinstance(node.args[1], int):
            return self.generic(node, [(a, self.val(a)) for a in tensor_args(node)])
        vals = self.op_amax(node)
        return [vals, Val(vals.labels, const=vals.const)]

    op_min = op_max

    # -- learned maps --------------------------------------------------------
    def weight(self, node, arg) -> tuple[str, tuple] | None:
        """``(canonical name, shape)`` if ``arg`` is a parameter placeholder."""
        if isinstance(arg, torch.fx.Node) and arg.op == "placeholder" and arg.name in self.param_of:
            return self.param_of[arg.name], shape_of(arg)
        return None

    def affine(self, node, x: Val, w, b, w_in: int, w_out: int) -> Val:
        """``y = x W^T + b`` (``linear``: in axis 1, out axis 0) or ``x W + b`` (``addmm``: in 0, out 1)."""
        layer = layer_of(node)
        wname, wshape = w
        ax = x.labels[-1]
        sid = self.full_atom(ax)
        blocked = self.blockwise(ax) if sid is None else None
        if sid is not None:
            self.sp.bind_param((wname, w_in), sid, self.name_for(wname, node), "contra", wshape[w_in], layer)
            self.sp.use(sid, "linear_in")
        elif blocked is not None:  # a flattened convolution output: the space acts blockwise
            self.sp.bind_param((wname, w_in), blocked[0], self.name_for(wname, node), "contra", wshape[w_in],
                               layer, layout=blocked[1])
            self.sp.use(blocked[0], "linear_in")
        elif self.sids((ax,)) or self.params((ax,)):
            raise Opaque(op_name(node))
        else:
            self.sp.fix((wname, w_in), "reads data (an input axis)")
        out = self.sp.bind_param((wname, w_out), None, self.name_for(wname, node), "co", wshape[w_out], layer,
                                 kind="hidden")
        if b is not None:
            bname, bshape = b
            self.sp.bind_param((bname, 0), out, self.name_for(bname, node), "co", bshape[0], layer)
        return Val(x.labels[:-1] + ((("f", out, 1, wshape[w_out]),),))

    def fresh_linear(self, node, name, ins) -> Val | None:
        """A Linear reading an opaque value: record the opaque use (it pins what the value came from), fix the
        weight's input axis and start a new output space."""
        xi, wi, bi = {"linear": (0, 1, 2), "addmm": (1, 2, 0), "matmul": (0, 1, None), "mm": (0, 1, None)}[name]
        w = self.weight(node, node.args[wi])
        b = self.weight(node, node.args[bi]) if bi is not None and len(node.args) > bi and \
            node.args[bi] is not None else None
        shape = shape_of(node)
        if w is None or len(w[1]) != 2 or shape is None or (bi is not None and len(node.args) > bi and
                                                          node.args[bi] is not None and b is None):
            return None
        self.make_opaque(node, [(node.args[xi], self.val(node.args[xi]))])
        w_in, w_out = (1, 0) if name == "linear" else (0, 1)
        x = Val(data(shape_of(node.args[xi])))
        return self.affine(node, x, w, b, w_in, w_out)

    def op_linear(self, node) -> Val:
        x = self.val(node.args[0])
        w = self.weight(node, node.args[1])
        b = self.weight(node, node.args[2]) if len(node.args) > 2 and node.args[2] is not None else None
        if w is None or (len(node.args) > 2 and node.args[2] is not None and b is None):
            return self.generic(node, [(a, self.val(a)) for a in tensor_args(node)])
        return self.affine(node, x, w, b, 1, 0)

    def op_addmm(self, node) -> Val:
        b = self.weight(node, node.args[0])
        x = self.val(node.args[1])
        w = self.weight(node, node.args[2])
        if w is None or b is None or len(shape_of(node.args[2])) != 2:
            return self.generic(node, [(a, self.val(a)) for a in tensor_args(node)])
        return self.affine(node, x, w, b, 0, 1)

    def op_matmul(self, node) -> Val:
        w = self.weight(node, node.args[1])
        if w is None or len(w[1]) != 2:
            return self.generic(node, [(a, self.val(a)) for a in tensor_args(node)])
        return self.affine(node, self.val(node.args[0]), w, None, 0, 1)

    op_mm = op_matmul

    def op_embedding(self, node) -> Val:
        w = self.weight(node, node.args[0])
        idx = self.val(node.args[1])
        if w is None or idx is None or self.sids(idx.labels):
            return self.generic(node, [(a, self.val(a)) for a in tensor_args(node)])
        wname, wshape = w
        layer = layer_of(node)
        self.sp.fix((wname, 0), "rows are looked up by the input ids")
        out = self.sp.bind_param((wname, 1), None, self.name_for(wname, node), "co", wshape[1], layer, kind="embed")
        self.sp.get(out).stream = True
        return Val(idx.labels + ((("f", out, 1, wshape[1]),),))

    def norm(self, node, x: Val, shape, w, b, kinds) -> Val:
        """LayerNorm / RMSNorm over the last ``len(shape)`` axes. At most one of them is a feature axis
        (a whole space: a channel LayerNorm over ``(C, H, W)`` or a channels-last ``C``); the statistics are
        taken over all of them, so permutations (and, without a gain, the rotations ``kinds``) of that space
        keep them, and the gain and bias are permuted along their matching axis. A space on an axis that is
        not normalised is normalised row by row: permutations only."""
        k = len(shape)
        if k < 1 or k > len(x.labels):
            raise Opaque(op_name(node))
        layer = layer_of(node)
        normed = x.labels[-k:]
        rows = x.labels[:-k]
        feat = [i for i, ax in enumerate(normed) if self.sids((ax,)) or self.params((ax,))]
        if len(feat) > 1 or self.params(rows):
            raise Opaque(op_name(node))
        for sid in self.sids(rows):
            self.sp.restrict(sid, {"perm"})
            self.sp.use(sid, "norm")
        if not feat:
            for p in (w, b):
                if p is not None:
                    for i in range(len(p[1])):
                        self.sp.fix((p[0], i), "normalises a data axis")
            return Val(x.labels, const=x.const)
        i = feat[0]
        sid = self.full_atom(normed[i])
        if sid is None:
            raise Opaque(op_name(node))
        self.sp.restrict(sid, kinds if w is None else {"perm"})
        self.sp.use(sid, "norm")
        for p in (w, b):
            if p is not None:
                self.sp.bind_param((p[0], i), sid, self.name_for(p[0], node), "co", p[1][i], layer)
        return Val(x.labels, const=x.const)

    def op_layer_norm(self, node) -> Val:
        args = list(node.args) + [None] * 5
        w = self.weight(node, args[2]) if args[2] is not None else None
        b = self.weight(node, args[3]) if args[3] is not None else None
        return self.norm(node, self.val(args[0]), args[1], w, b, {"o1", "perm"})

    def op_rms_norm(self, node) -> Val:
        args = list(node.args) + [None] * 4
        w = self.weight(node, args[2]) if args[2] is not None else None
        return self.norm(node, self.val(args[0]), args[1], w, None, {"o", "o1", "perm"})
