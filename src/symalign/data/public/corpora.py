"""Language-modelling corpora in their published layouts: enwik8, WikiText-103, One Billion Word.

Each loader returns ``{"train": pieces, "val": pieces, "test": pieces}`` where
``pieces`` is an iterable of ``bytes`` / ``str`` whose concatenation is the
split's text; :mod:`symalign.data.tokenize` turns them into one id stream.
Pieces are cut after a newline (about 1 MiB each) so that a Hugging Face
tokenizer never sees a whole corpus in one call.
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Iterable, Iterator

from symalign.data.public.tables import read_column, split_files
from symalign.errors import DatasetError

PIECE = 1 << 20


def line_pieces(data: bytes | str, size: int = PIECE) -> Iterator[bytes | str]:
    """``data`` in consecutive pieces of about ``size``, each (but the last) ending with a newline
    when one occurs in its window; the pieces concatenate back to ``data``."""
    nl = b"\n" if isinstance(data, bytes) else "\n"
    start = 0
    while start < len(data):
        end = min(start + size, len(data))
        if end < len(data):
            cut = data.rfind(nl, start, end)
            end = cut + 1 if cut >= start else end
        yield data[start:end]
        start = end


# ----------------------------------------------------------------------------------------- enwik8
ENWIK8_HELD = 5  # percent each for validation and test: the standard 90M / 5M / 5M split of 100M bytes


def enwik8_present(root: Path) -> bool:
    return (root / "enwik8").is_file() or (root / "enwik8.zip").is_file()


def read_enwik8(root: Path) -> bytes:
    """The raw bytes of ``root/enwik8``, or of the member ``enwik8`` of ``root/enwik8.zip``."""
    if (root / "enwik8").is_file():
        return (root / "enwik8").read_bytes()
    path = root / "enwik8.zip"
    try:
        with zipfile.ZipFile(path) as z:
            return z.read("enwik8")
    except KeyError as exc:
        raise DatasetError(f"{path}: the zip has no member 'enwik8' (it holds {', '.join(z.namelist()[:5])})") from exc
    except (zipfile.BadZipFile, OSError) as exc:
        raise DatasetError(f"{path}: not a zip archive holding 'enwik8' ({exc})") from exc


def load_enwik8(root: Path) -> dict[str, Iterable[bytes]]:
    """enwik8 split by position: the first 90 %, the next 5 % (validation) and the last 5 % (test),
    i.e. 90,000,000 / 5,000,000 / 5,000,000 bytes of the 100,000,000-byte file."""
    data = read_enwik8(root)
    if len(data) < 20:
        raise DatasetError(f"{root}: enwik8 has {len(data)} bytes, expected 100,000,000")
    held = len(data) * ENWIK8_HELD // 100
    n_train = len(data) - 2 * held
    return {"train": line_pieces(data[:n_train]), "val": line_pieces(data[n_train:n_train + held]),
            "test": line_pieces(data[n_train + held:])}


# ----------------------------------------------------------------------------------------- WikiText-103
WIKITEXT_RAW = {"train": "wiki.train.raw", "val": "wiki.valid.raw", "test": "wiki.test.raw"}
WIKITEXT_HF_SPLITS = {"train": "train", "val": "validation", "test": "test"}
WIKITEXT_HF_CONFIG = "wikitext-103-raw-v1"


def _wikitext_raw_dir(root: Path) -> Path | None:
    for d in (root, root / "wikitext-103-raw"):
        if all((d / f).is_file() for f in WIKITEXT_RAW.values()):
            return d
    return None


def wikitext_present(root: Path) -> bool:
    return _wikitext_raw_dir(root) is not None or all(split_files(root, s, WIKITEXT_HF_CONFIG)
                                                          for s in WIKITEXT_HF_SPLITS.values())


def hf_lines(lines: Iterable[str]) -> Iterator[str]:
    """The Hugging Face WikiText rows of a raw file's lines: a whitespace-only line becomes ``""``."""
    return (line if line.strip() else "" for line in lines)


def load_wikitext103(root: Path) -> dict[str, Iterable[str]]:
    """WikiText-103 (raw) with its official train / validation / test splits.

    Two layouts give the same text: the ``wiki.{train,valid,test}.raw`` files (read as
    UTF-8 lines) and the Hugging Face parquet files ``wikitext-103-raw-v1/{train,validation,
    test}-*.parquet`` (one line per ``text`` row). As in the Hugging Face release,
    whitespace-only lines are dropped; the rows are then concatenated.
    """
    d = _wikitext_raw_dir(root)
    out = {}
    for split, hf in WIKITEXT_HF_SPLITS.items():
        if d is not None:
            with open(d / WIKITEXT_RAW[split], encoding="utf-8") as f:  # universal newlines, as Hugging Face
                text = "".join(hf_lines(f))
        else:
            files = split_files(root, hf, WIKITEXT_HF_CONFIG)
            text = "".join(row for path in files for row in read_column(path, "text"))
        out[split] = line_pieces(text)
    return out


# ----------------------------------------------------------------------------------------- One Billion Word
LM1B_DIR = "1-billion-word-language-modeling-benchmark-r13output"
LM1B_TRAIN = "training-monolingual.tokenized.shuffled"
LM1B_HELDOUT = "heldout-monolingual.tokenized.shuffled"
LM1B_TEST, LM1B_VAL = "news.en.heldout-00000-of-00050", "news.en.heldout-00001-of-00050"


def _lm1b_dir(root: Path) -> Path | None:
    for d in (root, root / LM1B_DIR):
        if (d / LM1B_HELDOUT / LM1B_TEST).is_file() and (d / LM1B_HELDOUT / LM1B_VAL).is_file() \
                and any((d / LM1B_TRAIN).glob("news.en-*-of-00100")):
            return d
    return None


def lm1b_present(root: Path) -> bool:
    return _lm1b_dir(root) is not None


def _file_pieces(paths: list[Path]) -> Iterator[bytes]:
    for p in paths:
        with open(p, "rb") as f:
            yield from line_pieces(f.read())


def load_lm1b(root: Path) -> dict[str, Iterable[bytes]]:
    """One Billion Word: train = the 99 shards ``news.en-000NN-of-00100`` in order; test = the benchmark's
    ``news.en.heldout-00000-of-00050``, validation = ``news.en.heldout-00001-of-00050`` (one sentence a line)."""
    d = _lm1b_dir(root)
    if d is None:
        raise DatasetError(f"no One Billion Word shards in {root}")
    train = sorted((d / LM1B_TRAIN).glob("news.en-*-of-00100"))
    return {"train": _file_pieces(train), "val": _file_pieces([d / LM1B_HELDOUT / LM1B_VAL]),
            "test": _file_pieces([d / LM1B_HELDOUT / LM1B_TEST])}


__all__ = ["line_pieces", "load_enwik8", "load_wikitext103", "load_lm1b", "hf_lines"]
