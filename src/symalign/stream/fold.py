r"""The exact rewrite of ``--scope model`` (norm gains folded into the next linear maps) on part of a
checkpoint: one layer, one row chunk of the embedding or head, one expert of a mixture of experts.

:func:`symalign.families.prepare` is defined on whole state dicts. :class:`Preparer` runs it with every
tensor not given as a meta-device placeholder, so the fold of a part costs only that part, and a result
that depends on a placeholder stays a placeholder. On it stand

* :func:`prepare_parts`: a layer's big tensors folded one at a time with its small ones (gains, biases);
* :func:`prepare_experts`: a mixture of experts' layer folded one expert at a time into the stacked
  ``(E, 2F, D)`` / ``(E, D, F)`` tensors of transformers' fused layout;
* :class:`FoldedCheckpoint`: a whole checkpoint read through the fold, lazily and in row chunks (what the
  streamed merge reads B' and A through);
* :func:`refusal`: why the streamed model scope cannot be exact on a checkpoint (a residual group the passes do
  not solve), decided from the headers alone.

Every function here returns exactly what the in-memory rewrite gives on the same tensors (the folds
scale columns, and each part is folded with the small tensors it depends on); the tests compare them.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import Tensor

from symalign.io.layout import TensorInfo
from symalign.checkpoint.lazy import LazyCheckpoint, ResidentCheckpoint
from symalign.errors import CheckpointError, ConfigError
from symalign.spec import SymmetrySpec


CHUNK_ELEMENTS = 1 << 24  # rows of a big global tensor (embedding, head) read at a time
SMALL_ELEMENTS = 1 << 20  # a layer's tensors up to this size (norm gains, biases) are folded with each big one


class Preparer:
    """:func:`symalign.families.prepare` on part of a checkpoint.

    The fold is defined once, for whole state dicts; here every tensor not given is a
    meta-device placeholder (no memory, no work), so folding a layer or a row chunk
    of the head costs only that part. A result that depends on a placeholder is a
    placeholder (:func:`symalign.families.common.on_device_of`): e.g. a LayerNorm
    family's reader bias ``c + W b`` is real only in the call that is given ``W``.
    Row chunks are exact where the fold is row-local (:meth:`row_local`).
    """

    def __init__(self, ck: LazyCheckpoint, att_spec: SymmetrySpec):
        from symalign.families import prepare

        self._prepare = prepare
        self.config = ck.config
        self.adapter = ck.adapter
        self.att = att_spec
        self.meta = {n: torch.empty(t.shape, dtype=torch.float64, device="meta") for n, t in ck.tensors.items()}
        p = prepare(ck.config, self.meta, att_spec)
        self.spec, self.notes, self.untied = p.spec, p.notes, p.untied
        self.names = list(p.state)  # the prepared state's names (a mixture of experts: its fused layout)
        # tensors the rewrite adds (a head untied from the embedding): name -> shape
        self.extra = {k: tuple(v.shape) for k, v in p.state.items() if k not in self.meta} if not self.fused else {}
        # a mixture of experts: its stored expert tensors (layer prefix -> expert -> gate/up/down -> name), and
        # the other stored names its fused layout renames (Mixtral: block_sparse_moe.gate -> mlp.gate)
        self.experts = self.experts_of(self.meta)
        stacked = stored_names(self.experts)
        self.renamed = {n: new for n in self.meta if self.fused and n not in stacked
                        for new in self.adapter.fused({n: self.meta[n]}) if new != n}

    @property
    def fused(self) -> bool:
        """Whether the rewrite works in another layout than the checkpoint's (a mixture of experts: one stacked
        tensor per layer for the experts stored one by one, :meth:`symalign.families.moe.MoEFamily.fused`); its
        layers are then prepared whole."""
        from symalign.families.moe import MoEFamily

        return isinstance(self.adapter, MoEFamily)

    def __call__(self, real: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The prepared ``real`` tensors, and each other tensor computed from them alone (the untied head:
        from rows of the embedding, the same rows; a mixture of experts: the stacked experts of a layer)."""
        p = self._prepare(self.config, {**self.meta, **real}, self.att)
        out = {k: p.state[k] for k in real if k in p.state}
        out.update({k: v for k, v in p.state.items() if k not in out and k not in self.meta and not v.is_meta})
        return out

    def with_one(self, small: Mapping[str, Tensor], name: str | None = None, x: Tensor | None = None,
                 start: int = 0) -> dict[str, Tensor]:
        """The prepared ``small`` tensors and, given ``name``, ``x`` (rows ``start:start + len(x)`` of tensor
        ``name``; the others stay placeholders). ``name``'s own small tensors (its bias: same module) are given
        as the same rows, so that a fold ``c + W b`` of that chunk is exact; the result holds those rows."""
        real = dict(small)
        if name is not None and x is not None:
            real[name] = x
            full = self.meta[name].shape[0] if self.meta[name].dim() else 0
            if x.dim() and x.shape[0] != full:
                for k in own_tensors(name, small):
                    real[k] = small[k][start:start + x.shape[0]]
        return self(real)

    def experts_of(self, names) -> dict[str, dict[int, dict[str, str]]]:
        """The tensors among ``names`` that a mixture of experts stores one per expert: layer prefix -> expert ->
        gate / up / down (:meth:`~symalign.families.moe.MoEFamily.expert_key`) -> stored name (empty for
        other families)."""
        out: dict[str, dict[int, dict[str, str]]] = {}
        if not self.fused:
            return out
        for n in names:
            key = self.adapter.expert_key(n)
            if key is not None:
                out.setdefault(key[0], {}).setdefault(key[1], {})[key[2]] = n
        return out

    def one_expert(self, small: Mapping[str, Tensor], lp: str, tensors: Mapping[str, Tensor]) -> tuple[Tensor,
                                                                                                         Tensor]:
        """One expert of the layer at ``lp`` prepared alone: ``(gate_up_proj[e], down_proj[e])`` (``(2F, D)``,
        ``(D, F)``) from its stored ``tensors`` by kind (gate, up, down) and ``small`` (the norm gain folded
        into its readers).

        The rewrite runs on the model with this layer holding only this expert (stacked with ``E = 1``; the
        layer's other experts are left out, not placeholders, since the stack cannot mix real tensors and
        placeholders). The rewrite of a mixture of experts acts on each expert's own entries (the gain scales
        the ``D`` axis of ``gate_up_proj``; ``down_proj`` is only converted), so the result is exactly slice
        ``e`` of the layer prepared whole, with the float64 temporaries of one expert instead of the layer."""
        fam = self.adapter
        base = {k: v for k, v in self.meta.items() if (key := fam.expert_key(k)) is None or key[0] != lp}
        real = {**small, **{fam.expert_name(lp, 0, w): x for w, x in tensors.items()}}
        st = self._prepare(self.config, {**base, **real}, self.att).state
        return st[lp + fam.moe.gate_up][0], st[lp + fam.moe.down][0]

    def row_local(self, name: str) -> bool:
        """Whether the fold of ``name`` is exact on any block of its rows: the residual acts on no axis but
        the columns (a ``Conv1D`` reader stores its stream axis as rows) and the family rewrites rows one by one
        (:meth:`symalign.families.base.Family.rows_independent`)."""
        acts = self.spec.tensors.get(name, [])
        rows_ok = all(a.axis % len(self.meta[name].shape) != 0 for a in acts if self.spec.role(a.space) == "residual")
        return rows_ok and self.adapter.rows_independent(self.config)


