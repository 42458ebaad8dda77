"""Verification and garbage collection over a store, given its manifests (or a function that
lists what they reference): this module never sees a CheckpointStore.

GC safety (docs/format.md): a blob is deleted only if no manifest references it and it is older
than the grace period, and never younger than MIN_BLOB_AGE whatever the grace period says;
ages are read on the store's clock (object modification times against an object gc has just
written), never on the gc host's clock. Manifests are listed before the blobs and again just
before deleting, so a checkpoint committed meanwhile keeps its blobs, and a save in flight
writes its new blobs with fresh modification times that the grace period protects. A manifest
that cannot be parsed stops gc: nothing is deleted when what it references is unknown.
"""

from __future__ import annotations

import concurrent.futures as cf
import random
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from ..concurrency import run_concurrently
from ..errors import FormatError, IntegrityError, ObjectNotFoundError, StoreError
from ..format.hashing import XXH3_128, HashAlgorithm
from ..format.manifest import ChunkRef, Manifest, TensorEntry, with_next_read_ahead
from ..format.segment_encoding import IndexBlob
from ..format.segments import PART_READ_THREADS, SegmentedEntries, segment_parts
from ..format.tree_pages import page_loads
from ..layout import BLOB_PREFIX, blob_key, blob_of_key
from ..stores.base import Buffer, Store
from . import leases

T = TypeVar("T")

#: Temp files (`.tmp-*`, a write in progress) are removed only when at least this old,
#: whatever the grace period: a live writer's temp file exists for seconds, and deleting it
#: would fail that write (a lease refresh, a blob put).
TEMP_MIN_AGE = 600.0
#: No blob younger than this (store clock) is deleted, whatever the grace period: a save whose
#: lease someone may judge stale has been silent for at most this long.
MIN_BLOB_AGE = leases.STALE_AFTER + leases.SKEW_MARGIN


@dataclass(frozen=True)
class BlobProblem:
    """A bad or missing blob and what it breaks."""

    blob: str
    problem: str  # "missing" | "corrupt" | "unreadable"
    detail: str
    checkpoints: tuple[str, ...]
    keys: tuple[str, ...]


#: a verify run's bad blobs (data or index): blob -> (problem, detail, the checkpoints and
#: the keys using it), one entry however many checkpoints name the blob
_BadBlobs = dict[str, tuple[str, str, set[str], set[str]]]


