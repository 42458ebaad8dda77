"""Turning a manifest back into a state: choose the tensors, allocate (or adopt, for `into=`)
their destinations, read them in parallel, rebuild the tree. Destinations on a device (GPU
`into=` tensors, or new tensors with `device=`) are read through page-locked bounce slots
and copied up by the device seam (DeviceReads).

Why one module: the host and device paths share one plan of targets (which tensors, which
rows, which boxes) and one rebuild of the tree; splitting them would write that plan twice.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..collector import paused_collector
from ..concurrency import completed
from ..errors import FormatError, KeyMismatchError
from ..format import tree as tree_mod
from ..format.manifest import Manifest, TensorEntry
from ..format.regions import Box, Runs, block_runs, boxes, single_offset
from ..format.segments import SegmentedEntries
from ..format.shard import Shard
from .budget import ByteBudget
from .device import (
    CopyEvent,
    Device,
    DeviceBlock,
    Select,
    block_of,
    copy_to_device,
    on_device,
    settle,
    wait_all,
)
from .overlap import StagingPool, host_pool
from .reader import CheckpointReader, ReadTarget
from .regions import RegionReads

Finish = Callable[[], None] | None


def physical_memory() -> int:
    """Bytes of RAM on this machine (the default cap of what one load may allocate)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 40


def check_allocation(manifest: Manifest, fresh: list[int], limit: int | None) -> None:
    """Raise FormatError, before anything is allocated, if the tensors a load must create
    (`fresh`, indexes into manifest.tensors; shared storages counted once) declare more than
    `limit` bytes (default: this machine's RAM): such a manifest is damaged or hostile."""
    limit = physical_memory() if limit is None else limit
    storages: dict[int, int] = {}
    total = 0
    for i in fresh:
        entry = manifest.tensors[i]
        if entry.storage is not None:
            storages[entry.storage.id] = entry.storage.nbytes
        else:
            total += entry.nbytes
    total += sum(storages.values())
    if total > limit:
        raise FormatError(f"checkpoint {manifest.name!r} declares {total} bytes of tensors to "
                          f"allocate, more than the {limit} this load may use (damaged or "
                          "hostile manifest? load parts of it with keys=, or into=)")


def key_filter(keys: Iterable[str] | None) -> tree_mod.KeyFilter | None:
    """The filter keeping a dotted key equal to one of `keys` or below one of them. Each
    call costs the key's depth (set lookups of its prefixes), not the number of keys; walks
    of the tree skip the subtrees it cannot reach."""
    if keys is None:
        return None
    if isinstance(keys, str):
        raise TypeError("keys must be a list of dotted key strings")
    wanted = list(keys)
    if not all(isinstance(k, str) for k in wanted):
        raise TypeError("keys must be a list of dotted key strings")
    return tree_mod.KeyFilter(wanted)


def _numpy_new(entry: TensorEntry) -> tuple[Any, np.ndarray, Finish]:
    arr = np.empty(entry.shape, dtype=entry.dtype.numpy_dtype)
    return arr, arr.reshape(-1).view(np.uint8), None


def _numpy_into(dest: np.ndarray, entry: TensorEntry) -> tuple[Any, np.ndarray, Finish]:
    if dest.flags.c_contiguous and dest.flags.writeable and dest.dtype.isnative:
        return dest, dest.reshape(-1).view(np.uint8), None
    tmp = np.empty(dest.shape, dtype=entry.dtype.numpy_dtype)
    return dest, tmp.reshape(-1).view(np.uint8), lambda: np.copyto(dest, tmp)


@functools.cache
def _torch_interop() -> Any:
    """The torch side, imported on first use (importing it imports torch)."""
    from ..format import torch_types as torch_interop

    return torch_interop


def local_part(dest: Any, key: str) -> tuple[Any, Runs | None, tuple[int, ...]]:
    """(local array, where it lies in the global tensor (format/regions.py) or None when it
    holds the whole tensor, global shape) of an `into=` destination: a Shard (rows of dim
    0), a DTensor (any mesh and Shard/Replicate placements), or a plain tensor/array."""
    if isinstance(dest, Shard):
        ndim = len(dest.global_shape)
        offset = (dest.offset,) + (0,) * (ndim - 1)
        return dest.data, block_runs(offset, tuple(dest.data.shape)), dest.global_shape
    if not isinstance(dest, np.ndarray):
        found: tuple[Any, Runs | None, tuple[int, ...]] | None = (
            _torch_interop().dtensor_local(dest, key))
        if found is not None:
            return found
    return dest, None, tuple(dest.shape)


