"""Reading index segments, the per-tensor part of a version-3 manifest, in compact binary
blobs (docs/format.md §3.4; their bytes: segment_encoding.py).

A version-3 manifest's root holds everything but the tensor entries, plus a list of
segments (`SegmentRef`: digest, size, tensor count). Each segment is an ordinary blob, named
by the digest of its bytes like chunk data, holding the entries of consecutive tensors. So a
reader parses only the segments holding the tensors it needs (`SegmentedEntries`), an
unchanged segment is the same blob in the next checkpoint (written once, like unchanged
data), and gc, replication, peers and verify treat segments as the blobs they are.

Entries decode to exactly the TensorEntry that was encoded and obey `entry_problem`, the
rules of every other manifest version. A parted segment's entries hold `PartedRows`: each
part is read, checked against its digest and the chunk rules, when a chunk in it is first
used (`SegmentParts`).
"""

from __future__ import annotations

import bisect
import functools
import json
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing, contextmanager
from dataclasses import replace
from typing import Any, overload

import numpy as np

from ..collector import paused_collector
from ..concurrency import (
    OnceEach,
    fetches_started,
    outcome,
    read_ahead,
    results_ahead,
    run_concurrently,
)
from ..errors import FormatError
from .codecs import Codec, parse_codec
from .dtypes import DTYPES
from .hashing import is_digest
from .manifest import (
    FORMAT_VERSION,
    ROWS_ABOVE,
    SEGMENTED_VERSION,
    ChunkRef,
    ChunkRows,
    HexNames,
    LazyChunks,
    StorageRef,
    TensorEntry,
    _chunk_problems,
    _chunk_sizes,
    entry_problem,
    listed_rows_bad,
    rows_bad,
)
from .segment_encoding import (
    CHUNK_COLUMNS,
    DIGEST_BYTES,
    HEADER,
    MAGIC,
    MAX_PARTS,
    MAX_SEGMENT_BYTES,
    PART_HEADER,
    PART_MAGIC,
    ChunkTable,
    IndexBlob,
    PartRef,
    SegmentRef,
    first_use_table,
    is_segmented,
    part_bounds,
    part_of,
)

__all__ = ["MAX_SEGMENT_BYTES", "ChunkColumns", "ChunkTable", "PartedRows", "SegmentParts",
           "SegmentRef", "SegmentSource", "SegmentedEntries", "chunk_columns", "chunk_table",
           "decode", "segment_parts", "version_for"]

_ROW_BYTES = sum(width for _dtype, width in CHUNK_COLUMNS) + DIGEST_BYTES
#: Parts read at a time where all of a segment's are needed (gc, space, an incremental
#: save's parent, verify): tens of small reads whose round trips would otherwise add up.
PART_READ_THREADS = 8
#: Segments read side by side by a pass over all of them (`SegmentedEntries.chunk_tables`).
SEGMENT_READ_AHEAD = 8
#: The most bytes of one manifest's segments `SegmentedEntries.bytes_read_ahead` holds (an
#: incremental save's parent: 35 MiB at 200,000 tensors; a larger index is read ahead in
#: part, the rest when its pass reaches it).
READ_AHEAD_BYTES = 64 << 20
#: A load reads the index blobs it needs (segments, parts) on at least this many threads,
#: however few its data-reading threads (`LoadOptions.workers`: 4 on 2 cores): a read of
#: a small blob mostly waits for the store's round trip, and decoding happens on the
#: calling thread, so the threads take no core from the load.
INDEX_READ_THREADS = 8


def version_for(entries: Sequence[TensorEntry]) -> int:
    """The manifest version a writer uses for these entries (see is_segmented)."""
    return SEGMENTED_VERSION if is_segmented(entries) else FORMAT_VERSION


def _hexes(raw: bytes | memoryview) -> list[str]:
    h = raw.hex()
    return [h[i:i + 2 * DIGEST_BYTES] for i in range(0, len(h), 2 * DIGEST_BYTES)]


