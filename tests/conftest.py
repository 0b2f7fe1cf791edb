"""Shared test set-up: one intra-op thread, a private data cache, quiet transformers, the ``slow`` marker.

* Every test runs with ``torch.set_num_threads(1)``: the tensors are tiny, and two threads on a
  loaded 2-core machine are up to ~100x slower (oversubscription). The previous count is restored.
* ``SYMALIGN_CACHE`` points at a per-test temporary folder, so no test reads or writes the user's
  cache, and no test depends on another's leftovers.
* ``make test`` and ``make test-fast`` run one pytest-xdist worker per core, a file per worker at a time;
  plain ``pytest`` runs in one process. Tests share nothing but the installed package, so either works.
* ``pytest -m "not slow"`` is the fast inner loop; ``make test`` runs everything. A test is marked
  ``slow`` when it trains, starts Ray or a subprocess, or takes more than a few seconds here.
* Tiny Hugging Face models of every adapted family: ``tests/hf_tiny.py`` (imported where needed, so
  a machine without transformers still collects the rest).
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread for the test's duration (restored afterwards)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory, monkeypatch):
    """A fresh ``SYMALIGN_CACHE`` per test (tests that need a specific one set it themselves)."""
    monkeypatch.setenv("SYMALIGN_CACHE", str(tmp_path_factory.mktemp("cache")))


@pytest.fixture(autouse=True, scope="session")
def quiet_transformers():
    """No download/loading progress bars or info logs from transformers in test output."""
    try:
        import transformers
    except ImportError:  # pragma: no cover - the hf extra is not installed
        yield
        return
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    yield


# The fast loop runs each family-parametrised test on the first registered family of each kind (each direct base
# class of the family declarations: a plain decoder, a Llama-like decoder, an encoder, a mixture of experts);
# `make test` runs every registered family. The other families' cases are marked ``slow`` at collection.
FAMILY_PARAMETERS = ("family", "name")


def fast_families() -> frozenset[str]:
    """The model type of the first registered family of each kind (direct base class)."""
    from symalign.families import FAMILIES

    first: dict[type, str] = {}
    for fam in FAMILIES:
        first.setdefault(type(fam).__mro__[1], fam.model_types[0])
    return frozenset(first.values())


def pytest_collection_modifyitems(config, items):
    from symalign.families import FAMILIES

    model_types = {mt for f in FAMILIES for mt in f.model_types}
    fast = fast_families()
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        family = next((params[p] for p in FAMILY_PARAMETERS
                       if isinstance(params.get(p), str) and params[p] in model_types), None)
        if family is not None and family not in fast:
            item.add_marker(pytest.mark.slow)