def _row_range(entry: TensorEntry, local_shape: tuple[int, ...],
               runs: Runs | None) -> tuple[bool, tuple[int, int] | None]:
    """(True, rows or None for all) when the region can be read as rows of row-block chunks
    straight into its buffer; (False, None) when it needs the region path (`RegionReads`)."""
    if entry.is_grid:
        return False, None
    if runs is None:
        return True, None
    offset = single_offset(runs)
    if offset is None or not local_shape or tuple(local_shape[1:]) != tuple(entry.shape[1:]):
        return False, None
    return True, (offset[0], offset[0] + local_shape[0])


def _runs_fit(runs: Runs, local_shape: tuple[int, ...], gshape: tuple[int, ...]) -> bool:
    """The runs lie inside the global shape and exactly cover the local shape."""
    if len(runs) != len(gshape) or len(local_shape) != len(gshape):
        return False
    for dim_runs, n_local, n_global in zip(runs, local_shape, gshape):
        if sum(n for _l, _g, n in dim_runs) != n_local:
            return False
        if any(not (0 <= loc and loc + n <= n_local and 0 <= g and g + n <= n_global)
               for loc, g, n in dim_runs):
            return False
    return True


def _check_numpy_dest(dest: Any, entry: TensorEntry) -> str | None:
    if not isinstance(dest, np.ndarray):
        return f"destination is a {type(dest).__name__}, checkpoint holds a numpy array"
    if not entry.dtype.numpy_native or dest.dtype.name != entry.dtype.name:
        return f"destination dtype {dest.dtype} != stored {entry.dtype.name}"
    if not dest.flags.writeable:
        return "destination array is read-only"
    return None


@dataclass(frozen=True)
class LoadPlan:
    """What a load reads and where it goes, decided (and every check run) before anything
    is allocated or read: the tensors selected (indexes into the manifest), the dotted key
    each is found at, the further keys of tensors referenced from several places that have
    a destination of their own (`also`), and the `into=` destinations by key."""

    manifest: Manifest
    selected: list[int]
    key_of: dict[int, str]
    also: dict[int, list[str]]
    dests: dict[str, Any]
    keep: tree_mod.KeyFilter | None
    #: where new torch tensors are made: a device seam (pipeline/device.py), None for host
    device: Any = None
    #: `local_part` of each destination checked, by key (found once, used again to fill it)
    parts: dict[str, tuple[Any, Runs | None, tuple[int, ...]]] = field(default_factory=dict)


def plan_load(manifest: Manifest, into: Any = None, keys: Iterable[str] | None = None,
              strict: bool = True, max_alloc_bytes: int | None = None,
              device: Any = None, workers: int = 1) -> LoadPlan:
    """Plan a load (LoadPlan): select the tensors (`keys`: those subtrees), match them with
    the `into=` destinations, and check everything that can be checked without reading:
    requested keys exist, destinations fit (KeyMismatchError listing the problems; with
    `strict`, every destination must be in the checkpoint), and the tensors to create declare
    at most `max_alloc_bytes` (FormatError, see check_allocation). `device` ("cuda:0", a
    torch.device, a device seam; None or "cpu": host memory): where new torch tensors are
    made (UnsupportedTypeError if it is not one, or not available). `workers`: how many index
    segments of a version-3 manifest are read at a time."""
    seam = _torch_interop().resolve_device(device) if device is not None else None
    keep = key_filter(keys)
    # per tensor only strings and temporaries: thousands of retained tuples would cost more
    # in the cyclic GC's full collections than building them
    with _segments_read(manifest, keep, workers) as read_for:
        key_of = tree_mod.leaf_keys(manifest.tree, keep)  # tied tensors: by a selected path
        selected = [i for i in range(len(manifest.tensors)) if i in key_of]
        read_for(selected)
    if keep is not None:
        _check_keys_exist(manifest, keys or [], keep)
    dests = tree_mod.flatten_arrays(into) if into is not None else {}
    tied = tree_mod.tied_keys(manifest.tree, keep) if dests else {}
    also = {i: [k for k in extra if k in dests and dests[k] is not dests.get(key_of[i])]
            for i, extra in tied.items() if i in key_of}
    also = {i: ks for i, ks in also.items() if ks}
    parts = _check_into(manifest, selected, key_of, dests, strict, keep,
                        {k for ks in tied.values() for k in ks})
    for i, extra in also.items():  # a tied tensor's other destinations must fit it too
        for k in extra:
            _check_into(manifest, [i], {i: k}, {k: dests[k]}, False, keep)
    check_allocation(manifest, [i for i in selected if key_of.get(i, "") not in dests],
                     max_alloc_bytes)
    return LoadPlan(manifest, selected, key_of, also, dests, keep, seam, parts)


