r"""The attention rule of the tracer: ``scaled_dot_product_attention`` calls become head, Q-K and V-O spaces.

Q, K and V must be head splits ``(..., h, T, d)`` of Linear outputs (K/V heads may be
repeated for grouped-query attention); a position map between a projection and the
call (RoPE) is identified numerically (:mod:`symalign.tracing.positions`) by re-running
only the graph nodes in between, and its nodes are then *explained* (not pinned).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from symalign.tracing.common import LOW, Val, layer_of, shape_of
from symalign.tracing.labels import axis_size
from symalign.tracing.positions import identify_map, position_maps, qk_group


@dataclass
class Attention:
    """One ``scaled_dot_product_attention`` call and the spaces it reads and writes."""

    node: Any
    layer: str
    q: int
    k: int
    v: int
    o: int
    n_heads: int
    n_kv: int
    head_dim: int
    qk: Any = None  # MatrixGroup or None
    heads_ok: bool = True
    problems: list = field(default_factory=list)


class AttentionRule:
    """Mixin of :class:`symalign.tracing.graph.Walker`: the attention operation."""

    def op_scaled_dot_product_attention(self, node) -> Val:
        names = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"]
        args = dict(zip(names, node.args))
        args.update(node.kwargs)
        layer = layer_of(node)
        q, k, v = (args[n] for n in names[:3])
        sides = []
        problems = []
        for role, a in (("query", q), ("key", k), ("value", v)):
            side = self.head_side(a, role, node, problems)
            sides.append(side)
        mask = args.get("attn_mask")
        if mask is not None:
            mv = self.val(mask)
            if mv is None or mv.labels is None or self.sids(mv.labels) or self.params(mv.labels):
                problems.append("the attention mask depends on feature axes")
        if (args.get("dropout_p") or 0.0) != 0.0:
            problems.append("attention dropout is active")
        qv = self.vals.get(q)
        shape = shape_of(node)
        if problems or any(s is None for s in sides):
            self.failed.append((layer, "attention not aligned: " + "; ".join(problems)))
            return self.make_opaque(node, [(a, self.val(a)) for a in (q, k, v)] + ([(mask, self.val(mask))]
                                                                                    if mask is not None else []))
        (sq, h, d, base_q, _), (sk, hkv, dk, base_k, rk), (sv, hv, dv, _, rv) = sides
        att = Attention(node, layer, sq, sk, sv, -1, h, hkv, d)
        gqa = bool(args.get("enable_gqa")) or (rk == rv == h // max(hkv, 1) and rk > 1)
        if d != dk or hv != hkv or rk != rv or dv != d or h % hkv or (h != hkv and not gqa):
            att.problems.append(f"head shapes differ (q {h}x{d}, k {hkv}x{dk}, v {hv}x{dv})")
        if mask is not None:
            m = self.env.get(mask)
            if isinstance(m, Tensor) and m.dim() >= 3 and m.shape[-3] > 1:
                if not bool((m == m.narrow(m.dim() - 3, 0, 1)).all()):
                    att.heads_ok = False
                    att.problems.append("heads not permuted: the attention mask/bias differs between heads")
        att.qk = self.qk_of(node, base_q, base_k, q, k, att)
        for sid, role in ((sq, "sdpa"), (sk, "sdpa"), (sv, "sdpa")):
            self.sp.use(sid, role)
        o = self.sp.new(h * d, layer, "attn_out")
        att.o = o
        self.attention.append(att)
        base_labels = (self.vals[base_q].labels if base_q is not None else qv.labels)
        lab = list(base_labels)
        lab[-3] = (("f", o, d, h),)
        lab[-1] = (("f", o, 1, d),)
        assert len(lab) == len(shape)
        return Val(tuple(lab))

    def head_side(self, a, role, node, problems):
        """``(space, heads, head_dim, base)`` of a query/key/value input (base: the value a position map
        was applied to, or None)."""
        v = self.val(a)
        base = None
        if v is None:
            problems.append(f"the {role} is not traced")
            return None
        if v.labels is None:
            if role == "value" or len(v.roots) != 1:
                problems.append(f"the {role} passes through an unrecognised operation")
                return None
            base = next(iter(v.roots))
            bv = self.vals.get(base)
            sb, sa = shape_of(base), shape_of(a)
            if bv is None or bv.labels is None or sb is None or sa is None or len(sb) != len(sa) or len(sa) < 3 \
                    or sb[:-3] + sb[-2:] != sa[:-3] + sa[-2:] or sa[-3] % sb[-3]:
                problems.append(f"the {role}'s position map changes its shape")
                return None
            lab = bv.labels
            if sa[-3] != sb[-3]:  # RoPE, then K heads repeated for GQA (repeat_kv)
                if role == "query":
                    problems.append("the query's position map changes its shape")
                    return None
                g = sa[-3] // sb[-3]
                lab = lab[:-3] + ((lab[-3][0], ("d", g)),) + lab[-2:]
        else:
            lab = v.labels
        if len(lab) < 3:
            problems.append(f"the {role} has no head axis")
            return None
        hax, dax = lab[-3], lab[-1]
        repeat = 1
        if role != "query" and len(hax) == 2 and hax[1][0] == "d":  # K/V heads repeated for GQA (repeat_kv)
            repeat = hax[1][1]
            hax = hax[:1]
        if axis_size(hax) == 1 and len(dax) == 1 and dax[0][0] == "f":  # a single (K/V) head
            hax = (("f", dax[0][1], dax[0][3], 1),)
        if len(hax) != 1 or len(dax) != 1 or hax[0][0] != "f" or dax[0][0] != "f" or \
                self.sp.find(hax[0][1]) != self.sp.find(dax[0][1]):
            problems.append(f"the {role}'s head axes are not a head split of one projection")
            return None
        sid = self.sp.find(hax[0][1])
        h, d = hax[0][3], dax[0][3]
        if dax[0][2] != 1 or hax[0][2] != d or self.sp.get(sid).n != h * d:
            problems.append(f"the {role}'s head axes are not a head split of one projection")
            return None
        if any(self.sids((ax,)) for ax in lab[:-3] + lab[-2:-1]):
            problems.append(f"the {role} has features on its batch/position axes")
            return None
        return sid, h, d, base, repeat

    def qk_of(self, node, base_q, base_k, q, k, att):
        from symalign.groups import GeneralLinear

        if base_q is None and base_k is None:
            return GeneralLinear(att.head_dim)
        maps, tols = [], [1e-12]
        if min(shape_of(q)[-2], shape_of(k)[-2]) < 2:  # one position cannot reveal a position-dependent map
            att.problems.append("Q-K not aligned: the queries/keys pass through a position map; trace with at least "
                                "2 positions to identify it")
            return None
        for base, arg in ((base_q, q), (base_k, k)):
            x = self.env[arg] if base is None else self.env[base]
            if base is None:
                eye = torch.eye(att.head_dim, dtype=torch.float64)
                maps.append(eye.unsqueeze(0))
                continue
            run, low = self.runner(base, arg)
            tol = 1e-6 if low else 1e-12  # the map computes in float32 (e.g. ModernBERT's rotary)
            tols.append(tol)
            g = shape_of(arg)[-3] // shape_of(base)[-3]
            if g > 1:
                run = _collapsed(run, x.dim() - 3, g)
            m = identify_map(run, x, x.dim() - 1, self.gen, tol)
            if m is None:
                att.problems.append("Q-K not aligned: the map from the projection to the attention input is not a "
                                    "per-position linear map")
                return None
            pm, why = position_maps(m, x.dim() - 3, x.dim() - 1, tol)
            if pm is None:
                att.problems.append(f"Q-K not aligned: {why}")
                att.heads_ok = att.heads_ok and "heads" not in why
                return None
            maps.append(pm)
        mq, mk = maps
        if mq.shape[0] == 1 and mk.shape[0] > 1:
            mq = mq.expand(mk.shape[0], -1, -1)
        if mk.shape[0] == 1 and mq.shape[0] > 1:
            mk = mk.expand(mq.shape[0], -1, -1)
        for arg in (q, k):  # the maps are understood: per position, the same for every head and batch
            v = self.vals.get(arg)
            if v is not None and v.labels is None:
                self.explained |= set(v.opq)
        g = qk_group(mq, mk, self.gen, max(tols))
        if g is None:
            att.problems.append("Q-K not aligned: no candidate group keeps the position maps")
        return g

    def runner(self, base, target):
        """A function recomputing ``target`` from a replacement value of ``base`` (other nodes from ``env``)."""
        nodes = list(self.ep.graph.nodes)
        pos = {n: i for i, n in enumerate(nodes)}
        anc = set()
        stack = [target]
        while stack:
            n = stack.pop()
            if n in anc or n is base:
                continue
            anc.add(n)
            stack.extend(x for x in n.all_input_nodes)
        desc = {base}
        for n in nodes[pos[base] + 1: pos[target] + 1]:
            if any(x in desc for x in n.all_input_nodes):
                desc.add(n)
        region = sorted((anc & desc) - {base}, key=pos.get)
        low = any(isinstance(n.meta.get("val"), Tensor) and n.meta["val"].dtype in LOW for n in region)

        def run(x: Tensor) -> Tensor:
            env = {base: x}

            def look(a):
                return env[a] if a in env else self.env[a]

            for n in region:
                args = torch.fx.node.map_arg(n.args, look)
                kwargs = torch.fx.node.map_arg(n.kwargs, look)
                env[n] = n.target(*args, **kwargs)
            return env[target]

        return run, low


def _collapsed(run, axis: int, g: int):
    """``run`` followed by undoing a repeat of each entry of ``axis`` ``g`` times (None if not a repeat)."""

    def inner(x: Tensor) -> Tensor | None:
        y = run(x)
        y = y.unflatten(axis, (y.shape[axis] // g, g))
        first = y.select(axis + 1, 0)
        if not torch.equal(y, first.unsqueeze(axis + 1).expand_as(y)):
            return None
        return first

    return inner
