"""Writing a save: chunk and pack jobs -> (stage) -> hash -> (compress) -> write, then commit.

The plan (which chunks, who writes which) comes from pipeline/planning.py. Jobs (one per row
block, one per pack of small arrays) run on a bounded thread pool; each job takes its bytes
straight from the caller's arrays when they are contiguous, so a synchronous save copies
nothing. Extra memory (copies of non-contiguous blocks, compressed output, pack buffers) is
bounded by a ByteBudget. xxhash, numcodecs and file/socket I/O release the GIL.

Commit order (docs/format.md): every blob is written, then `store.sync()` makes them durable,
then the manifest is created create-only. Any failure before the commit leaves no checkpoint;
the blobs already written are unreferenced and later reclaimed by gc.

The jobs and the commit share the writer's claim set, stats and memory budget: they stay in
one module.
"""

from __future__ import annotations

import bisect
import concurrent.futures as cf
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import Any

import numpy as np

from ..concurrency import BOOST_THREADS, Turns, completed
from ..errors import (
    CheckpointExistsError,
    CkptStoreError,
    FormatError,
    ObjectExistsError,
    ObjectNotFoundError,
    UnsupportedTypeError,
)
from ..format.codecs import Codec
from ..format.leaf import ArrayLeaf
from ..format.manifest import (
    MAX_MANIFEST_BYTES,
    ChunkRef,
    Manifest,
    StorageRef,
    TensorEntry,
    expected_chunk_count,
)
from ..format.segments import ChunkColumns, version_for
from ..layout import blob_key
from ..stores.base import Store
from .budget import ByteBudget
from .device import (
    CopyEvent,
    Device,
    DeviceBlock,
    block_of,
    copy_to_host,
    devices_of,
    marks_for,
    on_device,
    settle,
    wait_all,
    wait_copy,
)
from .options import METADATA_THREADS, SaveOptions
from .overlap import Overlap, Remapped, StagingPool, Tracking, host_pool
from .planning import LeafPlan, TensorSpec, pack_groups, plan_leaves
from .planning import rows_per_chunk as rows_per_chunk  # re-exported: older imports

MiB = 1 << 20
#: An overlapped save of device tensors runs a thread per slot its budget allows (each waits
#: for its copy's event, which costs no CPU), up to this many: copies then run ahead of
#: writes by `max_host_bytes`, not by MAX_OVERLAP_THREADS blocks
MAX_DEVICE_THREADS = 1024
#: A save copies the small arrays it would reuse from a pack into its own new pack when they
#: are less than this fraction of that pack's bytes (see CheckpointWriter._mostly_dead).
RECLAIM_LIVE_FRACTION = 0.5


