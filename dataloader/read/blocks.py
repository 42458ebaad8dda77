"""The streaming read path: blocks of samples fetched straight from the store.

zarr-python would fetch a shard index and then each chunk one request at a time. Here:

* shard indexes (the tail of each shard object) are fetched once, verified against the digest
  the dataset index records, and cached in memory (and in the local chunk cache, if any);
* the chunks a set of blocks needs are grouped per shard object and nearby byte ranges are
  merged into single ranged reads (`merge_gap`, `max_request`);
* requests run concurrently on the caller's executor (I/O and xxh3 release the GIL);
* every chunk is verified against its xxh3-128 digest before it is decoded: a mismatch is
  re-fetched once from the store, then raises IntegrityError naming the array and chunk.

A *block* is the rows of one row-chunk (samples [b*R, (b+1)*R)): its columns are numpy arrays
(scalar/fixed fields) or (data, offsets[, shapes]) triples with offsets local to the block.
A partitioned dataset (index version 2) is read by one reader per partition (its keys under
the partition's prefix), blocks numbered across partitions; their requests are issued together.

Why one module of ~450 lines: one read (locate the chunks, merge ranges, fetch, verify, fetch
again, decode, assemble the blocks), for single-stream and partitioned datasets alike; its
steps share the reader's shard-index cache and its partition readers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptstore.errors import IntegrityError, ObjectNotFoundError
from ckptstore.stores import Store
from ckptstore.toolkit import MergedRange, digest, merge_ranges

from ..errors import MissingShardError
from ..format.arrays import ArrayInfo
from ..format.index import DatasetIndex, check_zarr_metadata
from ..format.spec import EMPTY
from .cache import ChunkCache
from .metrics import Metrics

ChunkId = tuple[str, int]  # (array path, chunk number)
Column = np.ndarray | tuple[np.ndarray, np.ndarray, np.ndarray | None]
Block = dict[str, Column]


@dataclass(frozen=True)
class _Part:
    path: str
    chunk: int
    key: str
    offset: int
    nbytes: int
    digest: str


class BlockReader:
    """Reads whole blocks of a dataset. Thread-safe; owns no threads (uses the caller's)."""

    def __init__(
        self,
        store: Store,
        index: DatasetIndex,
        *,
        cache: ChunkCache | None = None,
        merge_gap: int = 1 << 20,
        max_request: int = 16 << 20,
        metrics: Metrics | None = None,
        fields: Sequence[str] | None = None,
        prefix: str = "",
    ) -> None:
        self.store, self.index, self.cache = store, index, cache
        self.prefix = prefix  # a partition's key prefix ("parts/000003/"), "" for v1
        self._rows = index.block_rows()
        self.fields = tuple(index.field(n) for n in fields) if fields is not None else index.fields
        self.merge_gap, self.max_request = merge_gap, max_request
        self.metrics = metrics or Metrics()
        self._indexes: dict[tuple[str, int], np.ndarray] = {}
        self._lock = threading.Lock()
        self._zstd: Any = None
        # A partition's zarr metadata is checked on its first read (StreamingDataset checks a
        # v1 dataset's at open): opening a dataset of many partitions costs one request.
        self._meta_checked = not prefix
        # A partitioned dataset: one reader per partition, blocks numbered across them.
        self._parts: list[BlockReader] = []
        self._part_start = np.zeros(0, dtype=np.int64)
        if index.partitions:
            names = [f.name for f in self.fields]
            starts = [0]
            for key, sub in index.partitions:
                self._parts.append(
                    BlockReader(
                        store, sub, cache=cache, merge_gap=merge_gap, max_request=max_request,
                        metrics=self.metrics, fields=names, prefix=key + "/",
                    )
                )
                starts.append(starts[-1] + sub.num_blocks)
            self._part_start = np.asarray(starts, dtype=np.int64)

    # -- shard indexes -----------------------------------------------------------------
    def shard_index(self, path: str, shard: int) -> np.ndarray:
        """(chunks_per_shard, 2) uint64 of (offset, nbytes) per chunk; fetched once, verified."""
        with self._lock:
            hit = self._indexes.get((path, shard))
        if hit is not None:
            return hit
        a = self.index.arrays[path]
        info = a.shards[shard]
        if info.table is not None:  # recorded in the index: no request
            table = np.asarray(
                [(EMPTY, EMPTY) if t is None else t for t in info.table], dtype="<u8"
            ).reshape(-1, 2)
            with self._lock:
                self._indexes[(path, shard)] = table
            return table
        key = self.prefix + a.shard_key(shard)
        raw = self.cache.get(info.index_digest) if self.cache else None
        if raw is None:
            start = info.nbytes - a.index_nbytes
            raw = self._get_range(key, path, start, a.index_nbytes)
            if digest(raw) != info.index_digest:
                raw = self._get_range(key, path, start, a.index_nbytes)
                if digest(raw) != info.index_digest:
                    raise IntegrityError(
                        f"{self.store.uri}: shard index of {key!r} (array {path!r}) does not match "
                        "its recorded digest: the shard was changed or truncated"
                    )
            if self.cache:
                self.cache.put(info.index_digest, raw)
        table = np.frombuffer(raw[: 16 * a.chunks_per_shard], dtype="<u8").reshape(-1, 2)
        with self._lock:
            self._indexes[(path, shard)] = table
        return table

    def _get_range(self, key: str, path: str, start: int, length: int) -> bytes:
        try:
            data = self.store.get_range(key, start, length)
        except ObjectNotFoundError as exc:
            raise MissingShardError(
                f"{self.store.uri}: shard {key!r} of array {path!r} is missing although "
                f"{'dataset.json'} lists it: the dataset is incomplete or was partly deleted"
            ) from exc
        self.metrics.add_read(len(data))
        return data

    # -- planning --------------------------------------------------------------------------
    def chunks_for_blocks(self, blocks: Sequence[int]) -> list[ChunkId]:
        """Every (array, chunk) the given blocks need, without duplicates."""
        idx, need = self.index, []
        seen: set[ChunkId] = set()
        for b in blocks:
            for f in self.fields:
                if not f.variable:
                    cands = [(f.arrays["values"], b)]
                else:
                    cands = [(f.arrays["offsets"], b)]
                    if "shapes" in f.arrays:
                        cands.append((f.arrays["shapes"], b))
                    assert f.block_bounds is not None
                    lo, hi = f.block_bounds[b], f.block_bounds[b + 1]
                    if hi > lo:
                        ce = idx.arrays[f.arrays["data"]].chunk_shape[0]
                        cands += [
                            (f.arrays["data"], c) for c in range(lo // ce, (hi - 1) // ce + 1)
                        ]
                for c in cands:
                    if c not in seen:
                        seen.add(c)
                        need.append(c)
        return need

    def shards_for(self, chunks: Sequence[ChunkId]) -> list[tuple[str, int]]:
        out = {(p, c // self.index.arrays[p].chunks_per_shard) for p, c in chunks}
        return sorted(out)

    def _part(self, path: str, chunk: int) -> _Part:
        a = self.index.arrays[path]
        shard, i = divmod(chunk, a.chunks_per_shard)
        off, n = (int(x) for x in self.shard_index(path, shard)[i])
        if off == EMPTY or off + n > a.shards[shard].nbytes or n > a.max_stored_nbytes:
            raise IntegrityError(
                f"{self.store.uri}: shard index of {self.prefix + a.shard_key(shard)!r} gives no "
                "valid location "
                f"for chunk {chunk} of array {path!r} ({n} bytes at offset {off}; a chunk is at "
                f"most {a.max_stored_nbytes} bytes)"
            )
        return _Part(path, chunk, self.prefix + a.shard_key(shard), off, n, a.chunk_digest(chunk))

    # -- loading ---------------------------------------------------------------------------
    def load_blocks(self, blocks: Sequence[int], executor: Executor) -> list[Block]:
        """Fetch, verify and decode the given blocks (requests run on `executor`)."""
        if self._parts:
            return self._load_partitioned(blocks, executor)
        chunks = self.chunks_for_blocks(blocks)
        _wait_all(self._submit_shard_indexes(chunks, executor))
        decoded, futures = self._submit_fetches(chunks, executor)
        for fut in _wait_all(futures):
            decoded.update(fut.result())
        return [self._assemble(b, decoded) for b in blocks]

    def _submit_shard_indexes(
        self, chunks: Sequence[ChunkId], executor: Executor
    ) -> list[Future[Any]]:
        """The requests for the shard indexes `chunks` need that are neither cached nor
        recorded in the index (recorded ones are taken at once: no request)."""
        futures = []
        for p, s in self.shards_for(chunks):
            if (p, s) in self._indexes:
                continue
            if self.index.arrays[p].shards[s].table is not None:
                self.shard_index(p, s)
            else:
                futures.append(executor.submit(self.shard_index, p, s))
        return futures

    def _submit_fetches(
        self, chunks: Sequence[ChunkId], executor: Executor, decode: bool = True
    ) -> tuple[dict[ChunkId, np.ndarray], list[Future[Any]]]:
        """Chunks served from the cache, and the submitted (merged) reads of the others. Each
        future gives ((array, chunk), array) pairs; with `decode=False`, (_Part, verified bytes)
        pairs for `_decode_parts` (cache hits among them: nothing is decoded)."""
        parts = [self._part(p, c) for p, c in chunks]
        decoded: dict[ChunkId, np.ndarray] = {}
        futures: list[Future[Any]] = []
        if self.cache is not None:
            lookup = self._from_cache if decode else self._cached_bytes
            hits = _wait_all([executor.submit(lookup, part) for part in parts])
            misses, raw = [], []
            for part, fut in zip(parts, hits, strict=True):
                found = fut.result()
                if found is None:
                    misses.append(part)
                elif decode:
                    decoded[(part.path, part.chunk)] = found
                else:
                    raw.append((part, found))
            parts = misses
            if raw:
                futures.append(_done(raw))
        by_key: dict[str, list[tuple[int, int, _Part]]] = {}
        for part in parts:
            by_key.setdefault(part.key, []).append((part.offset, part.nbytes, part))
        futures += [
            executor.submit(self._fetch if decode else self._read, key, req)
            for key, items in by_key.items()
            for req in merge_ranges(items, self.merge_gap, self.max_request)
        ]
        return decoded, futures

    def _load_partitioned(self, blocks: Sequence[int], executor: Executor) -> list[Block]:
        """Blocks of several partitions, in one round trip where the index records the shard
        tables: the `zarr.json` checks of partitions read for the first time and every chunk
        read are in flight together, and chunks are decoded only once their partition's checks
        passed (a failed check fails the read; nothing unchecked is decoded or returned).
        Partitions whose shard indexes must be fetched read their chunks after that."""
        where = np.searchsorted(self._part_start, np.asarray(blocks, dtype=np.int64), "right") - 1
        wanted: dict[int, list[int]] = {}
        for b, p in zip(blocks, where.tolist(), strict=True):
            wanted.setdefault(p, []).append(int(b) - int(self._part_start[p]))
        chunks = {p: self._parts[p].chunks_for_blocks(local) for p, local in wanted.items()}
        checks = [  # one request each, all in flight together
            (p, executor.submit(self._parts[p].check_metadata, [path]))
            for p in chunks if not self._parts[p]._meta_checked
            for path in self._parts[p].metadata_paths()
        ]
        unchecked = {p for p, _ in checks}
        index_jobs = {p: self._parts[p]._submit_shard_indexes(c, executor)
                      for p, c in chunks.items()}
        decoded: dict[int, dict[ChunkId, np.ndarray]] = {}
        reads: list[tuple[int, Future[Any]]] = []  # give decoded chunks
        early: list[tuple[int, Future[Any]]] = []  # give verified bytes, decoded after checks
        try:
            for p, c in chunks.items():
                if not index_jobs[p]:  # every location known: read now, with the checks
                    decoded[p], futs = self._parts[p]._submit_fetches(
                        c, executor, decode=p not in unchecked)
                    (early if p in unchecked else reads).extend((p, f) for f in futs)
            _wait_all([f for _, f in checks] + [f for jobs in index_jobs.values() for f in jobs])
            for p in unchecked:  # every path of p was checked: before any decode
                self._parts[p]._meta_checked = True
            for p, c in chunks.items():
                if index_jobs[p]:
                    decoded[p], futs = self._parts[p]._submit_fetches(c, executor)
                    reads += [(p, f) for f in futs]
            _wait_all([f for _, f in early])
            reads += [(p, executor.submit(self._parts[p]._decode_parts, f.result()))
                      for p, f in early]
            _wait_all([f for _, f in reads])
        except BaseException:
            for _, fut in early + reads:
                fut.cancel()
            raise
        for p, fut in reads:
            decoded[p].update(fut.result())
        return [
            self._parts[p]._assemble(int(b) - int(self._part_start[p]), decoded[p])
            for b, p in zip(blocks, where.tolist(), strict=True)
        ]

    def metadata_paths(self) -> list[str]:
        """The arrays this reader decodes (whose zarr.json must be checked first)."""
        return sorted({p for f in self.fields for p in f.arrays.values()})

    def check_metadata(self, paths: Sequence[str] | None = None) -> None:
        """Check this partition's zarr.json files (or those of `paths`) against its index;
        checking them all marks the partition checked."""
        if not self._meta_checked:
            check_zarr_metadata(
                self.store, self.index, list(paths or self.metadata_paths()), self.prefix
            )
            if paths is None:
                self._meta_checked = True

    def _fetch(self, key: str, req: MergedRange[_Part]) -> list[tuple[ChunkId, np.ndarray]]:
        return self._decode_parts(self._read(key, req))

    def _read(self, key: str, req: MergedRange[_Part]) -> list[tuple[_Part, memoryview]]:
        """One merged ranged read: each chunk's bytes, verified against its digest (a
        mismatch is re-fetched once, then raises IntegrityError)."""
        buf = np.empty(req.length, dtype=np.uint8)  # not zero-filled
        mv: memoryview = buf.data
        try:
            self.store.read_into(key, req.start, mv)
        except ObjectNotFoundError as exc:
            p = req.parts[0][2]
            raise MissingShardError(
                f"{self.store.uri}: shard {key!r} of array {p.path!r} is missing although "
                "dataset.json lists it: the dataset is incomplete or was partly deleted"
            ) from exc
        self.metrics.add_read(req.length)
        out = []
        for start, n, part in req.parts:
            data = mv[start - req.start : start - req.start + n]
            if digest(data) != part.digest:
                data = memoryview(self._refetch(part))
            elif self.cache is not None:
                self.cache.put(part.digest, data)
            out.append((part, data))
        return out

    def _decode_parts(self, got: list[tuple[_Part, memoryview]]
                      ) -> list[tuple[ChunkId, np.ndarray]]:
        return [((part.path, part.chunk), self._decode(part.path, data)) for part, data in got]

    def _cached_bytes(self, part: _Part) -> memoryview | None:
        assert self.cache is not None
        data = self.cache.get(part.digest)
        if data is None:
            return None
        self.metrics.add_cache_hit(len(data))
        return memoryview(data)

    def _from_cache(self, part: _Part) -> np.ndarray | None:
        data = self._cached_bytes(part)
        return None if data is None else self._decode(part.path, data)

    def _refetch(self, part: _Part) -> bytes:
        """Second (and last) try of one chunk whose bytes did not match. A store that fails
        to answer raises its StoreError (an outage, not corrupt data); a chunk gone or
        still wrong is an IntegrityError."""
        try:
            data = self.store.get_range(part.key, part.offset, part.nbytes)
        except ObjectNotFoundError:
            data = b""
        self.metrics.add_read(len(data))
        if digest(data) != part.digest:
            raise IntegrityError(
                f"{self.store.uri}: chunk {part.chunk} of array {part.path!r} "
                f"(object {part.key!r}, "
                f"bytes {part.offset}..{part.offset + part.nbytes}) does not match its digest "
                f"{part.digest}: the data is corrupt"
            )
        if self.cache is not None:
            self.cache.put(part.digest, data)
        return data

    def _decode(self, path: str, data: memoryview) -> np.ndarray:
        a: ArrayInfo = self.index.arrays[path]
        if a.compressor is None:
            if len(data) != a.chunk_nbytes:
                raise IntegrityError(
                    f"array {path!r}: chunk of {len(data)} bytes, expected {a.chunk_nbytes}"
                )
            raw: Any = data
        else:
            if self._zstd is None:
                from numcodecs import Zstd

                self._zstd = Zstd()
            out = np.empty(a.chunk_nbytes, dtype=np.uint8)
            try:
                raw = self._zstd.decode(bytes(data), out=out)
            except (ValueError, RuntimeError) as exc:
                raise IntegrityError(f"array {path!r}: chunk does not decode: {exc}") from exc
        return np.frombuffer(raw, dtype=a.np_dtype).reshape(a.chunk_shape)

    def _assemble(self, b: int, chunks: dict[ChunkId, np.ndarray]) -> Block:
        idx = self.index
        n = int(self._rows[b])
        block: Block = {}
        for f in self.fields:
            if not f.variable:
                block[f.name] = chunks[(f.arrays["values"], b)][:n]
                continue
            assert f.block_bounds is not None
            lo, hi = f.block_bounds[b], f.block_bounds[b + 1]
            offs = chunks[(f.arrays["offsets"], b)][:n].astype(np.int64) - lo
            offsets = np.empty(n + 1, dtype=np.int64)
            offsets[:n] = offs
            offsets[n] = hi - lo
            if n and (offsets[0] != 0 or np.any(np.diff(offsets) < 0)):
                raise IntegrityError(f"field {f.name!r}: block {b} has inconsistent offsets")
            data_path = f.arrays["data"]
            a = idx.arrays[data_path]
            ce = a.chunk_shape[0]
            if hi > lo:
                c0, c1 = lo // ce, (hi - 1) // ce
                if c0 == c1:
                    data = chunks[(data_path, c0)][lo - c0 * ce : hi - c0 * ce]
                else:
                    data = np.concatenate([chunks[(data_path, c)] for c in range(c0, c1 + 1)])
                    data = data[lo - c0 * ce : hi - c0 * ce]
            else:
                data = np.zeros(0, dtype=a.np_dtype)
            shapes = chunks[(f.arrays["shapes"], b)][:n] if "shapes" in f.arrays else None
            block[f.name] = (data, offsets, shapes)
        return block


def _wait_all(futures: list[Future[Any]]) -> list[Future[Any]]:
    """Wait for all futures; raise the first failure (after cancelling the rest)."""
    for i, fut in enumerate(futures):
        try:
            fut.result()
        except BaseException:
            for other in futures[i + 1 :]:
                other.cancel()
            raise
    return futures


def _done(result: Any) -> Future[Any]:
    fut: Future[Any] = Future()
    fut.set_result(result)
    return fut


class InlineExecutor(Executor):
    """Runs submitted calls at once in the caller's thread (num_workers=0)."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # delivered through the future, like a pool would
            fut.set_exception(exc)
        return fut
