"""One zarr array of a dataset being written: rows in, whole shard objects out.

Contract: `ArrayWriter.append` copies rows into the current shard's buffer; each full shard is
encoded (shard_encoding.py: the bytes zarr itself would store) and put through the adapter,
the last one at `finish`, so every shard object is written once. zarr-python makes the array's
``zarr.json`` (held by the adapter until the writer flushes it), and `finish` sets its final
shape. The digests the dataset index records come from the encoded bytes themselves, before
they are put; nothing is read back.
"""

from __future__ import annotations

import math

import numpy as np
import zarr
from zarr.codecs import ZstdCodec

from ckptstore.errors import FormatError

from .format import ArrayInfo, ShardInfo
from .shard_encoding import encode_shard, tail_nbytes
from .zarr_adapter import ZarrStoreAdapter

__all__ = ["ArrayWriter"]


class ArrayWriter:
    """Appends rows to one sharded array (chunks along dim 0), writing whole shards only."""

    def __init__(
        self,
        group: zarr.Group,
        adapter: ZarrStoreAdapter,
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
        self.adapter = adapter
        compressors = [ZstdCodec(level=1)] if compressor == "zstd" else None
        self.array = group.create_array(
            path,
            shape=(0, *inner),
            dtype=self.dtype,
            chunks=(chunk_len, *inner),
            shards=(self.shard_rows, *inner),
            compressors=compressors,
            fill_value=0,
            config={"write_empty_chunks": True},
            overwrite=True,  # a partition written again: same keys, same bytes
        )
        # the current shard: raw rows at the front, room for the tail after a full shard
        self._buffer = np.empty(
            self.shard_rows * self.row_nbytes + tail_nbytes(chunks_per_shard), np.uint8
        )
        self._filled = 0  # rows in the current shard
        self.rows = 0  # rows appended in all
        self.shards: list[ShardInfo] = []

    def append(self, rows: np.ndarray) -> None:
        """Append rows (shape (n, *inner), a dtype that casts safely to this array's)."""
        rows = np.ascontiguousarray(rows, dtype=self.dtype)
        if rows.shape[1:] != self.inner:
            raise ValueError(f"array {self.path!r}: rows of shape {rows.shape[1:]}, "
                             f"expected {self.inner}")
        done = 0
        while done < len(rows):
            take = min(len(rows) - done, self.shard_rows - self._filled)
            start = self._filled * self.row_nbytes
            part = rows[done : done + take]
            self._buffer[start : start + part.nbytes] = part.reshape(-1).view(np.uint8)
            self._filled += take
            done += take
            if self._filled == self.shard_rows:
                self._write_shard()
        self.rows += len(rows)

    def _write_shard(self) -> None:
        nbytes = self._filled * self.row_nbytes
        shard = encode_shard(
            self._buffer, nbytes, self.chunk_len * self.row_nbytes, self.chunks_per_shard,
            self.compressor,
        )
        self.adapter.put_object(self._shard_key(len(self.shards)), shard.data)
        self.shards.append(shard.info)
        self._filled = 0

    def _shard_key(self, shard: int) -> str:
        """The shard object's zarr key (default chunk key encoding, '/' separator)."""
        return "/".join([self.path, "c", str(shard), *("0" * len(self.inner))])

    def finish(self) -> ArrayInfo:
        """Write the last (partial) shard, set the array's final shape; the array's entry
        in the dataset index."""
        if self._filled:
            self._write_shard()
        self.array.resize((self.rows, *self.inner))  # metadata only: it grows from 0 rows
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
