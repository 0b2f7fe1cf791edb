r"""Per-layer function check of a streamed alignment, through the family's own Hugging Face code.

A 7B model cannot be run in float64 on a small machine, but one of its layers can.
:class:`LayerChecker` builds, once, a one-layer model of B's family from B's config
(``num_hidden_layers = 1``, a tiny vocabulary; for the attention scope also a tiny
FF width, since the FF is not touched), randomly initialised in the check's dtype
(float64 when the layer fits, else float32). To check layer ``i`` it loads B's layer
``i`` into the model's layer 0 -- every tensor of that layer whose shape fits; the
rest keeps the (seeded, shared) random values -- runs the model's own forward on a
random batch, then loads the aligned layer (and, for the model scope, the rotated
embedding/head of the one-layer model) and runs again:

``rel = ||f_{B'_i}(x) - f_{B_i}(x)|| / ||f_{B_i}(x)||``, with ``f`` the hidden states the
layer outputs (captured by a forward hook, before any final norm: HF's RMSNorm
computes in float32 and would hide differences below float32 resolution).

With the embedding ``E`` and head ``H`` of the one-layer model, a residual rotation
``O`` of the model scope is checked by giving the aligned run ``E O^T`` and
``H O^T`` (the actions of the residual space on those tensors): the output is the
same iff ``layer'(O x) = O layer(x)`` on the inputs, i.e. iff the aligned layer is
the exact image of B's layer.
"""

from __future__ import annotations

import copy
import gc
import threading
from typing import Any, Mapping

import torch
from torch import Tensor

from symalign.tolerance import FunctionCheck, relative_change
from symalign.errors import ConfigError

FLOAT64_MAX_LAYER_PARAMS = 100_000_000  # a one-layer model above this (0.8 GB in float64) is checked in float32
TINY_VOCAB = 64
TINY_FF = 8


def layer_prefix(name: str, i: int) -> str:
    """``"model.layers.3."`` from ``"model.layers.3.self_attn.q_proj.weight"`` and ``i = 3``."""
    key = f".{i}."
    at = name.find(key)
    if at < 0:
        raise ConfigError(f"cannot find the layer index {i} in tensor name {name!r}")
    return name[: at + len(key)]


def disk_names(model: torch.nn.Module, state: Mapping[str, Tensor]) -> dict[str, str]:
    """Saved name -> module name of each tensor (transformers 5.x renames some families on save, e.g. ViT)."""
    same = {k: k for k in state}
    try:
        from transformers.core_model_loading import revert_weight_conversion

        on_disk = revert_weight_conversion(model, dict(state))
    except Exception:  # pragma: no cover - older transformers save names as in memory
        return same
    if len(on_disk) != len(state):
        return same
    by_id = {id(v): k for k, v in state.items()}
    out = {d: by_id[id(v)] for d, v in on_disk.items() if id(v) in by_id}
    return out if len(out) == len(state) else same


def sparse_layer(config: Any, i: int) -> bool | None:
    """Whether layer ``i`` has a mixture-of-experts block in a config that mixes dense and sparse layers
    (transformers' Qwen2-MoE rule: not in ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``);
    ``None`` for a config without that choice."""
    if not hasattr(config, "mlp_only_layers"):
        return None
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    return i not in list(config.mlp_only_layers or []) and int(getattr(config, "num_experts", 0) or 0) > 0 \
        and (i + 1) % step == 0


# Building the one-layer model sets process-wide state and restores it: the global RNG seed, transformers' log
# verbosity, and torch's default dtype (``_from_config`` builds in the config's dtype, float64 for a float64
# checkpoint). Two builds on two threads (``merge`` aligns each model on its own) would interleave the saves and
# restores and could leave the default dtype at float64 for the whole process: they take this lock.
_BUILDING = threading.Lock()


