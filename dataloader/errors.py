"""Errors of the dataloader. They derive from ckptstore's error types, so callers can catch a
`CkptStoreError` (or the matching builtin) for anything this package raises."""

from __future__ import annotations

from ckptstore.errors import CkptStoreError, FormatError, IntegrityError, ObjectNotFoundError

__all__ = [
    "DatasetNotFoundError",
    "FormatError",
    "IntegrityError",
    "MissingShardError",
    "StateMismatchError",
]


class DatasetNotFoundError(ObjectNotFoundError):
    """No dataset index (``dataset.json``) at the given URI."""


class MissingShardError(ObjectNotFoundError):
    """A shard object the dataset index lists is missing from the store."""


class StateMismatchError(CkptStoreError, ValueError):
    """A loader/dataset state does not belong to this dataset or configuration."""
