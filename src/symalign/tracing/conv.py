r"""The convolutional rules of the tracer: convolutions, BatchNorm, GroupNorm, pooling, padding, resizing.

A convolution contracts the channel axis like a Linear (``y_o = sum_i w_{oi} * x_i + b_o``,
``*`` the spatial correlation), so an invertible channel map ``A`` on its input is undone by
``W' = W A^{-1}`` on the weight's input-channel axis, and one on its output by ``W' = A W``,
``b' = A b``: the output channels start a new feature space, exactly as a Linear's units.
The channel axis is the one before the ``k`` spatial axes (``k`` = the weight's dimension
minus 2), batched or not. Grouped convolutions (``groups = g``: output group ``j`` reads
only input group ``j``) keep less:

* depthwise (one input and one output channel per group): output channel ``c`` is a
  per-channel filter of input channel ``c``; the output is the input's space, permuted
  together with the filters and biases (permutations only: a scale would have to leave
  the filter and move the bias);
* otherwise: the input channels are left out (each group's filters see their group's
  channels through one weight axis shared by every group, so only the same permutation
  inside every group, ``blockdiag(P, ..., P)`` with ``P`` on that axis, would keep them: a
  subgroup not declared yet), and the output channels may be permuted inside their group:
  ``(S_m)^g`` (:class:`~symalign.tracing.blocks.WithinBlocks`).

Per-channel operations of the spatial axes (max / average / adaptive pooling, padding,
upsampling) keep the channel space: max pooling commutes with permutations and positive
scales (as ReLU), the linear ones with any channel map; padding with a nonzero constant
allows only maps fixing the all-ones vector.

BatchNorm (eval mode: ``y = (x - mu) / sqrt(var + eps) w + b`` per channel) allows
permutations of its input (``eps`` breaks scales there); its ``weight``, ``bias``, ``running_mean`` and
``running_var`` are permuted along (the running statistics are state-dict buffers and part
of the action, so the permuted model computes the same function without any reset). Its output
scales with its affine: ``w, b -> s w, s b`` (``s > 0``) gives ``y -> s y``. So where a BatchNorm
reads a convolution's output channels that nothing else reads, the space is declared with
positive scales (:class:`~symalign.groups.PositiveMonomial`, when what follows allows them: a
ReLU, max pooling, the next layer's input) acting on the affine and after it, and with the
permutation alone (``rep="perm"``) on the convolution's weight and bias and on the statistics;
elsewhere (a BatchNorm of a residual stream, of a pooled value, of a value read twice) with
permutations only.
GroupNorm takes its statistics per group of channels: the permutations that map groups onto
groups, ``S_m wr S_g`` (:class:`~symalign.tracing.blocks.BlockWreath`); with a single group
and no affine, every rotation fixing the all-ones vector (``O_1(C)``).
"""

from __future__ import annotations

import re

import torch

from symalign.tracing.common import (
    Opaque,
    Val,
    layer_of,
    op_name,
    shape_of,
    tensor_args,
)
from symalign.tracing.labels import axis_size, data

CONVS = {"conv1d", "conv2d", "conv3d", "convolution", "_convolution", "conv_transpose1d", "conv_transpose2d",
         "conv_transpose3d"}
MAX_POOLS = {f"{p}{k}d{s}" for p in ("max_pool", "adaptive_max_pool") for k in (1, 2, 3)
             for s in ("", "_with_indices")}
LINEAR_SPATIAL = {f"{p}{k}d" for k in (1, 2, 3) for p in ("avg_pool", "adaptive_avg_pool", "upsample_nearest",
                                                          "_upsample_nearest_exact", "reflection_pad",
                                                          "replication_pad")} | {
    "upsample_linear1d", "upsample_bilinear2d", "upsample_bicubic2d", "upsample_trilinear3d",
    "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa", "constant_pad_nd", "pad"}
SPATIAL = MAX_POOLS | LINEAR_SPATIAL


