"""A later tier that was unreachable when the tiered store opened (an S3 outage at restart).

`LazyTier` stands in for that tier's store: nothing is asked of the far tier in the
foreground until it has been reached once. Its first use, normally by the background
replicator, opens the real store and runs `on_open` (the repository's marker check); a failed
open raises TierUnreachableError (a StoreError: the replicator retries it with backoff, and a
replication that gives up is raised by `wait_replicated`), and further attempts are spaced at
least `retry_after` seconds apart (calls in between fail at once, without a request). Once
open, every call goes straight to the real store.

The tiered repository skips a tier whose `reachable` is False where it lists, looks up or
reads (docs/recovery.md, "When a far tier is down"): saves to tier 0 and restores from tier 0
go on while the far tier is down.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

from ..errors import CkptStoreError, StoreError
from ..stores.base import Buffer, ObjectInfo, Store


class TierUnreachableError(StoreError):
    """The far tier could not be opened (yet); transient: retried by the replicator."""


class LazyTier(Store):
    """A store opened on first use (module docstring)."""

    def __init__(self, uri: str, opener: Callable[[], Store],
                 on_open: Callable[[Store], None], cause: BaseException,
                 retry_after: float = 2.0) -> None:
        self.uri = uri
        self._opener = opener
        self._on_open = on_open
        self._store: Store | None = None
        self._error: BaseException = cause
        self._next_try = time.monotonic() + retry_after
        self._retry_after = retry_after
        self._lock = threading.Lock()

    @property
    def reachable(self) -> bool:
        """True once the real store was opened (no request is made to find out)."""
        return self._store is not None

    def _real(self) -> Store:
        store = self._store
        if store is not None:
            return store
        with self._lock:
            if self._store is not None:
                return self._store
            if time.monotonic() < self._next_try:
                raise TierUnreachableError(f"tier {self.uri} is unreachable: {self._error}")
            try:
                opened = self._opener()
            except CkptStoreError as exc:
                self._fail(exc)
                raise TierUnreachableError(f"tier {self.uri} is unreachable: {exc}") from exc
            try:
                self._on_open(opened)
            except StoreError as exc:
                opened.close()
                self._fail(exc)
                raise TierUnreachableError(f"tier {self.uri} is unreachable: {exc}") from exc
            except BaseException:  # not a ckptstore tier, wrong hash: not transient
                opened.close()
                raise
            self._store = opened
            return opened

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        self._next_try = time.monotonic() + self._retry_after

    @property
    def in_flight_settle(self) -> float:
        return self._real().in_flight_settle

    def get(self, key: str) -> bytes:
        return self._real().get(key)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        return self._real().get_range(key, start, length)

    def read_into(self, key: str, start: int, out: memoryview) -> None:
        self._real().read_into(key, start, out)

    def read_into_digest(self, key: str, start: int, out: memoryview) -> str:
        return self._real().read_into_digest(key, start, out)

    def put(self, key: str, data: Buffer) -> None:
        self._real().put(key, data)

    def create(self, key: str, data: Buffer) -> None:
        self._real().create(key, data)

    def exists(self, key: str) -> bool:
        return self._real().exists(key)

    def stat(self, key: str) -> ObjectInfo:
        return self._real().stat(key)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return self._real().list(prefix)

    def delete(self, key: str) -> None:
        self._real().delete(key)

    def sync(self) -> None:
        self._real().sync()

    def close(self) -> None:
        with self._lock:
            store, self._store = self._store, None
            self._next_try = float("inf")  # closed: never opened again
        if store is not None:
            store.close()
