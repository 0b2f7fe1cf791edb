"""Experiment configuration (TOML), validated before anything runs.

A config names a model family, a dataset and the protocol::

    name = "vit-digits-rope"
    data = "digits"
    [data_options]            # optional, passed to symalign.data.load_dataset
    [model]                   # symalign.models.ModelConfig fields (family, pe, d_model, ...), or
                              # family = "hf:gpt2" | "hf:llama" | ... and that transformers config's
                              # fields (symalign.models.hf)
    [train]                   # symalign.train.TrainConfig fields (steps, batch_size, lr, ...)
    [protocol]
    scopes = ["all-attention"]            # first-attention | all-attention | first-block | full (alias model)
    seeds = [1, 2]                        # the seeds of models A and B
    base_seed = 0                         # the shared base model (scopes other than full)
    freeze = true                         # train only the re-initialised scope
    points = 25                           # interpolation grid
    eval_items = 2000                     # held-out examples (LM: windows) per curve point
    eval_split = "test"                   # the split of the curves: test | val | train (train: the
                                          # barrier on what the models fit; see docs/results.md)
    variants = ["full"]                   # stage-2 variants: none | orthogonal | full | learned
    stage1_ablation = false               # also run with stage 1 off
    methods = []                          # full scope: seed 002's methods weight | activation | learned (| sinkhorn)
                                          # (activation: families with activation sites, check_methods)
    learned_steps = 6000                  # learned matching: optimisation steps (a fresh training batch each)
    method_batch_size = 128               # training-split batch size for activation / learned matching
    learned_lambda = [0.2, 0.8]           # learned matching: lambda ~ U(lo, hi) (seed 002: [0.4, 0.6])
    device = "cpu"                        # where the curves are evaluated: cpu | cuda | auto

Unknown keys anywhere raise :class:`ConfigError` naming the key; ``[data_options]`` takes
the keyword arguments of :func:`symalign.data.load_dataset`. For ``hf:`` families the
scopes are checked against the family (``first-block``/``full`` need whole-model
alignment, see :func:`symalign.models.hf.whole_model_refusal`).
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from symalign.errors import ConfigError
from symalign.match.objective import LAM
from symalign.models.hf import is_hf_family

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

SCOPES = ("first-attention", "all-attention", "first-block", "full")
SCOPE_ALIASES = {"model": "full"}  # seed 002's name for whole-model alignment of two independent trainings
VARIANTS = ("none", "orthogonal", "full", "learned")  # learned: "full", then refined on data
METHODS = ("weight", "activation", "learned", "sinkhorn")  # sinkhorn: learned with soft permutations
# protocol settings added after configs were first recorded: left out of to_dict() at their defaults
OPTIONAL_PROTOCOL_KEYS = ("device", "methods", "learned_steps", "method_batch_size", "learned_lambda", "eval_split")
EVAL_SPLITS = ("test", "val", "train")


@dataclass
class Protocol:
    scopes: list[str] = field(default_factory=lambda: ["all-attention"])
    seeds: list[int] = field(default_factory=lambda: [1, 2])
    base_seed: int = 0
    freeze: bool = True
    points: int = 25
    eval_items: int | None = 2000
    variants: list[str] = field(default_factory=lambda: ["full"])
    stage1_ablation: bool = False
    device: str = "cpu"
    methods: list[str] = field(default_factory=list)
    learned_steps: int = 6000
    method_batch_size: int = 128
    learned_lambda: list[float] = field(default_factory=lambda: list(LAM))
    eval_split: str = "test"

    def __post_init__(self):
        if not self.scopes:
            raise ConfigError("protocol.scopes is empty; list at least one of " + ", ".join(SCOPES))
        self.scopes = [SCOPE_ALIASES.get(s, s) for s in self.scopes]
        for m in self.methods:
            if m not in METHODS:
                raise ConfigError(f"protocol.methods: unknown method {m!r}; use any of {', '.join(METHODS)}")
        if self.methods and "full" not in self.scopes:
            raise ConfigError("protocol.methods (weight/activation/learned matching of two independent trainings) "
                              "applies to the 'full' scope (alias 'model'); add it to protocol.scopes")
        if self.learned_steps < 0 or self.method_batch_size < 1:
            raise ConfigError(f"protocol.learned_steps must be >= 0 and protocol.method_batch_size >= 1, got "
                              f"{self.learned_steps} and {self.method_batch_size}")
        lam = self.learned_lambda
        if not (isinstance(lam, (list, tuple)) and len(lam) == 2
                and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in lam)
                and 0 <= lam[0] < lam[1] <= 1):
            raise ConfigError(f"protocol.learned_lambda must be [lo, hi] with 0 <= lo < hi <= 1 (the range of "
                              f"lambda ~ U(lo, hi) in learned matching), got {lam!r}")
        self.learned_lambda = [float(x) for x in lam]
        for s in self.scopes:
            if s not in SCOPES:
                raise ConfigError(f"protocol.scopes: unknown scope {s!r}; use one of {', '.join(SCOPES)}")
        for v in self.variants:
            if v not in VARIANTS:
                raise ConfigError(f"protocol.variants: unknown stage-2 variant {v!r}; use one of {', '.join(VARIANTS)}")
        if not self.variants:
            raise ConfigError("protocol.variants is empty; use e.g. [\"full\"]")
        if len(self.seeds) != 2 or self.seeds[0] == self.seeds[1]:
            raise ConfigError(f"protocol.seeds must be two different seeds (models A and B), got {self.seeds}")
        if self.eval_split not in EVAL_SPLITS:
            raise ConfigError(f"protocol.eval_split={self.eval_split!r}; use one of {', '.join(EVAL_SPLITS)}")
        if self.points < 2:
            raise ConfigError(f"protocol.points must be >= 2, got {self.points}")
        from symalign.train import DEVICES

        if self.device not in DEVICES:
            raise ConfigError(f"protocol.device={self.device!r}; use one of {', '.join(DEVICES)}")


@dataclass
class ExperimentConfig:
    name: str
    data: str
    model: dict
    train: dict = field(default_factory=dict)
    data_options: dict = field(default_factory=dict)
    protocol: Protocol = field(default_factory=Protocol)

    def to_dict(self) -> dict:
        """The config as a dict; the protocol settings added later (``OPTIONAL_PROTOCOL_KEYS``: device,
        the ``methods`` settings, ``eval_split``) only when they are not their defaults (so configs
        recorded before those settings existed, e.g. in a sweep store, compare equal)."""
        d = asdict(self)
        defaults = asdict(Protocol())
        for k in OPTIONAL_PROTOCOL_KEYS:
            if d["protocol"].get(k) == defaults[k]:
                del d["protocol"][k]
        return d


def _check_keys(section: str, d: dict, allowed) -> None:
    allowed = set(allowed)
    for k in d:
        if k not in allowed:
            where = f"[{section}] " if section else ""
            raise ConfigError(f"unknown key {where}{k!r}; allowed: {', '.join(sorted(allowed))}")


def parse_config(d: dict, source: str = "config") -> ExperimentConfig:
    """Validate a config dict (every section and key) and build an :class:`ExperimentConfig`."""
    from symalign.data import canonical_name
    from symalign.models import ModelConfig
    from symalign.train import TrainConfig

    _check_keys("", d, ("name", "data", "data_options", "model", "train", "protocol"))
    for key in ("name", "data", "model"):
        if key not in d:
            raise ConfigError(f"{source}: missing required key {key!r}")
    canonical_name(d["data"])
    model = dict(d["model"])
    if not is_hf_family(model.get("family")):
        _check_keys("model", model, (f.name for f in fields(ModelConfig)))
    train = dict(d.get("train", {}))
    _check_keys("train", train, (f.name for f in fields(TrainConfig)))
    TrainConfig(**train)  # validates values
    proto = dict(d.get("protocol", {}))
    _check_keys("protocol", proto, (f.name for f in fields(Protocol)))
    protocol = Protocol(**proto)
    if is_hf_family(model.get("family")):
        from symalign.models.hf import check_model_section

        check_model_section(model, protocol.scopes)
    check_methods(model, protocol)
    data_options = dict(d.get("data_options", {}))
    _check_keys("data_options", data_options, data_option_keys())
    return ExperimentConfig(name=str(d["name"]), data=d["data"], model=model, train=train,
                            data_options=data_options, protocol=protocol)


def check_methods(model: dict, protocol: Protocol) -> None:
    """The one place where ``protocol.methods`` is checked against the model family, before anything
    trains: activation matching needs the family's activation sites (:mod:`symalign.nn.sites`; every
    built-in family has them, an ``hf:`` family when its adapter declares them,
    :func:`symalign.models.hf.activation_refusal`). Weight and learned matching read only the spec."""
    if "activation" in protocol.methods and is_hf_family(model.get("family")):
        from symalign.models.hf import activation_refusal, family_of

        why = activation_refusal(family_of(model["family"]))
        if why:
            raise ConfigError(f"protocol.methods: activation: {why}")


def data_option_keys() -> list[str]:
    """The ``[data_options]`` keys: the keyword arguments of :func:`symalign.data.load_dataset`."""
    import inspect

    from symalign.data import load_dataset

    params = inspect.signature(load_dataset).parameters.values()
    return [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            and p.name not in ("name", "use_cache")]


def read_toml(path: str | Path, what: str = "config") -> dict:
    """The parsed TOML file, or a :class:`ConfigError` naming the file (missing, invalid TOML)."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: no such {what} file")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML ({exc})") from exc