@contextmanager
def _segments_read(manifest: Manifest, keep: tree_mod.KeyFilter | None, workers: int
                   ) -> Iterator[Callable[[list[int]], None]]:
    """Reads the index segments (a version-3 manifest's) of the tensors a load selects,
    `workers` (at least INDEX_READ_THREADS) at a time, as `read_for(selected)`. A whole load
    selects every tensor, so its segments' reads begin before the tree's pages are read and
    overlap them (on a remote store each is a round trip); a partial load learns which it
    needs from the pages."""
    tensors = manifest.tensors
    if not isinstance(tensors, SegmentedEntries):
        yield _nothing_to_read
    elif keep is not None:
        yield functools.partial(_prefetch_selected, tensors, workers)
    else:
        with tensors.prefetching(None, workers) as arrived:
            yield functools.partial(_all_arrived, arrived)


def _nothing_to_read(selected: list[int]) -> None:
    """`_segments_read` of a manifest whose entries are all in memory."""


def _prefetch_selected(tensors: SegmentedEntries, workers: int, selected: list[int]) -> None:
    """`_segments_read` of a partial load: the segments of the tensors its pages selected."""
    tensors.prefetch(selected, workers)


def _all_arrived(arrived: Callable[[], None], selected: list[int]) -> None:
    """`_segments_read` of a whole load: every segment's read began before the walk."""
    arrived()


def execute_load(plan: LoadPlan, reader: CheckpointReader) -> Any:
    """Carry out a LoadPlan: allocate (or adopt) every destination, read every chunk
    (verified) straight into it, fill further destinations of tied tensors, rebuild the
    tree. On an error `into=` tensors may be partly overwritten."""
    manifest, dests = plan.manifest, plan.dests
    with paused_collector():  # allocating thousands of tensors: a CPU-bound step
        torch_mat = None
        values: dict[int, Any] = {}
        targets: list[ReadTarget] = []
        regions = RegionReads(reader)
        device_reads = DeviceReads(reader)
        finishers: list[Callable[[], None]] = []
        for i in plan.selected:
            entry = manifest.tensors[i]
            key = plan.key_of.get(i, "")
            dest: Any = None
            runs: Runs | None = None
            original = dests.get(key)
            if original is not None:
                found = plan.parts.get(key)
                dest, runs, _gshape = found if found is not None else local_part(original, key)
            try:
                if isinstance(dest, np.ndarray):  # (any kind but bytes: _check_into)
                    value, buf, fin = _numpy_into(dest, entry)
                elif entry.kind == "torch" or dest is not None:
                    if torch_mat is None:
                        torch_mat = _torch_interop().TorchMaterializer(plan.device)
                    value, buf, fin = (torch_mat.into(dest, entry) if dest is not None
                                       else torch_mat.new(entry))
                else:
                    value, buf, fin = _numpy_new(entry)
            except (MemoryError, RuntimeError, ValueError, OverflowError) as exc:
                raise FormatError(f"tensor {key!r}: cannot allocate {entry.dtype.name} of shape "
                                  f"{list(entry.shape)}: {type(exc).__name__}: {exc}") from None
            values[i] = original if original is not None else value
            if buf.nbytes:
                local_shape = tuple(dest.shape) if dest is not None else entry.shape
                by_rows, rows = _row_range(entry, local_shape, runs)
                if on_device(buf):
                    device_reads.add(entry, block_of(buf), local_shape, runs)
                elif by_rows:
                    targets.append(ReadTarget(entry, buf, rows))
                else:
                    regions.add(entry, buf, local_shape, runs)
            if fin is not None:
                finishers.append(fin)
    reader.read_tensors(targets)
    regions.run()
    device_reads.run()
    for fin in finishers:
        fin()
    for i, extra in plan.also.items():  # the same tensor at other keys: copied there
        for key in extra:
            _copy_into(dests[key], values[i])
    for i in plan.selected:
        if manifest.tensors[i].kind == "bytes":
            values[i] = values[i].tobytes()
    result = tree_mod.decode(manifest.tree, values.__getitem__, plan.keep)
    return {} if result is tree_mod._DROP else result


