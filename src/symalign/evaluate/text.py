r"""Text for evaluation: the token stream, its windows, and the fixed masks of masked-LM evaluation.

**Stream.** Each document is encoded whole by the checkpoint's tokenizer, without
special tokens (``tokenizer(doc, add_special_tokens=False)``); documents are
concatenated with the tokenizer's EOS token between them when it has one. So for
a single document the stream *is* the tokenizer's own encoding of the text. A
document longer than ``max_chars`` is cut after the last newline before that many
characters (only when more text than needed would be encoded).

**Bytes.** ``ends[i]`` is the UTF-8 byte offset (in the concatenated text) where
token ``i`` ends, from the fast tokenizer's character offsets. The bytes a window
``w = stream[s : s + T]`` predicts (tokens ``s+1 .. s+T-1``) are
``ends[s + T - 1] - ends[s]``, so nats per byte = summed nats / summed bytes.
A slow tokenizer (no offsets) gives no byte count.

**Windows.** Non-overlapping windows of ``context`` tokens, in order. Causal LM:
the window is the input and the labels (the model predicts ``T - 1`` tokens).
Masked LM: ``context - n_special`` content tokens wrapped with the tokenizer's
special tokens (``[CLS] ... [SEP]``).

**Masks (masked LM).** With a generator seeded by ``seed``, each window masks
``max(1, round(0.15 n))`` of its ``n`` non-special positions, chosen uniformly; a
masked position becomes the mask token (80 %), a uniformly random token (10 %)
or stays (10 %), BERT's recipe. Labels are the original ids there, ``-100``
elsewhere. The masks are drawn once, so every interpolation point sees the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor

from symalign.errors import ConfigError, DatasetError

MASK_FRACTION = 0.15


@dataclass
class Stream:
    """Token ids of the evaluated text and the byte offset where each token ends (``None``: unknown)."""

    ids: np.ndarray
    ends: np.ndarray | None
    documents: int


def _byte_offsets(text: str) -> np.ndarray:
    """``cum[c]``: UTF-8 bytes of ``text[:c]``, for ``c = 0 .. len(text)``."""
    if text.isascii():
        return np.arange(len(text) + 1, dtype=np.int64)
    cp = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    width = 1 + (cp >= 0x80) + (cp >= 0x800) + (cp >= 0x10000)
    return np.concatenate([[0], np.cumsum(width, dtype=np.int64)])


class ByteLevel:
    """UTF-8 bytes as token ids (``--tokenizer bytes``): token ``i`` is byte value ``i``."""

    name = "bytes"
    eos_token_id = None
    mask_token_id = None
    pad_token_id = 0

    def __len__(self) -> int:
        return 256

    def get_vocab(self) -> dict[str, int]:
        return {f"<0x{i:02X}>": i for i in range(256)}


def encode_document(tok: Any, text: str) -> tuple[list[int], np.ndarray | None]:
    """Ids of ``text`` without special tokens and the byte offset (within ``text``) where each token ends."""
    if isinstance(tok, ByteLevel):
        ids = list(text.encode("utf-8"))
        return ids, np.arange(1, len(ids) + 1, dtype=np.int64)
    if getattr(tok, "is_fast", False):
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        cum = _byte_offsets(text)
        ends = cum[np.asarray([e for _, e in enc["offset_mapping"]], dtype=np.int64)] if enc["input_ids"] else \
            np.zeros(0, dtype=np.int64)
        return list(enc["input_ids"]), np.maximum.accumulate(ends) if len(ends) else ends
    return list(tok(text, add_special_tokens=False, verbose=False)["input_ids"]), None


def token_stream(tok: Any, texts: Sequence[str], need: int | None = None, max_chars: int | None = None) -> Stream:
    """The stream of ``texts`` (see the module docstring); stops once it holds ``need`` tokens."""
    eos = getattr(tok, "eos_token_id", None)
    ids: list[int] = []
    ends: list[np.ndarray] | None = []
    base, docs = 0, 0
    for text in texts:
        if max_chars is not None and len(text) > max_chars:
            cut = text.rfind("\n", 0, max_chars)
            text = text[:cut + 1 if cut > 0 else max_chars]
        if not text:
            continue
        if ids and eos is not None:
            ids.append(int(eos))
            if ends is not None:
                ends.append(np.asarray([base], dtype=np.int64))
        doc_ids, doc_ends = encode_document(tok, text)
        ids.extend(doc_ids)
        if doc_ends is None:
            ends = None
        elif ends is not None:
            ends.append(doc_ends + base)
        base += len(text.encode("utf-8"))
        docs += 1
        if need is not None and len(ids) >= need:
            break
    arr_ends = None if ends is None else (np.concatenate(ends) if ends else np.zeros(0, dtype=np.int64))
    return Stream(np.asarray(ids, dtype=np.int64), arr_ends, docs)


def special_wrap(tok: Any) -> tuple[list[int], list[int]]:
    """The ids the tokenizer puts before and after one sequence (``[CLS]``, ``[SEP]``), read off its own
    encoding of a probe text with and without special tokens."""
    if isinstance(tok, ByteLevel):
        return [], []
    full = list(tok("a", add_special_tokens=True, verbose=False)["input_ids"])
    body = list(tok("a", add_special_tokens=False, verbose=False)["input_ids"])
    for i in range(len(full) - len(body) + 1):
        if full[i:i + len(body)] == body:
            return full[:i], full[i + len(body):]
    raise ConfigError("cannot tell which special tokens the tokenizer adds around a sequence")


def n_special(tok: Any) -> int:
    """Special tokens the tokenizer adds around one sequence (``[CLS] x [SEP]``: 2)."""
    pre, post = special_wrap(tok)
    return len(pre) + len(post)


def window_count(n_tokens: int, width: int, max_windows: int | None, where: str) -> int:
    """Whole windows of ``width`` tokens in ``n_tokens`` (at most ``max_windows``); at least one, else a
    :class:`DatasetError` naming ``where``."""
    n = n_tokens // width
    if max_windows is not None:
        n = min(n, max_windows)
    if n < 1:
        raise DatasetError(f"{where} gives {n_tokens} tokens, fewer than one window of {width}; give more "
                           f"text or a smaller --context")
    return n


def lm_windows(stream: Stream, context: int, max_windows: int | None, where: str) -> tuple[Tensor, int | None]:
    """``(W, context)`` windows of the stream and the bytes their predicted tokens cover."""
    n = window_count(len(stream.ids), context, max_windows, where)
    win = torch.from_numpy(stream.ids[:n * context].reshape(n, context).copy())
    n_bytes = None
    if stream.ends is not None:
        e = stream.ends[:n * context].reshape(n, context)
        n_bytes = int((e[:, -1] - e[:, 0]).sum())
    return win, n_bytes


def mlm_windows(tok: Any, stream: Stream, context: int, max_windows: int | None, seed: int, where: str
                ) -> tuple[Tensor, Tensor, Tensor]:
    """``(input_ids, labels, mask)`` of masked-LM windows (see the module docstring); ``mask`` marks the
    masked positions."""
    mask_id = getattr(tok, "mask_token_id", None)
    if mask_id is None:
        raise ConfigError("the tokenizer has no mask token, so it cannot feed a masked-LM head; use the "
                          "checkpoint's own tokenizer (e.g. BERT's [MASK])")
    pre, post = special_wrap(tok)
    body = context - len(pre) - len(post)
    if body < 1:
        raise ConfigError(f"--context {context} leaves no room for text between the special tokens")
    n = window_count(len(stream.ids), body, max_windows, where)
    content = torch.from_numpy(stream.ids[:n * body].reshape(n, body).copy())
    ids = torch.cat([torch.tensor([pre] * n, dtype=torch.long).view(n, len(pre)), content,
                     torch.tensor([post] * n, dtype=torch.long).view(n, len(post))], dim=1)
    special = torch.zeros_like(ids, dtype=torch.bool)
    special[:, :len(pre)] = True
    special[:, ids.shape[1] - len(post):] = True
    g = torch.Generator().manual_seed(int(seed))
    vocab = len(tok)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    inputs = ids.clone()
    for i in range(n):
        cand = (~special[i]).nonzero().flatten()
        k = max(1, round(MASK_FRACTION * len(cand)))
        pos = cand[torch.randperm(len(cand), generator=g)[:k]]
        mask[i, pos] = True
        r = torch.rand(k, generator=g)
        rand_ids = torch.randint(0, vocab, (k,), generator=g)
        inputs[i, pos] = torch.where(r < 0.8, torch.full_like(pos, mask_id),
                                     torch.where(r < 0.9, rand_ids, ids[i, pos]))
    labels = torch.where(mask, ids, torch.full_like(ids, -100))
    return inputs, labels, mask


__all__ = ["Stream", "ByteLevel", "encode_document", "token_stream", "lm_windows", "mlm_windows", "n_special",
           "special_wrap",
           "MASK_FRACTION"]
