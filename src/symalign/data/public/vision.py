"""Image datasets in their published on-disk formats: MNIST (IDX), CIFAR-10/100 (python pickles),
and ImageNet-style image folders.

Images are returned as uint8 ``(N, C, H, W)`` (0-255, like Fashion-MNIST); the
registry scales them by ``1/255`` to [0, 1] when it builds the tensors.
"""

from __future__ import annotations

import importlib
import pickle
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from symalign.data.images import read_idx
from symalign.data.public.common import check_labels, classification_arrays, listing
from symalign.errors import DatasetError

# ----------------------------------------------------------------------------------------- MNIST
MNIST_STEMS = {"train_x": "train-images-idx3-ubyte", "train_y": "train-labels-idx1-ubyte",
               "test_x": "t10k-images-idx3-ubyte", "test_y": "t10k-labels-idx1-ubyte"}


def _mnist_dir(root: Path) -> Path | None:
    """The folder holding the four IDX files: ``root`` itself or torchvision's ``root/MNIST/raw``."""
    for d in (root, root / "MNIST" / "raw", root / "raw"):
        if all((d / s).is_file() or (d / f"{s}.gz").is_file() for s in MNIST_STEMS.values()):
            return d
    return None


def mnist_present(root: Path) -> bool:
    return _mnist_dir(root) is not None


def _idx(d: Path, stem: str) -> tuple[np.ndarray, Path]:
    path = d / stem if (d / stem).is_file() else d / f"{stem}.gz"
    return read_idx(path), path


def load_mnist(root: Path, seed: int, val_fraction: float) -> dict[str, np.ndarray]:
    """MNIST: 60,000 train (a seeded ``val_fraction`` held out) and 10,000 test images ``(N, 1, 28, 28)``."""
    d = _mnist_dir(root)
    if d is None:
        raise DatasetError(f"no MNIST IDX files in {root}{listing(root)}")
    out = {}
    for split in ("train", "test"):
        x, xp = _idx(d, MNIST_STEMS[f"{split}_x"])
        y, yp = _idx(d, MNIST_STEMS[f"{split}_y"])
        if x.ndim != 3 or y.ndim != 1:
            raise DatasetError(f"{xp if x.ndim != 3 else yp}: expected an IDX image file (N, H, W) and a label "
                               f"file (N,), got shapes {x.shape} and {y.shape}")
        if len(x) != len(y):
            raise DatasetError(f"{xp} holds {len(x)} images but {yp} holds {len(y)} labels")
        out[split] = (x[:, None], check_labels(y, 10, yp))
    return classification_arrays(out["train"], out["test"], [str(i) for i in range(10)], seed, val_fraction)