def decode(data: bytes, ref: SegmentRef, where: str, source: SegmentSource | None = None
           ) -> list[TensorEntry]:
    """The entries of segment `ref` from its bytes `data` (already matched to its digest),
    each validated by `entry_problem`; FormatError (prefixed by `where`) on anything wrong.
    Entries of many chunks keep views of the bytes (ChunkRows): a mutable buffer is copied
    first, so that no later write to it can change a validated entry. A parted segment's
    entries read their parts from `source` when their chunks are used (PartedRows)."""
    if type(data) is not bytes:
        data = bytes(data)
    try:
        return _decode(data, ref, source, where)
    except FormatError as exc:
        raise FormatError(f"{where}: index segment {ref.digest}: {exc}") from None


def _frame(data: bytes, ref: SegmentRef, *, records: bool = True
           ) -> tuple[list[Any], memoryview, int, int, list[PartRef]]:
    """Check a segment's framing against its ref: (tensor records, or [] without `records`
    where the JSON header need not be parsed; the blob table's raw digests; chunk count;
    where the chunk columns begin; the parts a parted segment's header names, else [])."""
    if len(data) != ref.size or len(data) < HEADER.size:
        raise FormatError(f"{len(data)} bytes, the root lists {ref.size}")
    magic, hlen, nblobs, nchunks = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise FormatError("not a ckptstore index segment")
    pos = HEADER.size + hlen
    want = pos + nblobs * DIGEST_BYTES + nchunks * _ROW_BYTES
    if len(data) != want:
        raise FormatError(f"{len(data)} bytes, its header implies {want}")
    found: list[Any] = []
    parts: list[PartRef] = []
    if records or not nchunks:  # (no chunk rows: perhaps parted, which only the header says)
        try:
            header = json.loads(data[HEADER.size:pos].decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise FormatError(f"header is not valid JSON: {exc}") from None
        if (type(header) is not dict or header.keys() - {"parts"} != {"tensors"}
                or type(found := header["tensors"]) is not list):
            raise FormatError("header must be {tensors} or {parts, tensors}")
        if len(found) != ref.tensors:
            raise FormatError(f"holds {len(found)} tensor(s), the root lists {ref.tensors}")
        if "parts" in header:
            parts = _part_refs(header["parts"])
            if nblobs or nchunks:
                raise FormatError("a parted segment holds chunk rows of its own")
    blob_table = memoryview(data)[pos:pos + nblobs * DIGEST_BYTES]
    return found, blob_table, nchunks, pos + nblobs * DIGEST_BYTES, parts


def _part_refs(doc: Any) -> list[PartRef]:
    if type(doc) is not list or not 2 <= len(doc) <= MAX_PARTS:
        raise FormatError(f"parts must list 2 to {MAX_PARTS} parts")
    out = []
    for i, item in enumerate(doc):
        if (type(item) is not list or len(item) != 2 or not is_digest(item[0])
                or type(item[1]) is not int
                or not PART_HEADER.size <= item[1] <= MAX_SEGMENT_BYTES):
            raise FormatError(f"part {i} must be [digest, size] with a size in "
                              f"[{PART_HEADER.size}, {MAX_SEGMENT_BYTES}]")
        out.append(PartRef(item[0], item[1]))
    return out


def _columns(data: bytes, nchunks: int, pos: int, nblobs: int) -> list[np.ndarray]:
    """The chunk columns (blob index, offset, size, nbytes) starting at `pos`."""
    cols = []
    for dtype, width in CHUNK_COLUMNS:
        cols.append(np.frombuffer(data, dtype=dtype, count=nchunks, offset=pos))
        pos += width * nchunks
    if nchunks and int(cols[0].max()) >= nblobs:
        raise FormatError("a chunk names a blob outside the blob table")
    return cols


def chunk_table(data: bytes, ref: SegmentRef, where: str, source: SegmentSource | None = None
                ) -> ChunkTable:
    """The chunk references of segment `ref` from its bytes (already matched to its digest),
    and a parted segment's parts from `source`, without building or validating its entries:
    the framing is checked (FormatError, prefixed by `where`), the entries' own rules are
    `decode`'s."""
    try:
        records, blob_table, nchunks, pos, parts = _frame(data, ref, records=False)
        if parts:
            counts = [_chunk_count(rec, i) for i, rec in enumerate(records)]
            table, columns, _digests = _joined(counts, _read_parts(parts, counts, source),
                                               in_order=False)
            return ChunkTable(tuple(_hexes(table)), columns[0], columns[1], columns[2],
                              tuple(parts))
        blob_names = _hexes(blob_table)
        blob_index, offsets, sizes, _nbytes = _columns(data, nchunks, pos, len(blob_names))
    except FormatError as exc:
        raise FormatError(f"{where}: index segment {ref.digest}: {exc}") from None
    return ChunkTable(tuple(blob_names), blob_index.astype(np.int64), offsets, sizes)


def _chunk_count(rec: Any, i: int) -> int:
    if type(rec) is not list or len(rec) != 11 or type(rec[6]) is not int or rec[6] < 0:
        raise FormatError(f"tensor record {i} malformed")
    return rec[6]


def _part_frame(data: bytes, rows: int) -> tuple[memoryview, list[np.ndarray], memoryview]:
    """Check a part's framing (it must hold `rows` chunk rows): (its blob table's raw
    digests, its chunk columns, their raw digests)."""
    if len(data) < PART_HEADER.size:
        raise FormatError(f"{len(data)} bytes, too short for a segment part")
    magic, nblobs, nchunks = PART_HEADER.unpack_from(data)
    if magic != PART_MAGIC:
        raise FormatError("not a part of a ckptstore index segment")
    if nchunks != rows:
        raise FormatError(f"holds {nchunks} chunk(s), its segment's records place {rows} "
                          "there")
    pos = PART_HEADER.size + nblobs * DIGEST_BYTES
    if len(data) != pos + nchunks * _ROW_BYTES:
        raise FormatError(f"{len(data)} bytes, its header implies "
                          f"{pos + nchunks * _ROW_BYTES}")
    columns = _columns(data, nchunks, pos, nblobs)
    return (memoryview(data)[PART_HEADER.size:pos], columns,
            memoryview(data)[pos + (_ROW_BYTES - DIGEST_BYTES) * nchunks:])


def _read_parts(parts: Sequence[PartRef], counts: Sequence[int], source: SegmentSource | None
                ) -> list[tuple[memoryview, list[np.ndarray], memoryview]]:
    """Every part of a parted segment of tensors holding `counts` chunks, framing checked."""
    if source is None:
        raise FormatError("its parts are not available here (only the manifest root was read)")
    held = np.diff(part_bounds(np.asarray(counts, dtype=np.int64), len(parts)), axis=1)
    read = source

    def framed(p: int) -> tuple[memoryview, list[np.ndarray], memoryview]:
        ref = parts[p]
        try:
            return _part_frame(_as_bytes(read(ref)), int(held[:, p].sum()))
        except FormatError as exc:
            raise FormatError(f"part {p} ({ref.digest}): {exc}") from None

    with ThreadPoolExecutor(min(PART_READ_THREADS, len(parts)),
                            thread_name_prefix="ckpt-parts") as pool:
        return list(pool.map(framed, range(len(parts))))


def _as_bytes(data: bytes | bytearray | memoryview) -> bytes:
    return data if type(data) is bytes else bytes(data)


def _joined(counts: Sequence[int], parts: list[tuple[memoryview, list[np.ndarray], memoryview]],
            *, in_order: bool) -> tuple[bytes, list[np.ndarray], np.ndarray]:
    """A parted segment's chunk rows as one table: (raw blob table, columns (blob index as
    int64, offset, size, nbytes), raw digests as uint8 rows of 16), in the order of an
    unparted segment (by tensor, then chunk) with `in_order`, else part after part."""
    raw_tables = np.frombuffer(b"".join(bytes(t) for t, _c, _d in parts), dtype=np.uint8)
    table, global_index = first_use_table(raw_tables)
    first = np.cumsum([0] + [len(t) // DIGEST_BYTES for t, _c, _d in parts])
    columns = [np.concatenate([global_index[first[p] + c[0].astype(np.int64)]
                               for p, (_t, c, _d) in enumerate(parts)]),
               *(np.concatenate([c[k] for _t, c, _d in parts]) for k in (1, 2, 3))]
    digests = np.frombuffer(b"".join(bytes(d) for _t, _c, d in parts),
                            dtype=np.uint8).reshape(-1, DIGEST_BYTES)
    if in_order:
        n = np.asarray(counts, dtype=np.int64)
        bounds = part_bounds(n, len(parts))
        held = np.diff(bounds, axis=1).T.ravel()  # blocks part by part, tensors within
        block_start = ((np.cumsum(n) - n)[None, :] + bounds[:, :-1].T).ravel()
        dest = np.repeat(block_start - (np.cumsum(held) - held), held) + np.arange(int(n.sum()))
        order = np.empty_like(dest)
        order[dest] = np.arange(len(dest))
        columns = [c[order] for c in columns]
        digests = digests[order]
    return table, columns, digests


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


def chunk_columns(data: bytes, ref: SegmentRef, where: str,
                  source: SegmentSource | None = None) -> ChunkColumns:
    """The chunk references of segment `ref` (bytes already matched to its digest; a parted
    segment's parts from `source`) with their digests and codecs: its framing and each
    record's codec and chunk count are checked (FormatError, prefixed by `where`), and a raw
    chunk must store exactly its raw bytes; the entries' other rules are `decode`'s."""
    try:
        records, blob_table, nchunks, pos, parts = _frame(data, ref)
        if parts:
            counts = [_chunk_count(rec, i) for i, rec in enumerate(records)]
            table, columns, digest_rows = _joined(
                counts, _read_parts(parts, counts, source), in_order=True)
            blob_names = _hexes(table)
            nchunks = len(columns[0])
            raw_digests: bytes | memoryview = digest_rows.tobytes()
        else:
            blob_names = _hexes(blob_table)
            columns = _columns(data, nchunks, pos, len(blob_names))
            raw_digests = memoryview(data)[pos + (_ROW_BYTES - DIGEST_BYTES) * nchunks:]
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
    return ChunkColumns(blob_names, columns, _hexes(raw_digests), codecs)


def _decode(data: bytes, ref: SegmentRef, source: SegmentSource | None, where: str
            ) -> list[TensorEntry]:
    records, blob_table, nchunks, pos, parts = _frame(data, ref)
    if parts:
        return _decode_parted(records, parts, ref, source, where)
    blob_names = HexNames(blob_table)
    arrays = _columns(data, nchunks, pos, len(blob_names))
    lists: list[list[int]] = []  # the columns as lists, made for the first small entry
    names: list[str] = []  # the blob table's names, made then too (small entries share packs)
    pos += sum(width for _dtype, width in CHUNK_COLUMNS) * nchunks
    raw = memoryview(data)[pos:]
    width = 2 * DIGEST_BYTES
    out: list[TensorEntry] = []
    listed: list[tuple[TensorEntry, int]] = []  # entries whose chunks are ChunkRef tuples
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
                names = _hexes(blob_table)
            blob_index, offsets, sizes, nbytes = lists
            hexes = digests.hex()
            chunks = tuple(
                ChunkRef(names[blob_index[j]], offsets[j], sizes[j], nbytes[j],
                         hexes[(j - at) * width:(j - at + 1) * width])
                for j in range(at, at + n))
        key, kind, dtype, shape, rows, codec = head
        grad, param, storage, grid = tail
        entry = TensorEntry(key, kind, dtype, shape, rows, codec, chunks, grad, param, storage,
                            grid)
        # listed chunks: their rows are checked below, all of the segment's at once
        problem = entry_problem(entry, rows_checked=type(chunks) is tuple)
        if problem is not None:
            raise FormatError(f"tensor {entry.key!r:.200}: {problem}")
        if n and type(chunks) is tuple:
            listed.append((entry, at))
        at += n
        out.append(entry)
    if at != nchunks:
        raise FormatError(f"{nchunks - at} chunk(s) belong to no tensor")
    _check_listed(listed, arrays, nchunks)
    return _declared(out, ref)


def _check_listed(listed: list[tuple[TensorEntry, int]], arrays: list[np.ndarray],
                  nchunks: int) -> None:
    """The chunk rules (`listed_rows_bad`) on the rows of entries whose chunks are listed as
    ChunkRef tuples, (entry, its first row in the segment), all at once; FormatError naming
    the first broken chunk as `entry_problem` would."""
    if not listed:
        return
    counts = np.array([len(e.chunks) for e, _at in listed], dtype=np.int64)
    if int(counts.sum()) == nchunks:  # every row (a segment of small tensors)
        columns = arrays
    else:
        first = np.array([at for _e, at in listed], dtype=np.int64)
        rows = np.repeat(first - np.cumsum(counts) + counts, counts) + np.arange(counts.sum())
        columns = [a[rows] for a in arrays]
    bad = np.flatnonzero(listed_rows_bad([e for e, _at in listed], *columns[1:]))
    if len(bad):
        k = int(np.searchsorted(np.cumsum(counts), int(bad[0]), side="right"))
        e = listed[k][0]
        c = int(bad[0]) - int(counts[:k].sum())
        raise FormatError(f"tensor {e.key!r:.200}: {_chunk_problems(e, [(c, e.chunks[c])])}")


def _declared(entries: list[TensorEntry], ref: SegmentRef) -> list[TensorEntry]:
    """`entries`, if they declare the bytes the root lists for their segment."""
    if sum(t.nbytes for t in entries) != ref.nbytes:
        raise FormatError(f"its tensors hold {sum(t.nbytes for t in entries)} bytes, the root "
                          f"lists {ref.nbytes}")
    return entries


def _decode_parted(records: list[Any], parts: list[PartRef], ref: SegmentRef,
                   source: SegmentSource | None, where: str) -> list[TensorEntry]:
    """The entries of a parted segment: their chunks are PartedRows of one SegmentParts."""
    fields = [_fields(rec, i) for i, rec in enumerate(records)]
    shared = SegmentParts(parts, [n for _head, _tail, n in fields], source,
                          f"{where}: index segment {ref.digest}")
    out: list[TensorEntry] = []
    for k, (head, tail, n) in enumerate(fields):
        key, kind, dtype, shape, rows, codec = head
        grad, param, storage, grid = tail
        entry = TensorEntry(key, kind, dtype, shape, rows, codec,
                            PartedRows(shared, k) if n else (), grad, param, storage, grid)
        problem = entry_problem(entry)
        if problem is not None:
            raise FormatError(f"tensor {entry.key!r:.200}: {problem}")
        out.append(entry)
    shared.entries = out
    return _declared(out, ref)


class SegmentParts:
    """The parts of one parted segment (segment_encoding.part_bounds): part p is read from
    `source` when first used, its framing and the chunk rules of every row in it checked
    (FormatError naming the segment, the part and the tensor), then kept. Thread-safe."""

    def __init__(self, refs: Sequence[PartRef], counts: Sequence[int],
                 source: SegmentSource | None, label: str) -> None:
        self.refs = tuple(refs)
        self.counts = np.asarray(counts, dtype=np.int64)
        self.bounds = part_bounds(self.counts, len(self.refs))  # [k, p]: first chunk in p
        self.held = np.diff(self.bounds, axis=1)  # [k, p]: tensor k's chunks in part p
        self.base = np.cumsum(self.held, axis=0) - self.held  # [k, p]: its first row there
        self.entries: list[TensorEntry] = []  # set once built (the rules need them)
        self._source = source
        self._label = label
        self._rows: OnceEach[int, ChunkRows] = OnceEach(self._read)
        self._sizes: dict[int, np.ndarray] = {}

    def row_of(self, k: int, c: int) -> tuple[int, int]:
        """(part, row in it) of chunk `c` of tensor `k`."""
        p = part_of(c, int(self.counts[k]), len(self.refs))
        return p, int(self.base[k, p]) + c - int(self.bounds[k, p])

    def rows(self, p: int) -> ChunkRows:
        """Every chunk row of part `p`, read and checked on first use (parts concurrently)."""
        return self._rows.get(p)

    def loads(self) -> list[tuple[PartRef, Callable[[], ChunkRows]]]:
        """Each part and the call that reads and checks it (for verify)."""
        return [(ref, functools.partial(self.rows, p)) for p, ref in enumerate(self.refs)]

    def _read(self, p: int) -> ChunkRows:
        ref = self.refs[p]
        try:
            if self._source is None:
                raise FormatError("not available here (only the manifest root was read)")
            table, columns, digests = _part_frame(_as_bytes(self._source(ref)),
                                                  int(self.held[:, p].sum()))
            rows = ChunkRows(HexNames(table), columns, digests)
            self._check(p, columns, rows)
        except FormatError as exc:
            raise FormatError(f"{self._label} part {p} ({ref.digest}): {exc}") from None
        return rows

    def _check(self, p: int, columns: list[np.ndarray], rows: ChunkRows) -> None:
        """Every row of part `p` against the chunk rules of its tensor (rows_bad)."""
        held = self.held[:, p]
        ks = np.flatnonzero(held)
        if not len(ks):
            return
        want = np.concatenate([self._chunk_sizes(k)[self.bounds[k, p]:self.bounds[k, p + 1]]
                               for k in ks.tolist()])
        raw = np.repeat(np.array([self.entries[k].codec is None for k in ks.tolist()]),
                        held[ks])
        bad = np.flatnonzero(rows_bad(columns[1], columns[2], columns[3], want, raw))
        if len(bad):
            j = int(bad[0])
            k = int(ks[np.searchsorted(np.cumsum(held[ks]), j, side="right")])
            c = int(self.bounds[k, p]) + j - int(self.base[k, p])
            e = self.entries[k]
            raise FormatError(f"tensor {e.key!r:.200}: {_chunk_problems(e, [(c, rows[j])])}")

    def _chunk_sizes(self, k: int) -> np.ndarray:  # (a race computes it twice: harmless)
        got = self._sizes.get(k)
        if got is None:
            e = self.entries[k]
            got = self._sizes[k] = _chunk_sizes(e.shape, e.chunk_rows, e.chunk_shape,
                                                e.dtype.itemsize, int(self.counts[k]))
        return got


class PartedRows(LazyChunks):
    """The chunk references of tensor `k` of a parted segment: chunk j comes from the part
    holding it (SegmentParts.rows), read and checked when first needed. Equal to any
    sequence of the same ChunkRefs."""

    __slots__ = ("_k", "_parts")

    def __init__(self, parts: SegmentParts, k: int) -> None:
        self._parts = parts
        self._k = k

    @property
    def parts(self) -> SegmentParts:
        return self._parts

    @property
    def k(self) -> int:
        """This tensor's place in its segment."""
        return self._k

    def __len__(self) -> int:
        return int(self._parts.counts[self._k])

    def _at(self, j: int) -> ChunkRef:
        p, row = self._parts.row_of(self._k, j)
        return self._parts.rows(p)[row]

    def __iter__(self) -> Iterator[ChunkRef]:
        parts, k = self._parts, self._k
        for p in range(len(parts.refs)):
            n = int(parts.held[k, p])
            if n:
                start = int(parts.base[k, p])
                yield from parts.rows(p)[start:start + n]

    def __repr__(self) -> str:
        return f"PartedRows({len(self)} chunks in {len(self._parts.refs)} parts)"


def prefetch_chunks(wanted: Iterable[tuple[TensorEntry, int]], workers: int) -> None:
    """Read the parts holding chunks (entry, index) of parted segments, `workers` (at least
    INDEX_READ_THREADS) at a time; chunks of other entries need nothing. Errors are left to
    the accesses that need them."""
    parts: dict[tuple[int, int], Callable[[], ChunkRows]] = {}
    for e, c in wanted:
        chunks = e.chunks
        if isinstance(chunks, PartedRows) and 0 <= c < len(chunks):
            p, _row = chunks.parts.row_of(chunks.k, c)
            parts.setdefault((id(chunks.parts), p), functools.partial(chunks.parts.rows, p))
    run_concurrently(list(parts.values()), max(workers, INDEX_READ_THREADS))


def segment_parts(entries: Sequence[TensorEntry]) -> SegmentParts | None:
    """The parts of the parted segment these entries were decoded from, or None."""
    for e in entries:
        if isinstance(e.chunks, PartedRows):
            return e.chunks.parts
    return None


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


def _given(entries: list[TensorEntry]) -> list[TensorEntry]:
    return entries


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
        self._segments: OnceEach[int, list[TensorEntry]] = OnceEach(self._read)
        self._parsed = self._segments.done
        self._fetched: dict[int, bytes] = {}  # a prefetch's bytes, until decoded
        self._ahead: Callable[[int], Callable[[], bytes] | None] = _none_ahead  # bytes_read_ahead
        self._flat: list[TensorEntry] | None = None  # all entries, once every segment is read

    def __len__(self) -> int:
        return self._starts[-1]

    def segment(self, s: int) -> list[TensorEntry]:
        """The entries of segment `s`, read and validated on first use (segments
        concurrently)."""
        return self._segments.get(s)

    def _read(self, s: int) -> list[TensorEntry]:
        ref = self.refs[s]
        data = self._fetched.pop(s, None)
        if data is None:
            data = self._fetch(s)()
        with paused_collector():  # a short CPU-bound step: see collector.py
            return decode(data, ref, self._where, self._source)

    def prefetch(self, indexes: Iterable[int], workers: int) -> None:
        """Read the segments holding tensors `indexes` that are not read yet: their bytes
        `workers` (at least INDEX_READ_THREADS) at a time (a reader of many tensors hides
        the store's round trips), each decoded on the calling thread as it arrives. Errors
        are left to the accesses that need them."""
        with self.prefetching(indexes, workers) as arrived:
            arrived()

    @contextmanager
    def prefetching(self, indexes: Iterable[int] | None, workers: int
                    ) -> Iterator[Callable[[], None]]:
        """`prefetch` (`indexes` None: every segment), its reads begun on entering the block
        (whose own reads, a tree's pages, then overlap them); the block calls what this
        yields to decode what arrived. Leaving the block without that call drops the bytes
        read."""
        wanted = (range(len(self.refs)) if indexes is None else
                  {bisect.bisect_right(self._starts, i) - 1 for i in indexes})
        fetches: dict[int, Callable[[], bytes]] = {
            s: functools.partial(self._bytes, self.refs[s]) for s in sorted(wanted)
            if s not in self._parsed}
        with fetches_started(fetches, max(workers, INDEX_READ_THREADS)) as deliver:
            yield functools.partial(deliver, self._arrived)

    @contextmanager
    def bytes_read_ahead(self, workers: int, budget: int = READ_AHEAD_BYTES,
                         skip: Collection[str] = ()) -> Iterator[None]:
        """Read the bytes of the segments not parsed yet (in order, up to `budget` bytes of
        them) `workers` (at least INDEX_READ_THREADS) at a time from entering the block, for
        the block's later pass over them (`chunk_columns`, `chunk_tables`, `segment`) to take
        instead of reading them: an incremental save reads its parent's index while it
        encodes its state. Only bytes are read ahead; decoding stays with the pass, on its
        thread (on two threads it would take turns with the block's own work). A read's
        error is raised by the access that takes it. Leaving the block drops what was not
        taken. Two blocks at once over one manifest (a cached parent of two saves) stay
        correct: a pass takes a read either began, or reads the segment itself. Segments
        whose digest is in `skip` are not read ahead (a pass over many checkpoints that
        reads each distinct segment once: `BlobUnion.add_each`)."""
        fetches: dict[int, Callable[[], bytes]] = {}
        room = budget
        for s, ref in enumerate(self.refs):
            if s in self._parsed or ref.digest in skip:
                continue
            if ref.size > room:
                break
            room -= ref.size
            fetches[s] = functools.partial(self._bytes, ref)
        with results_ahead(fetches, max(workers, INDEX_READ_THREADS)) as claim:
            self._ahead = claim
            try:
                yield
            finally:
                self._ahead = _none_ahead

    def _fetch(self, s: int) -> Callable[[], bytes]:
        """What gives segment `s`'s bytes: its read begun ahead, else a read now."""
        return self._ahead(s) or functools.partial(self._bytes, self.refs[s])

    def _arrived(self, s: int, data: bytes) -> None:
        self._fetched[s] = data
        try:
            self.segment(s)
        finally:
            self._fetched.pop(s, None)  # not kept when its decode failed

    def read_segment(self, s: int) -> list[TensorEntry]:
        """The entries of segment `s`, read and validated as `segment` does but not kept
        (those `segment` kept already are returned): for one pass over every entry of many
        checkpoints (verify), whose memory would otherwise grow with all of them."""
        got = self._parsed.get(s)
        if got is not None:
            return got
        return self._decoded(s, self._fetch(s)())

    def read_segments(self, skip: Collection[str] = ()
                      ) -> Iterator[tuple[int, Callable[[], list[TensorEntry]]]]:
        """(s, `read`) for every segment in order (those whose digest is in `skip` left out,
        unread), `read()` giving what `read_segment(s)` gives or raising what it raises: for
        a pass that reports a segment it cannot read and goes on (verify). The next segments'
        bytes are read meanwhile (`_each_segment`)."""
        for s, got, data in self._each_segment(skip):
            yield s, (functools.partial(_given, got) if data is None else
                      functools.partial(self._decoded_when_read, s, data))

    def _decoded_when_read(self, s: int, data: Callable[[], bytes]) -> list[TensorEntry]:
        return self._decoded(s, data())

    def _decoded(self, s: int, data: bytes) -> list[TensorEntry]:
        """Segment `s` decoded from its bytes, not kept."""
        with paused_collector():
            return decode(data, self.refs[s], self._where, self._source)

    def _bytes(self, ref: SegmentRef) -> bytes:
        if self._source is None:
            raise FormatError(f"{self._where}: its index segments are not available here "
                              "(only the manifest root was read)")
        return self._source(ref)

    def chunk_columns(self) -> Iterator[ChunkColumns | list[TensorEntry]]:
        """Each segment in order: its entries where already parsed, else its chunk columns
        straight from its bytes (not kept, no entries built; see `chunk_columns`)."""
        for s, got, data in self._each_segment():
            yield got if data is None else chunk_columns(data(), self.refs[s], self._where,
                                                         self._source)

    def chunk_tables(self, skip: Collection[str] = ()) -> Iterator[ChunkTable]:
        """The chunk references of each segment in order, as columns: a segment already
        parsed from its entries, any other straight from its bytes (not kept, no entries
        built; see `chunk_table`). Segments whose digest is in `skip` are left out, unread."""
        for s, got, data in self._each_segment(skip):
            if data is None:
                shared = segment_parts(got)
                table = ChunkTable.of(got)
                yield table if shared is None else replace(table, parts=shared.refs)
            else:
                yield chunk_table(data(), self.refs[s], self._where, self._source)

    def _each_segment(self, skip: Collection[str] = ()
                      ) -> Iterator[tuple[int, list[TensorEntry], Callable[[], bytes] | None]]:
        """(s, entries, None) for each segment already parsed and (s, [], `data`) for the
        others, in order, `data()` giving its bytes or raising why they cannot be read;
        segments whose digest is in `skip` are left out. A pass over every segment (an
        incremental save learning its parent's chunks, space accounting, gc, verify) reads
        them SEGMENT_READ_AHEAD at a time, so a store's round trips overlap, holding no more
        than that many segments' bytes."""
        known = [(s, self._parsed.get(s)) for s, ref in enumerate(self.refs)
                 if ref.digest not in skip]
        # reads begun ahead (bytes_read_ahead) are taken as they are, the others read here
        ahead = {s: self._ahead(s) for s, got in known if got is None}
        with closing(read_ahead([functools.partial(outcome, functools.partial(
                                     self._bytes, self.refs[s]))
                                 for s, claimed in ahead.items() if claimed is None],
                                SEGMENT_READ_AHEAD)) as fetched:
            for s, got in known:
                if got is not None:
                    yield s, got, None
                else:
                    yield s, [], ahead[s] or next(fetched)

    @overload
    def __getitem__(self, i: int) -> TensorEntry: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[TensorEntry]: ...

    def __getitem__(self, i: int | slice) -> TensorEntry | Sequence[TensorEntry]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        flat = self._flat
        if flat is not None:  # every segment read: one list lookup
            return flat[i]
        if not 0 <= i < len(self):
            raise IndexError(i)
        s = bisect.bisect_right(self._starts, i) - 1
        got = self.segment(s)[i - self._starts[s]]
        if len(self._parsed) == len(self.refs):
            self._flat = [e for s in range(len(self.refs)) for e in self._parsed[s]]
        return got

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


def _none_ahead(s: int) -> None:
    """No segment is read ahead (outside `SegmentedEntries.bytes_read_ahead`)."""