class LayerChecker:
    """Runs single layers of B's family (see the module docstring).

    ``shrink_ff``: replace the FF width by :data:`TINY_FF` (attention scope: the FF
    is unchanged, so its tensors are not loaded and need no memory).
    """

    def __init__(self, config: Any, adapter: Any, layer0: str, shrink_ff: bool, layer_params: int, seed: int = 0,
                 sparse: bool | None = None):
        """``sparse``: the kind of FF block the one layer has when the config mixes them (Qwen2-MoE's
        ``mlp_only_layers`` / ``decoder_sparse_step``; :func:`sparse_layer`), so that it holds the tensors
        of the layers of that kind (``None``: as the config says for layer 0)."""
        cfg = copy.deepcopy(config)
        cfg.num_hidden_layers = 1
        if sparse is not None and hasattr(cfg, "mlp_only_layers"):
            cfg.mlp_only_layers, cfg.decoder_sparse_step = ([] if sparse else [0]), 1
        for attr in ("layer_types",):  # per-layer tables must have one entry
            v = getattr(cfg, attr, None)
            if isinstance(v, list) and v:
                setattr(cfg, attr, v[:1])
        if hasattr(cfg, "vocab_size"):
            cfg.vocab_size = TINY_VOCAB
        if shrink_ff:
            ff_size = getattr(getattr(adapter, "decl", None), "ff_size", "intermediate_size")  # GPT-2: n_inner
            if ff_size != "intermediate_size" or getattr(cfg, ff_size, None) is not None:
                setattr(cfg, ff_size, TINY_FF)
            layer_params = min(layer_params, FLOAT64_MAX_LAYER_PARAMS)
        cfg._attn_implementation = "eager"
        cfg = adapter.function_check_config(cfg)  # e.g. every expert routed: a block continuous in its weights
        self.config = cfg
        self.adapter = adapter
        self.dtype = torch.float64 if layer_params <= FLOAT64_MAX_LAYER_PARAMS else torch.float32
        cls = adapter.model_class(cfg)
        from transformers.utils import logging

        with _BUILDING:  # process-wide state, set and restored: one build at a time (merge producers are threads)
            torch.manual_seed(seed)
            verbosity = logging.get_verbosity()
            logging.set_verbosity_error()
            try:
                model = cls._from_config(cfg, experts_implementation="eager")
            finally:
                logging.set_verbosity(verbosity)
        self.model = model.to(self.dtype).eval()
        if self.dtype == torch.float64:  # RMSNorm, eager softmax, MoE routers: in float64 too (same formulas)
            from symalign.probe.families import float64_numerics

            float64_numerics(self.model)
        self.names = self.model.state_dict()
        self.disk = disk_names(self.model, self.names)
        self.layer0 = layer0
        probe = next((m for d, m in self.disk.items() if d.startswith(layer0)), None)
        try:
            if probe is None:
                raise AttributeError(layer0)
            self.layer_module = self.model.get_submodule(layer_prefix(probe, 0).rstrip("."))
        except (AttributeError, ConfigError):
            raise ConfigError(f"the {adapter.family} model has no layer {layer0.rstrip('.')!r}: the per-layer "
                              "check cannot run (use --no-stream)") from None
        # the tensors outside the layer (embedding, final norm, head): restored before each run
        inside = layer_prefix(probe, 0)
        self.base = {k: v.detach().clone() for k, v in self.names.items() if not k.startswith(inside)}
        inputs = adapter.dummy_inputs(cfg, seed=seed)
        self.inputs = {k: (v.to(self.dtype) if v.is_floating_point() else v) for k, v in inputs.items()}

    def local_names(self, names, i: int) -> dict[str, str]:
        """On-disk names of layer ``i`` -> the one-layer model's names, for the tensors whose shapes fit."""
        out = {}
        for n in names:
            p = layer_prefix(n, i)
            local = self.disk.get(self.layer0 + n[len(p):])
            if local is not None:
                out[n] = local
        return out

    def wanted(self, names, shapes: Mapping[str, tuple[int, ...]], i: int) -> list[str]:
        """Layer ``i``'s tensors the check loads (those whose shapes the one-layer model shares)."""
        loc = self.local_names(names, i)
        return [n for n, ln in loc.items() if tuple(self.names[ln].shape) == tuple(shapes[n])]

    @torch.no_grad()
    def run(self, layer: Mapping[str, Tensor], i: int, overrides: Mapping[str, Tensor] | None = None) -> Tensor:
        """Output of the one-layer model with ``layer`` (on-disk names of layer ``i``) loaded."""
        from symalign.arch.check import _first_output

        state = dict(self.base)
        for n, ln in self.local_names(layer, i).items():
            state[ln] = layer[n]
        for k, v in (overrides or {}).items():
            state[k] = v
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        if unexpected:
            raise ConfigError(f"internal error: the one-layer model has no tensor {unexpected[0]!r}")
        seen: list[Tensor] = []
        handle = self.layer_module.register_forward_hook(lambda mod, args, out: seen.append(_first_output(out)))
        try:
            self.model(**self.inputs)
        finally:
            handle.remove()
        return seen[0].to(torch.float64)

    def change(self, ref: Mapping[str, Tensor], new: Mapping[str, Tensor], i: int,
               new_overrides: Mapping[str, Tensor] | None = None, rotate: Tensor | None = None
               ) -> tuple[float, float]:
        """``(||f_new - R f_ref|| / ||f_ref||, max |f_new - R f_ref|)`` (``inf`` if not finite), ``f`` the
        layer's output (hidden states).

        ``rotate``: the residual rotation ``R`` (``D x D``) of the model scope, applied to the
        reference output; ``new_overrides`` then carries the rotated embedding (and head).
        """
        y0 = self.run(ref, i)
        if rotate is not None:
            y0 = y0 @ rotate.to(torch.float64).T
        y1 = self.run(new, i, new_overrides)
        gc.collect(1)  # the forward's young cycles (a full collection costs ~1-2 s per call here)
        return relative_change(y0, y1)

    def compare(self, ref: Mapping[str, Tensor], new: Mapping[str, Tensor], i: int,
                new_overrides: Mapping[str, Tensor] | None = None, rotate: Tensor | None = None) -> float:
        """The relative change of :meth:`change`."""
        return self.change(ref, new, i, new_overrides, rotate)[0]

    def check(self, ref: Mapping[str, Tensor], new: Mapping[str, Tensor], i: int, tol: float,
              new_overrides: Mapping[str, Tensor] | None = None, rotate: Tensor | None = None,
              stored: bool = True) -> FunctionCheck:
        """:meth:`change` of layer ``i`` against the bound ``tol`` (``stored``: ``new`` is rounded to B's dtype)."""
        rel, max_abs = self.change(ref, new, i, new_overrides, rotate)
        return FunctionCheck.of(rel, max_abs, self.dtype, tol, layer=i, stored=stored)
