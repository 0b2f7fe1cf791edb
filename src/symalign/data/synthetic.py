"""Tiny generated datasets for tests (no files, no downloads).

* ``kind="image"``: ``(N, 1, 8, 8)`` noise images whose label is the quadrant with
  the largest mean (4 classes, learnable by a tiny ViT);
* ``kind="text"``: byte sequences whose label is the most frequent of 4 marker bytes;
* ``kind="lm"``: a byte stream of repeated short words (predictable next byte).
"""

from __future__ import annotations

import numpy as np

from symalign.data.base import split_indices


def synthetic_arrays(kind: str = "image", n: int = 256, seed: int = 0, seq_len: int = 16) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    if kind == "image":
        x = rng.random((n, 1, 8, 8), dtype=np.float32) * 0.5
        y = rng.integers(0, 4, n)
        for i, c in enumerate(y):
            r, q = divmod(int(c), 2)
            x[i, 0, 4 * r:4 * r + 4, 4 * q:4 * q + 4] += 0.5
    elif kind == "text":
        x = rng.integers(97, 123, (n, seq_len)).astype(np.uint8)
        y = rng.integers(0, 4, n)
        for i, c in enumerate(y):
            pos = rng.choice(seq_len, seq_len // 3, replace=False)
            x[i, pos] = 48 + int(c)
    elif kind == "lm":
        words = ["the ", "cat ", "sat ", "on ", "a ", "mat. "]
        text = "".join(words[int(i)] for i in rng.integers(0, len(words), n * 4))
        data = np.frombuffer(text.encode(), dtype=np.uint8)
        from symalign.data.base import split_stream

        tr, va, te = split_stream(data, seed, block=256)
        return {"x_train": tr, "x_val": va, "x_test": te}
    else:
        from symalign.errors import DatasetError

        raise DatasetError(f"unknown synthetic kind {kind!r}; use image, text or lm")
    y = y.astype(np.int64)
    tr, va, te = split_indices(n, seed, (0.25, 0.25))
    return {"x_train": x[tr], "y_train": y[tr], "x_val": x[va], "y_val": y[va], "x_test": x[te], "y_test": y[te]}
