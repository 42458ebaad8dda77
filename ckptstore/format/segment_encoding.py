"""Writing index segments, the per-tensor part of a version-3 manifest (docs/format.md §3.4):
where a manifest is cut into segments and the bytes of each. `segments` reads them back.

Segment bytes: MAGIC, then as u32 little-endian the JSON header's length, the blob count and
the chunk count, the canonical JSON header (the tensor records), then the chunk table as
columns (blob table of 16-byte digests, then per chunk: u32 blob index, u64
offset, u64 size, u64 nbytes, 16-byte digest). Only entries that pass `entry_problem` are
encoded; equal entries give equal bytes, so an unchanged segment is the same blob.

A segment of many chunks where some tensor has many (a collective save's: every rank holds a
slice of every tensor) is **parted**: its blob (the head) keeps the records and names part
blobs, each holding the same slice of every tensor's chunk list (`part_bounds`): so a rank
that needs its slice of each tensor reads one part per segment, not every rank's chunks.
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
PART_MAGIC = b"CKSTPRT\x01"
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
PART_HEADER = struct.Struct("<8sII")  # magic, blobs, chunks
#: A segment is parted (see the module docstring) when it holds more chunks than this and
#: some tensor of it more than PART_ABOVE_TENSOR_CHUNKS, into ceil(chunks / PART_CHUNKS)
#: parts (at most the largest tensor's chunk count): a writer's choice, not a reader's.
PART_ABOVE_CHUNKS = 4096
PART_ABOVE_TENSOR_CHUNKS = 64
PART_CHUNKS = 1024
#: No reader accepts a head naming more parts (bounds its allocation; 2^28-byte heads).
MAX_PARTS = 1 << 20
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
    gc need, read from a segment without building its entries (segments.chunk_table).
    `parts`: the part blobs the table was read from (a parted segment's), which the
    checkpoint needs as it needs its chunks' blobs."""

    blobs: tuple[str, ...]
    blob_index: np.ndarray
    offsets: np.ndarray
    sizes: np.ndarray
    parts: tuple[IndexBlob, ...] = ()

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

    def parts_and_extents(self) -> dict[str, int]:
        """`extents`, and each part blob the table was read from whole."""
        ext = {r.digest: r.size for r in self.parts}
        ext.update(self.extents())
        return ext

    def ranges(self) -> Iterator[tuple[str, int, int]]:
        """(blob, offset, size) of every chunk."""
        names = self.blobs
        return zip([names[i] for i in self.blob_index.tolist()], self.offsets.tolist(),
                   self.sizes.tolist())


@dataclass(frozen=True)
class PartRef:
    """One part of a parted segment as its head names it: the blob `digest` of `size`
    bytes."""

    digest: str
    size: int


@dataclass(frozen=True)
class EncodedSegment:
    """A segment's bytes: `ref` names its blob (`head`); a parted segment's head names its
    `parts` (ref and bytes of each), which are index blobs too."""

    ref: SegmentRef
    head: bytes
    parts: tuple[tuple[PartRef, bytes], ...] = ()

    def blobs(self) -> list[tuple[IndexBlob, bytes]]:
        """The head, then each part: every blob to write."""
        return [(self.ref, self.head), *self.parts]


