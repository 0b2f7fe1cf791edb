"""The paper's public datasets, read from their published on-disk formats.

One :class:`PublicSpec` per registry name says where the files go, where they
download from, how big the splits are and which loader reads them;
:func:`load_public_arrays` locates (or, with ``download=True``, fetches) the
files, reads them, tokenises text and caches the arrays as ``.npz``
(``symalign.data.base.cached``, keyed by the folder and every option).

Splits: the official ones; where a dataset has no validation split, a seeded
``val_fraction`` of the training set is held out (``split_seed``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from symalign.data.base import cached
from symalign.data.public import corpora, labelled, vision
from symalign.data.public.common import Remote, classification_arrays, data_root, ensure
from symalign.data.tokenize import ByteTokenizer, HFTokenizer, Tokenizer
from symalign.errors import DatasetError

_HF = "https://huggingface.co/datasets"
_MNIST = "https://ossci-datasets.s3.amazonaws.com/mnist"  # torchvision's mirror
CACHE_VERSION = 1


@dataclass(frozen=True)
class PublicSpec:
    """A public dataset: its files, its source and its splits."""

    name: str
    title: str
    modality: str  # "image" | "text" | "lm"
    present: Callable[[Path], bool]
    layout: str  # what must be under root (error messages, docs)
    remotes: tuple[Remote, ...] = ()
    manual: str = ""  # extra instructions when the files cannot be downloaded
    val_fraction: float = 0.1  # held out of train when the dataset has no validation split
    seq_len: tuple[int, int] = (0, 0)  # text classification: default length (byte-level, other tokenizers)
    text: labelled.TextSource | None = None


def _hf(repo: str, *paths: str) -> tuple[Remote, ...]:
    return tuple(Remote(f"{_HF}/{repo}/resolve/main/{p}", p) for p in paths)


SPECS: dict[str, PublicSpec] = {s.name: s for s in (
    PublicSpec("mnist", "MNIST", "image", vision.mnist_present,
               "train-images-idx3-ubyte[.gz], train-labels-idx1-ubyte[.gz], t10k-images-idx3-ubyte[.gz] and "
               "t10k-labels-idx1-ubyte[.gz] in root or in root/MNIST/raw (torchvision's layout)",
               (Remote(f"{_MNIST}/train-images-idx3-ubyte.gz", "train-images-idx3-ubyte.gz",
                       "f68b3c2dcbeaaa9fbdd348bbdeb94873"),
                Remote(f"{_MNIST}/train-labels-idx1-ubyte.gz", "train-labels-idx1-ubyte.gz",
                       "d53e105ee54ea40749a09fcbcd1e9432"),
                Remote(f"{_MNIST}/t10k-images-idx3-ubyte.gz", "t10k-images-idx3-ubyte.gz",
                       "9fb629c4189551a2d022fa330f9573f3"),
                Remote(f"{_MNIST}/t10k-labels-idx1-ubyte.gz", "t10k-labels-idx1-ubyte.gz",
                       "ec29112dd5afa0611ce80d1b7f02629c")),
               val_fraction=1 / 12),  # 5,000 of 60,000, as Fashion-MNIST
    PublicSpec("cifar10", "CIFAR-10", "image", vision.cifar10_present,
               "cifar-10-batches-py/{data_batch_1..5, test_batch, batches.meta} (the python version)",
               (Remote("https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz", "cifar-10-python.tar.gz",
                       "c58f30108f718f92721af3b95e74349a", extract=True),)),
    PublicSpec("cifar100", "CIFAR-100", "image", vision.cifar100_present,
               "cifar-100-python/{train, test, meta} (the python version)",
               (Remote("https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz", "cifar-100-python.tar.gz",
                       "eb9058c3a382ffc7106e4002c42a8d85", extract=True),)),
    PublicSpec("imagefolder", "the image folder", "image", vision.imagefolder_present,
               "train/<class>/*.png|jpg and val/<class>/*.png|jpg (optionally test/<class>/...)",
               manual=" ImageNet-1K cannot be downloaded automatically: get ILSVRC2012 from https://image-net.org, "
                      "unpack the training images as train/<wnid>/*.JPEG and sort the validation images into "
                      "val/<wnid>/*.JPEG (by the devkit's ground truth).",
               val_fraction=0.02),  # 25,623 of ImageNet's 1,281,167 training images
    PublicSpec("enwik8", "enwik8", "lm", corpora.enwik8_present, "enwik8 (100,000,000 bytes) or enwik8.zip",
               (Remote("http://mattmahoney.net/dc/enwik8.zip", "enwik8.zip"),)),
    PublicSpec("wikitext103", "WikiText-103", "lm", corpora.wikitext_present,
               "wiki.train.raw, wiki.valid.raw, wiki.test.raw (in root or root/wikitext-103-raw), or the Hugging "
               "Face parquet files wikitext-103-raw-v1/{train,validation,test}-*.parquet",
               _hf("Salesforce/wikitext", *(f"wikitext-103-raw-v1/{s}.parquet" for s in (
                   "train-00000-of-00002", "train-00001-of-00002", "validation-00000-of-00001",
                   "test-00000-of-00001")))),
    PublicSpec("lm1b", "One Billion Word", "lm", corpora.lm1b_present,
               f"{corpora.LM1B_TRAIN}/news.en-000NN-of-00100 and {corpora.LM1B_HELDOUT}/"
               f"news.en.heldout-0000{{0,1}}-of-00050 (in root or root/{corpora.LM1B_DIR})",
               (Remote("http://www.statmt.org/lm-benchmark/1-billion-word-language-modeling-benchmark-r13output.tar.gz",
                       "1-billion-word-language-modeling-benchmark-r13output.tar.gz", extract=True),)),
    PublicSpec("ag_news", "AG News", "text", lambda r: labelled.text_present(r, SPECS["ag_news"].text),
               "the Hugging Face parquet files data/{train,test}-*.parquet (columns text, label) or the CSV "
               "release ag_news_csv/{train,test}.csv",
               _hf("fancyzhx/ag_news", "data/train-00000-of-00001.parquet", "data/test-00000-of-00001.parquet"),
               manual=" The CSV release is https://s3.amazonaws.com/fast-ai-nlp/ag_news_csv.tgz.",
               val_fraction=0.05, seq_len=(256, 128),
               text=labelled.TextSource(labelled.AG_NEWS_CLASSES, ("text",), "data", csv_dir="ag_news_csv")),
    PublicSpec("imdb", "IMDB", "text", lambda r: labelled.text_present(r, SPECS["imdb"].text),
               "the Hugging Face parquet files plain_text/{train,test}-*.parquet (columns text, label) or the "
               "original aclImdb/{train,test}/{neg,pos}/*.txt",
               _hf("stanfordnlp/imdb", "plain_text/train-00000-of-00001.parquet",
                   "plain_text/test-00000-of-00001.parquet"),
               manual=" The original release is https://ai.stanford.edu/~amaas/data/sentiment/aclImdb_v1.tar.gz.",
               val_fraction=0.1, seq_len=(1024, 512),
               text=labelled.TextSource(labelled.IMDB_CLASSES, ("text",), "plain_text", acl_imdb=True)),
    PublicSpec("dbpedia", "DBPedia-14", "text", lambda r: labelled.text_present(r, SPECS["dbpedia"].text),
               "the Hugging Face parquet files dbpedia_14/{train,test}-*.parquet (columns title, content, label) "
               "or the CSV release dbpedia_csv/{train,test}.csv",
               _hf("fancyzhx/dbpedia_14", "dbpedia_14/train-00000-of-00001.parquet",
                   "dbpedia_14/test-00000-of-00001.parquet"),
               manual=" The CSV release is https://s3.amazonaws.com/fast-ai-nlp/dbpedia_csv.tgz.",
               val_fraction=0.05, seq_len=(256, 128),
               text=labelled.TextSource(labelled.DBPEDIA_CLASSES, ("title", "content"), "dbpedia_14",
                                        csv_dir="dbpedia_csv")),
)}

PUBLIC: tuple[str, ...] = tuple(SPECS)


def _check_options(spec: PublicSpec, tokenizer: Tokenizer, image_size: int | None, labels: str | None,
                   per_class: int | None, seq_len: int | None) -> None:
    """Options that do not apply to ``spec`` are errors, not silently ignored."""
    bad = []
    if spec.modality == "image" and not isinstance(tokenizer, ByteTokenizer):
        bad.append("tokenizer")
    if image_size is not None and spec.name != "imagefolder":
        bad.append("image_size")
    if per_class is not None and spec.name != "imagefolder":
        bad.append("per_class")
    if labels is not None and spec.name != "cifar100":
        bad.append("labels")
    if seq_len is not None and spec.modality != "text":
        bad.append("seq_len")
    if bad:
        raise DatasetError(f"dataset {spec.name!r} ({spec.modality}) takes no {', '.join(bad)} option")


def load_public_arrays(name: str, split_seed: int = 0, subset: int | None = None, seq_len: int | None = None,
                       tokenizer: Tokenizer | None = None, root: str | os.PathLike | None = None,
                       download: bool = False, image_size: int | None = None, labels: str | None = None,
                       per_class: int | None = None, use_cache: bool = True) -> tuple[dict[str, np.ndarray], dict]:
    """``(arrays, options)`` of the public dataset ``name`` (a key of :data:`SPECS`).

    Arrays follow the registry's convention (``x_*``/``y_*``, ``classes``) plus
    ``vocab_size`` for text. LM: ``subset`` tokens of training text are read
    (the rest is never tokenised). ``options`` is what went into the cache key.
    """
    spec = SPECS[name]
    tok = tokenizer or ByteTokenizer()
    _check_options(spec, tok, image_size, labels, per_class, seq_len)
    folder = data_root(name, root).absolute()
    opts: dict = {"split_seed": split_seed, "root": str(folder), "v": CACHE_VERSION}
    if spec.modality != "image":
        opts["tokenizer"] = tok.name
        if isinstance(tok, HFTokenizer):
            opts["tokenizer_sha"] = tok.fingerprint()
    if spec.modality == "text":
        opts["seq_len"] = int(spec.seq_len[0 if isinstance(tok, ByteTokenizer) else 1] if seq_len is None else seq_len)
        if opts["seq_len"] < 1:
            raise DatasetError(f"seq_len must be >= 1, got {seq_len}")
    if spec.modality == "lm" and subset is not None:
        opts["subset"] = int(subset)
    if name == "imagefolder":
        opts.update(image_size=vision.IMAGE_SIZE if image_size is None else int(image_size), per_class=per_class)
    if name == "cifar100":
        opts["labels"] = labels or "fine"

    def build() -> dict[str, np.ndarray]:
        ensure(spec.title, folder, spec.present, spec.layout, spec.remotes, download, spec.manual)
        if spec.modality == "image":
            return _images(spec, folder, split_seed, opts)
        if spec.modality == "lm":
            return _lm(spec, folder, tok, opts.get("subset"))
        return _text(spec, folder, tok, split_seed, opts["seq_len"])

    return cached(name, opts, build, use_cache), opts


def _images(spec: PublicSpec, folder: Path, seed: int, opts: dict) -> dict[str, np.ndarray]:
    if spec.name == "mnist":
        return vision.load_mnist(folder, seed, spec.val_fraction)
    if spec.name == "cifar10":
        return vision.load_cifar10(folder, seed, spec.val_fraction)
    if spec.name == "cifar100":
        return vision.load_cifar100(folder, seed, spec.val_fraction, opts["labels"])
    return vision.load_imagefolder(folder, seed, spec.val_fraction, opts["image_size"], opts["per_class"])


def _lm(spec: PublicSpec, folder: Path, tok: Tokenizer, limit: int | None) -> dict[str, np.ndarray]:
    load = {"enwik8": corpora.load_enwik8, "wikitext103": corpora.load_wikitext103, "lm1b": corpora.load_lm1b}
    pieces = load[spec.name](folder)
    out = {f"x_{s}": tok.encode_stream(pieces[s], limit if s == "train" else None) for s in ("train", "val", "test")}
    for s in ("train", "val", "test"):
        if len(out[f"x_{s}"]) < 2:
            raise DatasetError(f"{spec.title} in {folder}: the {s} split is empty; expected {spec.layout}")
    return {**out, "vocab_size": np.asarray(tok.vocab_size)}


def _text(spec: PublicSpec, folder: Path, tok: Tokenizer, seed: int, seq_len: int) -> dict[str, np.ndarray]:
    splits = labelled.load_text(folder, spec.text)
    enc = {s: (tok.encode_batch(texts, seq_len), y) for s, (texts, y) in splits.items()}
    for s, (x, _) in enc.items():
        if not len(x):
            raise DatasetError(f"{spec.title} in {folder}: the {s} split is empty; expected {spec.layout}")
    arrays = classification_arrays(enc["train"], enc["test"], spec.text.classes, seed, spec.val_fraction)
    return {**arrays, "vocab_size": np.asarray(tok.vocab_size)}


__all__ = ["SPECS", "PUBLIC", "PublicSpec", "load_public_arrays", "data_root"]
