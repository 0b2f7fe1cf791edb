"""Errors that name the problem and the fix.

Every error a user can cause derives from :class:`SymalignError`; the CLI turns
it into one line on stderr and exit code 2 (no traceback).
"""

from __future__ import annotations


class SymalignError(ValueError):
    """Base class for every user-facing error of symalign."""


class ConfigError(SymalignError):
    """An invalid model, attention or experiment configuration."""


class SpecError(SymalignError):
    """A symmetry spec that does not fit the tensors it is applied to."""


class GroupError(SymalignError):
    """A group element that is not in its group, or an invalid group."""


class MatchError(SymalignError):
    """Two models that cannot be matched (shapes, encodings, NaN weights...)."""


class CheckpointError(SymalignError):
    """A missing, corrupt or mismatched checkpoint."""


class DatasetError(SymalignError):
    """A dataset that is missing or malformed; the message says how to install it."""
