"""The sender's side of a live heal: one step of a live state, described as a sealed manifest
(docs/format.md: the state tree as canonical JSON, every tensor as row-block chunks of about
`chunk_bytes`, small tensors packed, each chunk named by its digest) whose blobs are views of
the state's own memory.

Nothing is copied from contiguous CPU tensors: a blob is a list of views into the caller's
arrays (a non-contiguous tensor is copied once, here). A tensor on a device (a GPU, or the
test suite's FakeDevice) is never copied to the host whole: each row block (or a pack of
small device tensors) is copied into a page-locked slot of the transport's `Staging`, hashed
there and the slot given back; a request for it copies it into a slot again (a `DeviceBlob`,
staging.py), so the host memory it takes is bounded by the staging budget. Every chunk is
hashed here, when the step is published, so the receiver checks every byte against what the
state held then: a state changed while it is served fails the receive instead of mixing two
steps.

The chunking is the one CheckpointStore saves use (`rows_per_chunk`, the same `chunk_bytes`
and pack threshold by default), so a receiver whose local repository holds an earlier save
of the same tensors finds the unchanged chunks there by digest.
"""

from __future__ import annotations

import concurrent.futures as cf
import secrets
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import UnsupportedTypeError
from ..format.hashing import HashAlgorithm
from ..format.manifest import ChunkRef, Manifest, TensorEntry
from ..format.tree import TreeEncoder
from ..pipeline.device import CopyEvent, DeviceBlock, block_of, marks_for, on_device
from ..pipeline.writer import rows_per_chunk, storage_refs
from . import dtensors
from .staging import Staging, aligned, device_parts, stage_to_host

MiB = 1 << 20
DEFAULT_CHUNK_BYTES = 16 * MiB
PACK_THRESHOLD = 256 * 1024
#: every row block of 4x this or more also gets the digest of its first PROBE_BYTES (a
#: "probe"): a receiver checking whether a destination already holds the chunk hashes that
#: much first, and the whole chunk only when the probe matches (a destination that differs,
#: like a freshly initialised model, then costs 1/256 of a hash)
PROBE_BYTES = 64 * 1024
#: the manifest's `metadata` field that carries what a heal adds to a checkpoint's manifest
META_KEY = "ckptstore.heal"
WIRE_VERSION = 1
#: host bytes a sender's device tensors may take at once, in slots of `chunk_bytes`, when the
#: transport names no budget (`device_host_bytes`): two slots being hashed or sent while
#: two more are being copied
DEFAULT_DEVICE_SLOTS = 4


def checkpoint_name(step: int) -> str:
    """The manifest name of a served step (a valid checkpoint name for any integer)."""
    return f"step-{step}" if step >= 0 else f"step-m{-step}"


@dataclass(frozen=True)
class Blob:
    """A blob as served: `size` bytes made of consecutive `pieces` (views of the state)."""

    size: int
    pieces: tuple[memoryview, ...]

    def slices(self, start: int, length: int) -> Iterator[memoryview]:
        """The views covering bytes [start, start + length) of the blob, in order."""
        pos = 0
        end = start + length
        for piece in self.pieces:
            lo, hi = pos, pos + len(piece)
            pos = hi
            if hi <= start or lo >= end:
                continue
            yield piece[max(start, lo) - lo : min(end, hi) - lo]

    @contextmanager
    def open(self, start: int, length: int) -> Iterator[list[memoryview]]:
        """The bytes [start, start + length) as views, readable while the block runs."""
        yield list(self.slices(start, length))


@dataclass(frozen=True)
class DeviceBlob:
    """A blob made of device blocks (one row block, or the members of a pack), copied into a
    page-locked slot of `staging` when it is requested (staging.py)."""

    size: int
    parts: tuple[DeviceBlock, ...]
    staging: Staging
    marks: Mapping[str, CopyEvent]
    what: str

    @contextmanager
    def open(self, start: int, length: int) -> Iterator[list[memoryview]]:
        """Copy the parts covering [start, start + length) into a slot, wait for the copies,
        and yield views of the requested bytes there; the slot goes back to the pool when the
        block ends (DeviceCopyError if a copy failed)."""
        end = start + length
        covering: list[tuple[DeviceBlock, int]] = []  # (part, its offset in the blob)
        pos = 0
        for part in self.parts:
            lo, hi = pos, pos + part.nbytes
            pos = hi
            if hi > start and lo < end:
                covering.append((part, lo))
        layout = device_parts(p for p, _lo in covering)
        need = sum(aligned(p.nbytes) for p, _lo in covering)
        devices = {p.device.name: p.device for p, _lo in covering}
        with self.staging.slot(need, devices.values()) as buf:
            stage_to_host(layout, buf, dict(self.marks), self.what)
            views = []
            for (part, lo), (_p, at) in zip(covering, layout):
                a = max(start, lo) - lo
                b = min(end, lo + part.nbytes) - lo
                views.append(memoryview(buf[at + a : at + b].data).cast("B"))
            yield views


ServedBlob = Blob | DeviceBlob