def _spatial_dims(node, name: str) -> int:
    if name == "constant_pad_nd" or name == "pad":
        return len(node.args[1]) // 2
    m = re.search(r"(\d)d", name)
    return int(m.group(1)) if m else 0


class ConvRule:
    """Mixin of :class:`symalign.tracing.graph.Walker`: the convolutional operations (module docstring)."""

    def buffer(self, arg) -> tuple[str, tuple, bool] | None:
        """``(state-dict name, shape, persistent)`` if ``arg`` is a buffer placeholder."""
        if isinstance(arg, torch.fx.Node) and arg.op == "placeholder" and arg.name in self.buffer_of:
            name, persistent = self.buffer_of[arg.name]
            return name, shape_of(arg), persistent
        return None

    def channel_axis(self, node, x: Val, n_spatial: int) -> int:
        """The channel axis of ``x`` (before ``n_spatial`` spatial axes); the spatial and leading axes must not
        carry features or parameter axes (else :class:`Opaque`)."""
        ch = len(x.labels) - n_spatial - 1
        if ch < 0:
            raise Opaque(op_name(node))
        others = x.labels[:ch] + x.labels[ch + 1:]
        if self.sids(others) or self.params(x.labels):
            raise Opaque(op_name(node))
        if self.sids((x.labels[ch],)) and self.full_atom(x.labels[ch]) is None:
            raise Opaque(op_name(node))
        return ch

    # -- convolutions -------------------------------------------------------
    def conv(self, node) -> Val:
        name = op_name(node)
        a = list(node.args) + [None] * 12
        if name in ("convolution", "_convolution"):
            transposed, groups = bool(a[6]), int(a[8] or 1)
        elif name.startswith("conv_transpose"):
            transposed, groups = True, int(a[6] or 1)
        else:
            transposed, groups = False, int(a[6] or 1)
        x = self.val(a[0])
        w = self.weight(node, a[1])
        b = self.weight(node, a[2]) if a[2] is not None else None
        if x is None or w is None or (a[2] is not None and b is None):
            return self.generic(node, [(t, self.val(t)) for t in tensor_args(node)])
        wname, wshape = w
        ch = self.channel_axis(node, x, len(wshape) - 2)
        if transposed and groups != 1:
            raise Opaque(f"{name} with groups")
        w_in, w_out = (0, 1) if transposed else (1, 0)
        c_out = wshape[w_out] * (groups if transposed else 1)
        layer = layer_of(node)
        sid_in = self.full_atom(x.labels[ch])
        depthwise = groups > 1 and wshape[1] == 1 and wshape[0] == groups
        if groups == 1:
            if sid_in is not None:
                self.sp.bind_param((wname, w_in), sid_in, self.name_for(wname, node), "contra", wshape[w_in], layer)
                self.sp.use(sid_in, "linear_in")
            else:
                self.sp.fix((wname, w_in), "reads data (an input axis)")
            out = self.sp.bind_param((wname, w_out), None, self.name_for(wname, node), "co", c_out, layer,
                                     kind="hidden")
        elif depthwise and sid_in is not None:
            self.sp.restrict(sid_in, {"perm"})
            self.sp.use(sid_in, "depthwise")
            out = self.sp.bind_param((wname, 0), sid_in, self.name_for(wname, node), "co", c_out, layer)
        else:
            if sid_in is not None:
                self.sp.pin(sid_in, layer, f"is read by a grouped convolution ({groups} groups): its channels "
                                           "are left out (one weight axis serves every group: only the same "
                                           "permutation in every group would keep them, which is not declared)")
            out = self.sp.bind_param((wname, 0), None, self.name_for(wname, node), "co", c_out, layer,
                                     kind="hidden")
            self.sp.blockify(out, groups, in_place=True)
            self.sp.use(out, "grouped_conv")
        if b is not None:
            self.sp.bind_param((b[0], 0), out, self.name_for(b[0], node), "co", b[1][0], layer)
        shape = shape_of(node)
        return Val(x.labels[:ch] + ((("f", out, 1, c_out),),) + data(shape[ch + 1:]))

    # -- norms ---------------------------------------------------------------
    def bn(self, node, x: Val, params: list, buffers: list) -> Val:
        """BatchNorm over channel axis 1 (module docstring); ``params``/``buffers``: weight, bias / mean, var
        arguments (``None`` when absent)."""
        if x is None or x.labels is None or len(x.labels) < 2:
            raise Opaque(op_name(node))
        ch = 1
        if self.sids(x.labels[:1] + x.labels[2:]) or self.params(x.labels):
            raise Opaque(op_name(node))
        ax = x.labels[ch]
        sid = self.full_atom(ax)
        if self.sids((ax,)) and sid is None:
            raise Opaque(op_name(node))
        layer = layer_of(node)
        ws = [self.weight(node, p) if p is not None else None for p in params]
        bs = [self.buffer(q) if q is not None else None for q in buffers]
        if any(p is not None and w is None for p, w in zip(params, ws)) or \
                any(q is not None and v is None for q, v in zip(buffers, bs)):
            raise Opaque(f"{op_name(node)} with computed statistics or affine parameters")
        if sid is None:
            for w in ws:
                if w is not None:
                    self.sp.fix((w[0], 0), "normalises a data axis")
            return Val(x.labels, const=x.const)
        # A convolution's own output read by this BatchNorm alone: the positive scales may act on the affine and
        # after it, the permutation alone on the input side (rep "perm"); else permutations only.
        fresh = self.fresh_conv_output(node, sid)
        self.sp.restrict(sid, {"posmon", "perm"} if fresh else {"perm"})
        self.sp.use(sid, "norm")
        if fresh:
            for pa in fresh:
                self.sp.bind_uses[pa] = [(name, "perm") for name, _ in self.sp.bind_uses[pa]]
        for w in ws:
            if w is not None:
                self.sp.bind_param((w[0], 0), sid, self.name_for(w[0], node), "co", w[1][0], layer)
        for v in bs:
            if v is None:
                continue
            if not v[2]:
                self.sp.pin(sid, layer, f"BatchNorm statistics {v[0]} are a non-persistent buffer (not in the "
                                        "state dict, so they cannot move with the channels)")
            else:
                self.sp.bind_param((v[0], 0), sid, v[0], "perm" if fresh else "co", v[1][0], layer)
        return Val(x.labels, const=x.const)

    def fresh_conv_output(self, node, sid: int) -> list:
        """The parameter axes bound to ``sid`` when the BatchNorm ``node`` reads a convolution's output channels
        that nothing else reads (the space made by that convolution, its weight's output axis and bias, nothing
        merged into it yet); ``[]`` otherwise. Then ``y = (x - mu) / sqrt(var + eps) w + b`` is exact under
        ``x -> P x`` with ``mu, var`` permuted and ``w, b -> diag(s) P w, diag(s) P b`` (``s > 0``): ``y -> diag(s)
        P y``, which a ReLU and the next layer's ``diag(1/s)`` on its input undo (module docstring)."""
        src = node.args[0] if node.args else None
        if not isinstance(src, torch.fx.Node) or op_name(src) not in CONVS or len(src.users) != 1:
            return []
        space = self.sp.get(sid)
        if space.kind != "hidden" or space.uses or space.stream or space.parent is not None:
            return []
        bound = [pa for pa, s in self.sp.bind.items() if self.sp.find(s) == space.sid]
        if not bound or any(v != "co" for pa in bound for _, v in self.sp.bind_uses[pa]):
            return []
        if any(s.parent is not None and self.sp.find(s.parent) == space.sid for s in self.sp.items.values()):
            return []
        return bound

    def op_batch_norm(self, node) -> Val:
        a = list(node.args) + [None] * 9
        return self.bn(node, self.val(a[0]), [a[1], a[2]], [a[3], a[4]])

    def op__native_batch_norm_legit_no_training(self, node) -> list:
        a = list(node.args) + [None] * 7
        x = self.val(a[0])
        out = self.bn(node, x, [a[1], a[2]], [a[3], a[4]])
        c = x.labels[1]
        stats = []
        for t in node.meta["val"][1:]:  # saved statistics: per channel (or empty)
            stats.append(Val((c,)) if tuple(t.shape) == (axis_size(c),) else Val(data(t.shape)))
        return [out, *stats]

    def op_group_norm(self, node) -> Val:
        a = list(node.args) + [None] * 6
        x, groups = self.val(a[0]), int(a[1])
        w = self.weight(node, a[2]) if a[2] is not None else None
        b = self.weight(node, a[3]) if a[3] is not None else None
        if x is None or x.labels is None or len(x.labels) < 2 or (a[2] is not None and w is None) or \
                (a[3] is not None and b is None):
            raise Opaque("group_norm")
        if self.sids(x.labels[:1] + x.labels[2:]) or self.params(x.labels):
            raise Opaque("group_norm")
        ax = x.labels[1]
        sid = self.full_atom(ax)
        if self.sids((ax,)) and sid is None:
            raise Opaque("group_norm")
        layer = layer_of(node)
        if sid is None:
            for p in (w, b):
                if p is not None:
                    self.sp.fix((p[0], 0), "normalises a data axis")
            return Val(x.labels, const=x.const)
        if groups == 1 and w is None and b is None:
            self.sp.restrict(sid, {"o1", "perm"})  # LayerNorm over (C, spatial): O with O 1 = 1 keeps it
        else:
            self.sp.restrict(sid, {"perm"})
            if groups > 1:
                self.sp.blockify(sid, groups, in_place=False)
        self.sp.use(sid, "norm")
        for p in (w, b):
            if p is not None:
                self.sp.bind_param((p[0], 0), sid, self.name_for(p[0], node), "co", p[1][0], layer)
        return Val(x.labels, const=x.const)

    # -- pooling, padding, resizing -----------------------------------------------
    def spatial(self, node, name: str):
        """A per-channel map of the trailing spatial axes (module docstring)."""
        x = self.val(node.args[0])
        k = _spatial_dims(node, name)
        if x is None or x.labels is None:
            raise Opaque(name)
        if not self.sids(x.labels) and not self.params(x.labels):  # data in, data out
            return self.generic(node, [(node.args[0], x)])
        if k == 0:
            raise Opaque(name)
        ch = self.channel_axis(node, x, k)
        sid = self.full_atom(x.labels[ch])
        if sid is not None:
            if name in MAX_POOLS:
                self.sp.restrict(sid, {"posmon", "perm"})
                self.sp.use(sid, name)
            elif name in ("constant_pad_nd", "pad"):
                mode = node.args[2] if len(node.args) > 2 else node.kwargs.get("mode", "constant")
                value = node.args[3] if name == "pad" and len(node.args) > 3 else (
                    node.args[2] if name == "constant_pad_nd" and len(node.args) > 2 else node.kwargs.get("value"))
                if (name == "constant_pad_nd" or mode == "constant") and value:
                    self.sp.restrict(sid, {"o1", "perm"})  # a constant c in every channel: T (c 1) = c 1
        mv = node.meta.get("val")
        outs = mv if isinstance(mv, (tuple, list)) else [mv]
        vals = [Val(x.labels[:ch + 1] + data(o.shape[ch + 1:]), const=x.const) for o in outs]
        return vals if isinstance(mv, (tuple, list)) else vals[0]


for _name in CONVS:
    setattr(ConvRule, f"op_{_name}", ConvRule.conv)
for _name in SPATIAL:
    setattr(ConvRule, f"op_{_name}", lambda self, node, _n=_name: self.spatial(node, _n))
