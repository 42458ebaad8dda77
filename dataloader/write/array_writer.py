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
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait

import numpy as np

from ckptstore.errors import FormatError
from ckptstore.stores import Store

from ..format.arrays import ArrayInfo, ShardInfo
from ..format.zarr_encoding import array_metadata, encode_shard, tail_nbytes

__all__ = ["ArrayWriter", "ObjectWrites"]

PUT_THREADS = 2  # a writer's background puts (device writes, S3 uploads) at a time
SHARD_BUFFERS = 3  # an array's raw shard buffers: one filling, the others being put


class ObjectWrites:
    """A writer's objects: keys under `prefix` in `store`, put through one deferred batch.
    Never deletes (a partition written again writes the same bytes to the same keys, and a
    concurrent duplicate must not delete what another copy has reported). Thread-safe.
    `put_soon` writes on up to PUT_THREADS background threads (made on first use, ended by
    `commit` and `abandon`), so shard writes overlap the next shard's filling and each other."""

    def __init__(self, store: Store, prefix: str = "") -> None:
        self.store, self.prefix = store, prefix.strip("/")
        self.batch = store.deferred()
        self._nbytes = 0
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._started: list[Future[None]] = []  # put_soon's puts since the last drain

    def put_soon(self, key: str, data: bytes | memoryview) -> Future[None]:
        """Start writing one object on a background thread. The caller leaves `data`
        unchanged until the future is done; a failure is raised by the future, and again by
        `drain`/`commit`."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(PUT_THREADS, thread_name_prefix="dataloader-put")
            done = self._pool.submit(self.put, key, data)
            self._started.append(done)
        return done

    def drain(self) -> None:
        """Wait for every put started by `put_soon`; raise the first failure."""
        with self._lock:
            started, self._started = self._started, []
        wait(started)
        for done in started:
            done.result()

    def _stop(self, cancel: bool = False) -> None:
        """End the background threads after the puts running (and, unless `cancel`, the
        queued ones)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=cancel)

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
        """Make every object put so far durable and visible, after the puts still running
        (their failure, or DurabilityError, is raised). Ends the background threads."""
        try:
            self.drain()
        finally:
            self._stop()
        with self._lock:
            self._nbytes = 0
        self.batch.commit()

    def abandon(self) -> None:
        """Drop the objects not yet committed (after the puts still running have ended;
        queued ones are cancelled)."""
        self._stop(cancel=True)
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
        self._writing: deque[tuple[Future[None], np.ndarray]] = deque()  # buffers being put
        self._use(_page_aligned(self.shard_rows * self.row_nbytes + self._tail))
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
                    view = self._view  # a free buffer while the full one is put
            self.rows += n // row

    def _write_shard(self, last: bool = False) -> None:
        """Encode and start putting the current shard; unless it is the `last`, go on in a
        free buffer."""
        shard = encode_shard(
            self._buffer, self._filled, self.chunk_len * self.row_nbytes, self.chunks_per_shard,
            self.compressor,
        )
        done = self.writes.put_soon(self._shard_key(len(self.shards)), shard.data)
        self.shards.append(shard.info)
        self._filled = 0
        if self.compressor is None:  # the put reads the buffer itself: fill another meanwhile
            self._writing.append((done, self._buffer))
            if not last:
                self._use(self._free_buffer())

    def _free_buffer(self) -> np.ndarray:
        """A buffer no put is reading: one whose put ended, a new one while fewer than
        SHARD_BUFFERS exist, else the oldest once its put ends (its failure is raised)."""
        if len(self._writing) < SHARD_BUFFERS - 1 and not self._writing[0][0].done():
            return _page_aligned(len(self._view))
        done, buffer = self._writing.popleft()
        done.result()
        return buffer

    def _use(self, buffer: np.ndarray) -> None:
        self._buffer, self._view = buffer, buffer.data.cast("B")

    def _shard_key(self, shard: int) -> str:
        """The shard object's zarr key (default chunk key encoding, '/' separator)."""
        return "/".join([self.path, "c", str(shard), *("0" * len(self.inner))])

    def finish(self) -> ArrayInfo:
        """Write the last (partial) shard and the array's zarr.json; return the array's entry
        in the dataset index."""
        if self._filled:
            self._write_shard(last=True)
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