class PreparedSource(ResidentCheckpoint):
    """A state already rewritten by :func:`symalign.families.prepare` (``prepared``: its state, spec, notes and
    whether it untied the head), as a tensor source of :class:`~symalign.stream.model.StreamedWhole`: read
    through :class:`Prepared`, which returns every tensor as it is. ``ck``: the checkpoint it was prepared from
    (path, config, family, and its stored names, from which the attention spec is read); ``state``: another state
    of the same prepared names and shapes to serve instead (universe matching's running average)."""

    def __init__(self, ck, prepared, state: Mapping[str, Tensor] | None = None):
        super().__init__(ck.path, prepared.state if state is None else state, ck.config, ck.adapter, checked=True)
        self.spec, self.notes, self.untied = prepared.spec, prepared.notes, prepared.untied
        self.att_spec = ck.adapter.spec(ck.config, list(ck.state.keys()))


class Prepared(Preparer):
    """The :class:`Preparer` of a :class:`PreparedSource`: the rewrite is already done, so every part read is
    returned as it is (no placeholders, nothing added, no experts to stack: a mixture of experts is already in
    its fused layout)."""

    def __init__(self, src: PreparedSource, att_spec: SymmetrySpec):
        self.config, self.adapter, self.att = src.config, src.adapter, att_spec
        self.meta = {n: torch.empty(t.shape, dtype=torch.float64, device="meta") for n, t in src.tensors.items()}
        self.spec, self.notes, self.untied = src.spec, src.notes, src.untied
        self.names = list(src.keys)
        self.extra: dict[str, tuple[int, ...]] = {}
        self.experts: dict = {}
        self.renamed: dict[str, str] = {}

    @property
    def fused(self) -> bool:
        return False

    def __call__(self, real: Mapping[str, Tensor]) -> dict[str, Tensor]:
        return dict(real)

    def row_local(self, name: str) -> bool:
        return True


