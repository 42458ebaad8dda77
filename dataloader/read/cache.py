"""An optional local cache of verified chunks, content-addressed by digest, bounded in bytes.

Contract: files are named by the xxh3-128 digest of their bytes (``<dir>/ab/ab12...``), so one
cache folder serves any number of datasets and a stale entry cannot be served for other
content: every hit is re-verified, and a file that fails is deleted and reported as a miss.
Writes go to a temp file and are renamed into place. When the total exceeds `limit_bytes`, the
least recently used entries (this process's view, seeded from file mtimes) are deleted.
Several processes may share a folder; a file vanishing under us is a miss, never an error.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections import OrderedDict
from pathlib import Path

from ckptstore.toolkit import digest, is_digest


class ChunkCache:
    """LRU file cache of immutable chunks keyed by digest."""

    def __init__(self, directory: str | os.PathLike[str], limit_bytes: int) -> None:
        if limit_bytes < 0:
            raise ValueError("cache limit must be >= 0")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.limit = limit_bytes
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, int] = OrderedDict()
        self._size = 0
        self.hits = self.misses = self.evictions = 0
        found = []
        for sub in self.dir.iterdir():
            if sub.is_dir() and len(sub.name) == 2:
                for f in sub.iterdir():
                    if is_digest(f.name):
                        try:
                            st = f.stat()
                        except FileNotFoundError:
                            continue
                        found.append((st.st_mtime, f.name, st.st_size))
        for _, name, size in sorted(found):
            self._entries[name] = size
            self._size += size
        self._evict()

    @property
    def size(self) -> int:
        return self._size

    def _path(self, key: str) -> Path:
        return self.dir / key[:2] / key

    def get(self, key: str) -> bytes | None:
        """The cached bytes of digest `key`, verified, or None."""
        path = self._path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            with self._lock:
                self.misses += 1
                self._forget(key)
            return None
        if digest(data) != key:
            path.unlink(missing_ok=True)
            with self._lock:
                self.misses += 1
                self._forget(key)
            return None
        with self._lock:
            self.hits += 1
            if key in self._entries:
                self._entries.move_to_end(key)
        return data

    def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        """Store verified bytes under their digest (the caller has checked it); evict if over."""
        n = len(data)
        if n > self.limit:
            return
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return
        path = self._path(key)
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f".tmp-{uuid.uuid4().hex}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            return  # a cache that cannot write is just a smaller cache
        with self._lock:
            if key not in self._entries:
                self._entries[key] = n
                self._size += n
            self._evict()

    def _forget(self, key: str) -> None:
        size = self._entries.pop(key, None)
        if size is not None:
            self._size -= size

    def _evict(self) -> None:
        while self._size > self.limit and self._entries:
            key, size = self._entries.popitem(last=False)
            self._size -= size
            self.evictions += 1
            self._path(key).unlink(missing_ok=True)
