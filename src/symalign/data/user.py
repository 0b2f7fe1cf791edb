"""The user's own evaluation data: text files, JSONL, image folders and ``datasets`` datasets.

:func:`load_user_data` turns ``--data SOURCE`` into a :class:`UserData` of raw
examples (no tokenisation: that is the checkpoint's job, see
:mod:`symalign.evaluate`). What ``SOURCE`` may be, tried in this order:

* a folder written by ``datasets``' ``save_to_disk`` (``dataset_info.json`` /
  ``state.json`` / ``dataset_dict.json`` inside): read with ``load_from_disk``;
  a ``DatasetDict`` is cut to ``split``;
* a folder of images in class sub-folders (``ROOT/<class>/*.png``), or
  ``ROOT/<split>/<class>/*`` when ``ROOT/<split>`` exists; class ``k`` is the
  ``k``-th class name in sorted order; at least two classes;
* a ``.jsonl`` / ``.ndjson`` file: one JSON object per line, the text in
  ``text_field`` (default ``text``), an optional label in ``label_field``;
* any other file: UTF-8 plain text, one document (refused when empty, not UTF-8
  or holding NUL bytes, i.e. binary);
* a name that is no path: a dataset in ``datasets``' local cache, loaded offline
  (``HF_DATASETS_OFFLINE=1``).

Sequence-to-sequence evaluation reads pairs instead (:func:`load_pairs`): a
``.jsonl`` file whose objects, or a ``.csv`` file (header row) whose columns,
include ``source`` and ``target`` (both text). Plain text is refused there: a
pair cannot be read off a line honestly.

Every problem raises :class:`~symalign.errors.DatasetError` with one line that
names the source and the fix.
"""

from __future__ import annotations

import csv
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from symalign.errors import DatasetError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm")
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".jsonlines")
SAVED_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
TEXT_FIELDS = ("text", "sentence", "content", "document")
LABEL_FIELDS = ("label", "labels")
IMAGE_FIELDS = ("image", "img")
SPLIT_ORDER = ("test", "validation", "valid", "val", "train")


@dataclass
class UserData:
    """Raw examples of one split.

    ``kind`` is ``"text"`` (``texts``, and ``labels`` when the source has them) or
    ``"image"`` (``images``: PIL images, and ``labels``). ``classes`` are the label
    names in id order (image folders, string labels, ``ClassLabel`` features).
    """

    source: str
    kind: str
    texts: list[str] = field(default_factory=list)
    images: list[Any] = field(default_factory=list)
    labels: list[int] | None = None
    classes: list[str] | None = None
    split: str | None = None

    def __len__(self) -> int:
        return len(self.texts) if self.kind == "text" else len(self.images)

    def summary(self) -> dict:
        return {"source": self.source, "kind": self.kind, "items": len(self), "split": self.split,
                "labelled": self.labels is not None, "classes": len(self.classes) if self.classes else None}


def is_user_source(spec: str) -> bool:
    """Whether ``spec`` names a file or folder (else a registry or ``datasets`` cache name)."""
    return Path(spec).expanduser().exists()