def preparer_of(ck, att_spec: SymmetrySpec) -> Preparer:
    """The :class:`Preparer` that reads ``ck`` through the rewrite (:class:`Prepared` for a
    :class:`PreparedSource`)."""
    return Prepared(ck, att_spec) if isinstance(ck, PreparedSource) else Preparer(ck, att_spec)


def att_spec_of(ck) -> SymmetrySpec:
    """The attention spec of ``ck`` (a :class:`PreparedSource`'s: read from the names it was prepared from)."""
    return ck.att_spec if isinstance(ck, PreparedSource) else ck.adapter.spec(ck.config, ck.keys)


def own_tensors(name: str, names) -> list[str]:
    """The other tensors of ``name``'s module (``x.bias`` for ``x.weight``)."""
    mod = name.rsplit(".", 1)[0]
    return [k for k in names if k != name and k.rsplit(".", 1)[0] == mod]


def prepare_parts(prep: Preparer, small: Mapping[str, Tensor], big, read, need=None) -> tuple[dict[str, Tensor],
                                                                                                 dict[str, Tensor]]:
    """``(prepared big, prepared small)``: each tensor of ``big`` read (``read(name)``) and folded on its own
    with the ``small`` ones (one big tensor in memory at a time); each small result is taken from a call in
    which it is real (a reader's bias from the call given its weight). ``need``: the small tensors wanted
    (default all)."""
    done = {k: v for k, v in prep.with_one(small).items() if not v.is_meta}
    out: dict[str, Tensor] = {}
    for n in big:
        r = prep.with_one(small, n, read(n))
        out[n] = r.pop(n)
        done.update({k: v for k, v in r.items() if k not in done and not v.is_meta})
        del r
    lost = [k for k in (small if need is None else need) if k in small and k not in done]
    if lost:
        raise ConfigError(f"internal error: the rewrite of {lost[0]!r} depends on more than one big tensor; "
                          "use --no-stream")
    return out, done


def stored_names(experts: Mapping[str, Mapping[int, Mapping[str, str]]]) -> set[str]:
    """The stored names of :meth:`Preparer.experts_of`'s tensors (every expert's gate, up and down)."""
    return {n for by_e in experts.values() for d in by_e.values() for n in d.values()}


def prepare_experts(prep: Preparer, small: Mapping[str, Tensor], experts: Mapping[str, Mapping[int, Mapping[str, str]]],
                    read) -> dict[str, Tensor]:
    """The stacked expert tensors of a mixture of experts' layer(s) (``experts``: :meth:`Preparer.experts_of`),
    prepared: ``gate_up_proj`` ``(E, 2F, D)`` and ``down_proj`` ``(E, D, F)``, each expert read
    (``read(name)``), converted and folded alone (:meth:`Preparer.one_expert`) into tensors allocated once in the
    dtype the rewrite returns (that of ``read``'s tensors): no float64 copy of the layer, no second stacked copy.
    Equal to :meth:`~symalign.families.moe.MoEFamily.fused` then :func:`symalign.families.prepare` on the layer."""
    fam = prep.adapter
    out: dict[str, Tensor] = {}
    for lp, by_e in experts.items():
        E = 1 + max(by_e)
        missing = [fam.expert_name(lp, e, w) for e in range(E) for w in fam.moe.disk_ffn if w not in by_e.get(e, {})]
        if missing:
            raise CheckpointError(f"{fam.family}: expert tensor {missing[0]!r} is missing")
        gu_name, dn_name = lp + fam.moe.gate_up, lp + fam.moe.down
        for e in range(E):
            gu, dn = prep.one_expert(small, lp, {w: read(n) for w, n in by_e[e].items()})
            if e == 0:
                out[gu_name], out[dn_name] = gu.new_empty((E, *gu.shape)), dn.new_empty((E, *dn.shape))
            out[gu_name][e], out[dn_name][e] = gu, dn
            del gu, dn
    return out


