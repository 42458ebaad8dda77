"""In-process store for tests and examples: a dict guarded by a lock. Named stores
(`memory://NAME`) are shared within the process, so two opens of one URI see the same data."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

from ..errors import ObjectExistsError, ObjectNotFoundError
from ..format.names import validate_key, validate_prefix
from .base import Buffer, ObjectInfo, Store, check_range, short_read

_SHARED: dict[str, dict[str, tuple[bytes, float]]] = {}
_SHARED_LOCK = threading.Lock()


class MemoryStore(Store):
    """Objects live in a dict of key -> (bytes, mtime)."""

    def __init__(self, name: str = "") -> None:
        self.uri = f"memory://{name}"
        with _SHARED_LOCK:
            self._objects = _SHARED.setdefault(name, {}) if name else {}
        self._lock = threading.Lock()

    def _lookup(self, key: str) -> bytes:
        validate_key(key)
        with self._lock:
            entry = self._objects.get(key)
        if entry is None:
            raise ObjectNotFoundError(f"{self.uri}: no object {key!r}")
        return entry[0]

    def get(self, key: str) -> bytes:
        return self._lookup(key)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        check_range(key, start, length)
        data = self._lookup(key)
        if start + length > len(data):
            raise short_read(key, start, length, max(0, len(data) - start))
        return data[start : start + length]

    def put(self, key: str, data: Buffer) -> None:
        validate_key(key)
        value = bytes(data)
        with self._lock:
            self._objects[key] = (value, time.time())

    def create(self, key: str, data: Buffer) -> None:
        validate_key(key)
        value = bytes(data)
        with self._lock:
            old = self._objects.get(key)
            if old is None:
                self._objects[key] = (value, time.time())
                return
        if old[0] != value:
            raise ObjectExistsError(f"{self.uri}: {key!r} exists")

    def exists(self, key: str) -> bool:
        validate_key(key)
        with self._lock:
            return key in self._objects

    def stat(self, key: str) -> ObjectInfo:
        validate_key(key)
        with self._lock:
            entry = self._objects.get(key)
        if entry is None:
            raise ObjectNotFoundError(f"{self.uri}: no object {key!r}")
        return ObjectInfo(key, len(entry[0]), entry[1])

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        validate_prefix(prefix)
        with self._lock:
            items = [(k, v) for k, v in self._objects.items() if k.startswith(prefix)]
        for key, (data, mtime) in items:
            yield ObjectInfo(key, len(data), mtime)

    def delete(self, key: str) -> None:
        validate_key(key)
        with self._lock:
            self._objects.pop(key, None)

    def set_mtime(self, key: str, mtime: float) -> None:
        """Test hook: age an object (used by GC grace-period tests)."""
        with self._lock:
            data, _ = self._objects[key]
            self._objects[key] = (data, mtime)
