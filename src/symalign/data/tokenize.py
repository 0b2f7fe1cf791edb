"""Tokenisation of text datasets: byte-level (the default) or a Hugging Face tokenizer from a local folder.

Two encodings, the same for every tokenizer:

* **stream** (language modelling): the pieces of a corpus (``str`` or ``bytes``)
  are encoded one after another without special tokens and concatenated into
  one 1-D id array. Byte-level: the UTF-8 bytes, unchanged (``bytes`` pieces
  are taken as they are). Hugging Face: ``bytes`` pieces are decoded as UTF-8
  (invalid sequences become U+FFFD) and each piece is encoded separately, so
  the ids equal those of the whole text except possibly at piece joins (the
  loaders cut pieces after a newline).
* **batch** (classification): each text becomes exactly ``length`` ids,
  truncated on the right and padded on the right with ``pad_id``. Byte-level:
  UTF-8 bytes padded with 0 (``base.encode_bytes``); Hugging Face: the
  tokenizer's special tokens are added (``[CLS] ... [SEP]`` for BERT), it
  truncates to ``length``, and the pad id is its ``pad_token_id`` (0 when it
  has none, e.g. GPT-2).

``vocab_size`` is the number of ids a model's embedding must hold: 256 for
bytes, ``len(tokenizer)`` (base vocabulary plus added tokens) for Hugging Face.
:func:`check_vocab` compares it with a model's vocabulary.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from symalign.data.base import BYTE_VOCAB, encode_bytes
from symalign.errors import ConfigError, DatasetError

BYTE_NAMES = ("bytes", "byte", "byte-level")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "merges.txt",
                   "tokenizer.model", "spiece.model", "special_tokens_map.json")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx", ".gguf")
_BATCH = 4096  # texts per call of a Hugging Face tokenizer


def id_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds ids ``0 .. vocab_size - 1`` (uint8, uint16 or uint32)."""
    for dt in (np.uint8, np.uint16, np.uint32):
        if vocab_size - 1 <= np.iinfo(dt).max:
            return np.dtype(dt)
    raise DatasetError(f"a vocabulary of {vocab_size} ids does not fit 32 bits")


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes as token ids (vocabulary 256, pad id 0)."""

    name: str = "bytes"
    vocab_size: int = BYTE_VOCAB
    pad_id: int = 0

    def fingerprint(self) -> str:
        return "bytes"

    def encode_stream(self, pieces: Iterable[str | bytes], limit: int | None = None) -> np.ndarray:
        """Concatenated UTF-8 bytes of ``pieces`` as uint8, stopping after ``limit`` ids if given."""
        return _concat((np.frombuffer(p if isinstance(p, bytes) else p.encode("utf-8"), dtype=np.uint8)
                        for p in pieces), limit, np.uint8)

    def encode_batch(self, texts: list[str], length: int) -> np.ndarray:
        """``(N, length)`` uint8: UTF-8 bytes truncated / right-padded with 0."""
        return encode_bytes(texts, length)


@dataclass
class HFTokenizer:
    """A Hugging Face tokenizer loaded with ``AutoTokenizer.from_pretrained(path)`` (offline)."""

    path: Path
    tok: Any = field(repr=False)

    @property
    def name(self) -> str:
        return str(self.path)

    @property
    def vocab_size(self) -> int:
        return int(len(self.tok))

    @property
    def pad_id(self) -> int:
        pid = self.tok.pad_token_id
        return 0 if pid is None else int(pid)

    def fingerprint(self) -> str:
        """SHA-256 of the tokenizer folder's files (names and contents; model weights skipped, the
        folder may be a whole checkpoint), so caches follow the tokenizer."""
        h = hashlib.sha256()
        for p in sorted(q for q in self.path.iterdir() if q.is_file() and q.suffix not in WEIGHT_SUFFIXES):
            h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
        return h.hexdigest()[:16]

    def _ids(self, texts: list[str], **kw) -> list[list[int]]:
        out: list[list[int]] = []
        for s in range(0, len(texts), _BATCH):
            out.extend(self.tok(texts[s:s + _BATCH], verbose=False, **kw)["input_ids"])
        return out

    def encode_stream(self, pieces: Iterable[str | bytes], limit: int | None = None) -> np.ndarray:
        """Ids of each piece (no special tokens), concatenated; at most ``limit`` ids."""
        dtype = id_dtype(self.vocab_size)

        def chunks() -> Iterator[np.ndarray]:
            batch: list[str] = []
            for p in pieces:
                batch.append(p.decode("utf-8", errors="replace") if isinstance(p, bytes) else p)
                if len(batch) == _BATCH:
                    yield from (np.asarray(ids, dtype=dtype) for ids in self._ids(batch, add_special_tokens=False))
                    batch = []
            if batch:
                yield from (np.asarray(ids, dtype=dtype) for ids in self._ids(batch, add_special_tokens=False))

        return _concat(chunks(), limit, dtype)

    def encode_batch(self, texts: list[str], length: int) -> np.ndarray:
        """``(N, length)`` ids with special tokens, truncated to ``length`` and right-padded with ``pad_id``."""
        out = np.full((len(texts), length), self.pad_id, dtype=id_dtype(self.vocab_size))
        for i, ids in enumerate(self._ids(list(texts), add_special_tokens=True, truncation=True, max_length=length)):
            out[i, :len(ids)] = ids[:length]
        return out


Tokenizer = ByteTokenizer | HFTokenizer


def _concat(arrays: Iterable[np.ndarray], limit: int | None, dtype) -> np.ndarray:
    parts, total = [], 0
    for a in arrays:
        if limit is not None and total + len(a) >= limit:
            parts.append(a[:limit - total])
            total = limit
            break
        parts.append(a)
        total += len(a)
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype=dtype)


def load_tokenizer(spec: str | Path | Tokenizer | None = None) -> Tokenizer:
    """``None`` or ``"bytes"``: :class:`ByteTokenizer`; a folder path: :class:`HFTokenizer` (needs ``transformers``).

    Errors (:class:`DatasetError`): the folder is missing or holds no tokenizer files,
    ``transformers`` is not installed, or it cannot load the folder.
    """
    if spec is None or isinstance(spec, (ByteTokenizer, HFTokenizer)):
        return spec or ByteTokenizer()
    if str(spec).lower() in BYTE_NAMES:
        return ByteTokenizer()
    path = Path(spec).expanduser()
    if not path.is_dir():
        raise DatasetError(f"tokenizer {str(spec)!r}: no such folder; give a folder saved with "
                           f"tokenizer.save_pretrained(PATH), or 'bytes' for byte-level text")
    if not any((path / f).exists() for f in TOKENIZER_FILES):
        raise DatasetError(f"tokenizer folder {path} holds none of {', '.join(TOKENIZER_FILES)}; save one there "
                           f"with tokenizer.save_pretrained({str(path)!r})")
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:  # pragma: no cover - the hf extra is installed in CI
        raise DatasetError("a Hugging Face tokenizer needs transformers: pip install 'symalign[hf]'") from exc
    try:
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # transformers raises OSError / ValueError / others for bad folders
        raise DatasetError(f"tokenizer folder {path}: transformers cannot load it ({type(exc).__name__}: "
                           f"{str(exc)[:300]})") from exc
    return HFTokenizer(path.resolve(), tok)


def check_vocab(tokenizer: Tokenizer | int, vocab_size: int, what: str = "the model") -> None:
    """Raise :class:`ConfigError` unless ``what``'s embedding (``vocab_size`` rows) holds every id of ``tokenizer``.

    ``tokenizer`` may be a tokenizer or its vocabulary size (e.g. ``Dataset.vocab_size``).
    A larger model vocabulary is allowed (ids ``>= tokenizer.vocab_size`` are never produced).
    """
    need = tokenizer if isinstance(tokenizer, int) else tokenizer.vocab_size
    name = "" if isinstance(tokenizer, int) else f" ({tokenizer.name})"
    if int(vocab_size) < int(need):
        raise ConfigError(f"the tokenizer{name} produces ids 0..{need - 1} but {what} has vocab_size={vocab_size}; "
                          f"build the model with vocab_size >= {need} or use a tokenizer that matches it")


__all__ = ["ByteTokenizer", "HFTokenizer", "Tokenizer", "load_tokenizer", "check_vocab", "id_dtype"]
