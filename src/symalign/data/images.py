"""Image classification data: scikit-learn digits and Fashion-MNIST (gzipped IDX files)."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np

from symalign.data.base import split_indices
from symalign.errors import DatasetError

FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_INSTALL = "apt-get install -y dataset-fashion-mnist"


def load_digits_arrays(seed: int = 0, test_fraction: float = 0.1) -> dict[str, np.ndarray]:
    """sklearn's 1,797 8x8 digits, scaled ``x / 16`` to [0, 1], shape ``(N, 1, 8, 8)``; a seeded
    split with 10 % validation and ``test_fraction`` test images (default 80/10/10: 180 test images;
    ``test_fraction=0.25``: 449 test images for curves measured on a few hundred items)."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:  # pragma: no cover
        raise DatasetError("the digits dataset needs scikit-learn: pip install scikit-learn") from exc
    d = load_digits()
    x = (d.images.astype(np.float32) / 16.0)[:, None]
    y = d.target.astype(np.int64)
    tr, va, te = split_indices(len(y), seed, (0.1, test_fraction))
    return {"x_train": x[tr], "y_train": y[tr], "x_val": x[va], "y_val": y[va], "x_test": x[te], "y_test": y[te]}


def read_idx(path: Path) -> np.ndarray:
    """Parse a (gzipped) IDX file: magic ``0x0000 08 ndim``, ``ndim`` big-endian int32 sizes, uint8 data.

    Images have 16 header bytes (3 dims), labels 8 (1 dim).
    """
    opener = gzip.open if str(path).endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise
    except (OSError, EOFError) as exc:
        raise DatasetError(f"{path}: cannot read IDX file ({exc})") from exc
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise DatasetError(f"{path}: not an unsigned-byte IDX file (bad magic {raw[:4].hex()})")
    ndim = raw[3]
    header = 4 + 4 * ndim
    dims = tuple(int(v) for v in np.frombuffer(raw[4:header], dtype=">i4"))
    data = np.frombuffer(raw, dtype=np.uint8, offset=header)
    if data.size != int(np.prod(dims)):
        raise DatasetError(f"{path}: header says {dims} = {int(np.prod(dims))} values, file has {data.size}")
    return data.reshape(dims)


def load_fashion_arrays(seed: int = 0, root: Path = FASHION_DIR, val_fraction: float = 1 / 12) -> dict[str, np.ndarray]:
    """Fashion-MNIST: 60k train (a seeded ``val_fraction`` held out as val) + the 10k test set,
    images ``(N, 1, 28, 28)`` uint8 (0-255)."""
    files = {f"{s}-{k}": Path(root) / f"{s}-{k}-ubyte.gz" for s in ("train", "t10k")
             for k in ("images-idx3", "labels-idx1")}
    missing = [str(p) for p in files.values() if not p.exists()]
    if missing:
        raise DatasetError(f"Fashion-MNIST is not installed ({missing[0]} is missing); install it with: "
                           f"{FASHION_INSTALL}")
    xtr = read_idx(files["train-images-idx3"])
    ytr = read_idx(files["train-labels-idx1"]).astype(np.int64)
    xte = read_idx(files["t10k-images-idx3"])
    yte = read_idx(files["t10k-labels-idx1"]).astype(np.int64)
    perm = np.random.default_rng(seed).permutation(len(ytr))
    n_val = int(round(len(ytr) * val_fraction))
    va, tr = perm[:n_val], perm[n_val:]

    def img(a: np.ndarray) -> np.ndarray:  # kept uint8 (4x smaller cache); scaled by /255 on load
        return a[:, None]

    return {"x_train": img(xtr[tr]), "y_train": ytr[tr], "x_val": img(xtr[va]), "y_val": ytr[va],
            "x_test": img(xte), "y_test": yte}