# ----------------------------------------------------------------------------------------- CIFAR
CIFAR10_DIR, CIFAR100_DIR = "cifar-10-batches-py", "cifar-100-python"
CIFAR10_TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))
# The classes a CIFAR pickle may reference: numpy's array reconstruction and nothing else.
_PICKLE_GLOBALS = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
                   ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
                   ("numpy", "ndarray"), ("numpy", "dtype"),
                   ("_codecs", "encode")}  # how Python 3 writes bytes at pickle protocol 2


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickles dicts, lists, strings and numpy arrays only (a CIFAR file cannot run code)."""

    def find_class(self, module: str, name: str):
        if (module, name) not in _PICKLE_GLOBALS:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a CIFAR file")
        if module.startswith("numpy.core") and int(np.__version__.split(".")[0]) >= 2:
            module = "numpy._core" + module[len("numpy.core"):]
        return getattr(importlib.import_module(module), name)


def read_cifar_pickle(path: Path, keys: tuple[str, ...]) -> dict:
    """A CIFAR python-version file: a pickled dict (Python 2 strings decoded as latin-1, as torchvision
    does) that must hold ``keys``; :class:`DatasetError` naming the file otherwise."""
    what = f"a CIFAR python pickle (a dict with {', '.join(keys)})"
    try:
        with open(path, "rb") as f:
            d = _ArrayUnpickler(f, encoding="latin1").load()
    except FileNotFoundError as exc:
        raise DatasetError(f"{path} is missing; expected {what}") from exc
    except Exception as exc:  # UnpicklingError, EOFError, ValueError, ... from a corrupt file
        raise DatasetError(f"{path}: not {what} ({type(exc).__name__}: {exc})") from exc
    if not isinstance(d, dict):
        raise DatasetError(f"{path}: not {what} (unpickled a {type(d).__name__})")
    d = {k.decode("latin1") if isinstance(k, bytes) else k: v for k, v in d.items()}
    absent = [k for k in keys if k not in d]
    if absent:
        raise DatasetError(f"{path}: not {what} (no {', '.join(absent)}; keys are {', '.join(map(str, d))})")
    return d


def _cifar_images(d: dict, path: Path) -> np.ndarray:
    """``data`` rows of 3072 bytes (1024 red, 1024 green, 1024 blue, each 32x32 row-major) -> ``(N, 3, 32, 32)``."""
    x = np.asarray(d["data"])
    if x.dtype != np.uint8 or x.ndim != 2 or x.shape[1] != 3 * 32 * 32:
        raise DatasetError(f"{path}: 'data' is {x.dtype} {x.shape}, expected uint8 (N, 3072)")
    return x.reshape(-1, 3, 32, 32)


def _names(meta: dict, key: str) -> list[str]:
    return [n.decode("latin1") if isinstance(n, bytes) else str(n) for n in meta[key]]


def _cifar_dir(root: Path, sub: str, first: str) -> Path | None:
    for d in (root / sub, root):
        if (d / first).is_file():
            return d
    return None


def cifar10_present(root: Path) -> bool:
    return _cifar_dir(root, CIFAR10_DIR, "data_batch_1") is not None


def cifar100_present(root: Path) -> bool:
    return _cifar_dir(root, CIFAR100_DIR, "train") is not None


def _cifar_split(d: Path, files: tuple[str, ...], label_key: str, n_classes: int) -> tuple[np.ndarray, np.ndarray]:
    xs, ys = [], []
    for f in files:
        b = read_cifar_pickle(d / f, ("data", label_key))
        x = _cifar_images(b, d / f)
        y = check_labels(b[label_key], n_classes, d / f)
        if len(x) != len(y):
            raise DatasetError(f"{d / f}: {len(x)} images but {len(y)} labels")
        xs.append(x)
        ys.append(y)
    return np.concatenate(xs), np.concatenate(ys)


def load_cifar10(root: Path, seed: int, val_fraction: float) -> dict[str, np.ndarray]:
    """CIFAR-10: ``data_batch_1..5`` (50,000, a seeded ``val_fraction`` held out) and ``test_batch``
    (10,000); images ``(N, 3, 32, 32)``; class names from ``batches.meta``."""
    d = _cifar_dir(root, CIFAR10_DIR, "data_batch_1")
    if d is None:
        raise DatasetError(f"no CIFAR-10 batches in {root}{listing(root)}")
    classes = _names(read_cifar_pickle(d / "batches.meta", ("label_names",)), "label_names")
    train = _cifar_split(d, CIFAR10_TRAIN, "labels", len(classes))
    test = _cifar_split(d, ("test_batch",), "labels", len(classes))
    return classification_arrays(train, test, classes, seed, val_fraction)


def load_cifar100(root: Path, seed: int, val_fraction: float, labels: str = "fine") -> dict[str, np.ndarray]:
    """CIFAR-100: ``train`` (50,000, a seeded ``val_fraction`` held out) and ``test`` (10,000);
    ``labels="fine"`` (100 classes) or ``"coarse"`` (20 superclasses); names from ``meta``."""
    if labels not in ("fine", "coarse"):
        raise DatasetError(f"cifar100: labels={labels!r}; use 'fine' (100 classes) or 'coarse' (20)")
    d = _cifar_dir(root, CIFAR100_DIR, "train")
    if d is None:
        raise DatasetError(f"no CIFAR-100 files in {root}{listing(root)}")
    key = f"{labels}_label_names"
    classes = _names(read_cifar_pickle(d / "meta", (key,)), key)
    train = _cifar_split(d, ("train",), f"{labels}_labels", len(classes))
    test = _cifar_split(d, ("test",), f"{labels}_labels", len(classes))
    return classification_arrays(train, test, classes, seed, val_fraction)


# ----------------------------------------------------------------------------------------- image folder
IMAGE_SIZE = 64  # default side of image-folder images
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".ppm", ".tif", ".tiff")


def imagefolder_present(root: Path) -> bool:
    return (root / "train").is_dir() and ((root / "val").is_dir() or (root / "test").is_dir())


def _class_files(split_dir: Path, per_class: int | None) -> dict[str, list[Path]]:
    """``{class: sorted image files}`` of ``split_dir/<class>/`` (at most ``per_class`` each)."""
    out = {}
    for c in sorted(p for p in split_dir.iterdir() if p.is_dir()):
        files = sorted(f for f in c.iterdir() if f.suffix.lower() in IMAGE_SUFFIXES and f.is_file())
        out[c.name] = files[:per_class] if per_class is not None else files
    return out


def decode_image(path: Path, size: int) -> np.ndarray:
    """RGB ``(3, size, size)`` uint8: Pillow decodes, converts to RGB, and ``ImageOps.fit`` scales the
    shorter side to ``size`` (bilinear) and centre-crops the longer one (no-op at ``size x size``)."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            im = im.convert("RGB")
            if im.size != (size, size):
                im = ImageOps.fit(im, (size, size), method=Image.Resampling.BILINEAR)
            return np.asarray(im, dtype=np.uint8).transpose(2, 0, 1).copy()
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise DatasetError(f"{path}: not a readable image ({exc}); remove it or replace it") from exc