class FoldedCheckpoint:
    """``ck`` read through the exact rewrite of ``--scope model`` (:class:`Preparer`: norm gains folded into
    the next linear maps, the gains set to one), lazily and in row chunks: the same interface as
    :class:`~symalign.checkpoint.lazy.LazyCheckpoint` for :func:`symalign.stream.merge.merge_into`.

    Each read folds only the rows read, in the stored dtype -- as the in-memory merge folds the first
    checkpoint (``prepare`` on its stored state) -- so the rows are exactly those of the folded
    checkpoint (the folds scale columns). Every vector (norm gains, biases) is read once and kept
    (``O(L D)`` values, about ``1/D`` of one layer per layer); a bias folded with its weight (``c + W b``)
    is computed once, from the whole weight. A rewrite that would add a tensor (an untied head) is refused
    (:func:`refusal`): the output keeps this checkpoint's layout. A tensor whose fold is not row-local
    (:meth:`Preparer.row_local`) is folded whole, once; a mixture of experts' expert is folded alone
    (:meth:`Preparer.one_expert`: its three stored tensors, once) and read back under the stored names, and a
    tensor its fused layout renames (Mixtral's router) is folded whole and read back under its stored name.
    """

    def __init__(self, ck: LazyCheckpoint):
        self.ck, self.path = ck, ck.path
        why = refusal(ck)
        if why is not None:
            raise ConfigError(why)
        self.prep = Preparer(ck, ck.adapter.spec(ck.config, ck.keys))
        # an untied head (a LayerNorm stream with a tied head): read from the same rows of the embedding,
        # written after B's last shard's tensors (ShardWriter's ``extra``)
        self.extra = added_tensors(ck, self.prep)
        self.source = {k: copied_from(ck, self.prep, k) for k in self.extra}
        last = sorted(ck.shards, key=lambda sh: sh.path.name)[-1]
        self.tensors = {**ck.tensors, **{k: TensorInfo(k, last.path, dt, shape, last.size, last.size)
                                         for k, (dt, shape) in self.extra.items()}}
        floats = [n for n, t in ck.tensors.items() if t.dtype.is_floating_point and t.numel]
        small = ck.read([n for n in floats if len(ck.tensors[n].shape) <= 1])  # gains, biases: O(L D) values
        self._big = [n for n in floats if n not in small]
        self._fixed = small
        # each small tensor from a call in which it is real: a bias folded with its own weight (read once)
        self._small = {k: v for k, v in self.prep.with_one(small).items() if not v.is_meta}
        for n in self._big:
            owned = [k for k in own_tensors(n, small) if k not in self._small]
            if owned:
                r = self.prep.with_one(small, n, ck.read([n])[n])
                self._small.update({k: r[k] for k in owned})
        self._whole: tuple[str, Tensor] | None = None  # the last tensor folded whole (not row-local)
        self._expert: tuple[tuple[str, int], dict[str, Tensor]] | None = None  # the last expert folded (MoE)

    def _folded_expert(self, name: str) -> Tensor | None:
        """Tensor ``name`` of a mixture of experts' expert, folded with the expert's other two tensors
        (:meth:`Preparer.one_expert`) and stored back under its name (``None``: not an expert's tensor)."""
        key = self.prep.adapter.expert_key(name) if self.prep.fused else None
        if key is None:
            return None
        lp, e, _ = key
        if self._expert is None or self._expert[0] != (lp, e):
            self._expert = None
            names = self.prep.experts[lp][e]
            raw = self.ck.read(list(names.values()))
            gu, dn = self.prep.one_expert(self._fixed, lp, {w: raw[n] for w, n in names.items()})
            self._expert = ((lp, e), self.prep.adapter.unfused(lp, e, gu, dn))
        return self._expert[1][name]

    @property
    def nbytes(self) -> int:
        return self.ck.nbytes

    @property
    def bytes_read(self) -> int:
        return self.ck.bytes_read

    @bytes_read.setter
    def bytes_read(self, value: int) -> None:
        self.ck.bytes_read = value

    def read_rows(self, name: str, start: int, stop: int, dtype: torch.dtype | None = None) -> Tensor:
        """Rows ``start:stop`` of the folded tensor ``name`` (in ``dtype`` if given)."""
        if name in self.extra:  # the untied head: the folded rows of the embedding it copies
            t = self.prep.with_one(self._fixed, self.source[name], self.ck.read_rows(self.source[name], start, stop),
                                   start)[name]
        elif name in self._small:
            t = self._small[name][start:stop]
        elif name not in self._fixed and name not in self._big:  # not a float tensor: untouched by the rewrite
            t = self.ck.read_rows(name, start, stop)
        elif (whole := self._folded_expert(name)) is not None:
            t = whole[start:stop]
        elif name in self.prep.renamed:  # small (a router): folded whole, read under the rewrite's name
            t = self.prep.with_one(self._fixed, name, self.ck.read([name])[name])[self.prep.renamed[name]][start:stop]
        elif self.tensors[name].shape and (start, stop) != (0, self.tensors[name].shape[0]) \
                and not self.prep.row_local(name):
            if self._whole is None or self._whole[0] != name:
                self._whole = None
                self._whole = (name, self.prep.with_one(self._fixed, name, self.ck.read([name])[name])[name])
            t = self._whole[1][start:stop]
        else:
            t = self.prep.with_one(self._fixed, name, self.ck.read_rows(name, start, stop), start)[name]
        return t.to(dtype) if dtype is not None else t

    def read_rows_into(self, name: str, start: int, stop: int, buf: Tensor) -> Tensor:
        """Rows ``start:stop`` of the folded tensor ``name`` in its stored dtype, copied into ``buf`` (as
        :meth:`~symalign.checkpoint.lazy.LazyCheckpoint.read_rows_into`); returns that view of ``buf``."""
        t = self.read_rows(name, start, stop)
        raw = buf.view(-1).view(torch.uint8)
        n = t.numel() * t.element_size()
        if raw.numel() < n:
            raise ValueError(f"buffer of {raw.numel()} bytes for {n} bytes of {name!r}")
        out = raw[:n].view(t.dtype).view(t.shape)
        out.copy_(t)
        return out

    def read(self, names, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
        out = {}
        for n in names:
            if n in self._small:
                out[n] = self._small[n].to(dtype) if dtype is not None else self._small[n]
            else:
                out[n] = self.read_rows(n, 0, self.tensors[n].shape[0], dtype)
        return out


def residual_space(spec: SymmetrySpec) -> str | None:
    """The one residual-stream space of a prepared spec (role ``residual``), if its group is one the
    streamed passes solve: ``O(D)``, a subgroup fixing a subspace (``O_1(D)``), or ``S_D``; ``None`` for a spec
    without one (a bare model outputs the stream: FF units and attention only, each layer on its own)."""
    res = [s for s in spec.spaces if spec.role(s) == "residual"]
    if not res:
        return None
    if len(res) != 1:
        raise ConfigError(f"streamed --scope model needs at most one residual-stream space (found {len(res)}); "
                          "use --no-stream")
    g = spec.spaces[res[0]]
    if not (g.matcher == "orthogonal" or g.is_permutation):  # O(D) and its subgroups (Procrustes), or S_D
        raise ConfigError(f"streamed --scope model does not solve a {g.describe()} residual stream; use --no-stream")
    return res[0]


def refusal(ck: LazyCheckpoint) -> str | None:
    """Why streamed ``--scope model`` cannot be exact on ``ck`` (one line naming the fix), or ``None``:
    more than one residual space, or a residual group the passes do not solve, decided from the tensor headers and
    the config (the family's rewrite run on placeholders). Decoders and encoders alike, with a residual space or
    without (a bare model: its layers alone): the spec the rewrite declares is all it reads."""
    prep = preparer_of(ck, att_spec_of(ck))
    try:
        residual_space(prep.spec)
    except ConfigError as e:
        return f"{ck.path}: {e}"
    return None


def copied_from(ck: LazyCheckpoint, prep: Preparer, name: str) -> str:
    """The tensor an added tensor copies: for an untied head, the embedding (of its shape, written into the
    stream: the residual acts covariantly on its columns)."""
    shape = prep.extra[name]
    for n, info in ck.tensors.items():
        acts = prep.spec.tensors.get(n, [])
        if info.shape == shape and any(prep.spec.role(a.space) == "residual" and a.axis % len(shape) == 1
                                       and a.variance == "co" for a in acts):
            return n
    raise ConfigError(f"internal error: no tensor of {ck.path} is the source of {name!r}; use --no-stream")


def added_tensors(ck: LazyCheckpoint, prep: Preparer) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The tensors ``ck``'s rewrite adds (the untied head) with the dtype of the tensor they copy
    (:func:`copied_from`), as the in-memory rewrite stores them."""
    return {name: (ck.tensors[copied_from(ck, prep, name)].dtype, shape) for name, shape in prep.extra.items()}
