"""One zarr array of a dataset being written: rows in, whole shard objects out.

Contract: `ArrayWriter.append` copies rows into the current shard's buffer; each full shard is
encoded (zarr_encoding.py: the bytes zarr-python itself would store) and put, the last one and
then the array's ``zarr.json`` (once, in its final form) at `finish`, so every object is written
once. The digests the dataset index records come from the encoded bytes themselves, before
they are put; nothing is read back. Objects go through `ObjectWrites`: one deferred batch
(`Store.deferred`) under the writer's prefix, durable and visible at its `commit()`.
"""

from __future__ import annotations

import math
import mmap
import threading
from collections.abc import Iterable

import numpy as np

from ckptstore.errors import FormatError
from ckptstore.stores import Store

from .format import ArrayInfo, ShardInfo
from .zarr_encoding import array_metadata, encode_shard, tail_nbytes

__all__ = ["ArrayWriter", "ObjectWrites"]


class ObjectWrites:
    """A writer's objects: keys under `prefix` in `store`, put through one deferred batch.
    Never deletes (a partition written again writes the same bytes to the same keys, and a
    concurrent duplicate must not delete what another copy has reported). Thread-safe."""

    def __init__(self, store: Store, prefix: str = "") -> None:
        self.store, self.prefix = store, prefix.strip("/")
        self.batch = store.deferred()
        self._nbytes = 0
        self._lock = threading.Lock()

    def put(self, key: str, data: bytes | memoryview) -> None:
        """Write one object (`key` relative to the prefix); its bytes are written (not yet
        durable) when this returns."""
        with self._lock:
            self._nbytes += len(data)
        self.batch.put(f"{self.prefix}/{key}" if self.prefix else key, data)

    @property
    def nbytes(self) -> int:
        """Bytes put since the last `commit()`."""
        return self._nbytes

    def commit(self) -> None:
        """Make every object put so far durable and visible (DurabilityError if that fails)."""
        with self._lock:
            self._nbytes = 0
        self.batch.commit()

    def abandon(self) -> None:
        """Drop the objects not yet committed."""
        self.batch.abandon()


class ArrayWriter:
    """Appends rows to one sharded array (chunks along dim 0), writing whole shards only."""

    def __init__(
        self,
        writes: ObjectWrites,
        path: str,
        dtype: np.dtype,
        inner: tuple[int, ...],
        chunk_len: int,
        chunks_per_shard: int,
        compressor: str | None,
    ) -> None:
        self.path, self.dtype, self.inner = path, np.dtype(dtype).newbyteorder("<"), inner
        self.chunk_len, self.chunks_per_shard = chunk_len, chunks_per_shard
        self.compressor = compressor
        self.shard_rows = chunk_len * chunks_per_shard
        self.row_nbytes = math.prod(inner) * self.dtype.itemsize
        self.writes = writes
        # the current shard: raw rows at the front, room for the tail after a full shard
        self._tail = tail_nbytes(chunks_per_shard)
        self._buffer = _page_aligned(self.shard_rows * self.row_nbytes + self._tail)
        self._view = self._buffer.data.cast("B")
        self._filled = 0  # bytes of rows in the current shard
        self.rows = 0  # rows appended in all
        self.shards: list[ShardInfo] = []

    def append(self, rows: np.ndarray) -> None:
        """Append rows (shape (n, *inner), a dtype that casts safely to this array's)."""
        rows = np.ascontiguousarray(rows, dtype=self.dtype)
        if rows.shape[1:] != self.inner:
            raise ValueError(f"array {self.path!r}: rows of shape {rows.shape[1:]}, "
                             f"expected {self.inner}")
        self.append_parts([rows])

    def append_parts(self, parts: Iterable[bytes | np.ndarray]) -> None:
        """Append rows given as consecutive pieces, without joining them first: bytes, or
        C-contiguous arrays of this array's dtype, each a whole number of rows."""
        view, cap, row = self._view, len(self._view) - self._tail, self.row_nbytes
        for part in parts:
            data = (part.reshape(-1).view(np.uint8).data if isinstance(part, np.ndarray)
                    else memoryview(part))
            n = len(data)
            if n % row:
                raise ValueError(f"array {self.path!r}: a piece of {n} bytes is not a whole "
                                 f"number of {row}-byte rows")
            at = 0
            while at < n:
                take = min(n - at, cap - self._filled)
                view[self._filled : self._filled + take] = data[at : at + take]
                self._filled += take
                at += take
                if self._filled == cap:
                    self._write_shard()
            self.rows += n // row

    def _write_shard(self) -> None:
        shard = encode_shard(
            self._buffer, self._filled, self.chunk_len * self.row_nbytes, self.chunks_per_shard,
            self.compressor,
        )
        self.writes.put(self._shard_key(len(self.shards)), shard.data)
        self.shards.append(shard.info)
        self._filled = 0

    def _shard_key(self, shard: int) -> str:
        """The shard object's zarr key (default chunk key encoding, '/' separator)."""
        return "/".join([self.path, "c", str(shard), *("0" * len(self.inner))])

    def finish(self) -> ArrayInfo:
        """Write the last (partial) shard and the array's zarr.json; return the array's entry
        in the dataset index."""
        if self._filled:
            self._write_shard()
        self.writes.put(f"{self.path}/zarr.json", array_metadata(
            self.dtype, (self.rows, *self.inner), self.chunk_len, self.chunks_per_shard,
            self.compressor,
        ))
        num_shards = -(-self.rows // self.shard_rows)
        if len(self.shards) != num_shards:  # pragma: no cover - append keeps them in step
            raise FormatError(f"array {self.path!r}: {len(self.shards)} shards written for "
                              f"{self.rows} rows")
        return ArrayInfo(
            path=self.path,
            dtype=self.dtype.str,
            shape=(self.rows, *self.inner),
            chunk_shape=(self.chunk_len, *self.inner),
            chunks_per_shard=self.chunks_per_shard,
            compressor=self.compressor,
            shards=tuple(self.shards),
        )


def _page_aligned(nbytes: int) -> np.ndarray:
    """A writable uint8 buffer starting on a page boundary (an anonymous mapping, released
    with the array): a raw shard built in it can be written with O_DIRECT."""
    return np.frombuffer(mmap.mmap(-1, max(1, nbytes)), np.uint8)[:nbytes]
