r"""What a checkpoint is evaluated on: its objective, tokenizer or image processor, and the fixed batches.

:func:`build_eval` reads the checkpoint (its head decides the objective, see
:mod:`symalign.evaluate.objective`), loads the data (a built-in dataset name, or
the user's file / folder / saved dataset, :mod:`symalign.data.user`) and turns it
into fixed batches of model inputs with labels:

* causal LM: non-overlapping windows of ``context`` tokens of the token stream
  (:mod:`symalign.evaluate.text`), labels = inputs (the model's own shift);
* masked LM: windows wrapped in the tokenizer's special tokens with a fixed,
  seeded 15 % masking (the same masks at every interpolation point);
* sequence classification: each text truncated to ``context`` tokens (with the
  tokenizer's special tokens), padded per batch, with its label;
* image classification: each image through the checkpoint's image processor;
* sequence-to-sequence (T5): ``(source, target)`` pairs of a ``.jsonl`` / ``.csv``
  file (:func:`symalign.data.user.load_pairs`); source and target each encoded
  by the tokenizer with its special tokens (T5: ``... </s>``), truncated to
  ``context`` tokens and padded per batch (source: ``pad_token_id`` with an
  attention mask; target: ``-100``); ``labels`` = target ids and
  ``decoder_input_ids`` = the model's own ``_shift_right(labels)``
  (``decoder_start_token_id`` first, ``-100`` read as pad), so the loss is the
  teacher-forced nats per target token, as ``model(input_ids, attention_mask,
  labels=labels).loss`` computes it.

``context`` defaults to the model's maximum positions, capped at
:data:`MAX_CONTEXT`. The text is read with the checkpoint's own tokenizer
(``AutoTokenizer`` on its folder); a checkpoint without tokenizer files is
refused unless ``tokenizer`` names a folder (or ``"bytes"`` for byte-level
models whose token ``i`` is byte ``i``). Built-in datasets: ``shakespeare`` /
``bible`` are read as raw text (the split's UTF-8 text) and tokenised like a
user's file; ``digits`` / ``fashion-mnist`` go through the image processor when
the checkpoint has one and are fed as they are otherwise; ``synthetic`` is
already token ids; the other built-in text datasets are tokenised by
:func:`symalign.data.load_dataset` with the checkpoint's tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from symalign.data.tokenize import TOKENIZER_FILES
from symalign.data.user import UserData, load_pairs, load_user_data
from symalign.errors import ConfigError, DatasetError, MatchError
from symalign.evaluate.objective import head_objective
from symalign.evaluate.text import ByteLevel, Stream, lm_windows, mlm_windows, token_stream

MAX_CONTEXT = 512
DEFAULT_ITEMS = 256
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
SPLITS = ("train", "val", "test")


@dataclass
class EvalOptions:
    """What is measured (the CLI's ``--split``, ``--eval-items`` ...)."""

    split: str | None = None
    text_field: str | None = None
    label_field: str | None = None
    eval_items: int | None = None  # windows (LM) or examples; default DEFAULT_ITEMS
    eval_tokens: int | None = None  # LM: windows = eval_tokens // context
    context: int | None = None
    batch_size: int = 16
    mask_seed: int = 0
    tokenizer: str | None = None
    image_processor: str | None = None
    data_options: dict = field(default_factory=dict)


@dataclass
class EvalSet:
    """Fixed batches (model keyword inputs plus ``labels``), the objective, and what they hold."""

    objective: str
    batches: list[dict[str, Tensor]]
    n_bytes: int | None
    info: dict

    @property
    def items(self) -> int:
        return sum(int(b["labels"].shape[0]) for b in self.batches)


# ----------------------------------------------------------------------------- tokenizer / processor


def has_tokenizer(path: str | Path) -> bool:
    return any((Path(path) / f).is_file() for f in TOKENIZER_FILES)


def resolve_tokenizer(ckpt_dir: str | Path, override: str | None = None) -> Any:
    """The tokenizer to read text with: ``override`` (a folder, or ``"bytes"``), else the checkpoint's own."""
    from symalign.data.tokenize import BYTE_NAMES, load_tokenizer

    if override is not None and str(override).lower() in BYTE_NAMES:
        return ByteLevel()
    if override is not None:
        return load_tokenizer(override).tok
    if not has_tokenizer(ckpt_dir):
        raise _no_tokenizer(ckpt_dir)
    return load_tokenizer(ckpt_dir).tok


def _no_tokenizer(ckpt_dir: str | Path) -> ConfigError:
    return ConfigError(f"{ckpt_dir} has no tokenizer files ({', '.join(TOKENIZER_FILES[:4])}, ...): save the "
                       f"model's tokenizer there with tokenizer.save_pretrained('{ckpt_dir}'), or name one with "
                       f"--tokenizer PATH (--tokenizer bytes for byte-level models)")


def check_tokenizers(dirs: list[str | Path], evalset: EvalSet, opts: EvalOptions | None = None) -> None:
    """Every checkpoint is held to the rule the first one met: when the batches were read with the first
    checkpoint's own tokenizer (text data, no ``--tokenizer``), each other checkpoint must have tokenizer
    files too (refused as the first would be, :func:`resolve_tokenizer`); :func:`check_same_vocabulary`
    then compares them."""
    if "tokenizer" not in evalset.info or (opts is not None and opts.tokenizer is not None):
        return
    for d in dirs[1:]:
        if not has_tokenizer(d):
            raise _no_tokenizer(d)


def check_same_vocabulary(dirs: list[str | Path]) -> None:
    """Refuse checkpoints whose own tokenizers map tokens to different ids (:class:`MatchError`)."""
    from symalign.data.tokenize import load_tokenizer

    with_tok = [Path(d) for d in dirs if has_tokenizer(d)]
    if len(with_tok) < 2:
        return
    ref = load_tokenizer(with_tok[0]).tok.get_vocab()
    for d in with_tok[1:]:
        voc = load_tokenizer(d).tok.get_vocab()
        if voc != ref:
            only = sorted(set(ref) ^ set(voc))
            if only:
                tok = only[0]
                what = f"{tok!r} is only in {with_tok[0] if tok in ref else d}"
            else:
                tok = sorted(k for k in ref if ref[k] != voc[k])[0]
                what = f"{tok!r} is id {ref[tok]} vs {voc[tok]}"
            raise MatchError(f"the tokenizers of {with_tok[0]} and {d} differ ({len(ref)} vs {len(voc)} tokens; "
                             f"{what}): the models must share one vocabulary")


def resolve_processor(ckpt_dir: str | Path, override: str | None = None) -> Any | None:
    """The checkpoint's (or ``override``'s) image processor, or ``None`` when it has none."""
    where = Path(override) if override is not None else Path(ckpt_dir)
    if not any((where / f).is_file() for f in PROCESSOR_FILES):
        if override is not None:
            raise ConfigError(f"{where} holds no preprocessor_config.json; save an image processor there with "
                              f"processor.save_pretrained('{where}')")
        return None
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(str(where), local_files_only=True)
    except Exception as exc:
        raise ConfigError(f"{where}: transformers cannot load its image processor ({type(exc).__name__}: "
                          f"{str(exc)[:200]})") from None


def _need_processor(ckpt_dir: str | Path) -> ConfigError:
    return ConfigError(f"{ckpt_dir} has no image processor (preprocessor_config.json): save the model's processor "
                       f"there with processor.save_pretrained('{ckpt_dir}'), or name one with --image-processor PATH")


# ----------------------------------------------------------------------------- helpers


def model_max_context(config: Any) -> int | None:
    for key in ("n_positions", "max_position_embeddings"):
        v = getattr(config, key, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def choose_context(config: Any, context: int | None) -> int:
    limit = model_max_context(config)
    if context is None:
        return min(limit or MAX_CONTEXT, MAX_CONTEXT)
    if context < 2:
        raise ConfigError(f"--context must be at least 2, got {context}")
    if limit is not None and context > limit:
        raise ConfigError(f"--context {context} exceeds the model's {limit} positions; use --context {limit} or less")
    return int(context)


def _batched(tensors: dict[str, Tensor], batch_size: int) -> list[dict[str, Tensor]]:
    n = next(iter(tensors.values())).shape[0]
    return [{k: v[s:s + batch_size] for k, v in tensors.items()} for s in range(0, n, batch_size)]


def _label_ids(data: UserData, config: Any, where: str) -> list[int]:
    """Data labels as the model's class ids (through ``config.label2id`` when it names the data's classes)."""
    if data.labels is None:
        raise DatasetError(f"{where} has no labels; a classifier is evaluated on labelled examples (a 'label' "
                           f"field / column, or image class folders)")
    k = int(getattr(config, "num_labels", 0))
    l2i = {str(n): int(i) for n, i in (getattr(config, "label2id", None) or {}).items()}
    if data.classes and set(data.classes) <= set(l2i) and not all(c.startswith("LABEL_") for c in data.classes):
        return [l2i[data.classes[y]] for y in data.labels]
    n = len(data.classes) if data.classes else max(data.labels) + 1
    if n != k and data.classes:
        raise ConfigError(f"the model has num_labels={k} but {where} has {n} classes")
    if max(data.labels) >= k or min(data.labels) < 0:
        raise ConfigError(f"the model has num_labels={k} but {where} has label {max(data.labels)}")
    return list(data.labels)


def _limit(items: int | None, default: int = DEFAULT_ITEMS) -> int:
    if items is not None and items < 1:
        raise ConfigError(f"--eval-items must be at least 1, got {items}")
    return default if items is None else int(items)


# ----------------------------------------------------------------------------- built-in datasets


def _builtin_name(data: str) -> str | None:
    from symalign.data import canonical_name

    if Path(data).expanduser().exists():
        return None
    try:
        return canonical_name(data)
    except DatasetError:
        return None


def _is_image_dataset(name: str) -> bool:
    from symalign.data.public import SPECS

    return name in ("digits", "fashion-mnist") or (name in SPECS and SPECS[name].modality == "image")


def _split(opts: EvalOptions) -> str:
    s = opts.split or "test"
    s = {"validation": "val", "valid": "val"}.get(s, s)
    if s not in SPLITS:
        raise ConfigError(f"built-in datasets have splits train, val, test; got --split {opts.split!r}")
    return s


def _builtin_text(name: str, opts: EvalOptions) -> UserData:
    """The raw UTF-8 text of a built-in LM corpus's split (the byte blocks of ``split_stream``)."""
    from symalign.data import text
    from symalign.data.base import split_stream

    raw = (text.load_shakespeare_text if name == "shakespeare" else text.load_bible_text)()
    parts = split_stream(np.frombuffer(raw.encode("utf-8"), dtype=np.uint8),
                         int(opts.data_options.get("split_seed", 0)))
    block = parts[SPLITS.index(_split(opts))].tobytes().decode("utf-8", errors="replace")
    return UserData(name, "text", texts=[block], split=_split(opts))


# ----------------------------------------------------------------------------- the builder


def build_eval(ckpt_dir: str | Path, model: nn.Module, data: str, opts: EvalOptions | None = None) -> EvalSet:
    """Fixed evaluation batches of ``data`` for the checkpoint in ``ckpt_dir`` (loaded as ``model``)."""
    opts = opts or EvalOptions()
    objective = head_objective(model)
    cfg = model.config
    context = choose_context(cfg, opts.context)
    name = _builtin_name(data)
    info: dict = {"objective": objective, "data": data, "context": context}
    dtype = next(model.parameters()).dtype

    if objective == "image-classification":
        return _image_eval(ckpt_dir, cfg, data, name, opts, info, dtype)
    if objective == "seq2seq":
        return _seq2seq_eval(ckpt_dir, model, data, opts, context, info)
    if name is not None and _is_image_dataset(name):
        raise ConfigError(f"{type(model).__name__} reads text, but {data!r} holds images")
    if name is not None and name not in ("shakespeare", "bible"):
        return _registry_eval(ckpt_dir, cfg, name, objective, opts, context, info, dtype)

    tok = resolve_tokenizer(ckpt_dir, opts.tokenizer)
    _check_vocab(tok, cfg)
    info["tokenizer"] = getattr(tok, "name_or_path", None) or getattr(tok, "name", "bytes")
    user = _builtin_text(name, opts) if name is not None else load_user_data(
        data, opts.split, opts.text_field, opts.label_field)
    if user.kind != "text":
        raise ConfigError(f"{type(model).__name__} reads text, but {data} holds images")
    info["source"] = user.summary()
    if objective == "sequence-classification":
        return _seqcls_eval(tok, cfg, user, data, opts, context, info)

    items = _limit(opts.eval_items)
    if opts.eval_tokens is not None:
        if opts.eval_tokens < 1:
            raise ConfigError(f"--eval-tokens must be at least 1, got {opts.eval_tokens}")
        items = max(1, opts.eval_tokens // context)
    need = items * context + 1
    stream = token_stream(tok, user.texts, need=need, max_chars=max(1 << 20, 32 * need))
    if objective == "causal-lm":
        win, n_bytes = lm_windows(stream, context, items, data)
        batches = _batched({"input_ids": win, "attention_mask": torch.ones_like(win), "labels": win},
                           opts.batch_size)
        info.update(items=int(win.shape[0]), tokens=int(win.shape[0] * (context - 1)), bytes=n_bytes)
        return EvalSet(objective, batches, n_bytes, info)
    inputs, labels, mask = mlm_windows(tok, stream, context, items, opts.mask_seed, data)
    batches = _batched({"input_ids": inputs, "attention_mask": torch.ones_like(inputs), "labels": labels},
                       opts.batch_size)
    info.update(items=int(inputs.shape[0]), tokens=int(mask.sum()), mask_seed=opts.mask_seed)
    return EvalSet(objective, batches, None, info)


def _check_vocab(tok: Any, cfg: Any) -> None:
    from symalign.data.tokenize import check_vocab

    check_vocab(int(len(tok)), int(cfg.vocab_size))


def _seqcls_eval(tok: Any, cfg: Any, user: UserData, where: str, opts: EvalOptions, context: int,
                 info: dict) -> EvalSet:
    labels = _label_ids(user, cfg, where)
    n = min(len(user.texts), _limit(opts.eval_items))
    texts, y = user.texts[:n], torch.tensor(labels[:n], dtype=torch.long)
    pad = getattr(tok, "pad_token_id", None)
    bs = opts.batch_size if (pad is not None and getattr(cfg, "pad_token_id", None) is not None) else 1
    batches = []
    for s in range(0, n, bs):
        chunk = texts[s:s + bs]
        if isinstance(tok, ByteLevel):
            rows = [list(t.encode("utf-8")[:context]) or [0] for t in chunk]
        else:
            rows = tok(chunk, add_special_tokens=True, truncation=True, max_length=context, verbose=False)["input_ids"]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), int(pad or 0), dtype=torch.long)
        att = torch.zeros_like(ids)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
            att[i, :len(r)] = 1
        batches.append({"input_ids": ids, "attention_mask": att, "labels": y[s:s + bs]})
    info.update(items=n, classes=user.classes)
    return EvalSet("sequence-classification", batches, None, info)


def _seq2seq_eval(ckpt_dir: str | Path, model: nn.Module, data: str, opts: EvalOptions, context: int,
                  info: dict) -> EvalSet:
    """Teacher-forced source/target batches (see the module docstring)."""
    if _builtin_name(data) is not None or not Path(data).expanduser().is_file():
        load_pairs(data)  # raises: built-in datasets and folders hold no source/target pairs
    tok = resolve_tokenizer(ckpt_dir, opts.tokenizer)
    if isinstance(tok, ByteLevel):
        raise ConfigError("--tokenizer bytes cannot feed a sequence-to-sequence model; use the checkpoint's own "
                          "tokenizer")
    cfg = model.config
    _check_vocab(tok, cfg)
    info["tokenizer"] = getattr(tok, "name_or_path", None) or str(opts.tokenizer or ckpt_dir)
    pairs = load_pairs(data)[:_limit(opts.eval_items)]
    pad = getattr(tok, "pad_token_id", None)
    if pad is None:
        pad = getattr(cfg, "pad_token_id", None)
    if pad is None:
        raise ConfigError("neither the tokenizer nor the model config names a pad token, so source/target pairs "
                          "cannot be batched; set pad_token_id in the config")
    batches = []
    n_tokens = 0
    for s in range(0, len(pairs), opts.batch_size):
        chunk = pairs[s:s + opts.batch_size]
        src = tok([p[0] for p in chunk], add_special_tokens=True, truncation=True, max_length=context,
                  verbose=False)["input_ids"]
        tgt = tok([p[1] for p in chunk], add_special_tokens=True, truncation=True, max_length=context,
                  verbose=False)["input_ids"]
        ids = torch.full((len(chunk), max(map(len, src))), int(pad), dtype=torch.long)
        att = torch.zeros_like(ids)
        labels = torch.full((len(chunk), max(map(len, tgt))), -100, dtype=torch.long)
        for i, (a, b) in enumerate(zip(src, tgt)):
            ids[i, :len(a)] = torch.tensor(a, dtype=torch.long)
            att[i, :len(a)] = 1
            labels[i, :len(b)] = torch.tensor(b, dtype=torch.long)
        n_tokens += int((labels != -100).sum())
        batches.append({"input_ids": ids, "attention_mask": att, "decoder_input_ids": model._shift_right(labels),
                        "labels": labels})
    info.update(items=len(pairs), tokens=n_tokens,
                tokenizer=getattr(tok, "name_or_path", None) or str(opts.tokenizer or ckpt_dir),
                source={"source": data, "kind": "pairs", "items": len(pairs)})
    return EvalSet("seq2seq", batches, None, info)


def _image_eval(ckpt_dir: str | Path, cfg: Any, data: str, name: str | None, opts: EvalOptions, info: dict,
                dtype: torch.dtype) -> EvalSet:
    processor = resolve_processor(ckpt_dir, opts.image_processor)
    n_max = _limit(opts.eval_items)
    if name is not None:
        from symalign.data import load_dataset

        ds = load_dataset(name, **opts.data_options)
        if ds.modality != "image":
            raise ConfigError(f"an image classifier needs an image dataset, but {data!r} is {ds.modality}")
        x, y = ds.split(_split(opts))
        x, y = x[:n_max], y[:n_max]
        if int(getattr(cfg, "num_labels", 0)) != ds.n_classes:
            raise ConfigError(f"the model has num_labels={cfg.num_labels} but {data!r} has {ds.n_classes} classes")
        if processor is None:
            c, h, w = ds.input_shape
            if int(cfg.image_size) != h or int(getattr(cfg, "num_channels", c)) != c:
                raise ConfigError(f"the model expects {cfg.num_channels}x{cfg.image_size}x{cfg.image_size} images, "
                                  f"{data!r} has {c}x{h}x{w}; save an image processor with the model to resize")
            pixels = x.to(dtype)
        else:
            from PIL import Image

            arr = (x.clamp(0, 1) * 255).round().to(torch.uint8).numpy()
            images = [Image.fromarray(a[0] if a.shape[0] == 1 else a.transpose(1, 2, 0)) for a in arr]
            pixels = _process(processor, images, cfg, dtype)
        info.update(items=int(len(y)), source={"source": data, "kind": "image", "items": int(len(y))})
        return EvalSet("image-classification", _batched({"pixel_values": pixels, "labels": y.long()},
                                                        opts.batch_size), None, info)
    user = load_user_data(data, opts.split, opts.text_field, opts.label_field)
    if user.kind != "image":
        raise ConfigError(f"an image classifier needs images, but {data} holds text")
    if processor is None:
        raise _need_processor(ckpt_dir)
    labels = _label_ids(user, cfg, data)
    n = min(len(user.images), n_max)
    pixels = _process(processor, user.images[:n], cfg, dtype)
    info.update(items=n, source=user.summary(), classes=user.classes)
    return EvalSet("image-classification",
                   _batched({"pixel_values": pixels, "labels": torch.tensor(labels[:n], dtype=torch.long)},
                            opts.batch_size), None, info)


def _process(processor: Any, images: list, cfg: Any, dtype: torch.dtype) -> Tensor:
    mode = "L" if int(getattr(cfg, "num_channels", 3)) == 1 else "RGB"
    images = [im.convert(mode) if im.mode != mode else im for im in images]
    kw = {"input_data_format": "channels_last"} if mode == "L" else {}
    out = processor(images=images, return_tensors="pt", **kw)["pixel_values"]
    if mode == "L" and out.dim() == 4 and out.shape[1] != 1:
        out = out[:, :1]
    return out.to(dtype)


def _registry_eval(ckpt_dir: str | Path, cfg: Any, name: str, objective: str, opts: EvalOptions, context: int,
                   info: dict, dtype: torch.dtype) -> EvalSet:
    """Built-in datasets other than the raw-text corpora: synthetic ids, or text the registry tokenises."""
    from symalign.data import load_dataset

    tokenizer = None
    if name != "synthetic":
        tok = resolve_tokenizer(ckpt_dir, opts.tokenizer)
        _check_vocab(tok, cfg)
        tokenizer = "bytes" if isinstance(tok, ByteLevel) else str(opts.tokenizer or ckpt_dir)
        info["tokenizer"] = tokenizer
    ds = load_dataset(name, tokenizer=tokenizer, **opts.data_options)
    need_vocab = int(ds.vocab_size or 0)
    if need_vocab > int(cfg.vocab_size):
        raise ConfigError(f"the model's vocabulary ({cfg.vocab_size}) does not cover the {need_vocab} tokens of "
                          f"{name!r}; use a model with vocab_size >= {need_vocab}")
    x, y = ds.split(_split(opts))
    items = _limit(opts.eval_items)
    if objective in ("causal-lm", "masked-lm"):
        if ds.task != "lm":
            raise ConfigError(f"a {objective} model needs a text corpus, but {name!r} is a classification dataset")
        if objective == "masked-lm":
            raise ConfigError(f"masked-LM evaluation needs raw text for its tokenizer; give {name!r}'s text as a file")
        if opts.eval_tokens is not None:
            items = max(1, opts.eval_tokens // context)
        win, _ = lm_windows(Stream(x.long().numpy(), None, 1), context, items, name)
        info.update(items=int(win.shape[0]), tokens=int(win.shape[0] * (context - 1)), bytes=None)
        return EvalSet(objective, _batched({"input_ids": win, "attention_mask": torch.ones_like(win), "labels": win},
                                           opts.batch_size), None, info)
    if ds.task != "classification" or ds.modality != "text":
        raise ConfigError(f"a sequence classifier needs a labelled text dataset, but {name!r} is {ds.modality}")
    if int(getattr(cfg, "num_labels", 0)) != ds.n_classes:
        raise ConfigError(f"the model has num_labels={cfg.num_labels} but {name!r} has {ds.n_classes} classes")
    x, y = x[:items].long(), y[:items].long()
    info.update(items=int(len(y)))
    return EvalSet(objective, _batched({"input_ids": x, "attention_mask": torch.ones_like(x), "labels": y},
                                       opts.batch_size), None, info)


__all__ = ["EvalOptions", "EvalSet", "build_eval", "resolve_tokenizer", "resolve_processor", "check_same_vocabulary",
           "check_tokenizers", "has_tokenizer", "choose_context", "MAX_CONTEXT"]
