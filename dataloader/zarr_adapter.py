"""A thin zarr v3 store over a ckptstore `Store`, so zarr-python writes (and validates) datasets
straight into local folders, memory stores or S3.

Contract: keys are passed through unchanged (zarr keys such as ``tokens/c/0/0`` are valid
ckptstore keys for valid field names). Every ``set`` is a whole-object ``Store.put``, except
that an adapter made by `holding_metadata` keeps the ``zarr.json`` objects in memory (and serves
them from there) until `flush_metadata()` writes each one once, in its final form: zarr rewrites
an array's metadata on every resize, and each rewrite would be a durable put (an fsync, or an S3
request). Such an adapter may also put through one `Store.deferred()` batch (`deferred=True`):
objects become durable and visible together at `commit_writes()` (locally: the fsyncs run in
the background and are waited for once); reading an object written since the last commit
raises instead of returning its old bytes or none. `put_object` writes an object zarr did not
encode (the writer's shards, see shard_encoding.py) the same way. Reads serve zarr itself
(validation, tests); the streaming read path does not go through zarr.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterable

import numpy as np
from zarr.abc.store import (
    ByteRequest,
    OffsetByteRequest,
    RangeByteRequest,
    SuffixByteRequest,
)
from zarr.abc.store import Store as ZarrStore
from zarr.core.buffer import Buffer, BufferPrototype, default_buffer_prototype

from ckptstore.errors import ObjectNotFoundError
from ckptstore.stores import Store
from ckptstore.stores.base import DeferredPuts


class ZarrStoreAdapter(ZarrStore):
    """zarr.abc.store.Store backed by a ckptstore Store (blocking calls run in threads)."""

    supports_writes = True
    supports_deletes = True
    supports_partial_writes = False
    supports_listing = True

    def __init__(
        self,
        store: Store,
        prefix: str = "",
        read_only: bool = False,
        held: dict[str, bytes] | None = None,
        writes: _Deferred | None = None,
    ) -> None:
        super().__init__(read_only=read_only)
        self.store = store
        self.prefix = prefix.strip("/")
        # held zarr.json objects (full key -> bytes), shared with with_read_only() copies;
        # None: metadata is written through like any other key
        self.held = held
        # the deferred batch objects are put through (shared with copies); None: plain puts
        self.writes = writes

    @classmethod
    def holding_metadata(
        cls, store: Store, prefix: str = "", deferred: bool = False
    ) -> ZarrStoreAdapter:
        """An adapter that keeps zarr.json objects until `flush_metadata()` and, if
        `deferred`, puts through a deferred batch made durable by `commit_writes()`."""
        return cls(store, prefix, False, {}, _Deferred(store) if deferred else None)

    def flush_metadata(self) -> None:
        """Write every held zarr.json (its last version), in key order; keep holding."""
        if self.held is None:
            return
        for key in sorted(self.held):
            self._put(key, self.held[key])
        self.held.clear()

    def put_object(self, key: str, data: bytes | memoryview) -> None:
        """Write one object (a key relative to the prefix) as zarr's own sets are written:
        through the deferred batch if there is one. The bytes are written before this returns."""
        self._put(self._key(key), data)

    def _put(self, key: str, data: bytes | memoryview) -> None:
        if self.writes is None:
            self.store.put(key, data)
        else:
            self.writes.put(key, data)

    @property
    def uncommitted_bytes(self) -> int:
        """Bytes put since the last `commit_writes()` (0 without a deferred batch)."""
        return 0 if self.writes is None else self.writes.nbytes

    def commit_writes(self) -> None:
        """Make every object written so far durable (and visible): commit the deferred
        batch, or `sync()` the store. DurabilityError if that fails."""
        if self.writes is None:
            self.store.sync()
        else:
            self.writes.commit()

    def abandon_writes(self) -> None:
        """Drop the deferred objects not yet committed (nothing to do without a batch)."""
        if self.writes is not None:
            self.writes.batch.abandon()

    def _is_held(self, key: str) -> bool:
        return self.held is not None and (key == "zarr.json" or key.endswith("/zarr.json"))

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, ZarrStoreAdapter)
            and other.store is self.store
            and other.prefix == self.prefix
        )

    def __hash__(self) -> int:
        return hash((id(self.store), self.prefix))

    def with_read_only(self, read_only: bool = False) -> ZarrStoreAdapter:
        return type(self)(self.store, self.prefix, read_only, self.held, self.writes)

    async def get(
        self,
        key: str,
        prototype: BufferPrototype | None = None,
        byte_range: ByteRequest | None = None,
    ) -> Buffer | None:
        prototype = prototype or default_buffer_prototype()
        if self.held is not None and self._key(key) in self.held:
            held = self.held[self._key(key)]
            if byte_range is not None:  # zarr reads metadata whole; ranges for completeness
                held = _slice(held, byte_range)
            return prototype.buffer.from_bytes(held)
        if self.writes is not None:
            self.writes.check_readable(self._key(key))
        try:
            data = await asyncio.to_thread(self._get_sync, self._key(key), byte_range)
        except ObjectNotFoundError:
            return None
        return prototype.buffer.from_bytes(data)

    def _get_sync(self, key: str, byte_range: ByteRequest | None) -> bytes:
        if byte_range is None:
            return self.store.get(key)
        start, end = _bounds(byte_range, self.store.stat(key).size)
        return self.store.get_range(key, start, max(0, end - start))

    async def get_partial_values(
        self, prototype: BufferPrototype, key_ranges: Iterable[tuple[str, ByteRequest | None]]
    ) -> list[Buffer | None]:
        return list(await asyncio.gather(*(self.get(k, prototype, r) for k, r in key_ranges)))

    async def exists(self, key: str) -> bool:
        if self.held is not None and self._key(key) in self.held:
            return True
        return await asyncio.to_thread(self.store.exists, self._key(key))

    async def set(self, key: str, value: Buffer) -> None:
        self._check_writable()
        # zarr's own buffer, not a copy: the put has written it before this returns
        data = np.ascontiguousarray(value.as_numpy_array()).data.cast("B")
        full = self._key(key)
        if self._is_held(key):
            assert self.held is not None
            self.held[full] = bytes(data)
            return
        await asyncio.to_thread(self._put, full, data)

    async def delete(self, key: str) -> None:
        self._check_writable()
        if self.held is not None:
            self.held.pop(self._key(key), None)
        await asyncio.to_thread(self.store.delete, self._key(key))

    async def set_partial_values(
        self, key_start_values: Iterable[tuple[str, int, bytes]]
    ) -> None:  # pragma: no cover - supports_partial_writes is False
        raise NotImplementedError

    def _keys(self, prefix: str) -> list[str]:
        full = self._key(prefix)
        cut = len(self.prefix) + 1 if self.prefix else 0
        keys = {info.key[cut:] for info in self.store.list(full)}
        keys.update(k[cut:] for k in (self.held or {}) if k.startswith(full))
        return sorted(keys)

    async def list(self) -> AsyncIterator[str]:
        for key in await asyncio.to_thread(self._keys, ""):
            yield key

    async def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        for key in await asyncio.to_thread(self._keys, prefix):
            yield key

    async def list_dir(self, prefix: str) -> AsyncIterator[str]:
        prefix = prefix.rstrip("/")
        base = prefix + "/" if prefix else ""
        seen: set[str] = set()
        for key in await asyncio.to_thread(self._keys, base):
            head = key[len(base) :].split("/", 1)[0]
            if head and head not in seen:
                seen.add(head)
                yield head


class _Deferred:
    """One deferred batch of an adapter, with the keys and bytes put since its last commit."""

    def __init__(self, store: Store) -> None:
        self.batch: DeferredPuts = store.deferred()
        self.keys: set[str] = set()
        self.nbytes = 0
        self._lock = threading.Lock()

    def put(self, key: str, data: bytes | memoryview) -> None:
        with self._lock:
            self.keys.add(key)
            self.nbytes += len(data)
        self.batch.put(key, data)

    def commit(self) -> None:
        with self._lock:
            self.keys, self.nbytes = set(), 0
        self.batch.commit()

    def check_readable(self, key: str) -> None:
        """Refuse to read an object written since the last commit: the store may not show
        it yet, and zarr would take a missing shard for an empty one."""
        with self._lock:
            pending = key in self.keys
        if pending:
            raise RuntimeError(f"{key!r} was written in this deferred batch and is read back "
                               "before its commit")


def _bounds(byte_range: ByteRequest, size: int) -> tuple[int, int]:
    """[start, end) of a zarr byte request on an object of `size` bytes."""
    if isinstance(byte_range, RangeByteRequest):
        return byte_range.start, min(byte_range.end, size)
    if isinstance(byte_range, OffsetByteRequest):
        return byte_range.offset, size
    if isinstance(byte_range, SuffixByteRequest):
        return max(0, size - byte_range.suffix), size
    raise TypeError(f"unknown byte range {byte_range!r}")  # pragma: no cover - zarr has three


def _slice(data: bytes, byte_range: ByteRequest) -> bytes:
    start, end = _bounds(byte_range, len(data))
    return data[start:end]
