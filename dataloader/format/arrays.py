"""One zarr array of a dataset as the index records it: dtype, shape, chunking and shards.

`ShardInfo` is one shard object (its size, the digest of its shard-index tail, the digest of
every stored chunk, optionally the shard index itself); `ArrayInfo` is an array and its shards,
parsed from untrusted JSON field by field, and compared with the array's ``zarr.json`` (as
zarr-python writes it for the dataloader) by `check_zarr`: a forged index must not make a
reader reinterpret stored bytes.

Why one module of ~250 lines: the array record, its shards and every check of them, each rule
next to the field it guards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ckptstore.errors import FormatError

from .spec import COMPRESSORS, DTYPES, EMPTY, MAX_CHUNK_NBYTES, MAX_NDIM, check_dtype
from .validate import (
    check_digest,
    check_int,
    check_keys,
    get_int,
    get_ints,
    get_typed,
    need_type,
    same_json,
    short_repr,
)


@dataclass(frozen=True)
class ShardInfo:
    """One shard object: total size, digest of its index tail, digest per chunk (None = absent),
    and optionally its shard index itself (`table`: (offset, nbytes) per chunk, None = absent),
    which spares readers a request per shard (format.md section 7.1)."""

    nbytes: int
    index_digest: str
    chunks: tuple[str | None, ...]
    table: tuple[tuple[int, int] | None, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "nbytes": self.nbytes, "index": self.index_digest, "chunks": list(self.chunks)
        }
        if self.table is not None:
            out["table"] = [None if t is None else list(t) for t in self.table]
        return out

    @classmethod
    def from_json(cls, d: Any, where: str) -> ShardInfo:
        check_keys(d, where, ("nbytes", "index", "chunks"), ("table",))
        chunks = tuple(
            None if c is None else check_digest(c, f"{where}.chunks[{i}]")
            for i, c in enumerate(get_typed(d, "chunks", list, where))
        )
        table = None
        if "table" in d:
            table = tuple(
                _table_entry(t, f"{where}.table[{i}]")
                for i, t in enumerate(get_typed(d, "table", list, where))
            )
        index_digest = check_digest(d["index"], f"{where}.index")
        return cls(get_int(d, "nbytes", where), index_digest, chunks, table)

    @staticmethod
    def table_of(
        raw: bytes | memoryview, chunks_per_shard: int
    ) -> tuple[tuple[int, int] | None, ...]:
        """The (offset, nbytes) entries of a shard-index tail (None for an absent chunk)."""
        index = np.frombuffer(raw[: 16 * chunks_per_shard], dtype="<u8").reshape(-1, 2)
        return tuple(
            None if int(off) == EMPTY else (int(off), int(n)) for off, n in index.tolist()
        )


def _table_entry(t: Any, where: str) -> tuple[int, int] | None:
    if t is None:
        return None
    if not isinstance(t, list) or len(t) != 2:
        raise FormatError(f"{where}: expected null or [offset, nbytes]")
    return check_int(t[0], f"{where}[0]"), check_int(t[1], f"{where}[1]")


@dataclass(frozen=True)
class ArrayInfo:
    """One zarr array of the dataset: its path, dtype, shape, chunking and shards."""

    path: str
    dtype: str
    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    chunks_per_shard: int
    compressor: str | None
    shards: tuple[ShardInfo, ...]

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(self.dtype)

    @property
    def chunk_nbytes(self) -> int:
        """Decoded size of one chunk (every chunk is stored at full size, the last padded)."""
        return math.prod(self.chunk_shape) * self.np_dtype.itemsize

    @property
    def max_stored_nbytes(self) -> int:
        """Largest stored (encoded) size a chunk can have: exact when raw, zstd's bound (with
        room to spare) when compressed."""
        n = self.chunk_nbytes
        return n if self.compressor is None else n + (n >> 7) + 4096

    @property
    def num_chunks(self) -> int:
        return -(-self.shape[0] // self.chunk_shape[0]) if self.shape[0] else 0

    @property
    def index_nbytes(self) -> int:
        return 16 * self.chunks_per_shard + 4  # (offset, nbytes) uint64 pairs + crc32c

    def shard_key(self, shard: int) -> str:
        return f"{self.path}/c/{shard}" + "/0" * (len(self.shape) - 1)

    def chunk_digest(self, chunk: int) -> str:
        s, i = divmod(chunk, self.chunks_per_shard)
        d = self.shards[s].chunks[i]
        if d is None:
            raise FormatError(f"array {self.path!r}: chunk {chunk} is recorded as absent")
        return d

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "chunk_shape": list(self.chunk_shape),
            "chunks_per_shard": self.chunks_per_shard,
            "compressor": self.compressor,
            "shards": [s.to_json() for s in self.shards],
        }

    @classmethod
    def from_json(cls, d: Any, where: str) -> ArrayInfo:
        keys = ("path", "dtype", "shape", "chunk_shape", "chunks_per_shard", "compressor")
        check_keys(d, where, (*keys, "shards"))
        shape = get_ints(d, "shape", where, 0, 1, MAX_NDIM + 1)
        chunk_shape = get_ints(d, "chunk_shape", where, 1, len(shape), len(shape))
        compressor = d["compressor"]
        if compressor not in COMPRESSORS:
            raise FormatError(f"{where}.compressor: unknown compressor {short_repr(compressor)}")
        head = cls(
            path=get_typed(d, "path", str, where),
            dtype=check_dtype(d["dtype"], f"{where}.dtype"),
            shape=tuple(shape),
            chunk_shape=tuple(chunk_shape),
            chunks_per_shard=check_int(d["chunks_per_shard"], f"{where}.chunks_per_shard", 1),
            compressor=compressor,
            shards=(),
        )
        if head.chunk_nbytes > MAX_CHUNK_NBYTES:
            raise FormatError(
                f"{where}.chunk_shape: chunks of {head.chunk_nbytes:,} bytes, over the "
                f"{MAX_CHUNK_NBYTES:,}-byte limit"
            )
        raw_shards = get_typed(d, "shards", list, where)
        want = -(-head.num_chunks // head.chunks_per_shard)
        if len(raw_shards) != want:
            raise FormatError(f"{where}.shards: expected {want} shards, got {len(raw_shards)}")
        shards = tuple(
            ShardInfo.from_json(s, f"{where}.shards[{i}]") for i, s in enumerate(raw_shards)
        )
        info = replace(head, shards=shards)
        info._check_shards(where)
        return info

    def _check_shards(self, where: str) -> None:
        """Each shard lists chunks_per_shard chunks: a digest for every chunk inside the
        shape (the writer stores them all), None past it; its size fits what it holds."""
        per, n = self.chunks_per_shard, self.num_chunks
        low, high = self.index_nbytes, per * self.max_stored_nbytes + self.index_nbytes
        for s, shard in enumerate(self.shards):
            at = f"{where}.shards[{s}]"
            if len(shard.chunks) != per:
                raise FormatError(f"{at}.chunks: expected {per} chunks, got {len(shard.chunks)}")
            inside = min(per, n - s * per)  # chunks of this shard inside the array's shape
            if None in shard.chunks[:inside]:
                i = shard.chunks.index(None)
                raise FormatError(f"{at}.chunks[{i}]: chunk {s * per + i} is recorded as absent")
            if any(c is not None for c in shard.chunks[inside:]):
                i = next(i for i in range(inside, per) if shard.chunks[i] is not None)
                raise FormatError(
                    f"{at}.chunks[{i}]: chunk {s * per + i} is listed outside the shape"
                )
            if not low <= shard.nbytes <= high:
                raise FormatError(
                    f"{at}.nbytes: {shard.nbytes:,} bytes cannot hold {per} chunks of at most "
                    f"{self.max_stored_nbytes:,} bytes and a {low}-byte index"
                )
            if shard.table is not None:
                self._check_table(shard, at)

    def _check_table(self, shard: ShardInfo, at: str) -> None:
        """A recorded shard index: one entry per chunk, absent exactly where the chunk is,
        each inside the shard's data (before its index tail) and at most a stored chunk."""
        assert shard.table is not None
        if len(shard.table) != len(shard.chunks):
            raise FormatError(f"{at}.table: expected {len(shard.chunks)} entries")
        end = shard.nbytes - self.index_nbytes
        for i, (t, c) in enumerate(zip(shard.table, shard.chunks, strict=True)):
            if (t is None) != (c is None):
                raise FormatError(f"{at}.table[{i}]: present/absent unlike chunks[{i}]")
            if t is not None and (t[0] + t[1] > end or t[1] > self.max_stored_nbytes):
                raise FormatError(f"{at}.table[{i}]: {t} is outside the shard's chunk data")

    def check_zarr(self, z: Any, where: str) -> None:
        """Compare this array with its parsed zarr.json (as zarr-python writes it for the
        dataloader: a regular grid of shards, little-endian bytes, optional zstd)."""
        need_type(z, dict, where)
        item = np.dtype(self.dtype).itemsize
        endian = [{"name": "bytes", "configuration": {"endian": "little"}}]
        inner_bytes = endian + [{"name": "bytes"}] if item == 1 else endian
        shard = [self.chunk_shape[0] * self.chunks_per_shard, *self.chunk_shape[1:]]
        want: dict[str, Any] = {
            "zarr_format": 3,
            "node_type": "array",
            "shape": list(self.shape),
            "data_type": DTYPES[self.dtype],
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": shard}},
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        }
        for key, value in want.items():
            if not same_json(z.get(key), value):
                raise FormatError(
                    f"{where}: {key} is {short_repr(z.get(key))}, the index says {value!r}"
                )
        if z.get("storage_transformers", []) != []:
            raise FormatError(f"{where}: storage_transformers are not supported")
        codecs = z.get("codecs")
        if not (isinstance(codecs, list) and len(codecs) == 1 and isinstance(codecs[0], dict)):
            raise FormatError(f"{where}: codecs must be one sharding_indexed codec")
        conf = codecs[0].get("configuration")
        if codecs[0].get("name") != "sharding_indexed" or not isinstance(conf, dict):
            raise FormatError(f"{where}: codecs must be one sharding_indexed codec")
        if not same_json(conf.get("chunk_shape"), list(self.chunk_shape)):
            raise FormatError(
                f"{where}: chunk_shape is {short_repr(conf.get('chunk_shape'))}, the index says "
                f"{list(self.chunk_shape)}"
            )
        inner = conf.get("codecs")
        if not isinstance(inner, list) or not inner or inner[0] not in inner_bytes:
            raise FormatError(
                f"{where}: chunks are not stored as little-endian bytes (the endian of every "
                f"chunk must be 'little'; got codecs {short_repr(inner)})"
            )
        names = [c.get("name") if isinstance(c, dict) else c for c in inner[1:]]
        if names != ([] if self.compressor is None else [self.compressor]):
            raise FormatError(
                f"{where}: codecs after 'bytes' are {short_repr(names)}, the index says "
                f"compressor {self.compressor!r}"
            )
        index_codecs = [*endian, {"name": "crc32c"}]
        if conf.get("index_location") != "end" or conf.get("index_codecs") != index_codecs:
            raise FormatError(f"{where}: the shard index must be little-endian + crc32c at the end")