def load_user_data(spec: str, split: str | None = None, text_field: str | None = None,
                   label_field: str | None = None) -> UserData:
    """The examples of ``spec`` (see the module docstring)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        if any((path / m).is_file() for m in SAVED_MARKERS):
            return _from_datasets(_load_from_disk(path), spec, split, text_field, label_field)
        return _image_folder(path, spec, split)
    if path.is_file():
        if path.suffix.lower() in JSONL_SUFFIXES:
            return _jsonl(path, text_field or "text", label_field)
        return _text_file(path)
    return _from_cache(spec, split, text_field, label_field)


# ----------------------------------------------------------------------------- text


def _text_file(path: Path) -> UserData:
    raw = path.read_bytes()
    if not raw.strip():
        raise DatasetError(f"{path} is empty; give a file with text to evaluate on")
    if b"\0" in raw:
        raise DatasetError(f"{path} is a binary file (it holds NUL bytes), not text; give a UTF-8 text file, "
                           f"a .jsonl file or a dataset folder")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DatasetError(f"{path} is not UTF-8 text (byte {exc.start}: {raw[exc.start:exc.start + 1]!r}); "
                           f"convert it with iconv -t utf-8, or give a .jsonl file") from None
    return UserData(str(path), "text", texts=[text])


def _jsonl(path: Path, text_field: str, label_field: str | None) -> UserData:
    texts: list[str] = []
    raw_labels: list[Any] = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise DatasetError(f"{path} is not UTF-8 text; a JSONL file holds one UTF-8 JSON object per line") from None
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as exc:
            raise DatasetError(f"{path}:{i}: not valid JSON ({exc.msg}); each line must be one JSON object") from None
        if not isinstance(rec, dict) or text_field not in rec:
            keys = ", ".join(sorted(rec)) if isinstance(rec, dict) else type(rec).__name__
            raise DatasetError(f"{path}:{i}: no field {text_field!r} (found: {keys}); name the text field "
                               f"with --text-field")
        if not isinstance(rec[text_field], str):
            raise DatasetError(f"{path}:{i}: field {text_field!r} is {type(rec[text_field]).__name__}, not text")
        texts.append(rec[text_field])
        lf = label_field or next((f for f in LABEL_FIELDS if f in rec), None)
        if label_field and label_field not in rec:
            raise DatasetError(f"{path}:{i}: no label field {label_field!r}; every line needs one (or drop "
                               f"--label-field)")
        raw_labels.append(rec.get(lf) if lf else None)
    if not texts or not any(t.strip() for t in texts):
        raise DatasetError(f"{path} holds no text (no non-empty {text_field!r} values); give a file with text")
    labels, classes = _encode_labels(raw_labels, str(path))
    return UserData(str(path), "text", texts=texts, labels=labels, classes=classes)


def _encode_labels(raw: list[Any], where: str, names: list[str] | None = None
                   ) -> tuple[list[int] | None, list[str] | None]:
    """Integer labels as they are; strings mapped to their index in sorted order; ``None`` if absent."""
    if not raw or all(r is None for r in raw):
        return None, names
    if any(r is None for r in raw):
        raise DatasetError(f"{where}: some examples have a label and some do not; label all or none")
    if all(isinstance(r, (int, bool)) for r in raw):
        return [int(r) for r in raw], names
    if all(isinstance(r, str) for r in raw):
        classes = sorted(set(raw))
        idx = {c: i for i, c in enumerate(classes)}
        return [idx[r] for r in raw], classes
    raise DatasetError(f"{where}: labels must be all integers or all strings")


# ----------------------------------------------------------------------------- source / target pairs

PAIR_FIELDS = ("source", "target")
CSV_SUFFIXES = (".csv",)


def load_pairs(spec: str) -> list[tuple[str, str]]:
    """``(source, target)`` text pairs of a ``.jsonl`` / ``.csv`` file with ``source`` and ``target`` fields
    (see the module docstring); :class:`DatasetError` with one line otherwise."""
    path = Path(spec).expanduser()
    need = "a .jsonl file of {\"source\": ..., \"target\": ...} objects or a .csv file with source,target columns"
    if not path.is_file():
        raise DatasetError(f"{spec}: a sequence-to-sequence model is evaluated on source/target pairs; give {need}")
    suffix = path.suffix.lower()
    if suffix not in JSONL_SUFFIXES + CSV_SUFFIXES:
        raise DatasetError(f"{spec} is not a .jsonl or .csv file; a sequence-to-sequence model is evaluated on "
                           f"source/target pairs: give {need}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise DatasetError(f"{spec} is not UTF-8 text; give {need}") from None
    rows: list[tuple[int, Any]] = []
    if suffix in CSV_SUFFIXES:
        reader = csv.DictReader(text.splitlines())
        rows = [(i, r) for i, r in enumerate(reader, 2)]
        if not reader.fieldnames or not set(PAIR_FIELDS) <= set(reader.fieldnames):
            found = ", ".join(reader.fieldnames or []) or "none"
            raise DatasetError(f"{spec}: no 'source' and 'target' columns (found: {found}); give {need}")
    else:
        for i, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append((i, json.loads(line)))
            except ValueError as exc:
                raise DatasetError(f"{spec}:{i}: not valid JSON ({exc.msg}); give {need}") from None
    pairs: list[tuple[str, str]] = []
    for i, rec in rows:
        if not isinstance(rec, dict) or not all(f in rec for f in PAIR_FIELDS):
            keys = ", ".join(sorted(map(str, rec))) if isinstance(rec, dict) else type(rec).__name__
            raise DatasetError(f"{spec}:{i}: no 'source' and 'target' fields (found: {keys}); give {need}")
        if not all(isinstance(rec[f], str) for f in PAIR_FIELDS):
            raise DatasetError(f"{spec}:{i}: 'source' and 'target' must be text")
        if rec["target"].strip():
            pairs.append((rec["source"], rec["target"]))
    if not pairs:
        raise DatasetError(f"{spec} holds no pair with a non-empty target; give {need}")
    return pairs


# ----------------------------------------------------------------------------- images


def _image_folder(root: Path, spec: str, split: str | None) -> UserData:
    base = root / split if split and (root / split).is_dir() else root
    if split and base is root and any((root / s).is_dir() for s in SPLIT_ORDER):
        raise DatasetError(f"{root} has no split folder {split!r}; use one of "
                           f"{', '.join(s for s in SPLIT_ORDER if (root / s).is_dir())}")
    if base is root and split is None:
        found = next((s for s in SPLIT_ORDER if (root / s).is_dir()), None)
        if found is not None:
            base, split = root / found, found
    classes = sorted(d.name for d in base.iterdir() if d.is_dir() and not d.name.startswith("."))
    files = {c: sorted(p for p in (base / c).rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES) for c in classes}
    classes = [c for c in classes if files[c]]
    if not classes:
        raise DatasetError(f"{base} holds no images in class sub-folders; lay it out as {base}/<class>/<image>.png "
                           f"(or give a text file, .jsonl file or a saved dataset)")
    if len(classes) < 2:
        raise DatasetError(f"{base} has images of one class only ({classes[0]!r}); an image folder needs one "
                           f"sub-folder per class, at least two")
    from PIL import Image

    images, labels = [], []
    for k, c in enumerate(classes):
        for p in files[c]:
            try:
                with Image.open(p) as im:
                    images.append(im.convert("RGB") if im.mode not in ("L", "RGB") else im.copy())
            except Exception as exc:
                raise DatasetError(f"{p} is not a readable image ({type(exc).__name__}); "
                                   "remove or replace it") from None
            labels.append(k)
    return UserData(spec, "image", images=images, labels=labels, classes=classes, split=split)


# ----------------------------------------------------------------------------- datasets


def _require_datasets():
    try:
        import datasets
    except ImportError:  # pragma: no cover - in the hf extra
        raise DatasetError("reading a saved dataset needs the datasets library: pip install 'symalign[hf]'") from None
    return datasets


def _load_from_disk(path: Path):
    datasets = _require_datasets()
    try:
        return datasets.load_from_disk(str(path))
    except Exception as exc:
        raise DatasetError(f"{path}: datasets cannot read this saved dataset ({type(exc).__name__}: "
                           f"{str(exc).splitlines()[0][:200] if str(exc) else ''})") from None


@contextmanager
def _offline(datasets: Any) -> Iterator[None]:
    """``datasets`` offline for one call unless the user set ``HF_DATASETS_OFFLINE`` themselves.

    ``datasets`` reads the variable once, when it is imported, so setting it in
    ``os.environ`` here would be too late: its flag ``datasets.config.HF_HUB_OFFLINE``
    is set for the call and restored after.
    """
    if os.environ.get("HF_DATASETS_OFFLINE") is not None:
        yield
        return
    old = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE = old


DATA_SUFFIXES = (".txt", ".text", ".md", ".json", ".csv", ".tsv", ".parquet", ".arrow", *JSONL_SUFFIXES,
                 *IMAGE_SUFFIXES)
"""File suffixes that mark ``--data`` as a path (a ``datasets`` cache name is ``NAME`` or ``OWNER/NAME``)."""


def looks_like_path(spec: str) -> bool:
    """Whether ``spec`` was meant as a file or folder: it starts with ``/``, ``.`` or ``~``, ends with a data
    file suffix (:data:`DATA_SUFFIXES`), or has more folders than a cache name's ``OWNER/NAME``."""
    return (spec.startswith(("/", ".", "~")) or spec.lower().endswith(DATA_SUFFIXES)
            or spec.rstrip("/").count("/") > 1 or os.sep != "/" and os.sep in spec)