class KnownChunks:
    """Chunks the store is known to hold, by (raw digest, codec): from parent manifests and from
    this process's earlier saves. Lets an incremental save skip unchanged chunks without a
    request per chunk. A raw chunk may be referenced wherever it lives (whole blob or a range
    of a pack); a compressed one only with the same codec settings."""

    def __init__(self) -> None:
        self._refs: dict[tuple[str, str | None], ChunkRef] = {}
        #: chunks of parent segments read as columns: codec -> {raw digest: n}, chunk n
        #: counting over `_parts` in order (`_starts`: each part's first n); a ChunkRef is
        #: built (and kept in `_refs`) when one is found
        self._columns: dict[str | None, dict[str, int]] = {}
        self._parts: list[ChunkColumns] = []
        self._starts: list[int] = []
        self._lock = threading.Lock()
        #: index blobs (segments, trees of version-3 manifests) the store holds: a commit
        #: reuses them
        self.index_blobs: set[str] = set()

    @staticmethod
    def _codec_key(codec: Codec | None) -> str | None:
        return None if codec is None else f"{codec.id}:{codec.level}"

    @classmethod
    def _key(cls, raw_digest: str, codec: Codec | None) -> tuple[str, str | None]:
        return (raw_digest, cls._codec_key(codec))

    def add_manifest(self, manifest: Manifest) -> None:
        """Every chunk of `manifest`. A version-3 manifest read from a store gives its
        segments as chunk columns (`segments.chunk_columns`): no entries are built."""
        with self._lock:
            self.index_blobs.update(r.digest for r in manifest.index_blobs())
        columns = getattr(manifest.tensors, "chunk_columns", None)
        parts = [manifest.tensors] if columns is None else columns()
        for part in parts:
            if not isinstance(part, ChunkColumns):
                for t in part:
                    for c in t.chunks:
                        self.add(c, t.codec)
                continue
            with self._lock:
                base = self._starts[-1] + len(self._parts[-1].digests) if self._parts else 0
                for codec, found in part.by_codec(base).items():
                    self._columns.setdefault(self._codec_key(codec), {}).update(found)
                self._parts.append(part)
                self._starts.append(base)

    def add(self, ref: ChunkRef, codec: Codec | None) -> None:
        with self._lock:
            self._refs.setdefault(self._key(ref.digest, codec), ref)

    def add_many(self, refs: Iterable[ChunkRef]) -> None:
        """`add` for uncompressed chunks, under one lock."""
        with self._lock:
            for ref in refs:
                self._refs.setdefault((ref.digest, None), ref)

    def find(self, raw_digest: str, nbytes: int, codec: Codec | None) -> ChunkRef | None:
        return self.find_raw([(raw_digest, nbytes)], codec)[0]

    def find_raw(self, chunks: Sequence[tuple[str, int]], codec: Codec | None = None
                 ) -> list[ChunkRef | None]:
        """`find` for many (raw digest, nbytes) of one codec, under one lock: the pack jobs
        of a save run in many threads, and a lock taken per small array by each of them
        made them wait on each other (and on the GIL's hand-offs) for most of the save."""
        ck = self._codec_key(codec)
        out: list[ChunkRef | None] = []
        with self._lock:
            columns = self._columns.get(ck, {})
            for raw_digest, nbytes in chunks:
                ref = self._refs.get((raw_digest, ck))
                if ref is None:
                    n = columns.get(raw_digest)
                    if n is not None:
                        p = bisect.bisect_right(self._starts, n) - 1
                        ref = self._refs[(raw_digest, ck)] = self._parts[p].ref(
                            n - self._starts[p])
                out.append(ref if ref is not None and ref.nbytes == nbytes else None)
        return out

    def __len__(self) -> int:
        """Distinct (raw digest, codec) known."""
        with self._lock:
            return len(set(self._refs) | {(d, k) for k, found in self._columns.items()
                                          for d in found})