def part_count(counts: Sequence[int]) -> int:
    """How many parts a segment of tensors holding `counts` chunks is written in (1: not
    parted; see PART_ABOVE_CHUNKS)."""
    total, largest = sum(counts), max(counts, default=0)
    if total <= PART_ABOVE_CHUNKS or largest <= PART_ABOVE_TENSOR_CHUNKS:
        return 1
    return min(-(-total // PART_CHUNKS), largest)


def part_of(chunk: Any, count: Any, parts: int) -> Any:
    """The part holding chunk `chunk` of a tensor of `count` chunks, in a segment of `parts`
    parts (ints, or int64 arrays of chunks and their tensors' counts): the one statement of
    where a parted segment keeps a chunk (`part_bounds` is its inverse)."""
    return chunk * parts // count


def part_bounds(counts: np.ndarray, parts: int) -> np.ndarray:
    """For tensors holding `counts` chunks (int64), the first chunk of each of `parts`
    parts and one past the last: `[k, p]` = ceil(p * counts[k] / parts), shape (K, parts +
    1). Part p holds chunks [bounds[k, p], bounds[k, p + 1]) of tensor k; chunk c of a
    tensor of n chunks is in part c * parts // n."""
    p = np.arange(parts + 1, dtype=np.int64)
    return -(-(np.asarray(counts, dtype=np.int64)[:, None] * p[None, :]) // parts)


def is_segmented(entries: Sequence[TensorEntry]) -> bool:
    """True if a manifest of these entries is written as version 3."""
    return (len(entries) > SEGMENTED_ABOVE_TENSORS
            or sum(len(t.chunks) for t in entries) > SEGMENTED_ABOVE_CHUNKS)


def segment_blobs(entries: Sequence[TensorEntry], algorithm: HashAlgorithm
                  ) -> list[EncodedSegment]:
    """The index segments of `entries`, cut (see `cut`) and encoded."""
    return [encode(entries[span.start:span.stop], algorithm) for span in cut(entries)]


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


def encode(entries: Sequence[TensorEntry], algorithm: HashAlgorithm) -> EncodedSegment:
    """The segment holding `entries` (each must pass `entry_problem`), its blobs named by
    `algorithm`; deterministic, so equal entries give the same blobs. FormatError if a blob
    would exceed MAX_SEGMENT_BYTES."""
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
                 bytes.fromhex("".join(digests)), algorithm)


def encode_columns(entries: Sequence[TensorEntry], blobs: np.ndarray, offsets: np.ndarray,
                   sizes: np.ndarray, nbytes: np.ndarray, digests: np.ndarray,
                   algorithm: HashAlgorithm) -> EncodedSegment:
    """What `encode(entries, algorithm)` gives, from the chunks of all `entries` in order as
    columns:
    raw blob digests and raw chunk digests (uint8, 16 per row), offset, size, nbytes. The
    blob table is made as `encode` makes it (distinct blobs in order of first use), so a
    segment built from rows is the blob a single-process save writes."""
    table, index = first_use_table(np.ascontiguousarray(blobs, dtype=np.uint8))
    return _pack(entries, table, [index.astype("<u4"), *(np.asarray(c, dtype="<u8")
                                                         for c in (offsets, sizes, nbytes))],
                 np.ascontiguousarray(digests, dtype=np.uint8).tobytes(), algorithm)


def first_use_table(raw: np.ndarray) -> tuple[bytes, np.ndarray]:
    """The blob table of chunks whose raw blob digests are `raw` (16 bytes a row): the
    distinct digests in order of first use, and each chunk's index into it."""
    keys = raw.reshape(-1, DIGEST_BYTES).view(np.dtype((np.void, DIGEST_BYTES))).ravel()
    distinct, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")
    position = np.empty(len(order), dtype=np.int64)
    position[order] = np.arange(len(order))
    return distinct[order].tobytes(), position[inverse.ravel()]


def _checked(data: bytes, what: str, entries: Sequence[TensorEntry]) -> bytes:
    if len(data) > MAX_SEGMENT_BYTES:
        raise FormatError(f"an index {what} of {len(entries)} tensor(s) would be {len(data)} "
                          f"bytes, more than the {MAX_SEGMENT_BYTES} a reader accepts; nothing "
                          "was committed (use a larger chunk_bytes)")
    return data


def _pack(entries: Sequence[TensorEntry], table: bytes, columns: list[np.ndarray],
          digests: bytes, algorithm: HashAlgorithm) -> EncodedSegment:
    """A segment's blobs: its header records, blob table, chunk columns and chunk digests
    in one blob, or (parted, see `part_count`) the records in the head and the chunk rows in
    parts."""
    counts = [len(t.chunks) for t in entries]
    records = [_record(t) for t in entries]
    nbytes = sum(t.nbytes for t in entries)
    parts = part_count(counts)
    if parts == 1:
        header = canonical_str({"tensors": records}).encode("utf-8")
        head = _checked(b"".join([
            HEADER.pack(MAGIC, len(header), len(table) // DIGEST_BYTES, len(columns[0])),
            header, table, *(c.tobytes() for c in columns), digests]), "segment", entries)
        return EncodedSegment(SegmentRef(algorithm.digest(head), len(head), len(entries),
                                         nbytes), head)
    blob_rows = np.frombuffer(table, dtype=np.uint8).reshape(-1, DIGEST_BYTES)
    digest_rows = np.frombuffer(digests, dtype=np.uint8).reshape(-1, DIGEST_BYTES)
    n = np.asarray(counts, dtype=np.int64)
    starts = np.cumsum(n) - n
    chunk = np.arange(int(n.sum()), dtype=np.int64) - np.repeat(starts, n)
    part_of_row = part_of(chunk, np.repeat(n, n), parts)
    order = np.argsort(part_of_row, kind="stable")  # in a part: by tensor, then chunk
    bounds = np.searchsorted(part_of_row[order], np.arange(parts + 1))
    out = []
    for p in range(parts):
        rows = order[bounds[p]:bounds[p + 1]]
        part_table, index = first_use_table(blob_rows[columns[0][rows].astype(np.int64)])
        data = _checked(b"".join([
            PART_HEADER.pack(PART_MAGIC, len(part_table) // DIGEST_BYTES, len(rows)),
            part_table, index.astype("<u4").tobytes(),
            *(c[rows].tobytes() for c in columns[1:]), digest_rows[rows].tobytes()]),
            "segment part", entries)
        out.append((PartRef(algorithm.digest(data), len(data)), data))
    header = canonical_str({"parts": [[ref.digest, ref.size] for ref, _data in out],
                            "tensors": records}).encode("utf-8")
    head = _checked(HEADER.pack(MAGIC, len(header), 0, 0) + header, "segment", entries)
    return EncodedSegment(SegmentRef(algorithm.digest(head), len(head), len(entries), nbytes),
                          head, tuple(out))
