"""What every public-dataset loader shares: where the files live, fetching them, the missing-file
message, archive unpacking and the carved validation split.

Location: ``root`` if given, else ``$SYMALIGN_DATA/<name>``, else
``~/.cache/symalign/datasets/<name>``. Nothing is downloaded unless asked
(``download=True``); a dataset that is absent and not downloaded raises
:class:`DatasetError` naming the files to put where and the URLs they come from.
"""

from __future__ import annotations

import os
import shutil
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from symalign.atomic import atomic_path, file_digest
from symalign.errors import DatasetError

DOWNLOAD_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Remote:
    """A file to fetch into the dataset folder: ``url`` saved as ``root / filename``.

    ``md5`` (when known) is checked after the download; ``extract`` unpacks a
    ``.tar.gz`` / ``.tgz`` / ``.zip`` archive into ``root``.
    """

    url: str
    filename: str
    md5: str | None = None
    extract: bool = False


def data_root(name: str, root: str | os.PathLike | None = None) -> Path:
    """``root``, else ``$SYMALIGN_DATA/<name>``, else ``~/.cache/symalign/datasets/<name>`` (``~`` expanded)."""
    if root is not None:
        return Path(root).expanduser()
    base = os.environ.get("SYMALIGN_DATA")
    return (Path(base).expanduser() if base else Path.home() / ".cache" / "symalign" / "datasets") / name


def listing(root: Path, limit: int = 8) -> str:
    """`` (the folder holds: a, b, ...)`` or `` (the folder does not exist)`` for error messages."""
    if not root.is_dir():
        return " (the folder does not exist)"
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in root.iterdir())
    if not names:
        return " (the folder is empty)"
    more = f", ... {len(names) - limit} more" if len(names) > limit else ""
    return f" (the folder holds: {', '.join(names[:limit])}{more})"


def missing_error(title: str, root: Path, layout: str, remotes: Sequence[Remote], manual: str = "") -> DatasetError:
    """The error for a dataset that is not under ``root``: what to put where, and from which URLs."""
    fetch = ""
    if remotes:
        fetch = (f" Download {', '.join(r.url for r in remotes)} into {root} (archives there are unpacked "
                 f"automatically), or pass download=True ([data_options] download = true).")
    return DatasetError(f"{title} not found in {root}{listing(root)}: expected {layout}.{fetch}{manual} "
                        f"Choose the folder with root= ([data_options] root = \"...\") or $SYMALIGN_DATA.")


def md5_of(path: Path) -> str:
    return file_digest(path, "md5")


def fetch(remote: Remote, root: Path) -> Path:
    """Download ``remote`` to ``root / remote.filename`` (atomically; md5 checked when known)."""
    import urllib.request

    dest = root / remote.filename
    try:
        with urllib.request.urlopen(remote.url, timeout=DOWNLOAD_TIMEOUT_S) as resp, atomic_path(dest) as tmp:
            with open(tmp, "wb") as f:
                shutil.copyfileobj(resp, f, 1 << 20)
            if remote.md5 and md5_of(tmp) != remote.md5:
                raise DatasetError(f"{remote.url}: the download's md5 is {md5_of(tmp)}, expected {remote.md5}; "
                                   f"retry, or fetch it by hand into {dest}")
    except DatasetError:
        raise
    except (OSError, ValueError) as exc:  # URLError, HTTPError, timeouts, unknown scheme
        raise DatasetError(f"cannot download {remote.url} ({exc}); fetch it by hand into {dest}") from exc
    return dest


def extract(archive: Path, into: Path) -> None:
    """Unpack a ``.tar(.gz)`` / ``.tgz`` / ``.zip`` archive into ``into`` (member paths kept inside it)."""
    try:
        if zipfile.is_zipfile(archive):
            with zipfile.ZipFile(archive) as z:
                for member in z.namelist():
                    if not (into / member).resolve().is_relative_to(into.resolve()):
                        raise DatasetError(f"{archive}: member {member!r} would land outside {into}")
                z.extractall(into)
        else:
            with tarfile.open(archive) as t:
                if hasattr(tarfile, "data_filter"):  # Python >= 3.10.12 / 3.11.4
                    t.extractall(into, filter="data")
                else:  # pragma: no cover - older patch releases
                    for m in t.getmembers():
                        inside = (into / m.name).resolve().is_relative_to(into.resolve())
                        if not (m.isfile() or m.isdir()) or not inside:
                            raise DatasetError(f"{archive}: member {m.name!r} is not a plain file inside {into}")
                    t.extractall(into)
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError) as exc:
        raise DatasetError(f"{archive}: cannot unpack the archive ({exc}); delete it and download it again") from exc


def ensure(title: str, root: Path, present: Callable[[Path], bool], layout: str, remotes: Sequence[Remote],
           download: bool, manual: str = "") -> None:
    """Make ``present(root)`` true: unpack archives already in ``root``, else (``download``) fetch
    the ``remotes`` and unpack them, else raise :func:`missing_error`."""
    if present(root):
        return
    archives = [r for r in remotes if r.extract and (root / r.filename).is_file()]
    for r in archives:
        extract(root / r.filename, root)
    if archives and present(root):
        return
    if not download or not remotes:
        raise missing_error(title, root, layout, remotes, manual)
    root.mkdir(parents=True, exist_ok=True)
    for r in remotes:
        if not (root / r.filename).is_file():
            fetch(r, root)
        if r.extract:
            extract(root / r.filename, root)
    if not present(root):
        raise DatasetError(f"{title}: downloaded {', '.join(r.url for r in remotes)} into {root} but still "
                           f"cannot find {layout}{listing(root)}")


def carve_val(n: int, seed: int, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """``(train, val)`` indices: a seeded permutation of ``range(n)``, its first ``round(n * fraction)``
    (at least one when ``n > 1``) held out.

    The same scheme as the Fashion-MNIST loader (``images.load_fashion_arrays``).
    """
    perm = np.random.default_rng(seed).permutation(n)
    n_val = max(1, int(round(n * fraction))) if n > 1 else 0
    return perm[n_val:], perm[:n_val]


def check_labels(labels: np.ndarray, n_classes: int, where: Path | str) -> np.ndarray:
    """``labels`` as int64, or :class:`DatasetError` if any is outside ``0 .. n_classes - 1``."""
    y = np.asarray(labels, dtype=np.int64).reshape(-1)
    if len(y) and (int(y.min()) < 0 or int(y.max()) >= n_classes):
        raise DatasetError(f"{where}: labels span {int(y.min())}..{int(y.max())}, expected 0..{n_classes - 1}")
    return y


def classification_arrays(train: tuple[np.ndarray, np.ndarray], test: tuple[np.ndarray, np.ndarray],
                          classes: Sequence[str], seed: int, val_fraction: float,
                          val: tuple[np.ndarray, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """The registry's array dict; without an official ``val`` split one is carved from ``train``."""
    x, y = train
    if val is None:
        tr, va = carve_val(len(y), seed, val_fraction)
        val, train = (x[va], y[va]), (x[tr], y[tr])
    return {"x_train": train[0], "y_train": train[1], "x_val": val[0], "y_val": val[1],
            "x_test": test[0], "y_test": test[1], "classes": np.asarray(list(classes), dtype=str)}