def load_state(reader: CheckpointReader, manifest: Manifest, into: Any = None,
               keys: Iterable[str] | None = None, strict: bool = True,
               max_alloc_bytes: int | None = None, device: Any = None) -> Any:
    """Rebuild the saved state: `plan_load`, then `execute_load`. With `into`, tensors found
    in it by dotted key are filled in place and returned as the same objects; with `keys`,
    only those subtrees are loaded; with `device`, new torch tensors are made there."""
    return execute_load(plan_load(manifest, into, keys, strict, max_alloc_bytes, device,
                                  reader.options.workers),
                        reader)


# ------------------------------------------------------------------------------ devices
#: the page-locked slots of device loads, unless the store's pool has larger ones already
LOAD_SLOT_BYTES = 16 << 20


@dataclass
class _Up:
    """One copy to the device: `dst` = the job buffer's bytes at `offset`, seen as an array of
    `shape` and `dtype` (or its part `select`)."""

    dst: Any
    shape: tuple[int, ...]
    dtype: np.dtype
    offset: int
    select: Select | None = None


@dataclass
class _DeviceJob:
    """Read `reads` (entry, offset in the job's buffer, bytes, rows) verified into one host
    buffer of `nbytes`, then copy `ups` to `device`."""

    device: Device
    key: str
    reads: list[tuple[TensorEntry, int, int, tuple[int, int] | None]] = field(
        default_factory=list)
    ups: list[_Up] = field(default_factory=list)
    nbytes: int = 0