def _decode_split(files: dict[str, list[Path]], index: dict[str, int], size: int) -> tuple[np.ndarray, np.ndarray]:
    paths = [p for c in files for p in files[c]]
    labels = np.asarray([index[c] for c in files for _ in files[c]], dtype=np.int64)
    x = np.zeros((len(paths), 3, size, size), dtype=np.uint8)
    with ThreadPoolExecutor(max_workers=min(8, (len(paths) // 64) + 1)) as pool:  # Pillow decodes without the GIL
        for i, img in enumerate(pool.map(lambda p: decode_image(p, size), paths)):
            x[i] = img
    return x, labels


def load_imagefolder(root: Path, seed: int, val_fraction: float, image_size: int = IMAGE_SIZE,
                     per_class: int | None = None) -> dict[str, np.ndarray]:
    """ImageNet-style folders ``root/{train,val[,test]}/<class>/<image>``; classes are the sorted
    folder names of ``train`` (labels 0..K-1, torchvision's ``ImageFolder`` order).

    With ``test/``: train / val / test as given. Without (ImageNet: its test labels are
    not public): ``val/`` is the test split and a seeded ``val_fraction`` of train is held out.
    """
    try:
        import PIL  # noqa: F401
    except ImportError as exc:  # pragma: no cover - Pillow comes with matplotlib
        raise DatasetError("image folders need Pillow: pip install 'symalign[paper]'") from exc
    if not imagefolder_present(root):
        raise DatasetError(f"{root}: not an image folder (expected train/<class>/*.png|jpg and val/<class>/...)"
                           f"{listing(root)}")
    if image_size < 1:
        raise DatasetError(f"image_size must be >= 1, got {image_size}")
    train_files = _class_files(root / "train", per_class)
    if not any(train_files.values()):
        raise DatasetError(f"{root / 'train'}: no images in class folders (expected train/<class>/*.png|jpg)"
                           f"{listing(root / 'train')}")
    classes = list(train_files)
    index = {c: i for i, c in enumerate(classes)}
    splits = {}
    for s in ("val", "test"):
        if (root / s).is_dir():
            files = _class_files(root / s, per_class)
            unknown = [c for c in files if c not in index]
            if unknown:
                raise DatasetError(f"{root / s}: classes {', '.join(unknown[:5])} have no folder in {root / 'train'}")
            splits[s] = _decode_split(files, index, image_size)
    train = _decode_split(train_files, index, image_size)
    if "test" in splits:
        return classification_arrays(train, splits["test"], classes, seed, val_fraction, val=splits.get("val"))
    return classification_arrays(train, splits["val"], classes, seed, val_fraction)
