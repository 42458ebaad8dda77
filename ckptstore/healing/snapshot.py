"""The sender's side of a live heal: one step of a live state, described as a sealed manifest
(docs/format.md: the state tree as canonical JSON, every tensor as row-block chunks of about
`chunk_bytes`, small tensors packed, each chunk named by its digest) whose blobs are views of
the state's own memory.

Nothing is copied from contiguous CPU tensors: a blob is a list of views into the caller's
arrays (a non-contiguous tensor is copied once, here; a tensor on another device is copied to
the CPU by the state tree's torch adapter). Every chunk is hashed here, when the step is
published, so the receiver checks every byte against what the state held then: a state
changed while it is served fails the receive instead of mixing two steps.

The chunking is the one CheckpointStore saves use (`rows_per_chunk`, the same `chunk_bytes`
and pack threshold by default), so a receiver whose local repository holds an earlier save
of the same tensors finds the unchanged chunks there by digest.
"""

from __future__ import annotations

import concurrent.futures as cf
import secrets
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import UnsupportedTypeError
from ..format.hashing import HashAlgorithm
from ..format.manifest import ChunkRef, Manifest, TensorEntry
from ..format.tree import TreeEncoder
from ..pipeline.writer import rows_per_chunk, storage_refs
from . import dtensors

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


@dataclass(frozen=True)
class Snapshot:
    """One published step: its sealed manifest (`index`) and its blobs by digest."""

    step: int
    token: str
    index: bytes
    blobs: Mapping[str, Blob]
    logical_bytes: int
    seconds: float  # time to describe and hash the state


def _flat(arr: np.ndarray) -> memoryview:
    if not arr.size:
        return memoryview(b"")
    return memoryview(arr.reshape(-1).view(np.uint8).data).cast("B")


def build_snapshot(state: Any, step: int, *, chunk_bytes: int, algorithm: HashAlgorithm,
                   workers: int) -> Snapshot:
    """Describe and hash `state` (a torch state dict: the types docs/format.md stores, and
    DTensors). Raises UnsupportedTypeError naming the key of anything else."""
    t0 = time.perf_counter()
    stripped, specs, _found = dtensors.strip(state)
    encoder = TreeEncoder()
    tree = encoder.encode_state(stripped)
    leaves = encoder.leaves
    partial = [leaf.key for leaf in leaves if leaf.is_partial]
    if partial:
        raise UnsupportedTypeError(f"{partial[0]}: a Shard (some rows of a tensor) cannot be "
                                   "sent; send each rank's own tensors (DTensors are)")
    arrays = [leaf.array if leaf.array.flags.c_contiguous else np.ascontiguousarray(leaf.array)
              for leaf in leaves]
    flats = [_flat(a) for a in arrays]

    # plan: small arrays packed, the rest in row blocks of about chunk_bytes
    rows: list[int] = []
    packed: list[bool] = []
    blocks: list[tuple[int, memoryview]] = []  # (leaf, bytes of one row block)
    for i, (leaf, arr, flat) in enumerate(zip(leaves, arrays, flats)):
        n = len(flat)
        small = 0 < n <= PACK_THRESHOLD
        packed.append(small)
        shape = tuple(int(s) for s in arr.shape)
        if small:
            rows.append(max(1, shape[0]) if shape else 1)
            continue
        r = rows_per_chunk(shape, leaf.dtype.itemsize, chunk_bytes)
        rows.append(r)
        step_bytes = r * (n // shape[0]) if shape and shape[0] else n
        for start in range(0, n, max(1, step_bytes)):
            blocks.append((i, flat[start : start + step_bytes]))
    small_ids = [i for i, p in enumerate(packed) if p]

    def hash_block(block: tuple[int, memoryview]) -> tuple[str, str | None]:
        view = block[1]
        probe = algorithm.digest(view[:PROBE_BYTES]) if len(view) >= 4 * PROBE_BYTES else None
        return algorithm.digest(view), probe

    with cf.ThreadPoolExecutor(max(1, workers), thread_name_prefix="ckpt-heal-hash") as pool:
        hashed = list(pool.map(hash_block, blocks, chunksize=1))
        small_digests = [algorithm.digest(flats[i]) for i in small_ids]
    block_digests = [d for d, _p in hashed]
    probes = {d: p for d, p in hashed if p is not None}

    where: dict[str, ChunkRef] = {}  # raw digest -> where it is served
    blobs: dict[str, Blob] = {}
    chunks: list[list[ChunkRef]] = [[] for _ in leaves]
    for (i, view), d in zip(blocks, block_digests):
        ref = where.get(d)
        if ref is None:
            ref = where[d] = ChunkRef(d, 0, len(view), len(view), d)
            blobs[d] = Blob(len(view), (view,))
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
        n = len(flats[i])
        if group and group_bytes + n > chunk_bytes:
            close_group()
            group, group_bytes = [], 0
        group.append((d, flats[i]))
        group_bytes += n
    if group:
        close_group()
    for i, d in zip(small_ids, small_digests):
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
                    logical_bytes=sum(len(f) for f in flats),
                    seconds=time.perf_counter() - t0)


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
