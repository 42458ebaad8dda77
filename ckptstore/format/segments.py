"""Reading index segments, the per-tensor part of a version-3 manifest, in compact binary
blobs (docs/format.md §3b; their bytes: segment_encoding.py).

A version-3 manifest's root holds everything but the tensor entries, plus a list of
segments (`SegmentRef`: digest, size, tensor count). Each segment is an ordinary blob, named
by the digest of its bytes like chunk data, holding the entries of consecutive tensors. So a
reader parses only the segments holding the tensors it needs (`SegmentedEntries`), an
unchanged segment is the same blob in the next checkpoint (written once, like unchanged
data), and gc, replication, peers and verify treat segments as the blobs they are.

Entries decode to exactly the TensorEntry that was encoded and obey `entry_problem`, the
rules of every other manifest version.
"""

from __future__ import annotations

import bisect
import json
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, overload

import numpy as np

from ..collector import paused_collector
from ..errors import FormatError
from .codecs import Codec, parse_codec
from .dtypes import DTYPES
from .manifest import (
    FORMAT_VERSION,
    ROWS_ABOVE,
    SEGMENTED_VERSION,
    ChunkRef,
    ChunkRows,
    HexNames,
    StorageRef,
    TensorEntry,
    entry_problem,
)
from .segment_encoding import (
    CHUNK_COLUMNS,
    DIGEST_BYTES,
    HEADER,
    MAGIC,
    MAX_SEGMENT_BYTES,
    ChunkTable,
    IndexBlob,
    SegmentRef,
    is_segmented,
)

__all__ = ["MAX_SEGMENT_BYTES", "ChunkColumns", "ChunkTable", "SegmentRef", "SegmentSource",
           "SegmentedEntries", "chunk_columns", "chunk_table", "decode", "version_for"]


def version_for(entries: Sequence[TensorEntry]) -> int:
    """The manifest version a writer uses for these entries (see is_segmented)."""
    return SEGMENTED_VERSION if is_segmented(entries) else FORMAT_VERSION


def _hexes(raw: bytes | memoryview) -> list[str]:
    h = raw.hex()
    return [h[i:i + 2 * DIGEST_BYTES] for i in range(0, len(h), 2 * DIGEST_BYTES)]


def decode(data: bytes, ref: SegmentRef, where: str) -> list[TensorEntry]:
    """The entries of segment `ref` from its bytes `data` (already matched to its digest),
    each validated by `entry_problem`; FormatError (prefixed by `where`) on anything wrong.
    Entries of many chunks keep views of the bytes (ChunkRows): a mutable buffer is copied
    first, so that no later write to it can change a validated entry."""
    if type(data) is not bytes:
        data = bytes(data)
    try:
        return _decode(data, ref)
    except FormatError as exc:
        raise FormatError(f"{where}: index segment {ref.digest}: {exc}") from None


