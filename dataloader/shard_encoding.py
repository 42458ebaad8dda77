"""The bytes of one shard object, encoded here instead of by zarr-python's codec pipeline.

Contract: `encode_shard` returns exactly the bytes zarr-python stores for the same rows of an
array made by the writer (zarr v3 ``sharding_indexed``; chunks along dim 0 only; inner codecs
``bytes`` little-endian, then optionally ``zstd`` at level 1 without checksum; index at the end,
encoded ``bytes`` + ``crc32c``; ``write_empty_chunks``). tests/dataloader/test_shard_encoding.py
holds it to that, object for object, against zarr itself. What zarr does, and so what this does:

- a shard holds its chunks in order, back to back, then the index: one little-endian
  (offset, nbytes) uint64 pair per chunk of the shard, (2**64-1, 2**64-1) for a chunk not
  stored, then the CRC-32C of those pairs (little-endian uint32);
- the last shard of an array stores only the chunks that hold rows; its last chunk is padded to
  the full chunk length with zeros (the fill value).

Why not zarr: writing through `Array.__setitem__` runs an asyncio pipeline per shard that
copies every byte three times and holds the caller until the put is done. Here a raw shard is
the caller's row buffer itself plus a tail written after it: no copy at all, and the put can
run beside the next shard's sample work.
"""

from __future__ import annotations

from dataclasses import dataclass

import google_crc32c
import numpy as np

from ckptstore.format.hashing import digest

from .format import EMPTY, ShardInfo

__all__ = ["EncodedShard", "encode_shard", "tail_nbytes"]


def tail_nbytes(chunks_per_shard: int) -> int:
    """Size of a shard's index tail: 16 bytes per chunk and a 4-byte CRC-32C."""
    return 16 * chunks_per_shard + 4


@dataclass(frozen=True)
class EncodedShard:
    """A shard object ready to put: its bytes (`data`) and what the dataset index records."""

    data: memoryview
    info: ShardInfo


def encode_shard(
    buffer: np.ndarray, nbytes: int, chunk_nbytes: int, chunks_per_shard: int,
    compressor: str | None,
) -> EncodedShard:
    """Encode the shard whose rows' bytes fill ``buffer[:nbytes]``: `buffer` is a 1-D
    C-contiguous uint8 array with room for the whole raw shard and its tail; a chunk holds
    `chunk_nbytes` bytes of rows. Raw shards are built in place: the padding and the tail are
    written into `buffer` and `data` is a view of it (valid until the buffer is reused).
    Compressed shards are new bytes."""
    if buffer.dtype != np.uint8 or buffer.ndim != 1 or not buffer.flags.c_contiguous:
        raise ValueError("buffer must be a 1-D C-contiguous uint8 array")
    if buffer.nbytes < chunk_nbytes * chunks_per_shard + tail_nbytes(chunks_per_shard):
        raise ValueError("buffer is smaller than a raw shard and its tail")
    if not 0 < nbytes <= chunk_nbytes * chunks_per_shard:
        raise ValueError(f"a shard holds 1 to {chunk_nbytes * chunks_per_shard} bytes of rows,"
                         f" not {nbytes}")
    nchunks = -(-nbytes // chunk_nbytes)
    body_end = nchunks * chunk_nbytes
    buffer[nbytes:body_end] = 0  # the last chunk's padding (the fill value)
    view = buffer.data.cast("B")
    chunks = [view[i * chunk_nbytes : (i + 1) * chunk_nbytes] for i in range(nchunks)]
    if compressor == "zstd":
        from numcodecs import Zstd

        codec = Zstd(level=1, checksum=False)  # as zarr's ZstdCodec(level=1)
        chunks = [memoryview(bytes(codec.encode(c))) for c in chunks]
    elif compressor is not None:
        raise ValueError(f"unknown compressor {compressor!r}")
    table = np.full((chunks_per_shard, 2), EMPTY, dtype="<u8")
    offset = 0
    for i, chunk in enumerate(chunks):
        table[i] = (offset, len(chunk))
        offset += len(chunk)
    pairs = table.tobytes()
    tail = pairs + int(google_crc32c.value(pairs)).to_bytes(4, "little")
    absent = (None,) * (chunks_per_shard - nchunks)
    info = ShardInfo(
        offset + len(tail),
        digest(tail),
        tuple(digest(c) for c in chunks) + absent,
        tuple((int(o), int(n)) for o, n in table[:nchunks].tolist()) + absent,
    )
    if compressor is None:
        buffer[body_end : body_end + len(tail)] = np.frombuffer(tail, np.uint8)
        return EncodedShard(view[: body_end + len(tail)], info)
    return EncodedShard(memoryview(b"".join([*chunks, tail])), info)
