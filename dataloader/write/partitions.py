"""Datasets written as partitions, by any engine: threads, processes, Ray, many machines.

    receipt = write_partition(uri, i, samples_i, rows_per_chunk=...)  # anywhere, any order
    index = commit_dataset(uri, [receipt_0, receipt_1, ...])          # once, anywhere

`write_partition` writes one partition's arrays under ``parts/<i>/`` (a v1-shaped set of zarr
arrays of its own) and makes nothing visible; it returns a *receipt*: a small JSON-able dict
(sample count, blocks, block bounds, shard sizes and digests). `commit_dataset` checks every
receipt against the store (each array's zarr.json, each shard's size and shard-index digest)
and creates ``dataset.json`` (format version 2) listing the partitions in order: create-only,
the commit point. Writing a partition again writes the same bytes to the same keys (zarr output
is deterministic and a partition's writer never deletes), so a retried or speculative task is
harmless, and the same partitions always give the same index and fingerprint.

Partitions never committed (an abandoned job, a retried task's older copy under another
index) are orphans: `gc_partitions` removes the ``parts/<i>/`` prefixes that the committed
index does not list and whose newest object is older than a grace period.

`write_dataset_parallel` (``write_dataset(..., workers=N)``, parallel.py) is this API driven by
threads or forked processes. JSON only: receipts and indexes never go through pickle.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from ckptstore.errors import FormatError, ObjectExistsError, ObjectNotFoundError
from ckptstore.stores import Store, open_store
from ckptstore.toolkit import HASH_NAME, digest

from ..format.arrays import ShardInfo
from ..format.index import DatasetIndex, check_zarr_metadata, load_index
from ..format.spec import (
    FORMAT_NAME,
    INDEX_KEY,
    MAX_INDEX_BYTES,
    PARTITION_PREFIX,
    PARTITIONED_VERSION,
    partition_prefix,
)
from ..format.validate import check_int, short_repr
from .dataset_writer import DatasetWriter

__all__ = ["commit_dataset", "fill_partition", "gc_partitions", "write_partition"]

RECEIPT_FORMAT = FORMAT_NAME + ".partition"
RECEIPT_VERSION = 1
MAX_PARTITION = 10**12 - 1  # parts/ + up to 12 digits
#: The options of DatasetWriter a partition takes (metadata is the commit's).
WRITER_OPTIONS = (
    "schema", "rows_per_chunk", "chunk_bytes", "shard_bytes", "data_chunk_bytes", "compression",
    "store_options",
)  # fmt: skip


def write_partition(
    uri: str | Store,
    index: int,
    samples: Iterable[Mapping[str, Any]],
    *,
    first_sample: int = 0,
    **options: Any,
) -> dict[str, Any]:
    """Write partition `index` (samples in order) under ``parts/<index>/``; return its receipt.

    Nothing becomes visible. Options as for DatasetWriter: schema, rows_per_chunk, chunk_bytes,
    shard_bytes, data_chunk_bytes, compression, store_options. Pass the same `schema` (and
    usually the same `rows_per_chunk`) to every partition: `commit_dataset` refuses partitions
    whose fields differ. An empty partition writes nothing and gives a receipt that the commit
    skips. Safe to call again for the same index (same samples: same bytes, same receipt).
    `first_sample` only numbers the samples in error messages."""
    return fill_partition(uri, index, samples, first_sample, options)()


def fill_partition(
    uri: str | Store, index: int, samples: Iterable[Mapping[str, Any]], first_sample: int,
    options: Mapping[str, Any],
) -> Callable[[], dict[str, Any]]:
    """The first part of write_partition: check and buffer every sample (shards that fill up
    are written on the way). Returns the rest, to call once, on any thread: write the last
    shards and the metadata, commit, return the receipt (or abandon and raise)."""
    index = check_int(index, "partition index", 0, MAX_PARTITION, ValueError)
    unknown = sorted(set(options) - set(WRITER_OPTIONS))
    if unknown:
        raise TypeError(f"write_partition: unexpected option(s) {unknown} (metadata: commit)")
    prefix = partition_prefix(index)
    head = {"format": RECEIPT_FORMAT, "version": RECEIPT_VERSION, "partition": index}
    writer = DatasetWriter(uri, prefix=prefix, **options)
    try:
        writer.first_sample = check_int(first_sample, "first_sample", 0, None, ValueError)
        n = 0
        for sample in samples:
            writer.add(sample)
            n += 1
    except BaseException:
        writer.abandon()
        raise

    def seal() -> dict[str, Any]:
        try:
            if n == 0:
                return {**head, "prefix": prefix, "num_samples": 0}
            sub = writer.finish_arrays()
            writer.commit_writes()
            return {**head, "prefix": prefix, **sub.part_body()}
        finally:
            writer.abandon()  # nothing left to drop after a commit; closes a store it opened

    return seal


def _parse_receipt(r: Any, i: int) -> tuple[int, dict[str, Any]] | None:
    """(partition index, its entry in the index) or None for an empty partition."""
    where = f"receipt {i}"
    if not isinstance(r, Mapping):
        raise FormatError(f"{where}: expected a dict, got {type(r).__name__}")
    version = r.get("version")
    if r.get("format") != RECEIPT_FORMAT or type(version) is not int or version != RECEIPT_VERSION:
        raise FormatError(f"{where}: not a partition receipt (format/version)")
    p = check_int(r.get("partition"), f"{where}.partition", 0, MAX_PARTITION)
    if r.get("prefix") != partition_prefix(p):
        raise FormatError(f"{where}.prefix: {short_repr(r.get('prefix'))} is not partition {p}'s")
    n = check_int(r.get("num_samples"), f"{where}.num_samples")
    entry = {k: v for k, v in r.items() if k not in ("format", "version", "partition")}
    if n == 0:
        if set(entry) != {"prefix", "num_samples"}:
            raise FormatError(f"{where}: an empty partition's receipt lists arrays")
        return None
    return p, entry


def commit_dataset(
    uri: str | Store,
    receipts: Sequence[Mapping[str, Any]],
    metadata: Mapping[str, Any] | None = None,
    *,
    store_options: Mapping[str, Any] | None = None,
) -> DatasetIndex:
    """Check the receipts against the store and create ``dataset.json`` (create-only).

    Receipts may come in any order (and a partition's receipt twice, if equal); the dataset
    lists the non-empty partitions by index. Every array's zarr.json must agree with its
    receipt and every shard must exist with the recorded size and shard-index digest. Committing
    the same receipts again where that exact index exists returns it; any other existing index
    raises ObjectExistsError."""
    store = open_store(uri, **dict(store_options or {}))
    try:
        entries: dict[int, dict[str, Any]] = {}
        for i, r in enumerate(receipts):
            parsed = _parse_receipt(r, i)
            if parsed is None:
                continue
            p, entry = parsed
            if p in entries and entries[p] != entry:
                raise FormatError(f"receipt {i}: partition {p} was reported twice, differently")
            entries[p] = entry
        if not entries:
            raise ValueError("no samples in any partition (a dataset needs at least one sample)")
        total = sum(int(e["num_samples"]) for e in entries.values())
        rows = max(int(e["rows_per_chunk"]) for e in entries.values())
        meta = dict(metadata or {})
        doc: dict[str, Any] = {
            "format": FORMAT_NAME,
            "version": PARTITIONED_VERSION,
            "hash": HASH_NAME,
            "num_samples": total,
            "rows_per_chunk": rows,
            "partitions": [entries[p] for p in sorted(entries)],
            "metadata": meta,
            "fingerprint": "0" * 32,
        }
        draft = DatasetIndex.parse_partitioned(doc, "commit", total, rows, meta)
        index = replace(draft, fingerprint=DatasetIndex.compute_fingerprint(draft.body()))
        raw = index.to_bytes()
        if len(raw) > MAX_INDEX_BYTES:
            raise ValueError(f"the dataset index would be {len(raw):,} bytes (over the limit)")
        index = DatasetIndex.from_bytes(raw, f"{store.uri}/{INDEX_KEY}")  # the reader's checks
        verify_partitions(store, index)
        store.sync()
        try:
            store.create(INDEX_KEY, raw)
        except ObjectExistsError:
            if store.get(INDEX_KEY) != raw:
                raise ObjectExistsError(
                    f"{store.uri}: a different dataset exists here already"
                ) from None
        return index
    finally:
        if not isinstance(uri, Store):
            store.close()


def verify_partitions(store: Store, index: DatasetIndex) -> None:
    """Every array's zarr.json agrees with the index; every shard exists with its recorded
    size and shard-index digest (the chunk digests are checked by readers, per chunk)."""
    check_zarr_metadata(store, index, sorted(index.arrays))
    for path, a in index.arrays.items():
        for s, shard in enumerate(a.shards):
            key = a.shard_key(s)
            try:
                size = store.stat(key).size
            except ObjectNotFoundError:
                raise FormatError(f"{store.uri}: shard {key!r} is missing") from None
            if size != shard.nbytes:
                raise FormatError(
                    f"{store.uri}: shard {key!r} has {size} bytes, the receipt says {shard.nbytes}"
                )
            tail = store.get_range(key, size - a.index_nbytes, a.index_nbytes)
            if digest(tail) != shard.index_digest or (
                shard.table is not None
                and ShardInfo.table_of(tail, a.chunks_per_shard) != shard.table
            ):
                raise FormatError(
                    f"{store.uri}: shard {key!r} (array {path!r}) does not match its receipt"
                )


def gc_partitions(
    uri: str | Store,
    *,
    grace_seconds: float = 24 * 3600,
    now: float | None = None,
    dry_run: bool = False,
    store_options: Mapping[str, Any] | None = None,
) -> list[str]:
    """Delete orphan partitions: ``parts/<i>/`` prefixes the committed ``dataset.json`` does not
    list (all of them if there is none), whose newest object is older than `grace_seconds`.
    Returns the deleted prefixes. Temp files that writers killed mid-write left anywhere in
    the store (local folders), older than `grace_seconds` too, are deleted as well. The grace
    period must exceed the longest write + commit of a job still running: a partition younger
    than it may be about to be committed."""
    store = open_store(uri, **dict(store_options or {}))
    try:
        keep: set[str] = set()
        try:
            keep = {k for k, _ in load_index(store).partitions}
        except ObjectNotFoundError:
            pass
        now = time.time() if now is None else now
        newest: dict[str, float] = {}
        keys: dict[str, list[str]] = {}
        for info in store.list(PARTITION_PREFIX):
            prefix = "/".join(info.key.split("/")[:2])
            if prefix in keep:
                continue
            newest[prefix] = max(newest.get(prefix, 0.0), info.mtime)
            keys.setdefault(prefix, []).append(info.key)
        doomed = sorted(p for p, t in newest.items() if now - t >= grace_seconds)
        if not dry_run:
            for prefix in doomed:
                for key in keys[prefix]:
                    store.delete(key)
            _delete_old_temps(store, now - grace_seconds)
        return doomed
    finally:
        if not isinstance(uri, Store):
            store.close()


def _delete_old_temps(store: Store, cutoff: float) -> None:
    """Delete the temp files (of stores that have them) last written at or before `cutoff`."""
    temp_files = getattr(store, "temp_files", None)
    if temp_files is None:
        return
    for info in list(temp_files()):
        if info.mtime <= cutoff:
            store.delete_temp(info.key)  # type: ignore[attr-defined]
