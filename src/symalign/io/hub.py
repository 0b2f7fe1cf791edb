"""Hugging Face Hub ids as checkpoint arguments: ``symalign align org/model-a org/model-b``.

:func:`resolve` turns a command's checkpoint argument into a local folder:

* an existing local path is used as it is (a local folder always wins over a Hub id of the
  same spelling);
* else an argument of the form ``org/name`` (or ``org/name@REVISION``) is a Hub id, resolved
  through ``huggingface_hub``'s cache (``snapshot_download``) at ``REVISION`` (else the command's
  ``--revision``, else ``main``): the folder is the cached snapshot
  ``<cache>/models--org--name/snapshots/<commit>/``. Offline (``HF_HUB_OFFLINE=1``) only the cache
  is read; an id that is not cached is refused in one line that says how to get it;
* anything else is returned unchanged (the command's own "no such folder" check speaks).

The cache is ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else huggingface_hub's default, read when a
command runs. Only the files a checkpoint needs are fetched online (weights in safetensors or
PyTorch format, configs, tokenizer and processor files), not other frameworks' weights.

Every resolution is remembered by its snapshot folder: :func:`sources` gives, for a command's
inputs, ``{"id", "revision", "commit", "snapshot"}`` -- what provenance records and what the
``symalign.json`` marker of an output names beside the resolved path.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from symalign.errors import CheckpointError

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
IGNORE = ["*.msgpack", "*.h5", "*.onnx", "*.ot", "*.tflite", "*.gguf", "flax_model*", "tf_model*", "onnx/*",
          "coreml/*", "openvino/*", "*.mlmodel"]
_TRUE = ("1", "true", "yes", "on")
REVISION_HELP = ("Hub revision (branch, tag or commit) of checkpoint arguments given as Hub ids org/name "
                 "(org/name@REV pins one; default main); read through the Hugging Face cache, offline with "
                 "HF_HUB_OFFLINE=1. A local folder of the same name wins.")


@dataclass(frozen=True)
class HubSource:
    """Where a checkpoint argument came from: the Hub id, the revision asked for, the commit it
    resolved to and the snapshot folder read."""

    id: str
    revision: str
    commit: str
    snapshot: str

    def to_dict(self) -> dict:
        return asdict(self)


_RESOLVED: dict[str, HubSource] = {}


def split_id(arg: str) -> tuple[str, str | None]:
    """``"org/name@rev"`` -> ``("org/name", "rev")``; without ``@``: ``(arg, None)``."""
    name, at, rev = arg.partition("@")
    return (name, rev) if at and rev else (arg, None)


def is_hub_id(arg: str | os.PathLike) -> bool:
    """Whether ``arg`` is spelled as a Hub model id ``org/name`` (optionally ``@REVISION``)."""
    return bool(HUB_ID.match(split_id(str(arg))[0]))


def cache_dir() -> Path:
    """The Hub cache this process reads: ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else the default."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def offline() -> bool:
    """``HF_HUB_OFFLINE`` is set (read now, not when huggingface_hub was imported)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


def resolve(arg: str | os.PathLike, revision: str | None = None, what: str = "checkpoint") -> Path:
    """The local folder for a checkpoint argument (see the module docstring); ``what`` names the
    argument in errors (e.g. ``"A_DIR"``)."""
    path = Path(arg)
    if path.exists() or not is_hub_id(arg):
        return path
    repo, pinned = split_id(str(arg))
    rev = pinned or revision or "main"
    cache = cache_dir()
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(repo, revision=rev, cache_dir=str(cache), local_files_only=offline(),
                                        ignore_patterns=IGNORE))
    except Exception as exc:  # noqa: BLE001 -- every failure becomes one line naming the id and the fix
        raise CheckpointError(_failure(what, str(arg), repo, rev, cache, exc)) from None
    source = HubSource(repo, rev, folder.name, str(folder))
    _RESOLVED[str(folder)] = _RESOLVED[str(folder.resolve())] = source
    return folder


def resolve_all(args: Iterable[str | os.PathLike | None], revision: str | None = None,
                what: str = "checkpoint") -> list[Path | None]:
    """:func:`resolve` for each argument (``None`` stays ``None``), before any work starts."""
    return [None if a is None else resolve(a, revision, what) for a in args]


def sources(paths: Iterable[str | os.PathLike | None]) -> list[dict]:
    """The Hub sources (:class:`HubSource`) of those of ``paths`` that :func:`resolve` produced."""
    found = [_RESOLVED.get(str(Path(p))) for p in paths if p is not None]
    return [s.to_dict() for s in found if s is not None]


def marker_fields(marker: Mapping[str, Any]) -> dict:
    """``{"hub": [...]}``: the Hub sources of the input paths a ``symalign.json`` marker names (its
    string values and lists of strings, e.g. ``a``, ``b``, ``inputs``); ``{}`` when none came from the Hub."""
    paths: list[str] = []
    for v in marker.values():
        paths += [v] if isinstance(v, str) else [x for x in v if isinstance(x, str)] if isinstance(v, list) else []
    found = sources(paths)
    unique = [dict(t) for t in dict.fromkeys(tuple(sorted(s.items())) for s in found)]
    return {"hub": unique} if unique else {}


def _failure(what: str, arg: str, repo: str, rev: str, cache: Path, exc: Exception) -> str:
    """The one line for a Hub id that could not be resolved."""
    name = type(exc).__name__
    head = f"{what} {arg}: no such local folder, and the Hub model {repo} at revision {rev!r}"
    get = f"`hf download {repo} --revision {rev}`"
    if offline() or name == "OfflineModeIsEnabled":
        return (f"{head} is not in the Hugging Face cache {cache} (HF_HUB_OFFLINE is set); download it once with "
                f"network access ({get}), point HF_HUB_CACHE or HF_HOME at a cache that holds it, or pass a local "
                "folder")
    if name == "LocalEntryNotFoundError":  # online, but the Hub could not be reached
        return (f"{head} could not be reached on the Hub (no network?) and is not in the Hugging Face cache "
                f"{cache}; check the network, point HF_HUB_CACHE or HF_HOME at a cache that holds it, or pass a "
                "local folder")
    if name == "RevisionNotFoundError":
        return f"{head}: the Hub has no such revision; pass an existing branch, tag or commit with --revision"
    if name in ("RepositoryNotFoundError", "GatedRepoError"):
        why = "is gated (accept its terms and log in with `hf auth login`)" if name == "GatedRepoError" else \
            "does not exist on the Hub (or is private: log in with `hf auth login`)"
        return f"{head} {why}; check the id or pass a local folder"
    return (f"{head} could not be fetched ({name}: {str(exc).splitlines()[0] if str(exc) else 'no detail'}); "
            f"check the network, or set HF_HUB_OFFLINE=1 to use the cache {cache} alone")
