r"""Probe a Hugging Face family's real attention layer and compare with what its adapter declares.

For ``source`` a local checkpoint folder (its ``config.json``) or a ``model_type``
(a tiny random config built with transformers' own config class), :func:`probe_hf`

1. builds the base model (``AutoModel``, eager attention, float64) with generic
   ``O(1)`` random weights (``N(0, 1 / fan_in)`` matrices, ``1 + N(0, 0.2^2)``
   vectors: the default ``0.02`` init makes attention nearly uniform and the
   spectrum needlessly ill-conditioned);
2. resolves the site (:func:`probe_site`: layer ``I`` of a single stack, or of the
   encoder / decoder of an encoder-decoder, self- or cross-attention), asks the family's
   adapter (:func:`symalign.families.get_adapter`) for its spec and keeps that layer's
   spaces: the declared dimension is the sum of their group dimensions, and the
   probed parameters are exactly the tensors those spaces act on (Q, K, V, O and the
   biases labelled with them; the output bias ``b_O`` is on the model axis, no
   declared group touches it, and it stays fixed);
3. finds the attention module as the smallest module holding those tensors, runs
   the model once on a generic batch (the adapter's ``dummy_inputs``) to capture
   the module's real call (hidden states, position embeddings, masks), and probes
   ``theta -> output of the output projection`` on that call, in float64 end to
   end (:mod:`symalign.probe.precision`), with the dense Jacobian formed in forward
   *and* reverse mode (they must agree; either spectrum without a clean gap is
   refused);
4. optionally probes the whole block (the enclosing layer of the model's layer
   list, every parameter, its output).

Nothing here is per family: the layer, its tensors and its group come from the
adapter. The measured nullity is compared with the declared dimension plus the
symmetries no adapter declares because they are not in the orbit of a group acting
on the weights (derived from the spec, see :func:`undeclared_terms`):

* ``key_bias``: ``q_m^T b_K`` is the same for every key ``n`` and softmax ignores a
  per-row constant, so the part of ``b_K`` that RoPE does not rotate is free:
  ``h_kv (d - r)`` (``r = 0`` without RoPE);
* ``value_bias_kernel``: shifting ``b_V`` by ``delta`` shifts the output by
  ``sum_i W_O^i delta_{j(i)}`` (attention rows sum to one); with ``b_O`` fixed that is
  zero only on the kernel of that map, ``max(0, h_kv d - D)``;
* ``qk_centring``: under a centring QK-norm (``qk`` group
  :class:`~symalign.groups.PlaneIdentity`, Phi's ``qk_layernorm``) ``W^i -> W^i + 1 v^T``,
  ``b^i -> b^i + c 1`` on every Q and K head is removed by the centring: ``D + 1`` per
  head (``D`` without a bias);
* ``key_norm_bias``: the bias of an affine key norm (a ``.bias`` on the contravariant
  side of a gain-scale space) adds ``q^T beta_k`` to every score of a query on its
  unrotated part: ``d - r`` per gain block.
"""

from __future__ import annotations

import copy
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from symalign.families import get_adapter
from symalign.errors import ConfigError
from symalign.probe.measure import ProbeResult, probe
from symalign.probe.precision import Float64Mode

TINY = dict(hidden_size=16, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, num_decoder_layers=2,
            intermediate_size=32, vocab_size=64, max_position_embeddings=64, image_size=8, patch_size=4,
            embedding_size=16, d_ff=32, ffn_hidden_size=32)
"""Overrides of a ``model_type``'s default config (each applied only when the config has the attribute). The
head is ``hidden_size / num_attention_heads = 4`` wide, and ``head_dim``, Gemma's ``query_pre_attn_scalar``
(default 256: near-uniform attention on a 4-wide head, an ill-conditioned spectrum) and GPT-J's
``rotary_dim`` (default 64; set to half the head) follow it."""

TINY_RMS_EPS = 1e-2
"""RMSNorm ``eps`` of the tiny configs: scaling one head's ``W_Q`` under a QK-norm (Qwen3, Gemma 3, OLMo 2) is
undone by the norm except for its ``eps``, a near-symmetry whose singular values scale with ``eps``; at the
default ``1e-6`` they fall inside the probe's ambiguity band and the probe refuses to count them. A larger
``eps`` shows with a clean gap that they are not symmetries (docs/symmetry.md)."""