def _missing_path(spec: str) -> DatasetError:
    """A path that does not exist: name the first missing folder, or a close name beside it."""
    import difflib

    path = Path(spec).expanduser()
    parent = path.parent
    while not parent.is_dir() and parent != parent.parent:
        path, parent = parent, parent.parent
    if path != Path(spec).expanduser():
        return DatasetError(f"{spec}: no such file or folder ({path} does not exist)")
    near = difflib.get_close_matches(path.name, [p.name for p in parent.iterdir()], n=1) if parent.is_dir() else []
    hint = f"; did you mean {parent / near[0]}?" if near else ""
    return DatasetError(f"{spec}: no such file or folder{hint}")


def check_data_path(spec: str) -> None:
    """Refuse, before any work, a ``--data`` that was meant as a path (:func:`looks_like_path`) and does not
    exist (one line naming the first missing folder or a close name)."""
    if looks_like_path(spec) and not Path(spec).expanduser().exists():
        raise _missing_path(spec)


# What ``datasets`` raises offline for a name it has not cached: said in words, not by class name.
_NOT_CACHED = ("ConnectionError", "DatasetNotFoundError", "FileNotFoundError", "OfflineModeIsEnabled",
               "LocalEntryNotFoundError", "HfHubHTTPError")


def _from_cache(spec: str, split: str | None, text_field: str | None, label_field: str | None) -> UserData:
    if looks_like_path(spec):
        raise _missing_path(spec)
    datasets = _require_datasets()
    try:
        with _offline(datasets):
            ds = datasets.load_dataset(spec)
    except Exception as exc:
        import difflib

        from symalign.data import ALIASES, DATASETS

        near = difflib.get_close_matches(spec.lower(), [*DATASETS, *ALIASES], n=1)
        hint = f"did you mean the built-in {near[0]!r}? Else give" if near else "give"
        first = str(exc).splitlines()[0][:120] if str(exc).strip() else ""
        why = "" if type(exc).__name__ in _NOT_CACHED else f" ({type(exc).__name__}: {first})"
        raise DatasetError(f"{spec!r} is neither a file, a folder, a built-in dataset nor a dataset in the local "
                           f"datasets cache{why}; {hint} a path, or save the dataset with save_to_disk") from None
    return _from_datasets(ds, spec, split, text_field, label_field)


