"""Columns of the tables Hugging Face publishes and caches: parquet files (the hub's layout,
``<config>/<split>-00000-of-0000N.parquet``) and Arrow files (the ``datasets`` cache,
``<builder>-<split>.arrow`` / ``<builder>-<split>-00000-of-0000N.arrow``). Needs ``pyarrow``.
"""

from __future__ import annotations

from pathlib import Path

from symalign.errors import DatasetError

PYARROW_INSTALL = "pip install 'symalign[paper]'  (or: pip install pyarrow)"


def split_files(root: Path, split: str, subdir: str | None = None) -> list[Path]:
    """The parquet files of ``split`` under ``root`` (sorted, so shard 00000 comes first); if there are
    none, its Arrow files; ``[]`` if neither. ``root/subdir`` (the hub's config folder, e.g.
    ``wikitext-103-raw-v1``) is searched alone when it exists. The files must share one folder:
    tables of several configs or cache versions under ``root`` are a :class:`DatasetError`."""
    if subdir and (root / subdir).is_dir():
        root = root / subdir
    if not root.is_dir():
        return []
    for patterns in ((f"{split}-*.parquet", f"{split}.parquet"), (f"*-{split}.arrow", f"*-{split}-*-of-*.arrow")):
        found = sorted({p for pat in patterns for p in root.rglob(pat) if p.is_file()
                        and not any(part.startswith(".") for part in p.relative_to(root).parts)})
        folders = sorted({str(p.parent) for p in found})
        if len(folders) > 1:
            raise DatasetError(f"{root}: the {split!r} tables lie in {len(folders)} folders "
                               f"({', '.join(folders[:4])}); set root to the one to use")
        if found:
            return found
    return []


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.ipc  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError as exc:
        raise DatasetError(f"reading parquet / Arrow files needs pyarrow: {PYARROW_INSTALL}") from exc
    return pyarrow


def read_table(path: Path, columns: tuple[str, ...]) -> dict[str, list]:
    """``{column: values}`` of ``columns`` in the parquet or Arrow (stream or file) table at ``path``.

    :class:`DatasetError` naming the file if it is not such a table or lacks a column.
    """
    pa = _pyarrow()
    kind = "parquet" if path.suffix == ".parquet" else "Arrow"
    try:
        if kind == "parquet":
            table = pa.parquet.read_table(path)
        else:
            with pa.memory_map(str(path)) as src:
                try:
                    table = pa.ipc.open_stream(src).read_all()  # how `datasets` writes its cache
                except pa.ArrowInvalid:
                    src.seek(0)
                    table = pa.ipc.open_file(src).read_all()
    except (pa.ArrowException, OSError) as exc:
        raise DatasetError(f"{path}: not a readable {kind} table ({exc})") from exc
    absent = [c for c in columns if c not in table.column_names]
    if absent:
        raise DatasetError(f"{path}: the {kind} table has no column {', '.join(map(repr, absent))} (it has "
                           f"{', '.join(map(repr, table.column_names))}); expected columns {', '.join(columns)}")
    return {c: table.column(c).to_pylist() for c in columns}


def read_column(path: Path, column: str) -> list:
    return read_table(path, (column,))[column]