@dataclass(frozen=True)
class Snapshot:
    """One published step: its sealed manifest (`index`) and its blobs by digest."""

    step: int
    token: str
    index: bytes
    blobs: Mapping[str, ServedBlob]
    logical_bytes: int
    seconds: float  # time to describe and hash the state
    device_bytes: int = 0  # of logical_bytes, those of tensors on a device


def _flat(arr: np.ndarray) -> memoryview:
    if not arr.size:
        return memoryview(b"")
    return memoryview(arr.reshape(-1).view(np.uint8).data).cast("B")


def default_staging(chunk_bytes: int) -> Staging:
    """The staging of a sender that names none (DEFAULT_DEVICE_SLOTS slots of chunk_bytes)."""
    return Staging(chunk_bytes, DEFAULT_DEVICE_SLOTS * chunk_bytes)


def build_snapshot(state: Any, step: int, *, chunk_bytes: int, algorithm: HashAlgorithm,
                   workers: int, staging: Staging | None = None) -> Snapshot:
    """Describe and hash `state` (a torch state dict: the types docs/format.md stores, and
    DTensors). Raises UnsupportedTypeError naming the key of anything else. Tensors on a
    device go through `staging` (default_staging when None); the caller keeps it, and its
    pinned slots, for the steps that follow."""
    t0 = time.perf_counter()
    stripped, specs, _found = dtensors.strip(state)
    encoder = TreeEncoder()
    tree = encoder.encode_state(stripped)
    leaves = encoder.leaves
    partial = [leaf.key for leaf in leaves if leaf.is_partial]
    if partial:
        raise UnsupportedTypeError(f"{partial[0]}: a Shard (some rows of a tensor) cannot be "
                                   "sent; send each rank's own tensors (DTensors are)")
    arrays: list[Any] = [
        leaf.array if on_device(leaf.array) or leaf.array.flags.c_contiguous
        else np.ascontiguousarray(leaf.array) for leaf in leaves]
    on_dev = [on_device(a) for a in arrays]
    # the copies of device blocks read the values of now: after the work the caller (the
    # training loop's thread) issued so far
    marks = marks_for(a for a, d in zip(arrays, on_dev) if d)
    if marks and staging is None:
        staging = default_staging(chunk_bytes)
    flats = [None if d else _flat(a) for a, d in zip(arrays, on_dev)]
    sizes = [int(a.nbytes) for a in arrays]

    # plan: small arrays packed, the rest in row blocks of about chunk_bytes
    rows: list[int] = []
    packed: list[bool] = []
    blocks: list[tuple[int, Any]] = []  # (leaf, bytes of one row block: a view or on a device)
    for i, (leaf, arr, flat) in enumerate(zip(leaves, arrays, flats)):
        n = sizes[i]
        small = 0 < n <= PACK_THRESHOLD
        packed.append(small)
        shape = tuple(int(s) for s in arr.shape)
        if small:
            rows.append(max(1, shape[0]) if shape else 1)
            continue
        r = rows_per_chunk(shape, leaf.dtype.itemsize, chunk_bytes)
        rows.append(r)
        if flat is None:  # on a device: row blocks of the tensor itself
            device = block_of(arr)
            if n:
                if shape:
                    blocks += [(i, device[a : a + r]) for a in range(0, shape[0], max(1, r))]
                else:
                    blocks.append((i, device))
            continue
        step_bytes = r * (n // shape[0]) if shape and shape[0] else n
        for start in range(0, n, max(1, step_bytes)):
            blocks.append((i, flat[start : start + step_bytes]))
    small_ids = [i for i, p in enumerate(packed) if p and flats[i] is not None]
    small_dev = [i for i, p in enumerate(packed) if p and flats[i] is None]

    hashing = threading.Semaphore(max(1, workers))  # threads hashing at once

    def digests(view: memoryview) -> tuple[str, str | None]:
        with hashing:
            probe = (algorithm.digest(view[:PROBE_BYTES]) if len(view) >= 4 * PROBE_BYTES
                     else None)
            return algorithm.digest(view), probe

    def hash_block(block: tuple[int, Any]) -> tuple[str, str | None]:
        i, part = block
        if isinstance(part, memoryview):
            return digests(part)
        assert staging is not None
        what = f"{leaves[i].key}: the copy from {part.device.name} to host memory"
        with staging.slot(part.nbytes, (part.device,)) as buf:
            stage_to_host([(part, 0)], buf, marks, what)
            return digests(memoryview(buf.data).cast("B"))

    # packs of small device tensors: members at aligned places of one slot, at most
    # chunk_bytes of them (with their alignment) per pack
    dev_groups: list[list[int]] = []
    group_need = 0
    for i in small_dev:
        if not dev_groups or group_need + aligned(sizes[i]) > chunk_bytes:
            dev_groups.append([])
            group_need = 0
        dev_groups[-1].append(i)
        group_need += aligned(sizes[i])

    def hash_pack(members: list[int]) -> tuple[list[str], str]:
        assert staging is not None
        parts = [block_of(arrays[i]) for i in members]
        layout = device_parts(parts)
        need = sum(aligned(p.nbytes) for p in parts)
        devices = {p.device.name: p.device for p in parts}
        what = f"{leaves[members[0]].key}: the copy from {parts[0].device.name} to host memory"
        with staging.slot(need, devices.values()) as buf:
            stage_to_host(layout, buf, marks, what)
            views = [memoryview(buf[at : at + p.nbytes].data).cast("B") for p, at in layout]
            with hashing:
                return [algorithm.digest(v) for v in views], _pack_digest(algorithm, views)

    threads = max(1, workers)
    if staging is not None and (blocks or dev_groups):
        threads = max(threads, staging.slots)  # most of them wait for copies, not hash
    with cf.ThreadPoolExecutor(threads, thread_name_prefix="ckpt-heal-hash") as pool:
        pending_packs = [pool.submit(hash_pack, g) for g in dev_groups]
        hashed = list(pool.map(hash_block, blocks, chunksize=1))
        small_digests = [algorithm.digest(flat) for i in small_ids
                         if (flat := flats[i]) is not None]
        pack_digests = [f.result() for f in pending_packs]
    block_digests = [d for d, _p in hashed]
    probes = {d: p for d, p in hashed if p is not None}

    where: dict[str, ChunkRef] = {}  # raw digest -> where it is served
    blobs: dict[str, ServedBlob] = {}
    chunks: list[list[ChunkRef]] = [[] for _ in leaves]
    for (i, part), d in zip(blocks, block_digests):
        ref = where.get(d)
        if ref is None:
            n = len(part) if isinstance(part, memoryview) else int(part.nbytes)
            ref = where[d] = ChunkRef(d, 0, n, n, d)
            if isinstance(part, memoryview):
                blobs[d] = Blob(n, (part,))
            else:
                assert staging is not None
                blobs[d] = DeviceBlob(n, (part,), staging, marks, _what(leaves[i].key, part))
        chunks[i].append(ref)
    # packs of the small arrays not served elsewhere, at most chunk_bytes each
    group: list[tuple[str, memoryview]] = []
    group_bytes = 0
    seen: set[str] = set(where)

    def close_group() -> None:
        hasher_input = [v for _d, v in group]
        pack = _pack_digest(algorithm, hasher_input)
        off = 0
        for d, v in group:
            where[d] = ChunkRef(pack, off, len(v), len(v), d)
            off += len(v)
        blobs[pack] = Blob(off, tuple(hasher_input))

    for i, d in zip(small_ids, small_digests):
        if d in seen:
            continue
        seen.add(d)
        flat = flats[i]
        assert flat is not None
        n = len(flat)
        if group and group_bytes + n > chunk_bytes:
            close_group()
            group, group_bytes = [], 0
        group.append((d, flat))
        group_bytes += n
    if group:
        close_group()
    for i, d in zip(small_ids, small_digests):
        chunks[i].append(where[d])
    # packs of small device tensors: every member stays in its pack (a member whose digest is
    # served elsewhere is never asked for there)
    for members, (member_digests, pack) in zip(dev_groups, pack_digests):
        assert staging is not None
        off = 0
        for i, d in zip(members, member_digests):
            where.setdefault(d, ChunkRef(pack, off, sizes[i], sizes[i], d))
            off += sizes[i]
        parts = tuple(block_of(arrays[i]) for i in members)
        blobs[pack] = DeviceBlob(off, parts, staging, marks,
                                 _what(leaves[members[0]].key, parts[0]))
        for i, d in zip(members, member_digests):
            chunks[i].append(where[d])

    shared = storage_refs(leaves)
    entries = tuple(
        TensorEntry(key=leaf.key, kind=leaf.kind, dtype=leaf.dtype,
                    shape=tuple(int(s) for s in arr.shape), chunk_rows=r, codec=None,
                    chunks=tuple(c), requires_grad=leaf.requires_grad,
                    parameter=leaf.parameter, storage=st)
        for leaf, arr, r, c, st in zip(leaves, arrays, rows, chunks, shared))
    token = secrets.token_hex(16)
    meta = {META_KEY: {"version": WIRE_VERSION, "step": step, "snapshot": token,
                       "dtensors": specs, "probe_bytes": PROBE_BYTES, "probes": probes}}
    manifest = Manifest(name=checkpoint_name(step), created=time.time(), metadata=meta,
                        tree=tree, tensors=entries, parent=None, hash=algorithm.name)
    index = manifest.to_bytes()
    return Snapshot(step=step, token=token, index=index, blobs=blobs,
                    logical_bytes=sum(sizes),
                    seconds=time.perf_counter() - t0,
                    device_bytes=sum(n for n, d in zip(sizes, on_dev) if d))


def _what(key: str, part: DeviceBlock) -> str:
    return f"{key}: the copy from {part.device.name} to host memory (serving it)"


def _pack_digest(algorithm: HashAlgorithm, views: list[memoryview]) -> str:
    """Digest of the concatenation of `views`, without concatenating (xxh3 streams; other
    algorithms hash a joined copy of these small arrays)."""
    if algorithm.name == "xxh3-128":
        from ..format.hashing import new_hasher

        h = new_hasher()
        for v in views:
            h.update(v)
        return h.hexdigest()
    return algorithm.digest(b"".join(views))
