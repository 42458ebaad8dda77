"""The bytes of the zarr v3 objects the writer stores, encoded here instead of by zarr-python.

Contract: `encode_shard`, `array_metadata` and `group_metadata` return exactly the bytes
zarr-python 3.1 stores for the same rows, array and group (the writer's arrays only: a regular
grid sharded along dim 0; inner codecs ``bytes`` little-endian, then optionally ``zstd`` at
level 1 without checksum; index at the end, encoded ``bytes`` + ``crc32c``; fill value 0;
``write_empty_chunks``). tests/dataloader/format/test_zarr_encoding.py holds them to that,
object for object, against zarr itself, so any zarr reader opens what the writer stores.
What zarr does for shards, and so what this does:

- a shard holds its chunks in order, back to back, then the index: one little-endian
  (offset, nbytes) uint64 pair per chunk of the shard, (2**64-1, 2**64-1) for a chunk not
  stored, then the CRC-32C of those pairs (little-endian uint32);
- the last shard of an array stores only the chunks that hold rows; its last chunk is padded to
  the full chunk length with zeros (the fill value).

Why not zarr: writing through `Array.__setitem__` runs an asyncio pipeline per shard that
copies every byte three times and holds the caller until the put is done, and creating an array
costs milliseconds of event-loop round trips (a partition creates several). Here a raw shard is
the caller's row buffer itself plus a tail written after it: no copy at all.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import google_crc32c
import numpy as np

from ckptstore.toolkit import digest

from .arrays import ShardInfo
from .spec import EMPTY

__all__ = ["EncodedShard", "array_metadata", "encode_shard", "group_metadata", "tail_nbytes"]


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


def group_metadata(attributes: dict[str, Any]) -> bytes:
    """A group's ``zarr.json``."""
    return _json({"attributes": attributes, "zarr_format": 3, "node_type": "group"})


def array_metadata(
    dtype: np.dtype, shape: tuple[int, ...], chunk_len: int, chunks_per_shard: int,
    compressor: str | None,
) -> bytes:
    """An array's ``zarr.json``: `shape` rows of shape[1:], chunks of `chunk_len` rows,
    `chunks_per_shard` chunks per shard object, fill value 0."""
    dtype = np.dtype(dtype)
    if dtype.kind not in "biufc" or dtype.byteorder == ">":
        raise ValueError(f"no zarr encoding here for dtype {dtype}")
    inner = list(shape[1:])
    bytes_codec: dict[str, Any] = {"name": "bytes"}
    if dtype.itemsize > 1:  # zarr gives one-byte types no endianness
        bytes_codec["configuration"] = {"endian": "little"}
    codecs = [bytes_codec]
    if compressor == "zstd":
        codecs.append({"name": "zstd", "configuration": {"level": 1, "checksum": False}})
    elif compressor is not None:
        raise ValueError(f"unknown compressor {compressor!r}")
    fill: Any = {"b": False, "f": 0.0, "c": [0.0, 0.0]}.get(dtype.kind, 0)
    return _json({
        "shape": list(shape),
        "data_type": dtype.name,
        "chunk_grid": {
            "name": "regular",
            "configuration": {"chunk_shape": [chunk_len * chunks_per_shard, *inner]},
        },
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": fill,
        "codecs": [{
            "name": "sharding_indexed",
            "configuration": {
                "chunk_shape": [chunk_len, *inner],
                "codecs": codecs,
                "index_codecs": [
                    {"name": "bytes", "configuration": {"endian": "little"}},
                    {"name": "crc32c"},
                ],
                "index_location": "end",
            },
        }],
        "attributes": {},
        "zarr_format": 3,
        "node_type": "array",
        "storage_transformers": [],
    })


def _json(doc: dict[str, Any]) -> bytes:
    """zarr-python's layout of a zarr.json: two-space indents, keys in the order given."""
    return json.dumps(doc, indent=2).encode()