def _frame(data: bytes, ref: SegmentRef, *, records: bool = True
           ) -> tuple[list[Any], memoryview, int, int]:
    """Check a segment's framing against its ref: (tensor records, or [] without `records`:
    the JSON header is then not parsed; the blob table's raw digests; chunk count; where
    the chunk columns begin)."""
    if len(data) != ref.size or len(data) < HEADER.size:
        raise FormatError(f"{len(data)} bytes, the root lists {ref.size}")
    magic, hlen, nblobs, nchunks = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise FormatError("not a ckptstore index segment")
    pos = HEADER.size + hlen
    want = pos + nblobs * DIGEST_BYTES + nchunks * (4 + 8 + 8 + 8 + DIGEST_BYTES)
    if len(data) != want:
        raise FormatError(f"{len(data)} bytes, its header implies {want}")
    found: list[Any] = []
    if records:
        try:
            header = json.loads(data[HEADER.size:pos].decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise FormatError(f"header is not valid JSON: {exc}") from None
        if (type(header) is not dict or header.keys() != {"tensors"}
                or type(found := header["tensors"]) is not list):
            raise FormatError("header must be {tensors}")
        if len(found) != ref.tensors:
            raise FormatError(f"holds {len(found)} tensor(s), the root lists {ref.tensors}")
    blob_table = memoryview(data)[pos:pos + nblobs * DIGEST_BYTES]
    return found, blob_table, nchunks, pos + nblobs * DIGEST_BYTES


def _columns(data: bytes, nchunks: int, pos: int, nblobs: int) -> list[np.ndarray]:
    """The chunk columns (blob index, offset, size, nbytes) starting at `pos`."""
    cols = []
    for dtype, width in CHUNK_COLUMNS:
        cols.append(np.frombuffer(data, dtype=dtype, count=nchunks, offset=pos))
        pos += width * nchunks
    if nchunks and int(cols[0].max()) >= nblobs:
        raise FormatError("a chunk names a blob outside the blob table")
    return cols


def chunk_table(data: bytes, ref: SegmentRef, where: str) -> ChunkTable:
    """The chunk references of segment `ref` from its bytes (already matched to its digest),
    without parsing, building or validating its entries: its framing is checked (FormatError,
    prefixed by `where`), the entries' own rules are `decode`'s."""
    try:
        _records, blob_table, nchunks, pos = _frame(data, ref, records=False)
        blob_names = _hexes(blob_table)
        blob_index, offsets, sizes, _nbytes = _columns(data, nchunks, pos, len(blob_names))
    except FormatError as exc:
        raise FormatError(f"{where}: index segment {ref.digest}: {exc}") from None
    return ChunkTable(tuple(blob_names), blob_index.astype(np.int64), offsets, sizes)


class ChunkColumns:
    """Every chunk reference of one segment, with its raw digest and its tensor's codec, as
    columns: what an incremental save needs of its parent (the chunks it may reuse), read
    without building or validating entries (`chunk_columns`). `ref(j)` builds chunk j's
    ChunkRef; `by_codec()` maps each codec to the chunks' digests."""

    def __init__(self, blobs: list[str], columns: list[np.ndarray], digests: list[str],
                 codecs: list[tuple[Codec | None, int]]) -> None:
        self._blobs = blobs
        self._index, self._offsets, self._sizes, self._nbytes = columns
        self.digests = digests
        self._codecs = codecs  # (codec, chunk count) per tensor, in order

    def ref(self, j: int) -> ChunkRef:
        return ChunkRef(self._blobs[int(self._index[j])], int(self._offsets[j]),
                        int(self._sizes[j]), int(self._nbytes[j]), self.digests[j])

    def by_codec(self, base: int = 0) -> dict[Codec | None, dict[str, int]]:
        """Each codec (None: raw) -> {raw digest: `base` + chunk index}."""
        if all(codec is None for codec, _n in self._codecs):  # the common case: one pass
            return {None: dict(zip(self.digests, range(base, base + len(self.digests))))}
        out: dict[Codec | None, dict[str, int]] = {}
        at = 0
        for codec, n in self._codecs:
            out.setdefault(codec, {}).update(zip(self.digests[at:at + n],
                                                 range(base + at, base + at + n)))
            at += n
        return out


def chunk_columns(data: bytes, ref: SegmentRef, where: str) -> ChunkColumns:
    """The chunk references of segment `ref` (bytes already matched to its digest) with their
    digests and codecs: its framing and each record's codec and chunk count are checked
    (FormatError, prefixed by `where`), and a raw chunk must store exactly its raw bytes; the
    entries' other rules are `decode`'s."""
    try:
        records, blob_table, nchunks, pos = _frame(data, ref)
        blob_names = _hexes(blob_table)
        columns = _columns(data, nchunks, pos, len(blob_names))
        pos += sum(width for _dtype, width in CHUNK_COLUMNS) * nchunks
        codecs = []
        for i, rec in enumerate(records):
            if type(rec) is not list or len(rec) != 11 or type(rec[6]) is not int or rec[6] < 0:
                raise FormatError(f"tensor record {i} malformed")
            codecs.append((None if rec[5] is None else parse_codec(rec[5]), rec[6]))
        counts = [n for _c, n in codecs]
        if sum(counts) != nchunks:
            raise FormatError("its records' chunk counts differ from its chunk count")
        raw = np.repeat(np.array([c is None for c, _n in codecs], dtype=bool), counts)
        if np.any(raw & (columns[2] != columns[3])):
            raise FormatError("a raw chunk's stored size differs from its raw size")
    except FormatError as exc:
        raise FormatError(f"{where}: index segment {ref.digest}: {exc}") from None
    return ChunkColumns(blob_names, columns, _hexes(data[pos:]), codecs)


def _decode(data: bytes, ref: SegmentRef) -> list[TensorEntry]:
    records, blob_table, nchunks, pos = _frame(data, ref)
    blob_names = HexNames(blob_table)
    arrays = _columns(data, nchunks, pos, len(blob_names))
    lists: list[list[int]] = []  # the columns as lists, made for the first small entry
    pos += sum(width for _dtype, width in CHUNK_COLUMNS) * nchunks
    raw = memoryview(data)[pos:]
    width = 2 * DIGEST_BYTES
    out: list[TensorEntry] = []
    at = 0
    for i, rec in enumerate(records):
        head, tail, n = _fields(rec, i)
        if at + n > nchunks:
            raise FormatError(f"tensor {i} lists more chunks than the segment holds")
        digests = raw[at * DIGEST_BYTES:(at + n) * DIGEST_BYTES]
        chunks: tuple[ChunkRef, ...] | ChunkRows
        if n > ROWS_ABOVE:
            chunks = ChunkRows(blob_names, [a[at:at + n] for a in arrays], digests)
        else:
            if not lists:
                lists = [a.tolist() for a in arrays]
            blob_index, offsets, sizes, nbytes = lists
            hexes = digests.hex()
            chunks = tuple(
                ChunkRef(blob_names[blob_index[j]], offsets[j], sizes[j], nbytes[j],
                         hexes[(j - at) * width:(j - at + 1) * width])
                for j in range(at, at + n))
        at += n
        key, kind, dtype, shape, rows, codec = head
        grad, param, storage, grid = tail
        entry = TensorEntry(key, kind, dtype, shape, rows, codec, chunks, grad, param, storage,
                            grid)
        problem = entry_problem(entry)
        if problem is not None:
            raise FormatError(f"tensor {entry.key!r:.200}: {problem}")
        out.append(entry)
    if at != nchunks:
        raise FormatError(f"{nchunks - at} chunk(s) belong to no tensor")
    if sum(t.nbytes for t in out) != ref.nbytes:
        raise FormatError(f"its tensors hold {sum(t.nbytes for t in out)} bytes, the root "
                          f"lists {ref.nbytes}")
    return out


def _fields(rec: Any, i: int) -> tuple[tuple[Any, ...], tuple[Any, ...], int]:
    """The TensorEntry fields a header record gives, before and after `chunks`, and its
    chunk count. Only what building the entry needs is checked here; the rules, by
    `entry_problem` once the chunks are in."""
    if type(rec) is not list or len(rec) != 11:
        raise FormatError(f"tensor record {i} must be a list of 11 fields")
    key, kind, dtype_name, shape, rows, codec_doc, n, grad, param, st, grid = rec
    dtype = DTYPES.get(dtype_name) if type(dtype_name) is str else None
    if dtype is None:
        raise FormatError(f"tensor record {i}: unknown dtype {dtype_name!r:.40}")
    if type(shape) is not list or type(n) is not int or n < 0 or (
            grid is not None and type(grid) is not list):
        raise FormatError(f"tensor record {i}: shape, chunk count or chunk_shape malformed")
    storage = None
    if st is not None:
        if type(st) is not list or len(st) != 4 or type(st[3]) is not list:
            raise FormatError(f"tensor record {i}: storage must be [id, nbytes, offset, stride]")
        storage = StorageRef(st[0], st[1], st[2], tuple(st[3]))
    return ((key, kind, dtype, tuple(shape), rows, parse_codec(codec_doc)),
            (grad, param, storage, None if grid is None else tuple(grid)), n)


#: Gives the bytes of an index blob (a segment, or the state tree), already matched to its
#: digest and size (FormatError if it cannot: layout.segments_in).
SegmentSource = Callable[[IndexBlob], bytes]


class SegmentedEntries(Sequence[TensorEntry]):
    """The tensor entries of a version-3 manifest, read segment by segment when first used
    (then kept): indexing reads one segment, iterating reads them all in order. Errors of a
    missing or damaged segment (FormatError, ObjectNotFoundError from the source) are raised
    by the access that needed it. Thread-safe."""

    def __init__(self, refs: Sequence[SegmentRef], source: SegmentSource | None, where: str):
        self.refs = tuple(refs)
        self._source = source
        self._where = where
        self._starts = [0]
        for r in self.refs:
            self._starts.append(self._starts[-1] + r.tensors)
        self._parsed: dict[int, list[TensorEntry]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._starts[-1]

    def segment(self, s: int) -> list[TensorEntry]:
        """The entries of segment `s`, read and validated on first use."""
        got = self._parsed.get(s)
        if got is not None:
            return got
        with self._lock:
            got = self._parsed.get(s)
            if got is None:
                ref = self.refs[s]
                data = self._bytes(ref)
                with paused_collector():  # a short CPU-bound step: see collector.py
                    got = self._parsed[s] = decode(data, ref, self._where)
            return got

    def read_segment(self, s: int) -> list[TensorEntry]:
        """The entries of segment `s`, read and validated as `segment` does but not kept
        (those `segment` kept already are returned): for one pass over every entry of many
        checkpoints (verify), whose memory would otherwise grow with all of them."""
        got = self._parsed.get(s)
        if got is not None:
            return got
        ref = self.refs[s]
        data = self._bytes(ref)
        with paused_collector():
            return decode(data, ref, self._where)

    def _bytes(self, ref: SegmentRef) -> bytes:
        if self._source is None:
            raise FormatError(f"{self._where}: its index segments are not available here "
                              "(only the manifest root was read)")
        return self._source(ref)

    def chunk_columns(self) -> Iterator[ChunkColumns | list[TensorEntry]]:
        """Each segment in order: its entries where already parsed, else its chunk columns
        straight from its bytes (not kept, no entries built; see `chunk_columns`)."""
        for s, ref in enumerate(self.refs):
            got = self._parsed.get(s)
            yield got if got is not None else chunk_columns(self._bytes(ref), ref, self._where)

    def chunk_tables(self) -> Iterator[ChunkTable]:
        """The chunk references of each segment in order, as columns: a segment already
        parsed from its entries, any other straight from its bytes (not kept, no entries
        built; see `chunk_table`)."""
        for s, ref in enumerate(self.refs):
            got = self._parsed.get(s)
            if got is not None:
                yield ChunkTable.of(got)
                continue
            yield chunk_table(self._bytes(ref), ref, self._where)

    @overload
    def __getitem__(self, i: int) -> TensorEntry: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[TensorEntry]: ...

    def __getitem__(self, i: int | slice) -> TensorEntry | Sequence[TensorEntry]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        s = bisect.bisect_right(self._starts, i) - 1
        return self.segment(s)[i - self._starts[s]]

    def __iter__(self) -> Iterator[TensorEntry]:
        for s in range(len(self.refs)):
            yield from self.segment(s)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or len(other) != len(self):
            return False
        return all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"SegmentedEntries({len(self)} tensors in {len(self.refs)} segments)"
