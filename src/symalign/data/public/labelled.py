"""Text-classification datasets in their published layouts: AG News, IMDB, DBPedia.

Layouts, tried in this order:

* Hugging Face hub parquet (or the ``datasets`` Arrow cache) under ``root``:
  ``<anything>/train-*.parquet`` and ``test-*.parquet`` with a ``label`` column
  and ``text`` (AG News, IMDB) or ``title`` + ``content`` (DBPedia);
* the classic CSV releases (Zhang et al. 2015) for AG News and DBPedia:
  ``ag_news_csv/{train,test}.csv`` (class 1-4, title, description) and
  ``dbpedia_csv/{train,test}.csv`` (class 1-14, title, content);
* for IMDB, the original ``aclImdb/{train,test}/{neg,pos}/*.txt`` folders.

Texts are built the same way from every layout: AG News ``title + " " +
description`` (how the Hugging Face release builds ``text``), DBPedia
``title.strip() + " " + content.strip()``. Labels are 0-based (CSV classes
minus 1; IMDB neg = 0, pos = 1).
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from symalign.data.public.common import check_labels
from symalign.data.public.tables import read_table, split_files
from symalign.errors import DatasetError

AG_NEWS_CLASSES = ("World", "Sports", "Business", "Sci/Tech")
DBPEDIA_CLASSES = ("Company", "EducationalInstitution", "Artist", "Athlete", "OfficeHolder", "MeanOfTransportation",
                   "Building", "NaturalPlace", "Village", "Animal", "Plant", "Album", "Film", "WrittenWork")
IMDB_CLASSES = ("neg", "pos")


@dataclass(frozen=True)
class TextSource:
    """Where a text-classification dataset's columns are and how they become one text."""

    classes: tuple[str, ...]
    columns: tuple[str, ...]  # parquet / Arrow text columns, joined into the text
    hub_dir: str | None = None  # the hub repository's folder of this dataset's parquet files
    csv_dir: str | None = None  # folder of the classic CSV release
    acl_imdb: bool = False


def dbpedia_text(title: str, content: str) -> str:
    return f"{title.strip()} {content.strip()}"


def _text(src: TextSource, parts: tuple[str, ...]) -> str:
    return parts[0] if len(parts) == 1 else dbpedia_text(*parts)


def _from_tables(src: TextSource, files: list[Path]) -> tuple[list[str], np.ndarray]:
    texts, labels = [], []
    for path in files:
        cols = read_table(path, src.columns + ("label",))
        texts.extend(_text(src, parts) for parts in zip(*(cols[c] for c in src.columns)))
        labels.append(check_labels(np.asarray(cols["label"]), len(src.classes), path))
    return texts, np.concatenate(labels) if labels else np.zeros(0, np.int64)


def _csv_dir(root: Path, name: str) -> Path | None:
    for d in (root / name, root):
        if (d / "train.csv").is_file() and (d / "test.csv").is_file():
            return d
    return None


def read_classic_csv(path: Path, src: TextSource) -> tuple[list[str], np.ndarray]:
    """Rows ``"class","title","body"`` (all quoted, class 1-based) as ``(texts, 0-based labels)``."""
    texts, labels = [], []
    try:
        with open(path, encoding="utf-8", newline="") as f:
            for i, row in enumerate(csv.reader(f, quotechar='"', delimiter=",", quoting=csv.QUOTE_ALL,
                                               skipinitialspace=True)):
                if len(row) != 3 or not row[0].strip().isdigit():
                    raise DatasetError(f"{path}, row {i + 1}: expected 3 fields (class 1-{len(src.classes)}, "
                                       f"title, text), got {row[:3]!r}{'...' if len(row) > 3 else ''}")
                labels.append(int(row[0]) - 1)
                texts.append(f"{row[1]} {row[2]}" if src.columns == ("text",) else dbpedia_text(row[1], row[2]))
    except UnicodeDecodeError as exc:
        raise DatasetError(f"{path}: not UTF-8 text ({exc}); expected the CSV release") from exc
    return texts, check_labels(np.asarray(labels, dtype=np.int64), len(src.classes), path)


_REVIEW_ID = re.compile(r"^(\d+)_")


def _review_key(p: Path) -> tuple[int, str]:
    m = _REVIEW_ID.match(p.name)
    return (int(m.group(1)) if m else -1, p.name)


def _acl_dir(root: Path) -> Path | None:
    for d in (root / "aclImdb", root):
        if all((d / s / c).is_dir() for s in ("train", "test") for c in IMDB_CLASSES):
            return d
    return None


def read_acl_imdb(split_dir: Path) -> tuple[list[str], np.ndarray]:
    """``split_dir/{neg,pos}/<id>_<rating>.txt`` (sorted by id) as ``(texts, labels)``, neg = 0, pos = 1."""
    texts, labels = [], []
    for label, cls in enumerate(IMDB_CLASSES):
        for p in sorted((split_dir / cls).glob("*.txt"), key=_review_key):
            texts.append(p.read_text(encoding="utf-8", errors="replace"))
            labels.append(label)
    return texts, np.asarray(labels, dtype=np.int64)


def text_present(root: Path, src: TextSource) -> bool:
    if split_files(root, "train", src.hub_dir) and split_files(root, "test", src.hub_dir):
        return True
    if src.csv_dir and _csv_dir(root, src.csv_dir):
        return True
    return bool(src.acl_imdb and _acl_dir(root))


def load_text(root: Path, src: TextSource) -> dict[str, tuple[list[str], np.ndarray]]:
    """``{"train": (texts, labels), "test": (texts, labels)}`` from the first layout found under ``root``."""
    tables = {s: split_files(root, s, src.hub_dir) for s in ("train", "test")}
    if all(tables.values()):
        return {s: _from_tables(src, files) for s, files in tables.items()}
    d = _csv_dir(root, src.csv_dir) if src.csv_dir else None
    if d is not None:
        return {s: read_classic_csv(d / f"{s}.csv", src) for s in ("train", "test")}
    d = _acl_dir(root) if src.acl_imdb else None
    if d is not None:
        return {s: read_acl_imdb(d / s) for s in ("train", "test")}
    raise DatasetError(f"no train and test files in {root}")
