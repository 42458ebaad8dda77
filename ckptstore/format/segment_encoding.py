"""Writing index segments, the per-tensor part of a version-3 manifest (docs/format.md §3b):
where a manifest is cut into segments and the bytes of each. `segments` reads them back.

Segment bytes: MAGIC, then as u32 little-endian the JSON header's length, the blob count and
the chunk count, the canonical JSON header (the tensor records), then the chunk table as
columns (blob table of 16-byte digests, then per chunk: u32 blob index, u64
offset, u64 size, u64 nbytes, 16-byte digest). Only entries that pass `entry_problem` are
encoded; equal entries give equal bytes, so an unchanged segment is the same blob.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import xxhash

from ..errors import FormatError
from .canonical import canonical_str
from .hashing import HashAlgorithm

if TYPE_CHECKING:
    from .manifest import TensorEntry

MAGIC = b"CKSTSEG\x01"
#: A manifest is written as version 3 (root + segments) above either size; smaller ones stay
#: one version-2 document (one read, nothing to gain from parts).
SEGMENTED_ABOVE_TENSORS = 1024
SEGMENTED_ABOVE_CHUNKS = 16384
#: Segment boundaries: after a tensor whose key hashes to 0 mod this (content-defined, so an
#: inserted or removed tensor changes one segment, not every later one), or at the caps.
CUT_MODULUS = 256
MAX_SEGMENT_TENSORS = 4096
MAX_SEGMENT_CHUNKS = 1 << 16  # a segment is cut before a tensor that would pass this
#: No segment may be larger (bounds a reader's allocation; a root lists each one's size).
MAX_SEGMENT_BYTES = 1 << 28
HEADER = struct.Struct("<8sIII")  # magic, JSON header length, blobs, chunks
DIGEST_BYTES = 16
CHUNK_COLUMNS = (("<u4", 4), ("<u8", 8), ("<u8", 8), ("<u8", 8))  # blob, offset, size, nbytes


@dataclass(frozen=True)
class SegmentRef:
    """One segment as a root lists it: the blob `digest` of its `size` bytes holding the
    entries of `tensors` consecutive tensors, which declare `nbytes` bytes (their
    TensorEntry.nbytes summed: listing a checkpoint's size reads the root alone)."""

    digest: str
    size: int
    tensors: int
    nbytes: int

    def to_json(self) -> dict[str, Any]:
        return {"digest": self.digest, "nbytes": self.nbytes, "size": self.size,
                "tensors": self.tensors}


class IndexBlob(Protocol):
    """A blob of a version-3 manifest's index (an index segment or the state tree) as its
    root names it: what a reader checks the bytes it fetches against."""

    @property
    def digest(self) -> str: ...

    @property
    def size(self) -> int: ...


@dataclass(frozen=True)
class TreeRef:
    """The state tree of a version-3 manifest as its root names it: the blob `digest` of the
    tree's canonical JSON, `size` bytes."""

    digest: str
    size: int

    def to_json(self) -> dict[str, Any]:
        return {"digest": self.digest, "size": self.size}


@dataclass(frozen=True)
class ChunkTable:
    """The chunk references of some tensor entries as columns: chunk j lies in blob
    `blobs[blob_index[j]]` at `offsets[j]`, `sizes[j]` bytes long. What space accounting and
    gc need, read from a segment without building its entries (segments.chunk_table)."""

    blobs: tuple[str, ...]
    blob_index: np.ndarray
    offsets: np.ndarray
    sizes: np.ndarray

    @classmethod
    def of(cls, entries: Sequence[TensorEntry]) -> ChunkTable:
        blobs: dict[str, int] = {}
        index: list[int] = []
        offsets: list[int] = []
        sizes: list[int] = []
        for t in entries:
            for c in t.chunks:
                index.append(blobs.setdefault(c.blob, len(blobs)))
                offsets.append(c.offset)
                sizes.append(c.size)
        return cls(tuple(blobs), np.asarray(index, dtype=np.int64),
                   np.asarray(offsets, dtype=np.uint64), np.asarray(sizes, dtype=np.uint64))

    def extents(self) -> dict[str, int]:
        """Each blob some chunk uses -> the furthest byte a chunk uses in it."""
        if not len(self.blob_index):
            return {}
        ends = np.zeros(len(self.blobs), dtype=np.uint64)
        np.maximum.at(ends, self.blob_index, self.offsets + self.sizes)
        return {self.blobs[i]: int(ends[i]) for i in np.unique(self.blob_index).tolist()}

    def ranges(self) -> Iterator[tuple[str, int, int]]:
        """(blob, offset, size) of every chunk."""
        names = self.blobs
        return zip([names[i] for i in self.blob_index.tolist()], self.offsets.tolist(),
                   self.sizes.tolist())


def is_segmented(entries: Sequence[TensorEntry]) -> bool:
    """True if a manifest of these entries is written as version 3."""
    return (len(entries) > SEGMENTED_ABOVE_TENSORS
            or sum(len(t.chunks) for t in entries) > SEGMENTED_ABOVE_CHUNKS)


def segment_blobs(entries: Sequence[TensorEntry], algorithm: HashAlgorithm
                  ) -> list[tuple[SegmentRef, bytes]]:
    """The index segments of `entries`, cut (see `cut`) and encoded, with their refs."""
    out = []
    for span in cut(entries):
        part = entries[span.start:span.stop]
        data = encode(part)
        out.append((SegmentRef(algorithm.digest(data), len(data), len(span),
                               sum(t.nbytes for t in part)), data))
    return out


def cut(entries: Sequence[TensorEntry]) -> list[range]:
    """The tensor index ranges of the segments, in order (see `cut_counts`)."""
    return cut_counts([t.key for t in entries], [len(t.chunks) for t in entries])


def cut_counts(keys: Sequence[str], counts: Sequence[int]) -> list[range]:
    """The tensor index ranges of the segments of tensors named `keys` holding `counts`
    chunks, in order: a segment ends after MAX_SEGMENT_TENSORS tensors, before a tensor that
    would take it past MAX_SEGMENT_CHUNKS, and after a tensor whose key hashes to 0 modulo
    CUT_MODULUS (so that a tensor added or removed moves few boundaries)."""
    out: list[range] = []
    start = chunks = 0
    for i, (key, n) in enumerate(zip(keys, counts)):
        if i > start and chunks + n > MAX_SEGMENT_CHUNKS:
            out.append(range(start, i))
            start, chunks = i, 0
        chunks += n
        if (i + 1 - start >= MAX_SEGMENT_TENSORS
                or xxhash.xxh64_intdigest(key.encode("utf-8", "surrogatepass"))
                % CUT_MODULUS == 0):
            out.append(range(start, i + 1))
            start, chunks = i + 1, 0
    if start < len(keys):
        out.append(range(start, len(keys)))
    return out


def _record(t: TensorEntry) -> list[Any]:
    st = t.storage
    return [t.key, t.kind, t.dtype.name, list(t.shape), t.chunk_rows,
            None if t.codec is None else t.codec.to_json(), len(t.chunks),
            t.requires_grad, t.parameter,
            None if st is None else [st.id, st.nbytes, st.offset, list(st.stride)],
            None if t.chunk_shape is None else list(t.chunk_shape)]


def encode(entries: Sequence[TensorEntry]) -> bytes:
    """The segment holding `entries` (each must pass `entry_problem`); deterministic, so
    equal entries give the same blob. FormatError if it would exceed MAX_SEGMENT_BYTES."""
    blobs: dict[str, int] = {}
    index: list[int] = []
    columns: list[list[int]] = [[], [], []]
    digests: list[str] = []
    for t in entries:
        for c in t.chunks:
            index.append(blobs.setdefault(c.blob, len(blobs)))
            columns[0].append(c.offset)
            columns[1].append(c.size)
            columns[2].append(c.nbytes)
            digests.append(c.digest)
    return _pack(entries, bytes.fromhex("".join(blobs)),
                 [np.asarray(index, dtype="<u4"), *(np.asarray(col, dtype="<u8")
                                                    for col in columns)],
                 bytes.fromhex("".join(digests)))


def encode_columns(entries: Sequence[TensorEntry], blobs: np.ndarray, offsets: np.ndarray,
                   sizes: np.ndarray, nbytes: np.ndarray, digests: np.ndarray) -> bytes:
    """What `encode(entries)` gives, from the chunks of all `entries` in order as columns:
    raw blob digests and raw chunk digests (uint8, 16 per row), offset, size, nbytes. The
    blob table is made as `encode` makes it (distinct blobs in order of first use), so a
    segment built from rows is the blob a single-process save writes."""
    rows = np.ascontiguousarray(blobs, dtype=np.uint8).reshape(-1, DIGEST_BYTES)
    keys = rows.view(np.dtype((np.void, DIGEST_BYTES))).ravel()
    distinct, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")  # table order: first use
    position = np.empty(len(order), dtype=np.int64)
    position[order] = np.arange(len(order))
    return _pack(entries, distinct[order].tobytes(),
                 [position[inverse.ravel()].astype("<u4"), *(np.asarray(c, dtype="<u8")
                                                            for c in (offsets, sizes, nbytes))],
                 np.ascontiguousarray(digests, dtype=np.uint8).tobytes())


def _pack(entries: Sequence[TensorEntry], table: bytes, columns: list[np.ndarray],
          digests: bytes) -> bytes:
    """A segment's bytes: its header records, blob table, chunk columns, chunk digests."""
    header = canonical_str({"tensors": [_record(t) for t in entries]}).encode("utf-8")
    parts = [HEADER.pack(MAGIC, len(header), len(table) // DIGEST_BYTES, len(columns[0])),
             header, table, *(c.tobytes() for c in columns), digests]
    data = b"".join(parts)
    if len(data) > MAX_SEGMENT_BYTES:
        raise FormatError(f"an index segment of {len(entries)} tensor(s) would be {len(data)} "
                          f"bytes, more than the {MAX_SEGMENT_BYTES} a reader accepts; nothing "
                          "was committed (use a larger chunk_bytes)")
    return data
