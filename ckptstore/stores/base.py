"""The store interface: a flat namespace of immutable-ish objects addressed by '/'-separated keys.

Contract shared by every backend (tests/ckptstore/stores/test_testing.py checks it against each):

* Keys are validated (`names.validate_key`): no absolute paths, no '..', so no key escapes the
  store's root.
* `put` replaces the object atomically: a reader sees the old bytes or the new, never a mix.
  It is durable once `sync()` has returned.
* `create` is create-only and durable on return: it raises ObjectExistsError if the key exists
  with other content (an identical object counts as success, which makes a retried create whose
  first reply was lost safe). It is the commit primitive.
* `get`/`get_range`/`read_into` raise ObjectNotFoundError for a missing key; a short read
  raises StoreError (never returns fewer bytes than asked without saying so).
* `deferred()` gives a batch of puts whose durability is paid once, at the batch's
  `commit()`: an object put through it is visible under its key once `commit()` has returned
  (earlier on backends whose puts are durable on return), and **never before its bytes are
  durable**: a crash at any moment leaves each key absent, with its old object, or with the
  new bytes durable. Content-addressed writers skip keys that exist, so a non-durable object
  under a final key would silently corrupt a later write. After `commit()` every object of
  the batch is durable (no `sync()` needed). Leftovers of a crash are the backend's ordinary
  temp files (gc removes them).
* All methods are safe to call from many threads at once.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from ..errors import ShortReadError, StoreError
from ..format.hashing import digest
from ..redact import redact_uri

Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True)
class ObjectInfo:
    """One listed object: its key, size in bytes and last-modified time (POSIX seconds)."""

    key: str
    size: int
    mtime: float


class DeferredPuts:
    """A batch of puts made durable together by `commit()` (see the module contract).

    This default, for backends whose puts are durable on return (S3) or need no durability
    (memory), puts at once and makes `commit()` a `sync()`. Safe to use from many threads;
    `commit()` may be called several times (each makes the puts since the last one durable).
    As a context manager it commits on success and abandons on an exception."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def put(self, key: str, data: Buffer) -> None:
        """Write the object; it is durable (and visible) once `commit()` has returned."""
        self.store.put(key, data)

    def commit(self) -> None:
        """Make every put so far durable and visible; DurabilityError if that fails (the
        batch's objects not yet visible are then lost)."""
        self.store.sync()

    def abandon(self) -> None:
        """Drop the puts not yet visible (best effort; a crash leaves temp files to gc)."""

    def __enter__(self) -> DeferredPuts:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abandon()


class Store(abc.ABC):
    """Abstract store. Subclasses implement the abstract methods; the rest have defaults."""

    _uri: str = ""

    @property
    def uri(self) -> str:
        """The URI this store was opened from, fit for messages and reprs: user info, query
        and fragment are redacted (`redact.redact_uri`). Backends keep what they need to
        connect elsewhere."""
        return self._uri

    @uri.setter
    def uri(self, value: str) -> None:
        self._uri = redact_uri(value)

    @property
    def in_flight_settle(self) -> float:
        """Seconds a request may still take effect after the process that sent it was killed
        (its bytes already on the wire or queued in the server). 0 where a request is done
        when its call returns (local folders, memory). Lease holders that find a lease of a
        just-killed process wait this long before trusting a listing (maintenance/leases.py)."""
        return 0.0

    @abc.abstractmethod
    def get(self, key: str) -> bytes:
        """Return the whole object."""

    @abc.abstractmethod
    def get_range(self, key: str, start: int, length: int) -> bytes:
        """Exactly `length` bytes from offset `start`; StoreError if the object is shorter."""

    def read_into(self, key: str, start: int, out: memoryview) -> None:
        """Fill `out` (a writable byte buffer) with bytes [start, start+len(out)) of the object.
        Backends override this to read straight into the caller's memory."""
        data = self.get_range(key, start, len(out))
        out[:] = data

    def read_into_digest(self, key: str, start: int, out: memoryview) -> str:
        """`read_into`, then return the xxh3-128 hex digest of the bytes now in `out`.
        Backends that can hash each piece while it is still in the CPU cache override this
        (one pass through memory instead of two); the result must equal `digest(out)`."""
        self.read_into(key, start, out)
        return digest(out)

    @abc.abstractmethod
    def put(self, key: str, data: Buffer) -> None:
        """Write the object atomically, replacing any existing one."""

    @abc.abstractmethod
    def create(self, key: str, data: Buffer) -> None:
        """Create the object only if absent; durable on return. See the module contract."""

    @abc.abstractmethod
    def exists(self, key: str) -> bool:
        """True if the object exists."""

    @abc.abstractmethod
    def stat(self, key: str) -> ObjectInfo:
        """Size and mtime of one object; ObjectNotFoundError if missing."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object whose key starts with `prefix`, in no promised order."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object; deleting a missing key is not an error."""

    def delete_many(self, keys: Iterable[str]) -> None:
        """`delete` every key (a missing one is not an error); a backend with round trips
        deletes many per request or side by side (S3: DeleteObjects). On an error the
        others are still tried, then the first error is raised: what was deleted stays
        deleted. This default deletes one after another."""
        first: BaseException | None = None
        for key in keys:
            try:
                self.delete(key)
            except Exception as exc:  # noqa: BLE001 - raised once the others were tried
                first = first or exc
        if first is not None:
            raise first

    def deferred(self) -> DeferredPuts:
        """A batch of puts whose durability is deferred to its `commit()` (module contract)."""
        return DeferredPuts(self)

    def sync(self) -> None:
        """Make every completed `put` durable (local: fsync the folders touched). Raises
        DurabilityError if that fails; the caller must then treat its writes as lost."""

    def close(self) -> None:
        """Release connections and handles."""

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.uri!r})"


def check_range(key: str, start: int, length: int) -> None:
    if start < 0 or length < 0:
        raise StoreError(f"invalid byte range start={start} length={length} for {key!r}")


def short_read(key: str, start: int, wanted: int, got: int) -> ShortReadError:
    return ShortReadError(
        f"short read of {key!r}: wanted {wanted} bytes at offset {start}, got {got}"
    )