class DeviceReads:
    """Reads into destinations on a device (DeviceArray targets: `into=` tensors on a GPU, or
    new tensors made there with `device=`), with no host copy of a whole tensor.

    Each job reads its pieces through the reader (every chunk verified) into a page-locked
    slot of the store's host pool (overlap.host_pool: kept with the store, pinned once), and
    only then issues the copies to the device; the slot goes back to the pool once those
    copies completed. Jobs run on the reader's threads, so while one job's copies run the
    next jobs read: reads overlap copies. A large tensor is read in jobs of whole chunks of
    up to a slot (a chunk larger than a slot gets a buffer of its own, not pinned); tensors
    of one chunk (packed ones, mostly) are read together (one reader call: reads of a pack
    are merged) and copied up one by one; a region of an N-D chunk grid (a
    DTensor's shard) is read chunk by chunk, each chunk copied up whole and its part placed
    on the device."""

    def __init__(self, reader: CheckpointReader) -> None:
        self.reader = reader
        self._jobs: list[_DeviceJob] = []
        self._small: dict[str, _DeviceJob] = {}  # per device: the job small pieces join
        self._devices: dict[str, Device] = {}
        self._pool: StagingPool | None = None

    @property
    def pool(self) -> StagingPool:
        if self._pool is None:
            want = min(LOAD_SLOT_BYTES, max(1, self.reader.options.max_inflight_bytes // 2))
            self._pool = host_pool(self.reader.store, want)
        return self._pool

    def add(self, entry: TensorEntry, target: DeviceBlock, local_shape: tuple[int, ...],
            runs: Runs | None) -> None:
        """Fill `target` (of `local_shape`) with the elements of `entry` that `runs` place
        there (None: the whole tensor)."""
        self._devices.setdefault(target.device.name, target.device)
        by_rows, rows = _row_range(entry, local_shape, runs)
        if not by_rows:
            self._add_region(entry, target, local_shape, runs)
        elif not entry.shape or (len(entry.chunks) == 1 and target.nbytes <= self.pool.slot_bytes):
            self._add_small(entry, target, rows)  # one chunk (a packed one, mostly)
        else:
            self._add_rows(entry, target, rows)

    def _add_small(self, entry: TensorEntry, target: DeviceBlock,
                   rows: tuple[int, int] | None) -> None:
        slot = self.pool.slot_bytes
        job = self._small.get(target.device.name)
        offset = -(-job.nbytes // 64) * 64 if job is not None else 0
        if job is None or offset + target.nbytes > slot:
            job = self._small[target.device.name] = _DeviceJob(target.device, entry.key)
            self._jobs.append(job)
            offset = 0
        job.reads.append((entry, offset, target.nbytes, rows))
        job.ups.append(_Up(target.tensor, target.shape, target.dtype, offset))
        job.nbytes = offset + target.nbytes

    def _add_rows(self, entry: TensorEntry, target: DeviceBlock,
                  rows: tuple[int, int] | None) -> None:
        lo, hi = rows if rows is not None else (0, entry.shape[0])
        row = entry.row_bytes
        slot = self.pool.slot_bytes
        start = lo
        while start < hi:  # jobs of whole chunks, up to a slot (at least one chunk)
            stop = start
            while stop < hi:
                end = min(hi, (stop // entry.chunk_rows + 1) * entry.chunk_rows)
                if stop > start and (end - start) * row > slot:
                    break
                stop = end
            job = _DeviceJob(target.device, entry.key, nbytes=(stop - start) * row)
            job.reads.append((entry, 0, job.nbytes, (start, stop)))
            job.ups.append(_Up(target.tensor[start - lo : stop - lo],
                               (stop - start, *entry.shape[1:]), target.dtype, 0))
            self._jobs.append(job)
            start = stop

    def _add_region(self, entry: TensorEntry, target: DeviceBlock,
                    local_shape: tuple[int, ...], runs: Runs | None) -> None:
        ndim = len(entry.shape)
        parts = boxes(runs) if runs is not None else [Box((0,) * ndim, (0,) * ndim, entry.shape)]
        pairs: dict[int, list[tuple[Select, Select]]] = {}  # chunk -> (dst, src) per box
        for box in parts:
            for index, inter, src in entry.chunks_over(list(zip(box.start, box.stop))):
                dst = tuple(slice(a - s + loc, b - s + loc)
                            for (a, b), s, loc in zip(inter, box.start, box.local))
                pairs.setdefault(index, []).append((dst, src))
        for index, found in pairs.items():
            extents = tuple(b - a for a, b in entry.chunk_region(index))
            one = entry.chunk_alone(index, extents)
            job = _DeviceJob(target.device, entry.key, nbytes=one.nbytes)
            job.reads.append((one, 0, one.nbytes, None))
            for dst, src in found:
                whole = all(s.start == 0 and s.stop == n for s, n in zip(src, extents))
                job.ups.append(_Up(target.tensor[dst], extents, target.dtype, 0,
                                   None if whole else src))
            self._jobs.append(job)

    def run(self) -> None:
        """Run every job (the class docstring); raises the reader's IntegrityError (or a
        DeviceCopyError) on the first failure, after every copy issued has completed."""
        jobs, self._jobs, self._small = self._jobs, [], {}
        if not jobs:
            return
        # the copies wait for what this thread issued on the device before the load (e.g.
        # the kernels that initialized the destinations)
        marks = {name: dev.mark() for name, dev in self._devices.items()}
        budget = ByteBudget(self.reader.options.max_inflight_bytes)
        jobs.sort(key=lambda j: -j.nbytes)
        workers = min(self.reader.options.workers, len(jobs))
        with cf.ThreadPoolExecutor(workers, thread_name_prefix="ckpt-load-device") as pool:
            for _ in completed(pool.submit(self._run_job, job, budget, marks)
                               for job in jobs):
                pass

    def _run_job(self, job: _DeviceJob, budget: ByteBudget,
                 marks: dict[str, CopyEvent]) -> None:
        pool = self.pool
        device = job.device
        what = f"tensor {job.key!r}: the copy to {device.name}"
        with budget.hold(max(job.nbytes, pool.slot_bytes)), \
                pool.buffer(job.nbytes, (device,)) as slot:
            # read and verified: nothing below is issued for bytes that failed their digest
            self.reader.read_tensors([ReadTarget(entry, slot[off : off + n], rows)
                                      for entry, off, n, rows in job.reads])
            after = marks.get(device.name)
            events: list[tuple[CopyEvent, str]] = []
            try:
                for up in job.ups:
                    src = np.ndarray(up.shape, up.dtype, slot, up.offset)
                    events.append((copy_to_device(device, src, up.dst, up.select, after, what),
                                   what))
            except BaseException:
                settle(events)  # the slot is reused only after its copies ran
                raise
            wait_all(events)



def _copy_into(dest: Any, value: Any) -> None:
    """Fill destination `dest` (a further key of a tied tensor) with the loaded `value`."""
    if isinstance(dest, np.ndarray):
        np.copyto(dest, value if isinstance(value, np.ndarray) else np.asarray(value))
    else:
        dest.copy_(value)


def _check_keys_exist(manifest: Manifest, keys: Iterable[str], keep: tree_mod.KeyFilter
                      ) -> None:
    """Every requested key must name something in the checkpoint (a leaf or a subtree):
    O(reached leaves x depth + keys), with every reached leaf key's prefixes in one set (the
    subtrees `keep` cannot reach hold none of the keys)."""
    names: set[str] = set()
    for a in _leaf_keys_reached(manifest.tree, keep):
        names.add(a)
        dot = a.find(".")
        while dot >= 0:
            names.add(a[:dot])
            dot = a.find(".", dot + 1)
    missing = [k for k in keys if k not in names]
    if missing:
        raise KeyMismatchError(f"checkpoint {manifest.name!r} has no key(s) {missing[:10]}")


def _leaf_keys_reached(node: Any, keep: tree_mod.KeyFilter, key: str | None = None
                       ) -> list[str]:
    """The dotted keys of the leaves (of any kind) under `node` (at dotted `key`, None for the
    root) that `keep` can reach."""
    if key is not None and not keep.reaches(key):
        return []
    kind, value = tree_mod.node_kind(node)
    if kind not in tree_mod.CONTAINERS:
        return ["" if key is None else key]
    return [leaf for name, child in tree_mod.children(kind, value, key, keep)
            for leaf in _leaf_keys_reached(child, keep,
                                           str(name) if key is None else f"{key}.{name}")]


def _check_into(manifest: Manifest, selected: list[int], key_of: dict[int, str],
                dests: dict[str, Any], strict: bool, keep: tree_mod.KeyFilter | None,
                also_stored: Iterable[str] = ()
                ) -> dict[str, tuple[Any, Runs | None, tuple[int, ...]]]:
    """Check that every destination found for a selected tensor can receive it in place (and,
    if `strict`, that every destination has a tensor: one at `key_of` or at `also_stored`,
    the further keys of tied tensors); KeyMismatchError lists the problems. Returns the
    `local_part` of each destination checked, by key."""
    problems = []
    parts = {}
    stored_keys = set(also_stored)
    for i in selected:
        key = key_of.get(i, "")
        stored_keys.add(key)
        original = dests.get(key)
        if original is None:
            continue
        entry = manifest.tensors[i]
        dest, runs, gshape = parts[key] = local_part(original, key)
        if entry.kind == "bytes":
            why: str | None = ("the checkpoint holds bytes here, which are returned new, never "
                               "loaded in place: leave this key out of `into`")
        elif gshape != entry.shape:
            why = f"destination shape {gshape} != stored {entry.shape}"
        elif runs is None and tuple(dest.shape) != entry.shape:
            why = f"destination holds shape {tuple(dest.shape)}, the tensor is {entry.shape}"
        elif runs is not None and not _runs_fit(runs, tuple(dest.shape), gshape):
            why = (f"destination of shape {list(dest.shape)} at {[list(r) for r in runs]} "
                   f"does not fit the stored shape {list(gshape)}")
        elif isinstance(dest, np.ndarray):
            why = _check_numpy_dest(dest, entry)
        else:
            why = _torch_interop().check_destination(dest, entry)
        if why:
            problems.append(f"{key}: {why}")
    if strict:
        absent = sorted(k for k in dests if (keep is None or keep(k)) and k not in stored_keys)
        if absent:
            problems.append(f"not in the checkpoint: {absent[:10]}"
                            + (f" and {len(absent) - 10} more" if len(absent) > 10 else ""))
    if problems:
        raise KeyMismatchError(f"cannot load {manifest.name!r} into the given state: "
                               + "; ".join(problems[:10]))
    return parts