MAX_PARAMETERS = 200_000
"""Refuse to probe a layer with more parameters than this (the matrix-free path would take hours on a CPU)."""

OUTPUT_RATIO = 2.0
"""The batch gives at least this many outputs per probed parameter."""

CROSS_INPUTS = ("key_value_states", "encoder_hidden_states")
"""Keyword arguments of a cross-attention call that hold the other stream (replaced by generic states too)."""


@dataclass
class HFProbe:
    """One probed site of a Hugging Face model: measured nullity vs the adapter's declared dimension.

    ``site``: ``"attention"`` (self-attention), ``"cross-attention"`` (an encoder-decoder's
    decoder layer reading the encoder's output) or ``"block"``; ``layer``: the index of the
    layer in its stack; ``stack``: ``"encoder"`` / ``"decoder"`` for an encoder-decoder
    family (None for a single stack); ``module``: the site's path in the base model;
    ``declared``: dimension of the adapter's group on the layer (None for a block,
    whose feed-forward and residual groups no attention adapter declares);
    ``undeclared``: the named exact symmetries outside the declared group
    (:func:`undeclared_terms`); ``expected = declared + sum(undeclared)``.
    """

    family: str
    model_type: str
    layer: int
    site: str
    module: str
    declared: int | None
    group: dict[str, str]
    undeclared: dict[str, int]
    result: ProbeResult
    config: dict[str, Any] = field(default_factory=dict)
    stack: str | None = None

    @property
    def expected(self) -> int | None:
        return None if self.declared is None else self.declared + sum(self.undeclared.values())

    @property
    def match(self) -> bool | None:
        if self.expected is None:
            return None
        return int(self.result.nullity) == self.expected if self.result.method == "dense" else \
            abs(self.result.nullity - self.expected) <= 4 * (self.result.stderr or 0.0) + 1.0

    def to_dict(self) -> dict[str, Any]:
        r = self.result.to_dict()
        for k in ("predicted", "match", "breakdown", "group"):
            r.pop(k, None)
        return {"family": self.family, "model_type": self.model_type, "stack": self.stack, "layer": self.layer,
                "site": self.site, "module": self.module, "declared": self.declared, "undeclared": self.undeclared,
                "expected": self.expected, "match": self.match, "group": self.group, **r, "config": self.config}


# ----------------------------------------------------------------------------
# Config and model
# ----------------------------------------------------------------------------


def hf_config(source: Any) -> Any:
    """A transformers config from a config object, a checkpoint folder, or a ``model_type`` (tiny, see :data:`TINY`)."""
    import transformers

    if not isinstance(source, (str, os.PathLike)):
        return copy.deepcopy(source)  # the probe trims layers and turns the cache off: never on the caller's object
    path = os.fspath(source)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ConfigError(f"{path} has no config.json: not a Hugging Face checkpoint folder")
        return transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if path not in CONFIG_MAPPING:
        raise ConfigError(f"{path!r} is neither a checkpoint folder nor a transformers model_type "
                          f"(e.g. llama, gpt2, bert)")
    config = CONFIG_MAPPING[path]()
    for name, value in TINY.items():
        if hasattr(config, name):
            setattr(config, name, value)
    d = TINY["hidden_size"] // TINY["num_attention_heads"]
    for name, value in (("head_dim", d), ("query_pre_attn_scalar", d), ("rms_norm_eps", TINY_RMS_EPS)):
        if getattr(config, name, None) is not None:
            try:
                setattr(config, name, value)
            except AttributeError:  # a derived property (Falcon's head_dim = hidden_size / heads)
                pass
    if isinstance(getattr(config, "rotary_dim", None), int) and config.rotary_dim > d:  # GPT-J's 64: partial RoPE
        config.rotary_dim = d // 2
    rope = getattr(config, "rope_parameters", None)  # StableLM's 0.25 of a 4-wide head would rotate 1 dimension
    holder = rope if isinstance(rope, dict) and "partial_rotary_factor" in rope else None
    factor = holder["partial_rotary_factor"] if holder is not None else getattr(config, "partial_rotary_factor", None)
    if isinstance(factor, float) and 0 < factor < 1 and int(factor * d) % 2:
        if holder is not None:  # still partial, on an even number of dimensions (whole rotation planes)
            holder["partial_rotary_factor"] = 0.5
        else:
            config.partial_rotary_factor = 0.5
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    for name in list(vars(config)):  # special tokens of the full vocabulary would not fit the tiny one
        value = getattr(config, name)
        if name.endswith("_token_id") and isinstance(value, int) and vocab and value >= vocab:
            setattr(config, name, min(vocab - 1, 3))
    return config


