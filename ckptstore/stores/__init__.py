"""Store backends, chosen by URI with `open_store`."""

from __future__ import annotations

import os
from typing import Any

from ..errors import InvalidNameError
from ..redact import redact_uri
from .base import ObjectInfo, Store
from .local import LocalStore
from .memory import MemoryStore

__all__ = ["ObjectInfo", "Store", "LocalStore", "MemoryStore", "is_local_uri", "open_store"]


def open_store(uri: str | os.PathLike[str] | Store, **options: Any) -> Store:
    """Open the store a URI names.

    * a plain path or ``file:///path`` -> LocalStore (options: ``create``, and ``direct_io``:
      write large page-aligned bodies with O_DIRECT, see stores/direct_io.py)
    * ``s3://bucket/prefix`` -> S3Store (options: ``endpoint_url``, ``region_name``,
      ``max_attempts``, ``multipart_threshold``, ... see ckptstore.stores.s3)
    * ``memory://name`` -> MemoryStore shared by name within this process
    A Store instance is returned unchanged.
    """
    if isinstance(uri, Store):
        return uri
    if isinstance(uri, os.PathLike):
        return _local(uri, **options)
    if not isinstance(uri, str) or not uri:
        raise InvalidNameError(f"store URI must be a non-empty string, got {redact_uri(uri)!r}")
    scheme, sep, rest = uri.partition("://")
    if not sep:
        return _local(uri, **options)
    scheme = scheme.lower()
    if scheme == "file":
        if not rest.startswith("/") or "?" in rest or "#" in rest:
            raise InvalidNameError("file URI must be absolute, without host, query or "
                                   f"fragment (file:///path): {redact_uri(uri)!r}")
        return _local(rest, **options)
    if scheme == "memory":
        return MemoryStore(rest, **options)
    if scheme == "s3":
        from .s3 import S3Store

        return S3Store.from_uri(uri, **options)
    raise InvalidNameError(f"unknown store scheme in {redact_uri(uri)!r} "
                           "(use a path, file://, s3://, memory://)")


def is_local_uri(uri: str | os.PathLike[str] | Store) -> bool:
    """Whether `open_store` opens `uri` as a local folder (a path or a file:// URI)."""
    if isinstance(uri, Store):
        return isinstance(uri, LocalStore)
    if isinstance(uri, os.PathLike):
        return True
    scheme, sep, _ = uri.partition("://")
    return not sep or scheme.lower() == "file"


def _local(path: str | os.PathLike[str], direct_io: bool = False, **options: Any) -> LocalStore:
    if direct_io:
        from .direct_io import DirectLocalStore

        return DirectLocalStore(path, **options)
    return LocalStore(path, **options)