def _from_datasets(ds: Any, spec: str, split: str | None, text_field: str | None,
                   label_field: str | None) -> UserData:
    if isinstance(ds, dict):  # a DatasetDict
        names = list(ds.keys())
        if split is None:
            split = next((s for s in SPLIT_ORDER if s in names), names[0])
        if split not in names:
            raise DatasetError(f"{spec} has no split {split!r}; use --split with one of {', '.join(names)}")
        ds = ds[split]
    cols = list(ds.column_names)
    if len(ds) == 0:
        raise DatasetError(f"{spec} (split {split}) holds no examples")
    lf = label_field or next((c for c in LABEL_FIELDS if c in cols), None)
    if label_field and label_field not in cols:
        raise DatasetError(f"{spec} has no column {label_field!r} (columns: {', '.join(cols)}); fix --label-field")
    names = None
    if lf is not None:
        feat = ds.features.get(lf)
        names = list(getattr(feat, "names", None) or []) or None
    labels, classes = _encode_labels(list(ds[lf]) if lf else [], spec, names)
    image_col = next((c for c in IMAGE_FIELDS if c in cols), None)
    if text_field is None and image_col is not None:
        images = [im.convert("RGB") if im.mode not in ("L", "RGB") else im for im in ds[image_col]]
        if labels is None:
            raise DatasetError(f"{spec}: images without a label column; name it with --label-field")
        return UserData(spec, "image", images=images, labels=labels, classes=classes, split=split)
    tf = text_field or next((c for c in TEXT_FIELDS if c in cols), None)
    if tf is None or tf not in cols:
        raise DatasetError(f"{spec} has no text column {text_field or 'text'!r} (columns: {', '.join(cols)}); "
                           f"name it with --text-field")
    texts = list(ds[tf])
    if not all(isinstance(t, str) for t in texts):
        raise DatasetError(f"{spec}: column {tf!r} is not text; name the text column with --text-field")
    if not any(t.strip() for t in texts):
        raise DatasetError(f"{spec}: column {tf!r} holds no text")
    return UserData(spec, "text", texts=texts, labels=labels, classes=classes, split=split)


__all__ = ["UserData", "load_user_data", "load_pairs", "is_user_source", "check_data_path", "looks_like_path",
           "PAIR_FIELDS"]
