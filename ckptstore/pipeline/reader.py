"""The restore pipeline: fetch -> verify -> (decompress) -> place, over a bounded thread pool.

A chunk that fills a whole blob is read straight into its destination bytes (one copy); chunks
living in the same pack blob are fetched with one ranged read and copied out. Every chunk is
checked against its digest before `read_tensors` returns; on an IntegrityError the destination
buffers may hold partial data and must not be used.

Fallback sources (tiered repositories): a reader may be given further stores, nearest to
farthest. A job (one chunk, or one run of a pack blob) whose blob is missing, short, corrupt or
unreadable in the first store is done again from the next store, and so on; the error of the
first store is raised only when no store served a good copy. After a job succeeded from store
i > 0, `on_fallback(blob, i, failed)` is called (failed: the indexes of the stores that could
not serve it) so the caller can repair them. `bytes_by_source[i]` counts what store i served.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..concurrency import completed
from ..errors import IntegrityError, ObjectNotFoundError, ShortReadError, StoreError
from ..format.hashing import XXH3_128
from ..format.manifest import ChunkRef, LazyChunks, TensorEntry, chunks_meeting
from ..format.segments import prefetch_chunks
from ..layout import blob_key
from ..stores.base import Store
from .budget import ByteBudget
from .options import LoadOptions
from .ranges import merge_ranges

MiB = 1 << 20
MERGE_GAP = 1 * MiB  # read across gaps up to this size instead of issuing another request
MERGE_LIMIT = 64 * MiB  # never merge reads into one larger than this


@dataclass(frozen=True)
class ReadTarget:
    """Fill `buffer` (flat, writable uint8) with the entry's bytes: all of them, or with `rows`
    only the row range [start, stop) of dim 0 (a shard), reading only the chunks it overlaps."""

    entry: TensorEntry
    buffer: np.ndarray
    rows: tuple[int, int] | None = None

    @property
    def nbytes(self) -> int:
        if self.rows is None:
            return self.entry.nbytes
        return (self.rows[1] - self.rows[0]) * self.entry.row_bytes


@dataclass(frozen=True)
class _Piece:
    entry: TensorEntry
    chunk: ChunkRef
    dest: np.ndarray  # the destination bytes of this chunk (or of its overlap with a shard)
    skip: int = 0  # bytes of the decoded chunk before the part `dest` receives

    @property
    def partial(self) -> bool:
        return len(self.dest) != self.chunk.nbytes


#: on_fallback(blob, index of the store that served it, indexes of the stores that failed)
FallbackHook = Callable[[str, int, list[int]], None]


class CheckpointReader:
    """Reads and verifies chunks into caller-provided buffers (from `store`, then from the
    `fallbacks` in order for a chunk the previous ones could not serve: module docstring)."""

    def __init__(self, store: Store, options: LoadOptions | None = None, *,
                 fallbacks: list[Store] | None = None,
                 on_fallback: FallbackHook | None = None) -> None:
        self.store = store
        self.sources = [store, *(fallbacks or [])]
        self.options = options or LoadOptions()
        self.bytes_read = 0
        self.bytes_by_source = [0] * len(self.sources)
        self.on_fallback = on_fallback
        self._lock = threading.Lock()

    def read_tensors(self, targets: list[ReadTarget]) -> None:
        """Fill every target; raises IntegrityError naming tensor and blob on any bad chunk."""
        raw_groups: dict[str, list[_Piece]] = defaultdict(list)
        whole: list[_Piece] = []
        prefetch_chunks(_lazy_chunks(targets), self.options.workers)  # parted index parts
        for t in targets:
            e = t.entry
            if t.buffer.nbytes != t.nbytes:
                raise ValueError(f"buffer for {e.key!r} has {t.buffer.nbytes} bytes, "
                                 f"needs {t.nbytes}")
            if t.rows is None and len(e.chunks) == 1:  # the common small tensor: one piece
                c = e.chunks[0]
                if e.codec is None and (c.offset != 0 or c.blob != c.digest):
                    raw_groups[c.blob].append(_Piece(e, c, t.buffer))
                else:
                    whole.append(_Piece(e, c, t.buffer))
                continue
            want = t.rows or ((0, e.shape[0]) if e.shape else (0, 1))
            if not 0 <= want[0] <= want[1] <= (e.shape[0] if e.shape else 1):
                raise ValueError(f"rows {want} out of range for {e.key!r} of shape {e.shape}")
            for i in _chunks_of_rows(e, want):
                c = e.chunks[i]
                start, stop = e.chunk_rows_range(i)
                a, b = max(start, want[0]), min(stop, want[1])
                if a >= b:
                    continue  # this chunk holds none of the wanted rows: not read
                row = e.row_bytes if e.shape else e.dtype.itemsize
                lo = (a - want[0]) * row
                piece = _Piece(e, c, t.buffer[lo : lo + (b - a) * row], skip=(a - start) * row)
                if piece.partial:
                    whole.append(piece)
                elif e.codec is None and (c.offset != 0 or c.blob != c.digest):
                    raw_groups[c.blob].append(piece)  # lives inside a larger blob
                else:
                    whole.append(piece)
        budget = ByteBudget(self.options.max_inflight_bytes)
        jobs: list[tuple[Callable[..., None], tuple[Any, ...]]] = [
            (self._read_whole, (p, budget)) for p in whole]
        for blob, pieces in raw_groups.items():
            for run in _merge_runs(pieces):
                jobs.append((self._read_run, (blob, run, budget)))
        jobs.sort(key=lambda j: -_job_size(j))  # big first: better load balance
        run_job = self._job if len(self.sources) == 1 else self._job_with_fallback
        with cf.ThreadPoolExecutor(self.options.workers, thread_name_prefix="ckpt-load") as pool:
            for _ in completed(pool.submit(run_job, fn, args) for fn, args in jobs):
                pass

    def _job(self, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
        fn(*args, source=0)

    def _job_with_fallback(self, fn: Callable[..., None], args: tuple[Any, ...]) -> None:
        """A job on the first source that has a good copy. When none has: IntegrityError
        (damage) only if every source answered that its copy is missing or bad; if one of
        them failed to answer (StoreError: an outage, not damage), that StoreError."""
        failed: list[int] = []
        first: BaseException | None = None
        outage: StoreError | None = None
        for i in range(len(self.sources)):
            try:
                fn(*args, source=i)
            except (IntegrityError, StoreError) as exc:
                failed.append(i)
                first = first or exc
                if isinstance(exc, StoreError):
                    outage = outage or exc
                continue
            if failed and self.on_fallback is not None:
                blob = args[0] if isinstance(args[0], str) else args[0].chunk.blob
                self.on_fallback(blob, i, failed)
            return
        assert first is not None
        raise outage if outage is not None else first

    # ------------------------------------------------------------------ jobs
    def _fetch_into(self, entry: TensorEntry, blob: str, start: int, out: memoryview,
                    want_digest: bool = False, source: int = 0) -> str | None:
        """Read blob bytes [start, start+len(out)) of store `source` into `out`; with
        `want_digest`, return the digest of those bytes (hashed by the store while reading
        where it can)."""
        store = self.sources[source]
        try:
            if want_digest and self.options.hash is XXH3_128:  # hashed while read, in cache
                found: str | None = store.read_into_digest(blob_key(blob), start, out)
            elif want_digest:
                store.read_into(blob_key(blob), start, out)
                found = self.options.hash.digest(out)
            else:
                store.read_into(blob_key(blob), start, out)
                found = None
        except ObjectNotFoundError:
            raise IntegrityError(f"tensor {entry.key!r}: blob {blob} is missing from "
                                 f"{store.uri}") from None
        except ShortReadError as exc:  # truncated, or replaced by a shorter object
            raise IntegrityError(f"tensor {entry.key!r}: blob {blob} is shorter than the "
                                 f"manifest declares ({exc})") from None
        with self._lock:
            self.bytes_read += len(out)
            self.bytes_by_source[source] += len(out)
        return found

    def _read_whole(self, p: _Piece, budget: ByteBudget, source: int = 0) -> None:
        c, e = p.chunk, p.entry
        if p.partial:  # only part of the chunk is wanted: verify all of it, keep the part
            with budget.hold(c.nbytes):
                full = np.empty(c.nbytes, np.uint8)
                self._read_whole(_Piece(e, c, full), budget, source)
                p.dest[:] = full[p.skip : p.skip + len(p.dest)]
            return
        dest = p.dest.data
        if e.codec is None:
            if self._fetch_into(e, c.blob, c.offset, dest, True, source) != c.digest:
                raise _bad(p, self.sources[source])
            return
        with budget.hold(c.size):
            stored = _scratch(c.size)
            if self._fetch_into(e, c.blob, 0, stored, True, source) != c.blob:
                raise IntegrityError(f"tensor {e.key!r}: blob {c.blob} is corrupt in "
                                     f"{self.sources[source].uri} (stored bytes do not match "
                                     "their digest)")
            e.codec.decode_into(stored, dest, e.dtype.itemsize,
                                f"tensor {e.key!r}: blob {c.blob}")
        if self.options.hash.digest(dest) != c.digest:
            raise _bad(p, self.sources[source])

    def _read_run(self, blob: str, run: list[_Piece], budget: ByteBudget,
                  source: int = 0) -> None:
        if len(run) == 1:
            p = run[0]
            if self._fetch_into(p.entry, blob, p.chunk.offset, p.dest.data, True,
                                source) != p.chunk.digest:
                raise _bad(p, self.sources[source])
            return
        lo = run[0].chunk.offset
        hi = max(p.chunk.offset + p.chunk.size for p in run)
        with budget.hold(hi - lo):
            span = _scratch(hi - lo)
            self._fetch_into(run[0].entry, blob, lo, span, source=source)
            for p in run:
                a = p.chunk.offset - lo
                part = span[a : a + p.chunk.size]
                if self.options.hash.digest(part) != p.chunk.digest:
                    raise _bad(p, self.sources[source])
                p.dest[:] = np.frombuffer(part, np.uint8)


def _scratch(nbytes: int) -> memoryview:
    """An uninitialised buffer for bytes about to be read. Its pages are committed only as
    the read fills them, so a manifest that declares more bytes than the blob holds costs the
    blob's real size, not the declared one, before the short read is reported."""
    return memoryview(np.empty(nbytes, np.uint8).data).cast("B")