def load_experiment_config(path: str | Path) -> ExperimentConfig:
    """Read and validate a TOML experiment config."""
    return parse_config(read_toml(path), str(path))


RUN_KEYS = ("scopes", "seeds", "eval_split")  # protocol keys a report shows as columns beside the config hash
WHICH_KEYS = ("variants", "stage1_ablation", "methods")  # which measurements ran, not how: each has its columns


def config_hash(config: dict) -> str:
    """A short (8 hex digits) SHA-256 of a recorded config (:meth:`ExperimentConfig.to_dict`) without
    the protocol's :data:`RUN_KEYS` (``scopes``, ``seeds``, ``eval_split``: a report shows the scope,
    seed pair and split as columns) and :data:`WHICH_KEYS` (which stage-2 variants and methods ran: a
    variant's number does not depend on which others ran beside it). Two results with the same hash,
    split and scope measured the same thing on different seed pairs, so they may be averaged; every
    other setting (model, data, training, points, learned-matching steps, ...) is in the hash.
    Optional protocol keys at their defaults are dropped first, so configs recorded before those
    keys existed hash alike."""
    import hashlib
    import json

    d = json.loads(json.dumps(config, default=str))
    proto = d.get("protocol") if isinstance(d.get("protocol"), dict) else {}
    defaults = asdict(Protocol())
    for k in RUN_KEYS + WHICH_KEYS:
        proto.pop(k, None)
    for k in OPTIONAL_PROTOCOL_KEYS:
        if k in proto and proto[k] == defaults[k]:
            del proto[k]
    if isinstance(d.get("protocol"), dict):
        d["protocol"] = proto
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:8]