class _Stats:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seconds: dict[str, float] = defaultdict(float)
        self.written = 0
        self.reused = 0
        self.chunks_written = 0
        self.chunks_reused = 0

    @contextmanager
    def timed(self, stage: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(stage, time.perf_counter() - t0)

    def add(self, stage: str, seconds: float) -> None:
        with self.lock:
            self.seconds[stage] += seconds

    def count_many(self, reused: int, chunks_reused: int) -> None:
        """Account for `chunks_reused` chunks of `reused` bytes in all."""
        with self.lock:
            self.reused += reused
            self.chunks_reused += chunks_reused

    def count(self, written: int = 0, reused: int = 0) -> None:
        with self.lock:
            self.written += written
            self.reused += reused
            self.chunks_written += 1 if written or not reused else 0
            self.chunks_reused += 1 if reused else 0


def storage_refs(leaves: list[ArrayLeaf]) -> list[StorageRef | None]:
    """StorageRef for every torch leaf whose storage is shared with another leaf, else None.
    Storages are numbered in the order of their first leaf, never by address: the same state
    gets the same numbers in every process (the ranks of a collective save build entries
    apart, and an unchanged index segment stays the same blob)."""
    groups: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i, leaf in enumerate(leaves):
        if leaf.storage_identity is not None:
            groups[leaf.storage_identity].append(i)
    refs: list[StorageRef | None] = [None] * len(leaves)
    tied = [(ident, members) for ident, members in groups.items() if len(members) > 1]
    for sid, (ident, members) in enumerate(tied):  # dicts keep first-insertion order
        for i in members:
            leaf = leaves[i]
            refs[i] = StorageRef(sid, ident[1], leaf.storage_offset, leaf.storage_stride)
    return refs


def _flat_bytes(block: np.ndarray) -> memoryview:
    """Flat byte view of a C-contiguous array."""
    return block.reshape(-1).view(np.uint8).data if block.size else memoryview(b"")


def background_turns(options: SaveOptions) -> Turns | None:
    """The Turns of a save beside training (how many of its threads work at once), or None
    for a save the caller waits for."""
    if not options.background:
        return None
    return Turns(options.background_workers, options.background_io)


class CheckpointWriter:
    """Writes the blobs of one checkpoint and commits its manifest. One instance per save.
    `turns` (default: `background_turns(options)`) is shared with whoever may lend the save
    a core while waiting for it (SaveHandle.wait, a guarded step)."""

    def __init__(self, store: Store, options: SaveOptions, known: KnownChunks, *,
                 turns: Turns | None = None, overlap: Overlap | None = None,
                 not_before: float = 0.0,
                 before_commit: Callable[[Manifest, set[str]], None] | None = None,
                 confirm_reused: Callable[[set[str]], None] | None = None) -> None:
        self.store = store
        self.options = options
        self.known = known
        self.stats = _Stats()
        self.budget = ByteBudget(options.max_inflight_bytes)
        self._claimed: set[str] = set()  # blobs written (or being written) by this save
        self._pack_sizes: dict[str, int] = {}  # stored size of packs this save reuses from
        self.committed: bytes | None = None  # the manifest bytes, once committed
        self._claim_lock = threading.Lock()
        #: Commit order: the manifest's `created` is at least this (the newest checkpoint's
        #: `created` plus a millisecond), so a save commits after every checkpoint it saw,
        #: whatever this host's clock says.
        self.not_before = not_before
        #: Called after the blobs are durable and before the manifest is created, with the
        #: manifest and the blobs it references that this writer did not write (reused from
        #: earlier checkpoints); raising stops the commit.
        self.before_commit = before_commit
        #: Checks that blobs of earlier checkpoints a save reuses still exist (a gc may have
        #: run since the save's lease began); raises ReusedBlobsMissingError if not. A rank of
        #: a collective save calls it on its own chunks before it reports them.
        self.confirm_reused = confirm_reused
        #: Overlapped staging (pipeline/overlap.py): leaves are the caller's live arrays;
        #: every block is copied into a budgeted slot, checked, then hashed and written.
        self.overlap = overlap
        #: A save beside training: how many of the pool's threads work at once
        self.turns = turns if turns is not None else background_turns(options)
        #: device saves not overlapped: per device, the mark the copies wait for (write_blobs)
        self._marks: dict[str, CopyEvent] = {}

    def _turn(self, copy: bool = False) -> AbstractContextManager[None]:
        """A turn to work (concurrency.Turns) in a save beside training; else no wait."""
        if self.turns is None:
            return nullcontext()
        return self.turns.copy() if copy else self.turns.write()

    # ---------------------------------------------------------------- one blob
    def _put_blob(self, blob: str, data: memoryview | bytes | bytearray) -> bool:
        """Write a blob unless this save already did; True if written here."""
        with self._claim_lock:
            if blob in self._claimed:
                return False
            self._claimed.add(blob)
        sink = self.overlap.sink if self.overlap is not None else None
        with self.turns.io() if self.turns is not None else nullcontext(), \
                self.stats.timed("write"):
            (self.store if sink is None else sink).put(blob_key(blob), data)
        return True

    def _chunk_job(self, leaf: ArrayLeaf, start: int, stop: int, index: int,
                   overlap: Tracking | None) -> ChunkRef:
        block = leaf.array[start:stop] if leaf.array.ndim else leaf.array
        if on_device(block):
            return self._device_chunk_job(leaf, block_of(block), index, overlap)
        if overlap is None:
            need_copy = not block.flags.c_contiguous
            with self.budget.hold(block.nbytes if need_copy else 0), self._turn():
                if need_copy:
                    with self.stats.timed("stage"):
                        block = np.ascontiguousarray(block)
                return self._chunk_of(leaf, block, hold_compressed=True)
        # overlapped staging: one hold covers the slot and the compressed output
        codec = self.options.compression
        slot_hold = max(block.nbytes, overlap.pool.slot_bytes)
        extra = block.nbytes // 2 if codec is not None else 0
        with self.budget.hold(slot_hold + extra), overlap.pool.buffer(block.nbytes) as slot:
            with self._turn(copy=True), self.stats.timed("stage"):
                overlap.check(index)
                dst = np.ndarray(block.shape, block.dtype.newbyteorder("="), slot, 0)
                np.copyto(dst, block)
                overlap.check(index)
            overlap.copied(index)
            with self._turn():
                return self._chunk_of(leaf, dst, hold_compressed=False)

    # ---------------------------------------------------------------- device blocks
    def _host_pool(self) -> StagingPool:
        """Page-locked slots for the device blocks of a save that is not overlapped."""
        return host_pool(self.store, min(self.options.chunk_bytes,
                                         self.options.max_inflight_bytes))

    def _mark(self, device: Device, overlap: Tracking | None) -> CopyEvent | None:
        """What a copy from `device` waits for: the work issued before the save (its mark)."""
        found = overlap.mark(device.name) if overlap is not None else None
        return found if found is not None else self._marks.get(device.name)

    def _to_host(self, leaf: ArrayLeaf, block: DeviceBlock, dst: np.ndarray,
                 overlap: Tracking | None) -> tuple[CopyEvent, str]:
        what = f"{leaf.key}: the copy from {block.device.name} to host memory"
        after = self._mark(block.device, overlap)
        return copy_to_host(block, dst, after, what), what

    def _device_chunk_job(self, leaf: ArrayLeaf, block: DeviceBlock, index: int,
                          overlap: Tracking | None) -> ChunkRef:
        """One block of a device tensor: copied into a page-locked slot after the save's
        mark, hashed and written only once the copy's event completed; the slot goes back to
        the pool once the block is written (pipeline/device.py)."""
        pool = overlap.pool if overlap is not None else self._host_pool()
        nbytes = block.nbytes
        extra = nbytes // 2 if self.options.compression is not None else 0
        with self.budget.hold(max(nbytes, pool.slot_bytes) + extra), \
                pool.buffer(nbytes, (block.device,)) as slot:
            dst = np.ndarray(block.shape, block.dtype, slot, 0)
            # enqueueing a copy takes no turn: it costs microseconds of CPU, and a turn held
            # by a write that waits for the disk must not hold back the copies
            with self.stats.timed("stage"):
                if overlap is not None:
                    overlap.check(index)
                event, what = self._to_host(leaf, block, dst, overlap)
            with self.stats.timed("device"):  # no turn held: other copies are enqueued
                wait_copy(event, what)
            if overlap is not None:
                overlap.check(index)
                overlap.copied(index)
            with self._turn():
                return self._chunk_of(leaf, dst, hold_compressed=False)

    def _device_pack_job(self, members: list[tuple[int, ArrayLeaf]], overlap: Tracking | None
                         ) -> dict[int, ChunkRef]:
        """A pack with members on a device: every member is staged into page-locked slots
        (device members by copies after the save's mark, host members by a copy here), and
        packed once every copy's event completed."""
        pool = overlap.pool if overlap is not None else self._host_pool()
        devices = list(devices_of(leaf.array for _i, leaf in members).values())
        places, used = _place([-(-leaf.nbytes // 64) * 64 for _i, leaf in members],
                              pool.slot_bytes)
        total = sum(leaf.nbytes for _i, leaf in members)
        hold = sum(max(u, pool.slot_bytes) for u in used) + total
        with self.budget.hold(hold), ExitStack() as stack:
            slots = [stack.enter_context(pool.buffer(u, devices)) for u in used]
            staged: list[tuple[int, ArrayLeaf]] = []
            pending: list[tuple[int, CopyEvent, str]] = []
            on_host = not all(on_device(leaf.array) for _i, leaf in members)
            try:  # a copy turn only for host members (device copies are only enqueued)
                with self._turn(copy=True) if on_host else nullcontext(), \
                        self.stats.timed("stage"):
                    for (index, leaf), (k, pos) in zip(members, places):
                        src = leaf.array
                        dst = np.ndarray(src.shape, src.dtype.newbyteorder("="), slots[k], pos)
                        if overlap is not None:
                            overlap.check(index)
                        if on_device(src):
                            pending.append((index, *self._to_host(leaf, block_of(src), dst,
                                                                  overlap)))
                        else:
                            np.copyto(dst, src)
                            if overlap is not None:
                                overlap.check(index)
                                overlap.copied(index)
                        staged.append((index, leaf.with_array(dst)))
            except BaseException:
                settle((event, what) for _i, event, what in pending)
                raise
            with self.stats.timed("device"):
                wait_all((event, what) for _i, event, what in pending)
            if overlap is not None:
                for index, _event, _what in pending:
                    overlap.check(index)
                    overlap.copied(index)
            with self._turn():
                return self._pack_of(staged, hold=False)

    def _chunk_of(self, leaf: ArrayLeaf, block: np.ndarray, hold_compressed: bool) -> ChunkRef:
        """Hash, dedup, (compress and) write one C-contiguous block."""
        codec = self.options.compression
        raw = _flat_bytes(block)
        with self.stats.timed("hash"):
            raw_digest = self.options.hash.digest(raw)
        ref = self.known.find(raw_digest, len(raw), codec)
        if ref is not None:
            self.stats.count(reused=len(raw))
            return ref
        if codec is None:
            ref = ChunkRef(raw_digest, 0, len(raw), len(raw), raw_digest)
            wrote = self._put_blob(raw_digest, raw)
            self.stats.count(written=len(raw) if wrote else 0, reused=0 if wrote else len(raw))
        else:
            # typical compressed size, an estimate (already held by overlapped jobs)
            with self.budget.hold(len(raw) // 2 if hold_compressed else 0):
                with self.stats.timed("compress"):
                    stored = codec.encode(raw, leaf.dtype.itemsize)
                with self.stats.timed("hash"):
                    stored_digest = self.options.hash.digest(stored)
                ref = ChunkRef(stored_digest, 0, len(stored), len(raw), raw_digest)
                wrote = self._put_blob(stored_digest, stored)
                self.stats.count(written=len(stored) if wrote else 0,
                                 reused=0 if wrote else len(raw))
        self.known.add(ref, codec)
        return ref

    def _pack_job(self, members: list[tuple[int, ArrayLeaf]], overlap: Tracking | None
                  ) -> dict[int, ChunkRef]:
        """Pack small arrays into one blob; members already known are referenced, not packed.
        Per member only a digest and a lookup: the stats are summed once per pack."""
        if any(on_device(leaf.array) for _i, leaf in members):
            return self._device_pack_job(members, overlap)
        if overlap is None:
            with self._turn():
                return self._pack_of(members, hold=True)
        # overlapped staging: copy (and check) every member into one slot first
        sizes = [-(-leaf.nbytes // 64) * 64 for _i, leaf in members]
        total = sum(leaf.nbytes for _i, leaf in members)
        slot_hold = max(sum(sizes), overlap.pool.slot_bytes)
        with self.budget.hold(slot_hold + total), overlap.pool.buffer(sum(sizes)) as slot:
            staged = []
            pos = 0
            with self._turn(copy=True), self.stats.timed("stage"):
                for (index, leaf), size in zip(members, sizes):
                    src = leaf.array
                    overlap.check(index)
                    dst = np.ndarray(src.shape, src.dtype.newbyteorder("="), slot, pos)
                    np.copyto(dst, src)
                    overlap.check(index)
                    overlap.copied(index)
                    staged.append((index, leaf.with_array(dst)))
                    pos += size
            with self._turn():
                return self._pack_of(staged, hold=False)

    def _mostly_dead(self, blob: str, live: int) -> bool:
        """Whether this save should copy its `live` bytes out of pack `blob` rather than
        reference them: when they are under RECLAIM_LIVE_FRACTION of the pack, the rest of it
        is kept only by older checkpoints, and once retention deletes those, gc can reclaim
        the pack only if no new checkpoint points into it. The copy is bounded by the small
        arrays of one pack group. A whole-blob chunk is never a pack. One stat per pack."""
        with self._claim_lock:
            size = self._pack_sizes.get(blob)
        if size is None:
            try:
                size = self.store.stat(blob_key(blob)).size
            except ObjectNotFoundError:
                size = 0  # gone (gc'd since the parent was read): write the members again
            with self._claim_lock:
                self._pack_sizes[blob] = size
        return size == 0 or live < size * RECLAIM_LIVE_FRACTION

    def _pack_of(self, members: list[tuple[int, ArrayLeaf]], hold: bool
                 ) -> dict[int, ChunkRef]:
        refs: dict[int, ChunkRef] = {}
        todo: list[tuple[int, memoryview, str]] = []
        found: dict[str, list[tuple[int, memoryview, str, ChunkRef]]] = defaultdict(list)
        reused = 0
        t0 = time.perf_counter()
        digest = self.options.hash.digest
        raws = [_flat_bytes(np.ascontiguousarray(leaf.array)) for _index, leaf in members]
        digests = [digest(raw) for raw in raws]
        known = self.known.find_raw([(d, len(raw)) for d, raw in zip(digests, raws)])
        for (index, _leaf), raw, d, ref in zip(members, raws, digests, known):
            if ref is not None:
                found[ref.blob].append((index, raw, d, ref))
            else:
                todo.append((index, raw, d))
        for blob, hits in found.items():
            if self._mostly_dead(blob, sum(ref.size for *_x, ref in hits)):
                todo.extend((index, raw, d) for index, raw, d, _ref in hits)  # bounded copy
                continue
            for index, raw, _d, ref in hits:
                refs[index] = ref
                reused += len(raw)
        self.stats.add("lookup", time.perf_counter() - t0)
        self.stats.count_many(reused=reused, chunks_reused=len(members) - len(todo))
        if not todo:
            return refs
        total = sum(len(raw) for _i, raw, _d in todo)
        with self.budget.hold(total if hold else 0):
            pack = bytearray(total)
            offsets = []
            pos = 0
            with self.stats.timed("stage"):
                for _index, raw, _d in todo:
                    pack[pos : pos + len(raw)] = raw
                    offsets.append(pos)
                    pos += len(raw)
            with self.stats.timed("hash"):
                pack_digest = self.options.hash.digest(pack)
            wrote = self._put_blob(pack_digest, pack)
            self.stats.count(written=total if wrote else 0, reused=0 if wrote else total)
        new_refs = [(index, ChunkRef(pack_digest, off, len(raw), len(raw), d))
                    for (index, raw, d), off in zip(todo, offsets)]
        refs.update(new_refs)
        self.known.add_many(ref for _index, ref in new_refs)
        return refs

    # ---------------------------------------------------------------- blobs of many leaves
    def write_blobs(self, leaves: list[ArrayLeaf], plans: list[LeafPlan],
                    leaf_of: Sequence[int] | None = None) -> dict[tuple[int, int], ChunkRef]:
        """Write the chunks `plans` assign to this process, in parallel. Returns
        {(leaf index, global chunk index): ChunkRef}. Blobs are not yet durable: call
        `store.sync()` before committing a manifest that references them. `leaf_of[i]`: the
        index in the save's state of `leaves[i]` (a collective save hands the writer one part
        per chunk it owns): what an overlapped save tracks."""
        opts = self.options
        refs: dict[tuple[int, int], ChunkRef] = {}
        packed = [i for i, p in enumerate(plans) if p.packed and p.writes_any]
        overlap: Tracking | None = self.overlap
        if overlap is not None and leaf_of is not None:
            overlap = Remapped(overlap, leaf_of)
        if overlap is None:  # device copies read the values of now (the caller's thread)
            self._marks = marks_for(leaf.array for leaf in leaves)
        threads = opts.threads()
        if overlap is not None and any(on_device(leaf.array) for leaf in leaves):
            slots = opts.max_inflight_bytes // max(1, overlap.pool.slot_bytes)
            threads = max(threads, min(MAX_DEVICE_THREADS, slots + opts.background_workers
                                       + opts.background_io + BOOST_THREADS))
        with cf.ThreadPoolExecutor(threads, thread_name_prefix="ckpt-save") as pool:
            futures: dict[cf.Future[Any], tuple[int, int]] = {}
            blocks = [(i, c, start, stop) for i, (leaf, plan) in enumerate(zip(leaves, plans))
                      if not plan.packed for c, start, stop in plan.local_chunks(leaf)]
            groups = list(pack_groups(packed, leaves, opts.chunk_bytes))
            if overlap is not None:  # blocks to copy per leaf, known before any job runs
                counts: dict[int, int] = defaultdict(int)
                for i in [b[0] for b in blocks] + [i for group in groups for i in group]:
                    counts[i] += 1
                overlap.expect(counts)
            for i, c, start, stop in blocks:
                futures[pool.submit(self._chunk_job, leaves[i], start, stop, i,
                                    overlap)] = (i, c)
            for group in groups:
                futures[pool.submit(self._pack_job, [(i, leaves[i]) for i in group],
                                    overlap)] = (-1, -1)
            for done in completed(futures):
                i, c = futures[done]
                if i >= 0:
                    refs[(i, c)] = done.result()
                else:
                    refs.update(((j, 0), ref) for j, ref in done.result().items())
        if self.overlap is not None:
            self.overlap.confirm()
            if self.overlap.sink is not None:
                self.overlap.sink.sync()  # what the writer process wrote: durable now too
        return refs

    def confirm_sources(self) -> None:
        """Overlapped staging: raise SourceChangedError if a source no guard covers changed
        in place since the call (Overlap.confirm); else nothing."""
        if self.overlap is not None:
            self.overlap.confirm()

    def creation_time(self) -> float:
        """The `created` time of the manifest committed now (see `not_before`)."""
        return max(time.time(), self.not_before)

    def reused_blobs(self, blobs: Iterable[str]) -> set[str]:
        """The blobs among `blobs` this writer did not write (reused from earlier
        checkpoints, or written by other processes of a collective save)."""
        wanted = set(blobs)
        with self._claim_lock:
            return wanted - self._claimed

    def put_index_blobs(self, blobs: Sequence[tuple[str, bytes]],
                        always: Collection[str] = ()) -> None:
        """Put the index blobs (digest, bytes) this save built that the store is not known to
        hold (`always`: these even then; like data, an index blob the store holds is
        reused), side by side through one deferred batch: a save of many small tensors has
        hundreds of segments and tree pages, and a durable put (an fsync, or a round trip)
        after another cost it more than its data. A save beside training puts them within
        its turns, as its data. Every one is durable when this returns; on an error none
        that was not yet is made visible."""
        new = list({digest: data for digest, data in blobs  # (a digest once)
                    if digest not in self.known.index_blobs or digest in always}.items())
        if not new:
            return
        with self._claim_lock:
            self._claimed.update(digest for digest, _data in new)
        batch = self.store.deferred()

        def put(digest: str, data: bytes) -> None:  # a save beside training: in its turns
            with self._turn(), self.turns.io() if self.turns is not None else nullcontext():
                batch.put(blob_key(digest), data)

        try:
            workers = min(METADATA_THREADS, self.options.threads(), len(new))
            if workers <= 1:
                for digest, data in new:
                    put(digest, data)
            else:
                with cf.ThreadPoolExecutor(workers,
                                           thread_name_prefix="ckpt-index") as pool:
                    for done in [pool.submit(put, digest, data) for digest, data in new]:
                        done.result()
        except BaseException:
            batch.abandon()
            raise
        batch.commit()

    def commit(self, manifest: Manifest, manifest_key: str,
               reused: set[str] | None = None) -> bytes:
        """Write a version-3 manifest's new index blobs (segments, tree), make the blobs
        durable, then create the manifest (its root) create-only. Returns the bytes
        committed. A manifest over MAX_MANIFEST_BYTES, an index blob over its cap, or an entry
        that breaks `entry_problem` is refused before anything of it is written (a reader
        would refuse it: it must never be created). `reused`: the blobs of earlier
        checkpoints the manifest references, where the caller knows them (a collective save
        whose ranks each confirmed their own; None: every blob the manifest names, less
        those this writer wrote)."""
        if type(manifest.tensors) is tuple:  # a writer's own entries: checked before, not after
            bad = [t.key for t, ok in zip(manifest.tensors, manifest.entries_ok()) if not ok]
            if bad:  # e.g. a parent's damaged chunk reference reused (read as chunk columns)
                raise FormatError(f"checkpoint {manifest.name!r}: the entries of {bad[:5]} "
                                  "break the manifest rules; nothing was committed")
        index = manifest.index_blob_data()
        body = manifest.to_bytes()
        if len(body) > MAX_MANIFEST_BYTES:
            raise FormatError(f"checkpoint {manifest.name!r}: its manifest would be {len(body)} "
                              f"bytes, more than the {MAX_MANIFEST_BYTES} a reader accepts; "
                              "nothing was committed (save fewer tensors per checkpoint, or a "
                              "larger chunk_bytes)")
        with self.stats.timed("commit"):
            self.put_index_blobs([(ref.digest, data) for ref, data in index])
            self.store.sync()  # every blob durable before the manifest exists
            self.confirm_sources()  # again, later: see Overlap.confirm
            if self.before_commit is not None:
                if reused is None:
                    with self._claim_lock:
                        reused = manifest.blob_digests() - self._claimed
                self.before_commit(manifest, reused)
            try:
                self.store.create(manifest_key, body)
            except ObjectExistsError:
                raise CheckpointExistsError(
                    f"checkpoint {manifest.name!r} already exists in {self.store.uri}; it was "
                    "not touched") from None
        self.committed = body
        self.known.index_blobs.update(ref.digest for ref, _data in index)
        return body

    def write(self, name: str, tree: Any, leaves: list[ArrayLeaf], metadata: dict[str, Any],
              parent: str | None, manifest_key: str) -> Manifest:
        """Single-process save: write every blob, then commit. Raises CheckpointExistsError if
        the name was taken meanwhile; any other failure propagates and nothing is committed."""
        partial = [leaf.key for leaf in leaves if leaf.is_partial]
        if partial:
            raise UnsupportedTypeError(
                f"{partial[0]}: this process holds only some rows of the tensor (a Shard or "
                "sharded DTensor); save it from every rank with CheckpointManager")
        plans = plan_leaves(leaves, self.options)
        refs = self.write_blobs(leaves, plans)
        specs = [TensorSpec.of(leaf) for leaf in leaves]
        entries = build_entries(specs, plans, refs, self.options.compression,
                                storage_refs(leaves))
        manifest = Manifest(name=name, created=self.creation_time(), metadata=metadata,
                            tree=tree, tensors=entries, parent=parent,
                            hash=self.options.hash.name,
                            version=version_for(entries))
        self.commit(manifest, manifest_key)
        return manifest


def _place(sizes: list[int], slot_bytes: int) -> tuple[list[tuple[int, int]], list[int]]:
    """Members of `sizes` bytes in slots of `slot_bytes`, in order: (slot, offset) of each,
    and the bytes used in each slot (a member larger than a slot has one of its own)."""
    places: list[tuple[int, int]] = []
    used: list[int] = []
    for n in sizes:
        if not used or (used[-1] and used[-1] + n > slot_bytes):
            used.append(0)
        places.append((len(used) - 1, used[-1]))
        used[-1] += n
    return places, used


def build_entries(specs: list[TensorSpec], plans: list[LeafPlan],
                  refs: dict[tuple[int, int], ChunkRef], compression: Codec | None,
                  storage: list[StorageRef | None] | None = None) -> tuple[TensorEntry, ...]:
    """Tensor entries from specs and every chunk's ref (all chunks must be present)."""
    entries = []
    for i, (spec, plan) in enumerate(zip(specs, plans)):
        n = expected_chunk_count(spec.shape, plan.chunk_rows, spec.dtype.itemsize)
        try:
            chunks = (refs[(i, 0)],) if n == 1 else tuple(refs[(i, c)] for c in range(n))
        except KeyError as exc:
            raise CkptStoreError(f"{spec.key}: chunk {exc.args[0][1]} was written by no "
                                 "process") from None
        entries.append(TensorEntry(
            key=spec.key, kind=spec.kind, dtype=spec.dtype, shape=spec.shape,
            chunk_rows=plan.chunk_rows, codec=None if plan.packed else compression,
            chunks=chunks, requires_grad=spec.requires_grad, parameter=spec.parameter,
            storage=None if storage is None else storage[i]))
    return tuple(entries)