def generic_model(config: Any, seed: int = 0) -> nn.Module:
    """The base model (``AutoModel``), eager attention, float64, with generic ``O(1)`` weights (module doc)."""
    import transformers

    if hasattr(config, "use_cache"):
        config.use_cache = False
    torch.manual_seed(seed)
    model = transformers.AutoModel.from_config(config, attn_implementation="eager", experts_implementation="eager")
    model = model.to(torch.float64).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if not p.is_floating_point():
                continue
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            p.copy_(noise / math.sqrt(p.shape[-1]) if p.dim() >= 2 else 1.0 + 0.2 * noise)
    return model


# ----------------------------------------------------------------------------
# What the adapter declares for one layer
# ----------------------------------------------------------------------------


def layer_spec(spec: Any, layer: int):
    """The sub-spec of layer ``layer``'s attention spaces (by role and layer when the spec records them)."""
    if hasattr(spec, "select"):
        names = spec.select(role=("heads", "qk", "vo"), layer=layer)
    else:
        names = [n for n in (f"heads.{layer}", f"qk.{layer}", f"vo.{layer}") if n in spec.spaces]
    return spec.restrict(names)


def _parent(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _common_module(names: list[str]) -> str:
    parts = [_parent(n).split(".") for n in names]
    common = []
    for level in zip(*parts):
        if len(set(level)) > 1:
            break
        common.append(level[0])
    return ".".join(common)


def _space_tensors(spec: Any, space: str, variance: str) -> list[str]:
    return [t for t, acts in spec.tensors.items() if any(a.space == space and a.variance == variance for a in acts)]


def undeclared_terms(spec: Any, state: dict[str, Tensor]) -> dict[str, int]:
    """Exact symmetries of one attention layer outside its declared group (module doc), from the spec alone.

    ``spec``: the layer's sub-spec (one ``qk`` and one ``vo`` space); ``state``: its tensors.
    A ``qk`` group other than ``GL(d)`` / ``H(r) (+) GL(d - r)`` per head (e.g. one that
    a normalisation shapes) gets no ``key_bias`` term.
    """
    terms: dict[str, int] = {}
    for space, group in spec.spaces.items():
        inner = group.head_block
        if inner is None:
            continue
        blocks = group.n_blocks
        role = spec.role(space) if hasattr(spec, "role") else space.split(".")[0]
        biases = [t for t in (_space_tensors(spec, space, "contra") + _space_tensors(spec, space, "co"))
                  if state[t].dim() == 1]
        if role == "qk" and inner.centring:  # a centring QK-norm removes 1 v^T, c 1 per head
            terms["qk_centring"] = sum(act.size_of(state[t]) // inner.n * (state[t].numel() // state[t].shape[act.axis])
                                       for t, act in spec.tensors_of(space))
        elif role == "qk":
            k_bias = [t for t in _space_tensors(spec, space, "contra") if state[t].dim() == 1]
            if k_bias and inner.key_bias_shift:  # the unrotated width (GL: all of it; QK-norm: none)
                terms["key_bias"] = blocks * inner.key_bias_shift
        elif role == "vo" and any(t in _space_tensors(spec, space, "co") for t in biases):
            out = [t for t in _space_tensors(spec, space, "contra") if state[t].dim() == 2]
            if out:
                act = next(a for a in spec.tensors[out[0]] if a.space == space)
                model_dim = state[out[0]].shape[1 - (act.axis % 2)]
                kernel = max(0, blocks * inner.n - int(model_dim))
                if kernel:
                    terms["value_bias_kernel"] = kernel
        elif inner.rescales_gains and inner.key_bias_shift and any(
                t.endswith(".bias") for t in _space_tensors(spec, space, "contra")):
            terms["key_norm_bias"] = blocks * inner.key_bias_shift  # an affine key norm's bias, unrotated part
    return terms


# ----------------------------------------------------------------------------
# Capturing the layer's real call
# ----------------------------------------------------------------------------


class _Call(nn.Module):
    """``theta -> output of module `site` inside one fixed call of `layer``` (the probed function; no inputs)."""

    def __init__(self, layer: nn.Module, args: tuple, kwargs: dict, site: str):
        super().__init__()
        self.layer = layer
        self.args, self.kwargs, self.site = args, kwargs, site

    def _apply(self, fn: Any, recurse: bool = True) -> "_Call":
        """``.to(device)`` (and every other ``_apply``) also moves the tensors of the captured call."""
        def each(x: Any) -> Any:
            if isinstance(x, Tensor):
                return fn(x)
            if isinstance(x, (tuple, list)):
                return type(x)(each(v) for v in x)
            if isinstance(x, dict):
                return {k: each(v) for k, v in x.items()}
            return x

        self.args, self.kwargs = each(self.args), each(self.kwargs)
        return super()._apply(fn, recurse)

    def forward(self) -> Tensor:
        target = self.layer.get_submodule(self.site) if self.site else self.layer
        seen: list[Any] = []
        hook = target.register_forward_hook(lambda m, i, o: seen.append(o))
        try:
            out = self.layer(*self.args, **self.kwargs)
        finally:
            hook.remove()
        y = seen[-1] if seen else out
        return y[0] if isinstance(y, (tuple, list)) else y


def capture_call(model: nn.Module, module_name: str, inputs: dict[str, Tensor]) -> tuple[tuple, dict]:
    """The positional and keyword arguments ``module_name`` receives when ``model(**inputs)`` runs (in float64)."""
    module = model.get_submodule(module_name)
    got: list[tuple[tuple, dict]] = []

    def grab(mod, args, kwargs):
        got.append((args, kwargs))

    handle = module.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with torch.no_grad(), Float64Mode():
            model(**inputs)
    finally:
        handle.remove()
    if not got:
        raise ConfigError(f"the model never called {module_name} on the probe batch")

    def detach(x):
        if isinstance(x, Tensor):
            return x.detach().to(torch.float64) if x.is_floating_point() else x.detach()
        if isinstance(x, tuple):
            return tuple(detach(v) for v in x)
        if isinstance(x, list):
            return [detach(v) for v in x]
        return x

    args, kwargs = got[0]
    return detach(args), {k: detach(v) for k, v in kwargs.items()}


def _hidden_states(args: tuple, kwargs: dict) -> tuple[str, Any] | None:
    """Where the call's hidden states are: ``("arg", i)`` or ``("kw", name)`` (the first 3-d floating tensor)."""
    for i, x in enumerate(args):
        if isinstance(x, Tensor) and x.is_floating_point() and x.dim() == 3:
            return "arg", i
    for k, x in kwargs.items():
        if isinstance(x, Tensor) and x.is_floating_point() and x.dim() == 3:
            return "kw", k
    return None


def generic_hidden_states(args: tuple, kwargs: dict, seed: int) -> tuple[tuple, dict, int]:
    r"""The call with its hidden states replaced by ``N(0, 1)`` ones of the same shape; also returns ``T``.

    The model's own hidden states are not generic: after a LayerNorm they lie in an
    affine hyperplane (``u^T x = c`` with ``u = 1 / gamma``), which adds exact symmetries
    of the *composition* (``W -> W + a u^T``, ``b -> b - c a``: ``D`` per biased
    projection) that are not symmetries of the layer. The probe measures the layer. A
    cross-attention call's other stream (:data:`CROSS_INPUTS`) is replaced the same way.
    """
    where = _hidden_states(args, kwargs)
    if where is None:
        raise ConfigError("could not find the hidden states (a 3-d floating tensor) in the attention layer's call")
    kind, key = where
    x = args[key] if kind == "arg" else kwargs[key]
    gen = torch.Generator().manual_seed(seed)
    fresh = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    if kind == "arg":
        args = args[:key] + (fresh,) + args[key + 1:]
    else:
        kwargs = {**kwargs, key: fresh}
    for name in CROSS_INPUTS:  # cross-attention: the other stream (keys/values) is generic too
        y = kwargs.get(name)
        if isinstance(y, Tensor) and y.is_floating_point() and y.dim() == 3 and name != key:
            kwargs = {**kwargs, name: torch.randn(y.shape, generator=gen, dtype=torch.float64)}
    return args, kwargs, int(x.shape[1])


def _frequencies(model: nn.Module, config: Any, layer: int) -> Tensor | None:
    """The RoPE plane frequencies of layer ``layer``: the model's ``*inv_freq`` buffer (per layer type if several),
    without zero frequencies (proportional RoPE's unrotated planes: not rotation planes at all)."""
    found = {n: b for n, b in model.named_buffers() if n.endswith("inv_freq") and not n.endswith("original_inv_freq")}
    if not found:
        return None
    distinct = {tuple(b.tolist()): b for b in found.values()}
    hit = None
    if len(distinct) == 1:
        hit = next(iter(distinct.values()))
    types = getattr(config, "layer_types", None)
    if hit is None and types and layer < len(types):
        hits = [b for n, b in found.items() if n.rsplit(".", 1)[-1].startswith(str(types[layer]))]
        hit = hits[0] if hits else None
    return None if hit is None else hit[hit != 0]


def _block_of(module_name: str) -> str:
    """The enclosing element of a layer list: the deepest proper ancestor whose last name part is an index."""
    parts = module_name.split(".")
    for k in range(len(parts) - 2, -1, -1):
        if parts[k].isdigit():
            return ".".join(parts[: k + 1])
    raise ConfigError(f"{module_name} is not inside a layer list (no 'name.<index>' ancestor): no block to probe")


def _tokens_times_width(args: tuple, kwargs: dict) -> int:
    where = _hidden_states(args, kwargs)
    if where is None:
        raise ConfigError("could not find the hidden states (a 3-d floating tensor) in the attention layer's call")
    x = args[where[1]] if where[0] == "arg" else kwargs[where[1]]
    return int(x.shape[1]) * int(x.shape[2])


#: Bytes the block probe needs per squared parameter: two dense Jacobians of ``OUTPUT_RATIO n`` rows by ``n``
#: float64 columns and their SVD workspaces (measured: a 13,216-parameter Mixtral block took 23 GB).
BLOCK_BYTES_PER_PARAM2 = 8 * OUTPUT_RATIO * 8


def _available_bytes() -> int:
    """Memory available to this process now (``MemAvailable``; the physical pages where that is unreadable)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _check_block_fits(n_block: int, family: str, block_name: str) -> None:
    """Refuse ``--block`` before forming a dense Jacobian that would not fit in memory (no OOM kill)."""
    need, have = BLOCK_BYTES_PER_PARAM2 * n_block ** 2, _available_bytes()
    if need > have:
        raise ConfigError(f"--block: the {family} block {block_name!r} has {n_block:,} parameters, whose dense "
                          f"Jacobians need about {need / 2**30:.1f} GiB and {have / 2**30:.1f} GiB are available; "
                          "drop --block (the attention layer is probed alone)")


def _batch(n_params: int, per_item: int) -> int:
    """Batch size giving at least :data:`OUTPUT_RATIO` outputs per probed parameter."""
    return max(1, math.ceil(OUTPUT_RATIO * n_params / per_item))


# ----------------------------------------------------------------------------
# The probe
# ----------------------------------------------------------------------------


def probe_site(adapter: Any, config: Any, layer: int, stack: str | None = None,
               cross: bool = False) -> tuple[int, str | None]:
    """Resolve ``--layer [STACK.]I [--cross]`` for ``adapter``: trim ``config`` in place to what the probe builds
    and return ``(number, stack)``: the layer number of the site's spaces in the adapter's spec
    and the site's stack (None for a single stack).

    An adapter with several stacks (an encoder-decoder: T5) resolves it itself
    (``adapter.probe_site``). A single stack: ``I`` is the layer index, no stack and no
    cross-attention may be named, and only layers ``0..I`` are built.
    """
    own = getattr(adapter, "probe_site", None)
    if own is not None:
        return own(config, layer, stack, cross)
    if stack is not None:
        raise ConfigError(f"--layer {stack}.{layer} names a stack, but {adapter.family} has a single stack of layers; "
                          f"use --layer {layer}")
    if cross:
        raise ConfigError(f"--cross: {adapter.family} has no cross-attention (encoder-decoder families such as T5 do)")
    n_layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    if not 0 <= layer < max(n_layers, 1):
        raise ConfigError(f"--layer {layer} is out of range: the model has {n_layers} layers (0..{n_layers - 1})")
    if n_layers > layer + 1:  # build only what is needed up to the probed layer
        config.num_hidden_layers = layer + 1
        if getattr(config, "layer_types", None):
            config.layer_types = list(config.layer_types)[: layer + 1]
    return layer, None


def probe_hf(source: Any, layer: int = 0, *, stack: str | None = None, cross: bool = False, block: bool = False,
             seed: int = 0, method: str = "auto", ad: str = "both", probes: int = 16,
             device: str | torch.device | None = None) -> list[HFProbe]:
    """Probe one attention site of a Hugging Face family (module doc): ``[attention]`` or ``[attention, block]``.

    ``source``: a checkpoint folder, a ``model_type``, or a transformers config.
    ``layer``: the layer's index in its stack; ``stack``: ``"encoder"`` / ``"decoder"`` of an
    encoder-decoder family (default: its encoder); ``cross``: the decoder layer's
    cross-attention instead of its self-attention (:func:`probe_site`); ``device``: where the Jacobians are
    measured (:func:`symalign.probe.measure.probe`'s ``device``).
    Raises :class:`~symalign.errors.ConfigError` for an unknown source, a family
    without an adapter, or a site that does not exist, and
    :class:`~symalign.probe.spectrum.AmbiguousSpectrumError` when a spectrum has no clean gap.
    """
    t = _AttentionSite.open(source, layer, stack, cross, seed)
    per_item = _tokens_times_width(*capture_call(t.model, t.attn_name, _inputs(t.adapter, t.config, 1, seed)))
    opts = dict(method=method, ad=ad, probes=probes, seed=seed, device=device)
    res, freqs = _probe_attention(t, per_item, opts)
    rows = [HFProbe(t.adapter.family, t.config.model_type, layer, "cross-attention" if cross else "attention",
                    t.attn_name, t.declared, t.spec.describe(), t.undeclared, res, t.cfg_summary, t.stack)]
    if block:
        rows.append(_probe_block(t, layer, per_item, freqs, opts))
    return rows


@dataclass
class _AttentionSite:
    """The probed layer of a generic model of the family: its config and adapter, the model and its state, the
    layer's spec (its attention spaces) and tensors, the attention module (``attn_name``) and the value/output site
    inside it, the declared group's dimension and the undeclared exact symmetries."""

    config: Any
    adapter: Any
    cfg_summary: Any
    number: int
    stack: str | None
    model: nn.Module
    state: dict[str, Tensor]
    spec: Any
    tensors: list[str]
    attn_name: str
    site: str
    declared: int
    undeclared: dict[str, int]
    n_params: int

    @classmethod
    def open(cls, source: Any, layer: int, stack: str | None, cross: bool, seed: int) -> _AttentionSite:
        """The site of ``layer`` (:func:`probe_site`) in a generic model (``seed``); :class:`ConfigError` when the
        adapter declares no attention space there or the layer has more than ``MAX_PARAMETERS`` parameters."""
        config = hf_config(source)
        adapter = get_adapter(config)
        cfg_summary = _summary(config)
        number, stack = probe_site(adapter, config, layer, stack, cross)
        model = generic_model(config, seed)
        state = dict(model.state_dict())
        full = adapter.spec(model)
        spaces = getattr(adapter, "layer_spaces", None)  # a Family names all its attention spaces (QK-norm gains too)
        spec = full.restrict([s for s in spaces(number) if s in full.spaces]) if spaces else layer_spec(full, number)
        tensors = list(spec.tensors)
        if not tensors:
            raise ConfigError(f"the {adapter.family} adapter declares no attention spaces for layer {layer}")
        attn_name = _common_module(tensors)
        site = _parent(next(t for t in tensors if any(a.variance == "contra" for a in spec.tensors[t])
                            and state[t].dim() == 2 and _is_vo(spec, t)))
        declared = int(spec.dim)
        undeclared = undeclared_terms(spec, state)
        n_params = sum(state[t].numel() for t in tensors)
        if n_params > MAX_PARAMETERS:
            raise ConfigError(f"layer {layer} of this {adapter.family} model has {n_params:,} attention parameters; "
                              f"the probe handles up to {MAX_PARAMETERS:,} (pass the model_type, e.g. "
                              f"{config.model_type!r}, to probe a tiny model with the same structure)")
        return cls(config, adapter, cfg_summary, number, stack, model, state, spec, tensors, attn_name, site, declared,
                   undeclared, n_params)


def _probe_attention(t: _AttentionSite, per_item: int, opts: dict) -> tuple[ProbeResult, Tensor | None]:
    """The attention module's Jacobian probe on its captured call (a batch sized by :func:`_batch`, generic hidden
    states), predicted nullity ``declared + sum(undeclared)``; also the layer's RoPE frequencies (read after the
    calls, as the block probe reuses them)."""
    seed = opts["seed"]
    args, kwargs = capture_call(t.model, t.attn_name, _inputs(t.adapter, t.config, _batch(t.n_params, per_item), seed))
    args, kwargs, seq_len = generic_hidden_states(args, kwargs, seed + 2)
    freqs = _frequencies(t.model, t.config, t.number)
    call = _Call(t.model.get_submodule(t.attn_name), args, kwargs,
                 t.site[len(t.attn_name) + 1:] if t.attn_name else t.site)
    names = ["layer." + n[len(t.attn_name) + 1:] if t.attn_name else "layer." + n for n in t.tensors]
    res = probe(call, (), method=opts["method"], ad=opts["ad"], probes=opts["probes"], seed=seed, parameters=names,
                check_heads=False, predicted=t.declared + sum(t.undeclared.values()), frequencies=freqs,
                seq_len=seq_len, spec=t.spec, device=opts["device"])
    return res, freqs


def _probe_block(t: _AttentionSite, layer: int, per_item: int, freqs: Tensor | None, opts: dict) -> HFProbe:
    """``--block``: the Jacobian probe of the whole layer enclosing the attention module (no declared group);
    :class:`ConfigError` for a mixture-of-experts layer or a block too large."""
    if getattr(t.adapter, "moe", None) is not None:
        raise ConfigError(f"--block: a {t.adapter.family} layer routes each token to its experts data-dependently, "
                          "which the Jacobian tracer cannot follow; drop --block (the experts-and-router block "
                          "is probed on its own: docs/symmetry.md, 'Mixture-of-experts blocks')")
    seed = opts["seed"]
    block_name = _block_of(t.attn_name)
    block_module = t.model.get_submodule(block_name)
    n_block = sum(p.numel() for p in block_module.parameters() if p.is_floating_point())
    _check_block_fits(n_block, t.adapter.family, block_name)
    bargs, bkwargs = capture_call(t.model, block_name, _inputs(t.adapter, t.config, _batch(n_block, per_item), seed))
    bargs, bkwargs, bseq = generic_hidden_states(bargs, bkwargs, seed + 3)
    bres = probe(_Call(block_module, bargs, bkwargs, ""), (), method=opts["method"], ad=opts["ad"],
                 probes=opts["probes"], seed=seed, check_heads=False, frequencies=freqs, seq_len=bseq,
                 device=opts["device"])
    return HFProbe(t.adapter.family, t.config.model_type, layer, "block", block_name, None, {}, {}, bres,
                   t.cfg_summary, t.stack)


def _is_vo(spec: Any, tensor: str) -> bool:
    role = (lambda s: spec.role(s)) if hasattr(spec, "role") else (lambda s: s.split(".")[0])
    return any(role(a.space) == "vo" and a.variance == "contra" for a in spec.tensors[tensor])


def _inputs(adapter: Any, config: Any, batch: int, seed: int) -> dict[str, Tensor]:
    """The adapter's generic batch (8 tokens for text models), floating inputs in float64."""
    inputs = adapter.dummy_inputs(config, batch=batch, seq=8, seed=seed + 1)
    return {k: (v.to(torch.float64) if v.is_floating_point() else v) for k, v in inputs.items()}


def _summary(config: Any) -> dict[str, Any]:
    keys = ("model_type", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "num_hidden_layers", "num_decoder_layers", "partial_rotary_factor", "rope_theta", "attention_bias",
            "qkv_bias")
    out = {}
    for k in keys:
        v = getattr(config, k, None)
        if v is not None and isinstance(v, (int, float, str, bool)):
            out[k] = v
    return out