def _bad(p: _Piece, store: Store) -> IntegrityError:
    return IntegrityError(f"tensor {p.entry.key!r}: blob {p.chunk.blob} is corrupt in "
                          f"{store.uri} (bytes {p.chunk.offset}..{p.chunk.offset + p.chunk.size}"
                          " do not match their digest)")


def _merge_runs(pieces: list[_Piece]) -> list[list[_Piece]]:
    """Group ranges of one blob into runs read with one request each."""
    merged = merge_ranges(((p.chunk.offset, p.chunk.size, p) for p in pieces), MERGE_GAP,
                          MERGE_LIMIT)
    return [[part[2] for part in run.parts] for run in merged]


def _job_size(job: tuple[Callable[..., None], tuple[Any, ...]]) -> int:
    fn, args = job
    if isinstance(args[0], _Piece):
        return args[0].chunk.size
    return sum(p.chunk.size for p in args[1])


def _lazy_chunks(targets: list[ReadTarget]) -> Iterator[tuple[TensorEntry, int]]:
    """(entry, chunk index) of every chunk the targets read whose reference is read where it
    is used (LazyChunks: a parted segment's)."""
    for t in targets:
        e = t.entry
        if isinstance(e.chunks, LazyChunks):
            want = t.rows or ((0, e.shape[0]) if e.shape else (0, 1))
            for i in _chunks_of_rows(e, want):
                yield e, i


def _chunks_of_rows(e: TensorEntry, rows: tuple[int, int]) -> Iterable[int]:
    """The chunks of `e` that can hold rows [start, stop) of dim 0: those row blocks alone, so
    a rank reading its rows of a tensor held in thousands of chunks visits its own few."""
    if not e.shape or e.is_grid or not len(e.chunks):  # (no chunks: an extent may be 0)
        return range(len(e.chunks))
    return chunks_meeting(e.shape, e.block_shape(), [rows, *((0, n) for n in e.shape[1:])])
