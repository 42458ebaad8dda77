"""A later tier's store as the tiered repository sees it: opened lazily, and known to be down.

Every tier after tier 0 is a `FarTier`. It stands in for the tier's real store and knows
whether that store can be asked now (`reachable`), so that the foreground (saves, restores,
listings) never waits on a far tier it already knows is down (docs/recovery.md, "When a far
tier is down"):

* A tier that could not be opened when the repository opened (an S3 outage at restart) is
  opened on first use, normally by the background replicator: the real store is opened and
  `on_open` (the repository's marker check) runs.
* A call that fails with a transient store error (connection refused or dropped, timeouts,
  5xx after the client's retries: any StoreError but "no such object", "exists already" and
  a short read, which are answers) raises TierUnreachableError and marks the tier down:
  `reachable` is False for `retry_after` seconds (2 s, doubling while failures go on, at
  most 60 s), then True again, so that the next foreground read tries it once more. Any
  success marks it up at once.

Calls made on the tier itself always make their request, down or not: the background
replicator (whose own retries pace them, and whose first success ends the outage) and a
user's explicit call on one tier. What skips a tier that is down is the tiered repository's
reads that tier 0 can answer alone (`CheckpointStore._from_tiers`) and the save's checks
(`CheckpointStore.known_created`). TierUnreachableError is a StoreError.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

from ..errors import (
    ObjectExistsError,
    ObjectNotFoundError,
    ShortReadError,
    StoreError,
    TierUnreachableError,
)
from ..redact import redact_text
from ..stores.base import Buffer, ObjectInfo, Store

T = TypeVar("T")
#: store errors that are answers from a working tier, not signs that it is down
ANSWERS = (ObjectNotFoundError, ObjectExistsError, ShortReadError)
FIRST_RETRY_AFTER = 2.0
MAX_RETRY_AFTER = 60.0



class FarTier(Store):
    """The store of a later tier (module docstring). Thread-safe."""

    def __init__(self, uri: str, opener: Callable[[], Store],
                 on_open: Callable[[Store], None],
                 retry_after: float = FIRST_RETRY_AFTER) -> None:
        self.uri = uri
        self._opener = opener
        self._on_open = on_open
        self._store: Store | None = None
        self._error: BaseException | None = None
        self._down_until = 0.0  # monotonic; `reachable` is False before it
        self._first_retry = retry_after
        self._retry_after = retry_after
        self._closed = False
        self._lock = threading.Lock()

    @property
    def reachable(self) -> bool:
        """True when the store is open and not down (no request is made to find out)."""
        return self._store is not None and time.monotonic() >= self._down_until

    @property
    def opened(self) -> bool:
        return self._store is not None

    def open_now(self) -> bool:
        """Try to open the store now (the repository's open); False if it is unreachable.
        Errors that are not transient (not a ckptstore tier, another hash) are raised."""
        try:
            self._real()
        except TierUnreachableError:
            return False
        return True

    def _real(self) -> Store:
        store = self._store
        if store is not None:
            return store
        with self._lock:
            if self._store is not None:
                return self._store
            try:
                opened = self._opener()
            except StoreError as exc:  # anything else (no repository there) is raised
                self._mark_down(exc)
                raise self._unreachable(exc) from exc
            try:
                self._on_open(opened)
            except StoreError as exc:
                opened.close()
                self._mark_down(exc)
                raise self._unreachable(exc) from exc
            except BaseException:  # not a ckptstore tier, wrong hash: not transient
                opened.close()
                raise
            self._store = opened
            self._mark_up()
            return opened

    def _unreachable(self, cause: BaseException | None) -> TierUnreachableError:
        reason = redact_text(str(cause)) if cause is not None else "down"
        return TierUnreachableError(f"tier {self.uri} is unreachable: {reason}")

    def _mark_down(self, exc: BaseException) -> None:
        self._error = exc
        self._down_until = time.monotonic() + self._retry_after
        self._retry_after = min(self._retry_after * 2, MAX_RETRY_AFTER)

    def _mark_up(self) -> None:
        self._error = None
        self._down_until = 0.0
        self._retry_after = self._first_retry

    def _call(self, fn: Callable[[Store], T]) -> T:
        if self._closed:
            raise TierUnreachableError(f"tier {self.uri} is closed")
        store = self._real()
        try:
            result = fn(store)
        except ANSWERS:
            self._mark_up()
            raise
        except StoreError as exc:
            with self._lock:
                self._mark_down(exc)
            raise self._unreachable(exc) from exc
        if self._error is not None:
            with self._lock:
                self._mark_up()
        return result

    @property
    def in_flight_settle(self) -> float:
        return self._call(lambda s: s.in_flight_settle)

    def get(self, key: str) -> bytes:
        return self._call(lambda s: s.get(key))

    def get_range(self, key: str, start: int, length: int) -> bytes:
        return self._call(lambda s: s.get_range(key, start, length))

    def read_into(self, key: str, start: int, out: memoryview) -> None:
        self._call(lambda s: s.read_into(key, start, out))

    def read_into_digest(self, key: str, start: int, out: memoryview) -> str:
        return self._call(lambda s: s.read_into_digest(key, start, out))

    def put(self, key: str, data: Buffer) -> None:
        self._call(lambda s: s.put(key, data))

    def create(self, key: str, data: Buffer) -> None:
        self._call(lambda s: s.create(key, data))

    def exists(self, key: str) -> bool:
        return self._call(lambda s: s.exists(key))

    def stat(self, key: str) -> ObjectInfo:
        return self._call(lambda s: s.stat(key))

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        items = self._call(lambda s: s.list(prefix))
        # each step through `_call`: a failure half-way through marks the tier down too
        while (item := self._call(lambda _s: next(items, None))) is not None:
            yield item

    def delete(self, key: str) -> None:
        self._call(lambda s: s.delete(key))

    def delete_many(self, keys: Iterable[str]) -> None:
        todo = list(keys)
        self._call(lambda s: s.delete_many(todo))

    def sync(self) -> None:
        self._call(lambda s: s.sync())

    def close(self) -> None:
        with self._lock:
            store, self._store = self._store, None
            self._closed = True  # never opened again
        if store is not None:
            store.close()

