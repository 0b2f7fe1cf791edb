r"""Tables in the README and ``docs/`` written from committed result files, and checked against them.

A Markdown file marks each generated table with a pair of HTML comments::

    <!-- results: results/demo.json table=main -->
    | encoding | naive loss barrier | ... |      <- written by `symalign docs` (`make results-docs`)
    <!-- /results -->

The result file (JSON, under ``results/`` in the repository) holds a ``provenance``
record (:func:`symalign.provenance.provenance`) and ``tables``: name ->
``{"columns": [{"key", "header", "format"?}, ...], "rows": [{key: value}, ...]}``, so
the producer of a result decides how it is shown, and a table in the docs is a pure
function of the file. :func:`render_file` rewrites every block of a Markdown file;
:func:`stale_blocks` lists the blocks whose text differs from what the files give (the
test suite fails on any). Changing one number in a result file therefore changes the
docs on the next ``make results-docs`` and fails the test until then.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from symalign.atomic import write_text
from symalign.errors import ConfigError

BLOCK = re.compile(r"(<!-- results: (?P<file>\S+) table=(?P<table>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /results -->)",
                   re.S)
DOCS: tuple[str, ...] = ("README.md", "docs/*.md")


@dataclass(frozen=True)
class Column:
    """One column: the row key, its header and a ``format`` spec (``".4f"``, ``".1%"``...; ``""``: ``str``)."""

    key: str
    header: str
    format: str = ""

    def cell(self, row: Mapping[str, Any]) -> str:
        v = row.get(self.key)
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return "-"
        return format(v, self.format) if self.format else str(v)


def make_table(rows: Iterable[Mapping[str, Any]], columns: Sequence[tuple[str, str] | tuple[str, str, str]]) -> dict:
    """The ``tables`` entry of a result file: ``columns`` as ``(key, header[, format])``."""
    cols = [Column(*c) for c in columns]
    rows = [dict(r) for r in rows]
    for c in cols:
        if not any(c.key in r for r in rows):
            raise ConfigError(f"no row has the column key {c.key!r}")
    return {"columns": [c.__dict__ for c in cols], "rows": rows}


def _short(prov: Mapping[str, Any]) -> str:
    parts = [f"`{prov['command']}`" if prov.get("command") else None]
    commit = prov.get("commit")
    if commit:
        dirty = " (uncommitted changes)" if str(commit).endswith("+dirty") else ""
        parts.append(f"commit `{str(commit)[:10]}`" + dirty)
    if prov.get("threads") is not None:
        parts.append(f"{prov['threads']} thread{'s' if prov['threads'] != 1 else ''}")
    ver = prov.get("versions") or {}
    if "torch" in ver:
        parts.append(f"torch {ver['torch']}")
    if prov.get("seed_pairs") is not None:
        n = int(prov["seed_pairs"])
        parts.append(f"{n} seed pair{'s' if n != 1 else ''}")
    return ", ".join(p for p in parts if p)


def render_table(result: Mapping[str, Any], table: str, source: str) -> str:
    """The Markdown of ``result["tables"][table]`` with a provenance line naming ``source``."""
    tables = result.get("tables") or {}
    if table not in tables:
        raise ConfigError(f"{source} has no table {table!r} (it has: {', '.join(sorted(tables)) or 'none'})")
    spec = tables[table]
    cols = [Column(**c) for c in spec["columns"]]
    lines = ["| " + " | ".join(c.header for c in cols) + " |",
             "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(c.cell(r) for c in cols) + " |" for r in spec["rows"]]
    prov = result.get("provenance") or {}
    lines += ["", f"<sub>From `{source}`" + (f": {_short(prov)}" if prov else "") + ".</sub>"]
    return "\n".join(lines) + "\n"


def _load(root: Path, rel: str, cache: dict[str, Any]) -> Any:
    if rel not in cache:
        path = root / rel
        if not path.is_file():
            raise ConfigError(f"a docs table names {rel}, which does not exist under {root}")
        try:
            cache[rel] = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{rel} is not valid JSON ({exc}); regenerate it") from exc
    return cache[rel]


def render_text(text: str, root: Path, cache: dict[str, Any] | None = None) -> str:
    """``text`` with every results block rewritten from its file (paths relative to ``root``)."""
    cache = {} if cache is None else cache

    def sub(m: re.Match) -> str:
        body = render_table(_load(root, m["file"], cache), m["table"], m["file"])
        return m.group(1) + body + m.group(5)

    return BLOCK.sub(sub, text)


def doc_files(root: Path, patterns: Sequence[str] = DOCS) -> list[Path]:
    return sorted({p for pat in patterns for p in root.glob(pat) if p.is_file()})


def render_file(path: Path, root: Path) -> bool:
    """Rewrite ``path``'s blocks in place (atomically); ``True`` when anything changed."""
    old = path.read_text()
    new = render_text(old, root)
    if new != old:
        write_text(path, new)
    return new != old


def stale_blocks(root: Path, patterns: Sequence[str] = DOCS) -> list[str]:
    """``"file: table"`` for every block whose text differs from its result file's rendering."""
    out, cache = [], {}
    for path in doc_files(root, patterns):
        for m in BLOCK.finditer(path.read_text()):
            want = render_table(_load(root, m["file"], cache), m["table"], m["file"])
            if m["body"] != want:
                out.append(f"{path.relative_to(root)}: {m['file']} table={m['table']}")
    return out


def blocks(root: Path, patterns: Sequence[str] = DOCS) -> list[tuple[str, str, str]]:
    """``(doc, result file, table)`` of every block."""
    return [(str(p.relative_to(root)), m["file"], m["table"])
            for p in doc_files(root, patterns) for m in BLOCK.finditer(p.read_text())]
