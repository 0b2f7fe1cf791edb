r"""Hugging Face model families inside the experiment protocol: ``family = "hf:<model_type>"``.

An experiment config may name ``family = "hf:gpt2"`` (or ``hf:llama``, ``hf:mistral``,
``hf:qwen2``, ``hf:bert``, ``hf:roformer``, ``hf:modernbert``, ``hf:vit`` -- every family
with an adapter in :mod:`symalign.arch`) and put the transformers config fields in
``[model]`` (``n_embd``/``n_layer``/``n_head`` for GPT-2; ``hidden_size``,
``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``,
``intermediate_size`` for Llama; ...). Two more ``[model]`` keys belong to symalign:
``family`` and ``attn_implementation`` (``"eager"``, the default, or ``"sdpa"``).

* **Head** (from the dataset's modality): a byte/token LM corpus -> ``...ForCausalLM``
  (``GPT2LMHeadModel``); labelled text -> ``...ForSequenceClassification``; images ->
  ``ViTForImageClassification``: each family module's ``experiment``, collected in :data:`FAMILIES`).
* **Dataset-derived fields** (:func:`fit_hf_config`), filled in when absent and checked
  when given: ``vocab_size`` (the dataset's vocabulary: 256 for bytes, the tokenizer's
  otherwise; a larger one is allowed), the position limit (``n_positions`` /
  ``max_position_embeddings``: the context, or the text length; a larger one is
  allowed), ``num_labels`` (exactly the classes), ``image_size``/``num_channels``
  (exactly the images'), ``patch_size`` (must divide the image size). Special-token
  ids a family defaults to but the vocabulary does not hold (GPT-2's 50256) are unset.
* **Model** (:class:`HFModel`): built from config with ``torch.manual_seed(seed)``
  around transformers' own initialisation (so the same seed gives the same weights,
  and re-initialising a scope re-draws exactly those values), float32. Its state dict
  holds the transformers names under the prefix ``hf.``; ``forward(x)`` returns the
  logits, so training, checkpoints and interpolation treat it like a built-in model.
* **Symmetries**: the adapter's attention spec (``heads.i``, ``qk.i``, ``vo.i``) plus,
  for the families :mod:`symalign.families` maps (``model_types()``), the FF unit
  permutations ``ff.i`` (exact on the model as it is). The ``full`` scope aligns in
  the coordinates of :func:`symalign.families.prepare` -- the same function with
  the norm gains folded where the family needs it (Llama-style: RMSNorm gains, residual
  ``O(D)``; GPT-2, ViT: LayerNorm gains and biases, ``O_1(D)``, GPT-2's head untied;
  BERT, RoFormer, ModernBERT unchanged, ``S_D``), where the spec has the residual
  stream too: :meth:`HFModel.rewritten_model`.
* **Scopes** (:meth:`HFModel.scope_names`): ``first-attention``/``all-attention`` = the
  Q, K, V, O weights and biases the adapter lists for those layers, plus the output
  projection's bias (norms are outside, as for the built-in models);
  ``first-block`` = every parameter of layer 0 (norms, attention, MLP); ``full`` = all.

PE per family: GPT-2, BERT, ViT learned absolute positions; Llama, Mistral, Qwen2,
RoFormer, ModernBERT RoPE.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import Tensor, nn

from symalign.arch.base import Adapter
from symalign.errors import ConfigError, SymalignError
from symalign.families import FAMILIES as REGISTERED
from symalign.families.declared import Experiment
from symalign.spec import SymmetrySpec

HF_PREFIX = "hf:"
PREFIX = "hf."  # state-dict prefix of the wrapped transformers model
SYMALIGN_KEYS = ("family", "attn_implementation")
ATTN_IMPLEMENTATIONS = ("eager", "sdpa")
ATTENTION_SCOPES = ("first-attention", "all-attention")
WHOLE_SCOPES = ("first-block", "full")
# transformers config fields symalign sets itself (or that would change what the model returns)
RESERVED = {"dtype": "symalign builds float32 models", "return_dict": "symalign reads the outputs' logits",
            "output_hidden_states": "symalign reads the outputs' logits",
            "transformers_version": "it is recorded by transformers", "architectures": "the head follows the data",
            "add_cross_attention": "cross-attention is not part of the protocol",
            "is_encoder_decoder": "encoder-decoder models are not supported"}
# config-dict entries not kept in a checkpoint (derived, or version-dependent)
_DROP = ("transformers_version", "architectures", "_name_or_path", "model_type", "id2label", "label2id", "dtype")
INSTALL = "pip install 'symalign[hf]' (transformers)"


@dataclass(frozen=True)
class ExperimentFamily:
    """A registered family as an ``hf:`` experiment family: its ``model_type`` and what its module declares
    (:class:`~symalign.families.declared.Experiment`: positional encoding, heads per data modality as
    transformers class names, the config field bounding the sequence length)."""

    model_type: str
    experiment: Experiment

    @property
    def name(self) -> str:
        return HF_PREFIX + self.model_type

    @property
    def pe(self) -> str:
        return self.experiment.pe

    @property
    def heads(self) -> Mapping[str, str]:
        return self.experiment.heads

    @property
    def positions(self) -> str | None:
        return self.experiment.positions


MODALITY = {"lm": "a language-modelling corpus", "text": "a labelled text dataset", "image": "an image dataset"}


def _by_modality(f) -> int:
    return min(list(MODALITY).index(h) for h in f.experiment.heads)


FAMILIES: dict[str, ExperimentFamily] = {
    f.model_types[0]: ExperimentFamily(f.model_types[0], f.experiment)
    for f in sorted((f for f in REGISTERED if f.experiment is not None), key=_by_modality)}
"""The ``hf:`` experiment families: every registered family declaring an ``experiment``, listed by data
modality (language models, labelled text, images), registry order within one."""


def is_hf_family(family: Any) -> bool:
    return isinstance(family, str) and family.startswith(HF_PREFIX)


def _transformers():
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - transformers is installed with the hf extra
        raise ConfigError(f"hf: model families need transformers; install it with: {INSTALL}") from exc
    transformers.utils.logging.disable_progress_bar()
    return transformers


def family_of(family: str) -> ExperimentFamily:
    """The :class:`ExperimentFamily` of ``"hf:<model_type>"``; a family without an adapter is a
    :class:`ConfigError` listing the supported ones (and why, for known refusals)."""
    from symalign.families import UNSUPPORTED

    mt = family[len(HF_PREFIX):] if is_hf_family(family) else family
    if mt not in FAMILIES:
        from symalign.families import model_types

        listed = ", ".join(f.name for f in FAMILIES.values())
        if mt in model_types():
            raise ConfigError(f"[model] family={family!r}: {mt!r} has an adapter (symalign align, interpolate, probe) "
                              f"but is not an hf: experiment family; supported: {listed}")
        why = f" ({UNSUPPORTED[mt]})" if mt in UNSUPPORTED else ""
        raise ConfigError(f"[model] family={family!r}: symalign has no adapter for {mt!r}{why}; supported: {listed}")
    return FAMILIES[mt]


def config_class(fam: ExperimentFamily) -> type:
    return _transformers().CONFIG_MAPPING[fam.model_type]


def allowed_keys(fam: ExperimentFamily) -> list[str]:
    """``[model]`` keys of a family: its transformers config fields (constructor arguments,
    attribute aliases such as GPT-2's ``hidden_size``, ``num_labels``) and :data:`SYMALIGN_KEYS`."""
    cls = config_class(fam)
    params = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    keys = set(params) | set(getattr(cls, "attribute_map", {}) or {}) | {"num_labels"} | set(SYMALIGN_KEYS)
    return sorted(keys - set(RESERVED))


def whole_model_refusal(fam: ExperimentFamily, fields: dict) -> str | None:
    """Why ``first-block``/``full`` cannot run for this family and config (``None``: they can)."""
    from symalign.families import LLAMA_LIKE, model_types

    mapped = model_types()
    if fam.model_type not in mapped:
        return (f"{fam.name} supports the scopes {', '.join(ATTENTION_SCOPES)}; first-block and full need "
                f"whole-model alignment (FF units, residual stream), which symalign maps for "
                f"{', '.join(HF_PREFIX + s for s in mapped)} (docs/whole-model.md)")
    if fam.model_type in LLAMA_LIKE and fields.get("tie_word_embeddings"):
        return (f"{fam.name} with tie_word_embeddings = true cannot fold its final RMSNorm gain into the head, "
                "so first-block and full are refused; set tie_word_embeddings = false or use the scopes "
                + ", ".join(ATTENTION_SCOPES))
    return None


def activation_refusal(fam: ExperimentFamily) -> str | None:
    """Why activation matching cannot run for this family (``None``: it can): its adapter declares no
    activation sites (:meth:`symalign.arch.base.Adapter.activation_sites`)."""
    from symalign.families import get_adapter

    adapter = get_adapter({"model_type": fam.model_type})
    if type(adapter).activation_sites is not Adapter.activation_sites:
        return None
    return (f"{fam.name} declares no activation sites (where a forward pass shows the stream, FF units and "
            "head outputs), so activation matching cannot read its activations; use the methods weight or learned")


def check_model_section(model: dict, scopes: list[str] | tuple[str, ...] = ()) -> ExperimentFamily:
    """Validate an ``hf:`` ``[model]`` section before anything runs: the family has an adapter,
    every key is a field of its transformers config, ``attn_implementation`` is known, the
    fields build a config, and the scopes asked for are supported by the family."""
    fam = family_of(model.get("family", ""))
    allowed = allowed_keys(fam)
    for k in model:
        if k in RESERVED:
            raise ConfigError(f"[model] {k!r} cannot be set for {fam.name}: {RESERVED[k]}")
        if k not in allowed:
            raise ConfigError(f"unknown key [model] {k!r}: {config_class(fam).__name__} has no such field; "
                              f"allowed: {', '.join(allowed)}")
    attn = model.get("attn_implementation", "eager")
    if attn not in ATTN_IMPLEMENTATIONS:
        raise ConfigError(f"[model] attn_implementation={attn!r}; use one of {', '.join(ATTN_IMPLEMENTATIONS)}")
    hf_fields = {k: v for k, v in model.items() if k not in SYMALIGN_KEYS}
    _build_config(fam, hf_fields)
    wanted = [s for s in scopes if s in WHOLE_SCOPES]
    if wanted:
        why = whole_model_refusal(fam, hf_fields)
        if why:
            raise ConfigError(f"protocol.scopes {wanted}: {why}")
    return fam


def _build_config(fam: ExperimentFamily, fields: dict):
    """The transformers config of ``fields``; its own refusals become a :class:`ConfigError`.

    transformers' warnings are silenced here: out-of-vocabulary special-token defaults are
    unset by :func:`fit_hf_config`, and everything else it could warn about is an error below.
    """
    cls = config_class(fam)
    logging = _transformers().utils.logging
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        return cls(**fields)
    except (ValueError, TypeError, KeyError, AssertionError) as exc:
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"{fam.name}: transformers refuses the [model] settings ({msg})") from None
    finally:
        logging.set_verbosity(verbosity)


