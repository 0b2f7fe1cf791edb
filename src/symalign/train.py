r"""Seeded, deterministic, resumable training of the built-in models (and ``hf:`` families).

* Initialisation: ``build_model(cfg, seed)`` (an explicit generator; for ``hf:``
  families transformers' own initialisation under ``torch.manual_seed(seed)``).
* Data order: batch ``s`` is a pure function of ``(seed, s)``
  (:mod:`symalign.data.batches`), so resuming needs no loader state.
* Dropout RNG: the global torch RNG seeded from ``seed``; saved/restored.
* Optimiser: AdamW, weight decay on matrices only, gradient clipping by global
  norm, learning rate (``s`` = step, ``W`` = warm-up, ``S`` = steps)::

      lr(s) = lr (s + 1) / W                                     for s < W
      lr(s) = lr_min + (lr - lr_min) (1 + cos(pi (s - W) / (S - W))) / 2   otherwise

  with ``lr_min = min_lr_ratio * lr``. The schedule is a pure function of the
  step, so only AdamW's moments need saving.
* A non-finite loss stops training with a :class:`SymalignError` naming the step;
  the last good checkpoint is kept.

Same seed, same machine and thread count: bit-identical weights; interrupted +
resumed runs equal uninterrupted ones.
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from symalign.arithmetic import describe
from symalign.checkpoint import has_checkpoint, load_run, load_state_into, save_run, MODEL_FILE
from symalign.data import Dataset, eval_batches, load_dataset, train_batch
from symalign.data.batches import mix
from symalign.errors import CheckpointError, ConfigError, SymalignError
from symalign.models import HFConfig, ModelConfig, build_model
from symalign.models.hf import is_hf_family

DEVICES = ("auto", "cpu", "cuda")


@dataclass
class TrainConfig:
    """Optimisation and bookkeeping settings (``warmup=None``: ``min(100, steps // 10)``)."""

    steps: int = 1000
    batch_size: int = 64
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int | None = None
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    eval_every: int = 200
    eval_items: int | None = None
    context: int = 128
    seed: int = 0

    def __post_init__(self):
        for name in ("steps", "batch_size", "context"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")
        if not self.lr > 0 or not math.isfinite(self.lr):
            raise ConfigError(f"lr must be positive and finite, got {self.lr}")
        if self.warmup is None:
            self.warmup = min(100, self.steps // 10)
        if self.warmup < 0 or self.eval_every < 0:
            raise ConfigError("warmup and eval_every must be >= 0")

    def lr_at(self, step: int) -> float:
        """The learning rate of step ``step`` (module docstring formula)."""
        w, S = self.warmup, self.steps
        if step < w:
            return self.lr * (step + 1) / w
        lo = self.min_lr_ratio * self.lr
        progress = min(1.0, (step - w) / max(1, S - w))
        return lo + (self.lr - lo) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        """Inverse of ``asdict``; an unknown key raises :class:`ConfigError` naming it (as
        :meth:`symalign.models.config.ModelConfig.from_dict` does)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown train config key(s) {unknown}; known keys are {sorted(known)}")
        return cls(**d)


def resolve_device(device: str) -> torch.device:
    """``auto`` -> CUDA if available else CPU; asking for CUDA without one is a :class:`ConfigError`."""
    if device not in DEVICES:
        raise ConfigError(f"unknown device {device!r}; use one of {', '.join(DEVICES)}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was requested but no CUDA device is available; use --device cpu")
    return torch.device(device)


def set_deterministic(device: torch.device) -> None:
    """Deterministic kernels (warn-only where an op has no deterministic variant)."""
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True, warn_only=True)


def fit_config(model: dict, ds: Dataset, context: int) -> ModelConfig | HFConfig:
    """Complete a model-config dict from the data (classes, image size, vocabulary, lengths) and
    check the family fits the task: ViT <- images, GPT <- LM text, encoder <- labelled text
    (``hf:`` families: :func:`symalign.models.hf.fit_hf_config`)."""
    family = model.get("family", "gpt")
    if is_hf_family(family):
        from symalign.models.hf import fit_hf_config

        return fit_hf_config(model, ds, context)
    want = {"vit": "image", "gpt": "lm", "encoder": "text"}.get(family)
    if want is not None and ds.modality != want:
        fit = {"image": "vit", "lm": "gpt", "text": "encoder"}[ds.modality]
        raise ConfigError(f"dataset {ds.name!r} ({ds.modality}) does not fit family {family!r}; use --family {fit}")
    m = dict(model)
    if ds.modality == "image":
        m.update(channels=ds.input_shape[0], image_size=ds.input_shape[1], n_classes=ds.n_classes)
        size = ds.input_shape[1]
        if m.get("patch_size") is None:
            m["patch_size"] = next(p for p in (7, 4, 2, 1) if size % p == 0)
        elif not isinstance(m["patch_size"], int) or m["patch_size"] <= 0 or size % m["patch_size"]:
            fits = ", ".join(str(p) for p in range(1, size + 1) if size % p == 0)
            raise ConfigError(f"patch size {m['patch_size']} does not divide the {size}x{size} images of "
                              f"{ds.name!r}; use one of {fits}")
        m.setdefault("max_len", 128)
        n_tok = (ds.input_shape[1] // m["patch_size"]) ** 2 + 1
        m["max_len"] = max(m["max_len"], n_tok)
    elif ds.modality == "text":
        m.update(vocab_size=ds.vocab_size, n_classes=ds.n_classes, max_len=ds.input_shape[0])
    else:
        m.update(vocab_size=ds.vocab_size, max_len=context)
    return ModelConfig(**m)


def loss_fn(logits: Tensor, y: Tensor) -> Tensor:
    """Mean cross-entropy (per token for an LM)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


@torch.no_grad()
def evaluate(model: nn.Module, ds: Dataset, split: str = "val", batch_size: int = 256, context: int = 128,
             max_items: int | None = None, device: torch.device | str = "cpu") -> dict[str, float]:
    """``{"loss", "accuracy"}`` (classification) or ``{"loss"}`` in nats per byte (LM) on ``split``."""
    was = model.training
    model.eval()
    total, correct, n = 0.0, 0, 0
    for x, y in eval_batches(ds, split, batch_size, context, max_items):
        x, y = x.to(device), y.to(device)
        logits = model(x)
        k = y.numel()
        total += loss_fn(logits, y).item() * k
        if ds.task == "classification":
            correct += int((logits.argmax(-1) == y).sum())
        n += k
    model.train(was)
    out = {"loss": total / max(n, 1)}
    if ds.task == "classification":
        out["accuracy"] = correct / max(n, 1)
    return out


def _optimizer(model: nn.Module, tc: TrainConfig) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": tc.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=tc.lr, betas=(tc.beta1, tc.beta2))


def _rng_state() -> dict:
    out = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def _set_rng_state(s: dict) -> None:
    torch.set_rng_state(s["torch"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


class _Reporter:
    """Rich progress bar (loss, throughput) on a terminal; plain log lines otherwise."""

    def __init__(self, total: int, start: int, unit: str, enabled: bool, log_every: int = 50):
        self.enabled, self.unit, self.log_every = enabled, unit, log_every
        self.tty = sys.stderr.isatty()
        self.progress = None
        if enabled and self.tty:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("loss {task.fields[loss]:.4f}"),
                                     TextColumn("{task.fields[rate]:,.0f} " + unit + "/s"), TimeRemainingColumn(),
                                     transient=False)
            self.progress.start()
            self.task = self.progress.add_task("train", total=total, completed=start, loss=float("nan"), rate=0.0)

    def update(self, step: int, loss: float, rate: float) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=step, loss=loss, rate=rate)
        elif self.enabled and step % self.log_every == 0:
            print(f"step {step} loss {loss:.4f} {rate:,.0f} {self.unit}/s", file=sys.stderr, flush=True)

    def log(self, msg: str) -> None:
        if not self.enabled:
            return
        if self.progress is not None:
            self.progress.console.print(msg)
        else:
            print(msg, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


def train(model_cfg: ModelConfig | dict, data: str, tc: TrainConfig, out_dir: str | Path,
          data_options: dict | None = None, resume: bool = False, device: str = "auto",
          threads: int | None = None, stop_at: int | None = None, progress: bool = True,
          init: dict | None = None) -> dict:
    """Train and checkpoint under ``out_dir``; returns the final ``config.json`` metadata.

    ``model_cfg`` may be a partial dict (completed from the data by :func:`fit_config`).
    ``resume`` continues from ``out_dir``'s latest checkpoint (its model/data/training
    settings must match). ``stop_at`` ends after that many total steps (simulating an
    interruption; the schedule still targets ``tc.steps``). ``init`` starts from a
    re-initialised copy of a base checkpoint instead of a fresh model (the paper's
    protocol): ``{"base": path, "scope": scope, "seed": seed, "freeze": bool}`` -- see
    :func:`symalign.reinit.reinit`; with ``freeze`` only the scope is trained.
    """
    if threads:
        torch.set_num_threads(int(threads))
    dev = resolve_device(device)
    previous = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    set_deterministic(dev)
    try:
        return _train(model_cfg, data, tc, Path(out_dir), data_options, resume, dev, stop_at, progress, init)
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])


def _train(model_cfg, data: str, tc: TrainConfig, out_dir: Path, data_options: dict | None, resume: bool,
           dev: torch.device, stop_at: int | None, progress: bool, init: dict | None = None) -> dict:
    """The body of :func:`train` (deterministic mode already set)."""
    data_options = dict(data_options or {})
    ds = load_dataset(data, **data_options)
    cfg = model_cfg if isinstance(model_cfg, (ModelConfig, HFConfig)) else fit_config(model_cfg, ds, tc.context)
    if ds.task == "lm" and tc.context > cfg.max_len and cfg.pe in ("sinusoidal", "learned"):
        raise ConfigError(f"context={tc.context} exceeds max_len={cfg.max_len}")
    out_dir = Path(out_dir)
    meta = _run_meta(cfg, ds, data_options, tc, init)
    start, resumed_from = 0, None
    if resume and has_checkpoint(out_dir):
        model, opt, start, resumed_from = _resume_from(out_dir, meta, cfg, tc, dev, init)
    else:
        model, opt = _fresh_start(out_dir, resume, cfg, tc, dev, init)
    model.train()
    unit = "tok" if ds.task == "lm" else ("img" if ds.modality == "image" else "seq")
    end = tc.steps if stop_at is None else min(tc.steps, stop_at)
    run = _Run(ds, tc, model, opt, meta, out_dir, dev, _Reporter(tc.steps, start, unit, progress), unit)
    step, done, t0, last_good = _loop(run, start, end, resumed_from)
    meta["metrics"]["train_seconds"] = meta["metrics"].get("train_seconds", 0.0) + time.perf_counter() - t0
    if done:  # refresh the recorded wall time
        run.checkpoint(step)
    meta["checkpoint"] = str(last_good) if last_good else None
    return meta


def _run_meta(cfg: ModelConfig | HFConfig, ds: Dataset, data_options: dict, tc: TrainConfig,
              init: dict | None) -> dict:
    """The run's ``config.json`` metadata at step 0: model, data, training settings, seed, threads, arithmetic
    (and the re-initialisation, when ``init`` is given)."""
    meta = {"model": cfg.to_dict(), "data": {"name": ds.name, "options": data_options}, "train": tc.to_dict(),
            "seed": tc.seed, "step": 0, "metrics": {}, "history": [], "threads": torch.get_num_threads(),
            "arithmetic": describe()}
    if init is not None:
        meta["init"] = dict(init)
    return meta


def _resume_from(out_dir: Path, meta: dict, cfg: ModelConfig | HFConfig, tc: TrainConfig, dev: torch.device,
                 init: dict | None) -> tuple[nn.Module, torch.optim.AdamW, int, Path]:
    """Model, optimiser moments and RNG state restored from ``out_dir``'s latest checkpoint, whose model, data,
    training and init settings must equal ``meta``'s; ``meta`` takes its step, metrics and history. Returns the
    model, the optimiser, the step reached and the checkpoint's path."""
    ck = load_run(out_dir)
    for key in ("model", "data", "train", "init"):
        if ck.meta.get(key) != meta.get(key):
            raise CheckpointError(f"{ck.path}/config.json: its {key} settings differ from this run's; "
                                  "resume with the same options or use another --out")
    model = build_model(cfg, seed=None)
    load_state_into(model, ck.state, ck.path / MODEL_FILE)
    model.to(dev)
    if init is not None and init.get("freeze"):
        _freeze_outside(model, init["scope"])
    opt = _optimizer(model, tc)
    saved = ck.optim_state()
    if saved is None:
        raise CheckpointError(f"{ck.path}/optim.pt: missing; cannot resume exactly")
    opt.load_state_dict(saved["optimizer"])
    _set_rng_state(saved["rng"])
    start = int(ck.meta["step"])
    meta.update(step=start, metrics=ck.meta.get("metrics", {}), history=ck.meta.get("history", []))
    return model, opt, start, ck.path


def _freeze_outside(model: nn.Module, scope: str) -> None:
    """Stop the gradient of every parameter outside ``scope`` (:func:`symalign.reinit.scope_names`)."""
    from symalign.reinit import scope_names

    keep = scope_names(model, scope)
    for n, p in model.named_parameters():
        p.requires_grad_(p.requires_grad and n in keep)


def _fresh_start(out_dir: Path, resume: bool, cfg: ModelConfig | HFConfig, tc: TrainConfig, dev: torch.device,
                 init: dict | None) -> tuple[nn.Module, torch.optim.AdamW]:
    """A new model (``build_model(cfg, seed)``, or a re-initialised copy of ``init``'s base checkpoint), its
    optimiser, and the dropout stream seeded from ``tc.seed``; an ``out_dir`` holding a checkpoint is refused
    unless resuming."""
    if out_dir.exists() and has_checkpoint(out_dir) and not resume:
        raise ConfigError(f"{out_dir} already holds a checkpoint; pass --resume or choose another --out")
    if init is not None:
        from symalign.reinit import reinit

        model, _ = reinit(init["base"], init["scope"], int(init["seed"]), bool(init.get("freeze", False)))
        if model.cfg.to_dict() != cfg.to_dict():
            raise ConfigError(f"the base checkpoint {init['base']} has a different model config than this run")
        model = model.to(dev)
    else:
        model = build_model(cfg, seed=tc.seed).to(dev)
    opt = _optimizer(model, tc)
    torch.manual_seed(mix(tc.seed, 0x0D50))  # dropout stream
    return model, opt


@dataclass
class _Run:
    """A training run in progress: its data, settings, model, optimiser, ``config.json`` metadata, output folder,
    device, progress reporter and throughput unit (tok, img or seq)."""

    ds: Dataset
    tc: TrainConfig
    model: nn.Module
    opt: torch.optim.AdamW
    meta: dict
    out_dir: Path
    dev: torch.device
    rep: _Reporter
    unit: str

    def checkpoint(self, step: int) -> Path:
        """Save the model, the optimiser moments and the RNG state at ``step``; returns the checkpoint's path."""
        self.meta["step"] = step
        return save_run(self.out_dir, self.model, self.meta, {"optimizer": self.opt.state_dict(),
                                                              "rng": _rng_state()})


def _loop(run: _Run, start: int, end: int, last_good: Path | None) -> tuple[int, int, float, Path | None]:
    """Optimiser steps ``start .. end - 1``, evaluated and checkpointed every ``eval_every`` steps and at ``end``;
    an interrupt saves the step reached (if any step was taken) and is re-raised. Returns the step reached, the
    steps taken, the start time and the last checkpoint written."""
    tc = run.tc
    per_step = tc.batch_size * (tc.context if run.ds.task == "lm" else 1)
    t0, done = time.perf_counter(), 0
    step = start
    try:
        while step < end:
            lv = _optimizer_step(run, step, last_good)
            step += 1
            done += 1
            rate = done * per_step / max(time.perf_counter() - t0, 1e-9)
            run.rep.update(step, lv, rate)
            is_eval = tc.eval_every and step % tc.eval_every == 0
            if is_eval or step == end:
                _record_eval(run, step, lv, rate, t0)
                last_good = run.checkpoint(step)
    except KeyboardInterrupt:
        if step > start:
            last_good = run.checkpoint(step)
            run.rep.log(f"interrupted: saved {last_good}")  # the command says how to continue (it knows its options)
        raise
    finally:
        run.rep.close()
    return step, done, t0, last_good


def _optimizer_step(run: _Run, step: int, last_good: Path | None) -> float:
    """One AdamW step on batch ``step`` at the scheduled learning rate ``lr(step)``, gradients clipped to global
    norm ``grad_clip``; returns the batch loss. A non-finite loss raises before the update."""
    tc, model, opt = run.tc, run.model, run.opt
    lr = tc.lr_at(step)
    for g in opt.param_groups:
        g["lr"] = lr
    x, y = train_batch(run.ds, step, tc.batch_size, tc.seed, tc.context)
    x, y = x.to(run.dev, non_blocking=True), y.to(run.dev, non_blocking=True)
    loss = loss_fn(model(x), y)
    lv = loss.item()
    if not math.isfinite(lv):
        where = f"; the last good checkpoint ({last_good or 'none saved yet'}) is kept"
        raise SymalignError(f"the training loss is {lv} at step {step}; training stopped{where}. "
                            "Lower --lr or raise the warm-up")
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if tc.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
    opt.step()
    return lv


def _record_eval(run: _Run, step: int, lv: float, rate: float, t0: float) -> None:
    """Validation metrics at ``step`` appended to the history and merged into ``metrics`` (with the test metrics
    at the schedule's last step), and logged."""
    tc, meta = run.tc, run.meta
    m = evaluate(run.model, run.ds, "val", 256, tc.context, tc.eval_items, run.dev)
    rec = {"step": step, "train_loss": lv, **{f"val_{k}": v for k, v in m.items()},
           "elapsed_s": time.perf_counter() - t0, f"{run.unit}_per_s": rate}
    meta["history"].append(rec)
    meta["metrics"] = {**meta["metrics"], **rec}
    run.rep.log("step {step}: train {train_loss:.4f}, val {val_loss:.4f}".format(**rec)
                + (f", val acc {m['accuracy']:.4f}" if "accuracy" in m else ""))
    if step == tc.steps:
        tm = evaluate(run.model, run.ds, "test", 256, tc.context, tc.eval_items, run.dev)
        meta["metrics"].update({f"test_{k}": v for k, v in tm.items()})
        run.rep.log("test: " + ", ".join(f"{k} {v:.4f}" for k, v in tm.items()))
