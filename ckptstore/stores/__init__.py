"""Store backends, chosen by URI with `open_store`."""

from __future__ import annotations

import os
from typing import Any

from ..errors import InvalidNameError
from ..redact import redact_uri
from .base import ObjectInfo, Store
from .local import LocalStore
from .memory import MemoryStore

__all__ = ["ObjectInfo", "Store", "LocalStore", "MemoryStore", "open_store"]


def open_store(uri: str | os.PathLike[str] | Store, **options: Any) -> Store:
    """Open the store a URI names.

    * a plain path or ``file:///path`` -> LocalStore (options: ``create``)
    * ``s3://bucket/prefix`` -> S3Store (options: ``endpoint_url``, ``region_name``,
      ``max_attempts``, ``multipart_threshold``, ... see ckptstore.stores.s3)
    * ``memory://name`` -> MemoryStore shared by name within this process
    A Store instance is returned unchanged.
    """
    if isinstance(uri, Store):
        return uri
    if isinstance(uri, os.PathLike):
        return LocalStore(uri, **options)
    if not isinstance(uri, str) or not uri:
        raise InvalidNameError(f"store URI must be a non-empty string, got {redact_uri(uri)!r}")
    scheme, sep, rest = uri.partition("://")
    if not sep:
        return LocalStore(uri, **options)
    scheme = scheme.lower()
    if scheme == "file":
        if not rest.startswith("/") or "?" in rest or "#" in rest:
            raise InvalidNameError("file URI must be absolute, without host, query or "
                                   f"fragment (file:///path): {redact_uri(uri)!r}")
        return LocalStore(rest, **options)
    if scheme == "memory":
        return MemoryStore(rest, **options)
    if scheme == "s3":
        from .s3 import S3Store

        return S3Store.from_uri(uri, **options)
    raise InvalidNameError(f"unknown store scheme in {redact_uri(uri)!r} "
                           "(use a path, file://, s3://, memory://)")