def _normalised(config) -> dict:
    """The config as a JSON-stable dict (what a checkpoint stores): derived and version-dependent
    entries dropped, ``num_labels`` kept instead of the label maps."""
    d = {k: v for k, v in config.to_dict().items() if k not in _DROP}
    d["num_labels"] = int(config.num_labels)
    return json.loads(json.dumps(d, sort_keys=True))


@dataclass
class HFConfig:
    """An ``hf:`` model: family, task head (``lm`` | ``text`` | ``image``), the transformers
    config (normalised dict) and the attention implementation.

    ``to_dict``/``from_dict`` round-trip exactly through JSON (the checkpoint's ``config.json``).
    """

    family: str
    head: str
    hf: dict = field(default_factory=dict)
    attn_implementation: str = "eager"

    def __post_init__(self):
        fam = family_of(self.family)
        if self.head not in fam.heads:
            raise ConfigError(f"{fam.name} has no {self.head!r} head; it has {', '.join(fam.heads)}")
        if self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise ConfigError(f"attn_implementation={self.attn_implementation!r}; "
                              f"use one of {', '.join(ATTN_IMPLEMENTATIONS)}")

    # -- what the protocol reads ------------------------------------------------
    @property
    def fam(self) -> ExperimentFamily:
        return family_of(self.family)

    @property
    def model_type(self) -> str:
        return self.fam.model_type

    @property
    def pe(self) -> str:
        return self.fam.pe

    def hf_config(self):
        """A fresh transformers config object."""
        return _build_config(self.fam, self.hf)

    @property
    def n_layers(self) -> int:
        return int(self.hf_config().num_hidden_layers)

    @property
    def max_len(self) -> int:
        """Longest input: the position limit (text), or patches + CLS (images)."""
        c = self.hf_config()
        if self.fam.positions is None:
            return (int(c.image_size) // int(c.patch_size)) ** 2 + 1
        return int(getattr(c, self.fam.positions))

    @property
    def class_name(self) -> str:
        return self.fam.heads[self.head]

    # -- serialisation ----------------------------------------------------------
    def to_dict(self) -> dict:
        return {"family": self.family, "head": self.head, "hf": json.loads(json.dumps(self.hf, sort_keys=True)),
                "attn_implementation": self.attn_implementation}

    @classmethod
    def from_dict(cls, d: dict) -> "HFConfig":
        known = {"family", "head", "hf", "attn_implementation"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown hf model config key(s) {unknown}; known keys are {sorted(known)}")
        return cls(**d)


# ----------------------------------------------------------------------------
# fitting a [model] section to a dataset
# ----------------------------------------------------------------------------


def _fill(fields: dict, given: dict, key: str, value: int, ds_name: str, what: str, at_least: bool = False) -> None:
    """Set ``key`` to ``value`` unless given; a given value must equal it (``at_least``: be >= it)."""
    if key not in given:
        fields[key] = value
        return
    v = given[key]
    ok = isinstance(v, int) and not isinstance(v, bool) and (v >= value if at_least else v == value)
    if not ok:
        need = f">= {value}" if at_least else f"= {value}"
        raise ConfigError(f"[model] {key}={v!r} does not fit dataset {ds_name!r} ({what} {value}); "
                          f"set {key} {need} or leave it out to have it filled in")


def fit_hf_config(model: dict, ds, context: int) -> HFConfig:
    """Complete an ``hf:`` ``[model]`` dict from the dataset ``ds`` and check it fits.

    Picks the head from ``ds.modality``, fills and checks the dataset-derived fields (module
    docstring), unsets out-of-vocabulary special-token ids, and builds the model on the meta
    device (no memory) with the adapter's spec, so every shape or group problem is a
    :class:`ConfigError` before training. ``context`` is the training context (LM).
    """
    fam = check_model_section(model)
    given = {k: v for k, v in model.items() if k not in SYMALIGN_KEYS}
    head = ds.modality
    if head not in fam.heads:
        fits = [f.name for f in FAMILIES.values() if head in f.heads]
        raise ConfigError(f"dataset {ds.name!r} is {MODALITY.get(head, head)}, but {fam.name} is built for "
                          f"{' or '.join(MODALITY[h] for h in fam.heads)}; use a family among {', '.join(fits)}")
    fields = dict(given)
    if head in ("lm", "text"):
        _fill(fields, given, "vocab_size", int(ds.vocab_size), ds.name, "vocabulary of", at_least=True)
        need = int(context) if head == "lm" else int(ds.input_shape[0])
        _fill(fields, given, fam.positions, need, ds.name, "sequences of length" if head == "text" else
              "training context", at_least=True)
    if head in ("text", "image"):
        _fill(fields, given, "num_labels", int(ds.n_classes), ds.name, "classes:")
    if head == "image":
        c, h, w = (int(s) for s in ds.input_shape)
        if h != w:
            raise ConfigError(f"dataset {ds.name!r} has {h}x{w} images; {fam.name} needs square images")
        _fill(fields, given, "image_size", h, ds.name, "image size")
        _fill(fields, given, "num_channels", c, ds.name, "channels:")
        if "patch_size" not in given:
            fields["patch_size"] = next(p for p in (7, 4, 2, 1) if h % p == 0)
        elif not isinstance(given["patch_size"], int) or given["patch_size"] <= 0 or h % given["patch_size"]:
            raise ConfigError(f"[model] patch_size={given['patch_size']!r} must divide the image size {h} of "
                              f"{ds.name!r}; pick a divisor of {h}")
    config = _build_config(fam, fields)
    vocab = getattr(config, "vocab_size", None)
    for key in sorted(config.to_dict()):
        tid = getattr(config, key, None)
        if key.endswith("_token_id") and isinstance(tid, int) and vocab is not None and not 0 <= tid < int(vocab):
            if key in given:
                raise ConfigError(f"[model] {key}={tid} is outside the vocabulary (0..{int(vocab) - 1}); "
                                  f"set {key} below vocab_size={vocab} or leave it out")
            fields[key] = None
    cfg = HFConfig(fam.name, head, _normalised(_build_config(fam, fields)),
                   model.get("attn_implementation", "eager"))
    check_buildable(cfg)
    return cfg


def check_buildable(cfg: HFConfig) -> None:
    """Instantiate the model on the meta device and derive its spec: shape and group problems
    (heads not dividing the width, RoPE widths, ...) become :class:`ConfigError`."""
    from symalign.families import get_adapter

    try:
        with torch.device("meta"):
            model = HFModel(cfg, seed=None)
        get_adapter(model.hf.config).spec(model.hf.config, model.state_dict().keys())
    except SymalignError:
        raise
    except (ValueError, TypeError, AssertionError, RuntimeError) as exc:
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"{cfg.family}: transformers cannot build this model ({msg}); check the [model] "
                          "sizes (e.g. hidden_size divisible by num_attention_heads)") from None


# ----------------------------------------------------------------------------
# the model
# ----------------------------------------------------------------------------


class HFModel(nn.Module):
    """A transformers model with symalign's interface: ``forward(x) -> logits``, ``cfg``,
    ``symmetry_spec()``, ``scope_names(scope)``. The transformers model is ``self.hf``
    (state-dict names ``hf.<transformers name>``).

    ``seed``: transformers' initialisation runs under ``torch.manual_seed(seed)`` with the
    caller's RNG state restored afterwards; ``None`` draws from the global RNG.
    """

    def __init__(self, cfg: HFConfig, seed: int | None = 0):
        super().__init__()
        self.cfg = cfg
        # True: in symalign.families.prepare's coordinates, where the spec has the residual stream
        self.rewritten = False
        cls = getattr(_transformers(), cfg.class_name)
        config = cfg.hf_config()
        if seed is None:
            self.hf = cls._from_config(config, attn_implementation=cfg.attn_implementation, dtype=torch.float32)
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(int(seed))
                self.hf = cls._from_config(config, attn_implementation=cfg.attn_implementation, dtype=torch.float32)

    def forward(self, x: Tensor) -> Tensor:
        if self.cfg.head == "image":
            return self.hf(pixel_values=x).logits
        if self.cfg.head == "lm":
            return self.hf(input_ids=x, use_cache=False).logits
        return self.hf(input_ids=x).logits

    # -- symmetries -------------------------------------------------------------
    def _adapter(self):
        from symalign.families import get_adapter

        return get_adapter(self.hf.config)

    def attention_spec(self) -> SymmetrySpec:
        """The adapter's spec (``heads.i``, ``qk.i``, ``vo.i``) over this model's names."""
        return self._adapter().spec(self.hf.config, self.state_dict().keys())

    def _prepared(self):
        """:func:`symalign.families.prepare` of this model's weights (transformers names)."""
        from symalign.families import prepare

        st = {k: v.detach() for k, v in self.hf.state_dict().items()}
        return prepare(self.hf.config, st, self._adapter().spec(self.hf.config, st.keys()), arch=self.cfg.class_name)

    def symmetry_spec(self) -> SymmetrySpec:
        """Exact symmetries: the adapter's attention spaces; with whole-model support also ``ff.i``
        (FF unit permutations) and, once :attr:`rewritten`, the residual stream's group."""
        fam = self.cfg.fam
        if whole_model_refusal(fam, self.cfg.hf) is not None:
            return self.attention_spec()
        spec = SymmetrySpec().merge(self._prepared().spec, prefix=PREFIX)
        if self.rewritten:
            return spec
        return spec.restrict([s for s in spec.spaces if spec.role(s) != "residual"])

    def rewritten_model(self) -> tuple["HFModel", list[str]]:
        """The same function in :func:`symalign.families.prepare`'s coordinates (norm gains
        folded into the next linear maps where the family needs it, GPT-2's head untied), whose
        spec has the residual stream; for the ``full`` scope. Returns ``(model, notes)``."""
        why = whole_model_refusal(self.cfg.fam, self.cfg.hf)
        if why is not None:
            raise ConfigError(why)
        p = self._prepared()
        hf = dict(self.cfg.hf)
        if p.untied:
            hf["tie_word_embeddings"] = False
        ref = next(self.parameters())
        with torch.random.fork_rng(devices=[]):
            out = HFModel(HFConfig(self.cfg.family, self.cfg.head, hf, self.cfg.attn_implementation), seed=None)
        out = out.to(device=ref.device, dtype=ref.dtype)  # before loading: no rounding through float32
        out.hf.load_state_dict(p.state, strict=True)
        out.rewritten = True
        return out.train(self.training), list(p.notes)

    def activation_sites(self) -> list:
        """Where activation matching reads each space (:mod:`symalign.nn.sites`), from the family
        adapter (:meth:`symalign.arch.base.Adapter.activation_sites`); a family without sites raises
        :class:`~symalign.errors.ConfigError` (:func:`activation_refusal` refuses it at config time)."""
        sites = self._adapter().activation_sites(self.hf)
        if sites is None:
            raise ConfigError(activation_refusal(self.cfg.fam) or f"{self.cfg.family} declares no activation sites")
        return sites

    # -- re-initialisation scopes ------------------------------------------------
    def attention_names(self, layers: list[int] | None = None) -> set[str]:
        """Parameters of the attention of ``layers`` (all by default): the Q/K/V/O weights and
        biases the adapter lists, plus the output projection's bias."""
        keys = set(self.state_dict().keys())
        adapter = self._adapter()
        lays = adapter.layouts(self.hf.config, adapter.prefix(keys), keys)
        out: set[str] = set()
        for i, lay in enumerate(lays):
            if layers is not None and i not in layers:
                continue
            for proj in (lay.q, lay.k, lay.v, lay.o):
                out.add(proj.weight)
                if proj.bias:
                    out.add(proj.bias)
            o_bias = lay.o.weight[: -len("weight")] + "bias"
            if lay.o.weight.endswith("weight") and o_bias in keys:
                out.add(o_bias)
        return out

    def block_prefix(self, layer: int) -> str:
        """The name prefix of block ``layer`` (e.g. ``hf.transformer.h.0.``), from the adapter's probe."""
        adapter = self._adapter()
        keys = set(self.state_dict().keys())
        parts = adapter.probe.split(".")
        at = parts.index("0")
        return adapter.prefix(keys) + ".".join(parts[:at] + [str(layer)]) + "."

    def scope_names(self, scope: str) -> set[str]:
        """Parameter names a re-initialisation scope covers (module docstring)."""
        names = [n for n, _ in self.named_parameters()]
        if scope == "full":
            return set(names)
        if scope == "first-attention":
            return self.attention_names([0])
        if scope == "all-attention":
            return self.attention_names()
        if scope == "first-block":
            prefix = self.block_prefix(0)
            return {n for n in names if n.startswith(prefix)}
        from symalign.models.config import SCOPES

        raise ConfigError(f"unknown re-initialisation scope {scope!r}; use one of {', '.join(SCOPES)}")


def build_hf_model(cfg: HFConfig | dict, seed: int | None = 0) -> HFModel:
    """A fresh :class:`HFModel` for ``cfg`` (a config or its ``to_dict``)."""
    if isinstance(cfg, dict):
        cfg = HFConfig.from_dict(cfg)
    return HFModel(cfg, seed=seed)


__all__ = ["ExperimentFamily", "FAMILIES", "HFConfig", "HFModel", "build_hf_model", "check_model_section",
           "fit_hf_config", "is_hf_family", "family_of", "whole_model_refusal", "HF_PREFIX", "PREFIX"]