@dataclass
class VerifyReport:
    checkpoints: list[str]
    blobs_checked: int = 0
    bytes_checked: int = 0
    seconds: float = 0.0
    problems: list[BlobProblem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def raise_if_bad(self) -> None:
        if self.problems:
            p = self.problems[0]
            raise IntegrityError(f"{len(self.problems)} bad blob(s); first: {p.blob} "
                                 f"({p.problem}: {p.detail}) used by {list(p.keys)[:5]}")


def _check_blob(store: Store, hash_of: Callable[[Buffer], str], blob: str,
                uses: list[tuple[str, TensorEntry, ChunkRef]]) -> tuple[int, str, str]:
    """Read a whole blob, check its digest and every chunk that lives in it. Returns
    (bytes read, "ok", "") if good, else (bytes read, problem, detail)."""
    try:
        data = store.get(blob_key(blob))
    except ObjectNotFoundError:
        return (0, "missing", "blob does not exist")
    except StoreError as exc:
        return (0, "unreadable", str(exc))
    if hash_of(data) != blob:
        return (len(data), "corrupt", "content does not match its digest")
    view = memoryview(data)
    for _name, entry, chunk in uses:
        part = view[chunk.offset : chunk.offset + chunk.size]
        if len(part) != chunk.size:
            return (len(data), "corrupt", f"shorter than chunk of {entry.key!r} needs")
        if entry.codec is None:
            if hash_of(part) != chunk.digest:
                return (len(data), "corrupt", f"chunk of {entry.key!r} does not match")
            continue
        if chunk.offset != 0 or chunk.size != len(data):
            return (len(data), "corrupt", f"blob size {len(data)} differs from the "
                                          f"{chunk.size} bytes declared for {entry.key!r}")
        out = memoryview(np.empty(chunk.nbytes, np.uint8).data).cast("B")  # pages filled lazily
        try:
            entry.codec.decode_into(part, out, entry.dtype.itemsize, entry.key)
        except IntegrityError as exc:
            return (len(data), "corrupt", str(exc))
        if hash_of(out) != chunk.digest:
            return (len(data), "corrupt", f"decoded chunk of {entry.key!r} does not match")
    return (len(data), "ok", "")


def verify(store: Store, manifests: list[Manifest], algorithm: HashAlgorithm = XXH3_128,
           sample: float = 1.0,
           workers: int = 8,
           progress: Callable[[int], Any] | None = None) -> VerifyReport:
    """Check every blob the manifests reference (or a random `sample` fraction of them).

    One manifest's entries at a time, not kept (a version-3 manifest's segments are read and
    let go): memory grows with the distinct chunks checked (a set of their places) and the
    distinct index segments (the blobs each names), not with the number and size of the
    checkpoints. A blob is read again only by a later checkpoint that uses a part of it not
    yet checked; a blob found bad is not read again, and every checkpoint and key using it is
    named. An index segment a checkpoint shares with an earlier one of the pass (the same
    digest: the same entries) is not read again: its chunks were checked with that one's,
    and this checkpoint joins the users of any bad blob it names. A state tree found whole
    and good (its blob and every page) is not read again either. An index blob (a segment,
    its parts, a tree or a page) found missing or damaged is one problem, as a data blob
    is, listing every checkpoint that names it; it is not read again, not even ahead."""
    if not 0 < sample <= 1:
        raise ValueError("sample must be in (0, 1]")
    t0 = time.perf_counter()
    report = VerifyReport([m.name for m in manifests])
    chosen: set[str] | None = None
    if sample < 1:
        blobs = sorted(chunk_blobs(manifests))
        chosen = set(random.sample(blobs, max(1, round(len(blobs) * sample))) if blobs else ())
    checked: set[tuple[str, int, int]] = set()  # (blob, offset, size) of good chunks
    bad: _BadBlobs = {}
    seen = _Seen()
    with cf.ThreadPoolExecutor(workers) as pool:
        # the next checkpoint's segments that this one and earlier ones do not name, and
        # that were not found bad, are read while this one is checked
        for m in with_next_read_ahead(manifests, lambda: seen.segments.keys() | bad.keys()):
            uses, segments = _unchecked_uses(store, m, report, chosen, checked, bad, seen)
            futures = {pool.submit(_check_blob, store, algorithm.digest, b, u): b
                       for b, u in uses.items()}
            for fut in cf.as_completed(futures):
                blob = futures[fut]
                read, verdict, detail = fut.result()
                report.blobs_checked += 1
                if progress is not None:
                    progress(1)
                report.bytes_checked += read  # bytes actually read
                if verdict == "ok":
                    checked.update((blob, c.offset, c.size) for _n, _t, c in uses[blob])
                else:
                    bad[blob] = (verdict, detail, {n for n, _t, _c in uses[blob]},
                                 {t.key for _n, t, _c in uses[blob]})
            seen.segments.update(segments)  # (their chunks' verdicts are all known now)
    report.problems.extend(BlobProblem(blob, verdict, detail, tuple(sorted(names)),
                                       tuple(sorted(keys)))
                           for blob, (verdict, detail, names, keys) in bad.items())
    report.problems.sort(key=lambda p: p.blob)
    report.seconds = time.perf_counter() - t0
    return report


def chunk_blobs(manifests: list[Manifest]) -> set[str]:
    """Every blob a chunk of the manifests lies in, read from chunk tables (no entries):
    each distinct index segment once, the next manifest's while one is taken in (a segment
    is named by its content: one read already names no blob the set lacks). A segment that
    is missing or damaged names none (verify reports it); the others still count."""
    blobs: set[str] = set()
    read: set[str] = set()
    for m in with_next_read_ahead(manifests, lambda: read):
        refs = {r.digest for r in m.segment_refs()}
        try:
            for table in m.chunk_tables(read):
                blobs.update(table.blobs)
        except FormatError:  # rare: then each segment alone, the bad one left out
            for digest in refs - read:
                try:
                    for table in m.chunk_tables(read | (refs - {digest})):
                        blobs.update(table.blobs)
                except FormatError:
                    continue
        read.update(refs)
    return blobs


def _unchecked_uses(store: Store, m: Manifest, report: VerifyReport, chosen: set[str] | None,
                    checked: set[tuple[str, int, int]],
                    bad: _BadBlobs, seen: _Seen
                    ) -> tuple[dict[str, list[tuple[str, TensorEntry, ChunkRef]]],
                               dict[str, frozenset[str]]]:
    """The chunks of `m` still to check, by blob: those in `chosen` blobs (None: all), not
    already found good, and not in a blob already found bad (whose users `m` joins); and the
    index segments read ({digest: the blobs its chunks lie in}). Segments `seen` are not
    read: `m` joins the users of the bad blobs they name."""
    uses: dict[str, list[tuple[str, TensorEntry, ChunkRef]]] = defaultdict(list)
    segments: dict[str, frozenset[str]] = {}
    for digest, entries in _readable_segments(store, m, report, seen, bad):
        blobs: set[str] = set()
        for t in entries:
            for c in t.chunks:
                blobs.add(c.blob)
                if chosen is not None and c.blob not in chosen:
                    continue
                known_bad = bad.get(c.blob)
                if known_bad is not None:
                    known_bad[2].add(m.name)
                    known_bad[3].add(t.key)
                elif (c.blob, c.offset, c.size) not in checked:
                    uses[c.blob].append((m.name, t, c))
        if digest is not None:
            segments[digest] = frozenset(blobs)
    for ref in m.segment_refs():
        for blob in seen.segments.get(ref.digest, ()):
            if blob in bad:  # (its keys: the same entries named them before)
                bad[blob][2].add(m.name)
    return uses, segments


@dataclass
class _Seen:
    """What a verify run found whole and good, by digest (the same digest: the same
    content): index segments (-> the blobs their chunks lie in) and state trees (their blob
    and every page)."""

    segments: dict[str, frozenset[str]] = field(default_factory=dict)
    trees: set[str] = field(default_factory=set)


def _readable_segments(store: Store, m: Manifest, report: VerifyReport, seen: _Seen,
                       bad: _BadBlobs
                       ) -> Iterator[tuple[str | None, Sequence[TensorEntry]]]:
    """The tensor entries of `m` as (index segment digest, its entries), a segment at a time
    (not kept); (None, all of them) for a manifest without segments read from a store. A
    version-3 manifest's index blobs (its tree, its pages, its segments and their parts) are
    read and checked whole, but for those `seen` (not read; a tree found whole and good is
    added to it); one that is missing or damaged goes into `bad` as a data blob does (one
    problem, every checkpoint that names it), and a segment's tensors' chunks then cannot be
    checked."""
    entries = m.tensors
    if not isinstance(entries, SegmentedEntries):
        yield None, entries
        return
    tree_ref = m.tree_ref()
    if tree_ref.digest not in seen.trees:
        tree = _index_blob(store, m, report, bad, tree_ref, lambda: m.tree, "(state tree)")
        whole = tree is not None
        if tree is not None:
            for page, read in page_loads(tree):
                whole &= _index_blob(store, m, report, bad, page, read,
                                     "(state tree page)") is not None
        if whole:
            seen.trees.add(tree_ref.digest)
    for ref in entries.refs:  # found bad earlier in the run: `m` joins its users, unread
        _joined_bad(bad, ref.digest, m.name, "(index segment)")
    for s, read in entries.read_segments(seen.segments.keys() | bad.keys()):
        got = _index_blob(store, m, report, bad, entries.refs[s], read, "(index segment)")
        if got is None:
            continue
        shared = segment_parts(got)  # a parted segment: each part checked as a blob too
        if shared is not None:
            loads = shared.loads()
            run_concurrently([read for part, read in loads if part.digest not in bad],
                             PART_READ_THREADS)
            found = [_index_blob(store, m, report, bad, part, read, "(index segment part)")
                     for part, read in loads]  # every part, each problem reported
            if any(rows is None for rows in found):
                continue
        yield entries.refs[s].digest, got


def _index_blob(store: Store, m: Manifest, report: VerifyReport,
                bad: _BadBlobs, ref: IndexBlob,
                read: Callable[[], T], label: str) -> T | None:
    """`read()` (which reads and checks one index blob of `m`), or None with the problem in
    `bad`. A blob already found bad in this run is not checked again: `m` joins its users."""
    if _joined_bad(bad, ref.digest, m.name, label):
        return None
    report.blobs_checked += 1
    try:
        got = read()
    except FormatError as exc:
        kind = "corrupt" if store.exists(blob_key(ref.digest)) else "missing"
        bad[ref.digest] = (kind, str(exc), {m.name}, {label})
        return None
    report.bytes_checked += ref.size
    return got


def _joined_bad(bad: _BadBlobs, blob: str, name: str, label: str) -> bool:
    """Whether `blob` was found bad earlier in the run; if so checkpoint `name` (using it as
    `label`) joins its users."""
    known = bad.get(blob)
    if known is None:
        return False
    known[2].add(name)
    known[3].add(label)
    return True


@dataclass
class GcReport:
    dry_run: bool
    referenced_blobs: int = 0
    deleted_blobs: int = 0
    freed_bytes: int = 0
    kept_young_blobs: int = 0  # unreferenced but younger than `min_age_seconds`
    deleted_temp_files: int = 0
    seconds: float = 0.0
    deleted: list[str] = field(default_factory=list)
    min_age_seconds: float = 0.0  # the age a blob needed: max(grace period, MIN_BLOB_AGE)
    removed_stale_leases: int = 0  # lease objects of dead or silent processes


def gc(store: Store, referenced: Callable[[], set[str]], grace_seconds: float = 3600.0,
       dry_run: bool = False, now: float | None = None) -> GcReport:
    """Delete blobs of `store` that `referenced()` (every blob any manifest references; it
    raises, and nothing is deleted, if a manifest cannot be read) does not name and that are
    older than max(`grace_seconds`, MIN_BLOB_AGE) (see the module docstring). `now` is the
    store's current time (default: read from the store). The caller holds a gc lease."""
    if grace_seconds < 0:
        raise ValueError("grace period must be >= 0")
    t0 = time.perf_counter()
    if now is None:
        now = leases.store_clock(store)
    report = GcReport(dry_run=dry_run, min_age_seconds=max(grace_seconds, MIN_BLOB_AGE))
    refs = referenced()
    listed = list(store.list(BLOB_PREFIX))
    cutoff = now - report.min_age_seconds
    candidates = []
    for info in listed:
        name = blob_of_key(info.key)
        if name is None:
            continue  # not ours: leave it alone
        if name in refs:
            continue
        if info.mtime > cutoff:
            report.kept_young_blobs += 1
            continue
        candidates.append((name, info))
    refs |= referenced()  # second look: checkpoints committed while we listed
    report.referenced_blobs = len(refs)
    doomed = [(name, info) for name, info in candidates if name not in refs]
    if not dry_run:  # many per request (or side by side) where the store has round trips
        store.delete_many(info.key for _name, info in doomed)
    for name, info in doomed:
        report.deleted_blobs += 1
        report.freed_bytes += info.size
        report.deleted.append(name)
    temp_files = getattr(store, "temp_files", None)
    temp_cutoff = min(cutoff, now - TEMP_MIN_AGE)
    if temp_files is not None:
        for info in list(temp_files()):
            if info.mtime <= temp_cutoff:
                if not dry_run:
                    store.delete_temp(info.key)  # type: ignore[attr-defined]
                report.deleted_temp_files += 1
                report.freed_bytes += info.size
    if not dry_run:
        store.sync()
        report.removed_stale_leases = leases.remove_stale(store)
    report.seconds = time.perf_counter() - t0
    return report
