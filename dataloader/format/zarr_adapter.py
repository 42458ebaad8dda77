"""A thin zarr v3 store over a ckptstore `Store`, so zarr-python can open (and, in tests, write)
datasets in local folders, memory stores or S3.

Contract: keys are passed through unchanged under an optional prefix (zarr keys such as
``tokens/c/0/0`` are valid ckptstore keys for valid field names); every ``set`` is a whole-object
``Store.put``. Neither the writer nor the streaming read path goes through zarr-python (see
zarr_encoding.py): this adapter is for interoperability, validation and tests.
"""

from __future__ import annotations

import asyncio
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


class ZarrStoreAdapter(ZarrStore):
    """zarr.abc.store.Store backed by a ckptstore Store (blocking calls run in threads)."""

    supports_writes = True
    supports_deletes = True
    supports_partial_writes = False
    supports_listing = True

    def __init__(self, store: Store, prefix: str = "", read_only: bool = False) -> None:
        super().__init__(read_only=read_only)
        self.store = store
        self.prefix = prefix.strip("/")

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
        return type(self)(self.store, self.prefix, read_only)

    async def get(
        self,
        key: str,
        prototype: BufferPrototype | None = None,
        byte_range: ByteRequest | None = None,
    ) -> Buffer | None:
        prototype = prototype or default_buffer_prototype()
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
        return await asyncio.to_thread(self.store.exists, self._key(key))

    async def set(self, key: str, value: Buffer) -> None:
        self._check_writable()
        # zarr's own buffer, not a copy: the put has written it before this returns
        data = np.ascontiguousarray(value.as_numpy_array()).data.cast("B")
        full = self._key(key)
        await asyncio.to_thread(self.store.put, full, data)

    async def delete(self, key: str) -> None:
        self._check_writable()
        await asyncio.to_thread(self.store.delete, self._key(key))

    async def set_partial_values(
        self, key_start_values: Iterable[tuple[str, int, bytes]]
    ) -> None:  # pragma: no cover - supports_partial_writes is False
        raise NotImplementedError

    def _keys(self, prefix: str) -> list[str]:
        full = self._key(prefix)
        cut = len(self.prefix) + 1 if self.prefix else 0
        keys = {info.key[cut:] for info in self.store.list(full)}
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


def _bounds(byte_range: ByteRequest, size: int) -> tuple[int, int]:
    """[start, end) of a zarr byte request on an object of `size` bytes."""
    if isinstance(byte_range, RangeByteRequest):
        return byte_range.start, min(byte_range.end, size)
    if isinstance(byte_range, OffsetByteRequest):
        return byte_range.offset, size
    if isinstance(byte_range, SuffixByteRequest):
        return max(0, size - byte_range.suffix), size
    raise TypeError(f"unknown byte range {byte_range!r}")  # pragma: no cover - zarr has three
