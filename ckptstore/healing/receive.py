"""The receiver's side of a live heal: fetch a sender's index, decide where every chunk comes
from, fetch the rest in parallel, verify every chunk, rebuild the state.

Where a chunk comes from, in order:

1. **in place**: a destination tensor (the caller's `destinations`, e.g. the replacement's
   freshly built model) already holds it: its bytes are hashed where they are and match.
   Frozen weights the replacement loaded itself cost a hash, nothing else;
2. **local**: the receiver's own repository (`local`: its near tier's latest checkpoint)
   has a chunk with that digest: read it, verify it, place it;
3. **the sender**: ranged GETs by digest over `workers` kept-alive connections, largest
   chunks first, started at once for chunks no local source can have and fed with the local
   misses as the local checks run beside them (two threads).

Every chunk is checked against the digest in the index before it lands in a tensor the caller
holds: into a destination it is read into a scratch buffer, verified, then copied; a tensor
created by this receive (returned only if the whole receive succeeds) is filled directly and
verified there. A tensor on a device (a destination there, or a new tensor made on the
destinations' device) never receives bytes directly: its chunk is read into a page-locked
slot (staging.py), verified there, then copied up, and the slot is reused only once that copy
completed. A whole chunk is hashed piece by piece as it arrives; the memory of new
tensors is backed ahead of the transfer by a thread of its own where a spare core allows
(memory.py). A chunk that fails its digest is fetched again (`retries` times), then the
receive fails with IntegrityError and no destination received it. The index itself is a
sealed manifest, parsed and checked like any checkpoint's.

Why one module: the three sources share one work queue, one scratch-buffer pool and one
rule for when a chunk may land; split, each piece would need the others' private state.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import (
    CkptStoreError,
    FormatError,
    IntegrityError,
    KeyMismatchError,
)
from ..format import tree as tree_mod
from ..format.codecs import Codec
from ..format.hashing import HashAlgorithm, StreamingDigest, is_digest
from ..format.manifest import MAX_MANIFEST_BYTES, ChunkRef, Manifest, TensorEntry
from ..format.manifest_parse import parse_manifest
from ..layout import blob_key
from ..pipeline.device import CopyEvent, Device, DeviceBlock, block_of, marks_for, on_device
from ..pipeline.loading import physical_memory
from ..pipeline.ranges import merge_ranges
from ..stores.base import Store
from . import dtensors
from .client import Address, Broken, Connection, Deadline, Refused
from .errors import HealError
from .memory import advise_huge, populate
from .snapshot import DEFAULT_CHUNK_BYTES, META_KEY, WIRE_VERSION, checkpoint_name
from .staging import Staging, copy_up, stage_to_host

log = logging.getLogger("ckptstore.healing")
MERGE_GAP = 64 * 1024  # pack members this close share one ranged GET
LOCAL_THREADS = 2


def _spare_core() -> bool:
    """Whether this process may run on more than one core (a thread backing new memory
    ahead of the transfer then takes its page faults beside the receiving threads; on one
    core it would only take turns with them)."""
    try:
        return len(os.sched_getaffinity(0)) > 1
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return (os.cpu_count() or 1) > 1


def default_workers() -> int:
    """Connections to the sender: one per core, 2 to 8 (on 2 cores more only contend)."""
    return max(2, min(8, os.cpu_count() or 2))


@dataclass(frozen=True)
class ReceiveInfo:
    """What one receive did. Bytes are raw tensor bytes; `network_bytes` counts what came
    from the sender (the index and every fetch, refetches included)."""

    step: int
    seconds: float
    logical_bytes: int
    network_bytes: int
    in_place_bytes: int
    local_bytes: int
    chunks: int
    network_chunks: int
    in_place_chunks: int
    local_chunks: int
    refetched_chunks: int
    index_bytes: int


@dataclass
class _Piece:
    out: np.ndarray | None  # flat uint8: where the chunk's bytes go (None: on a device)
    live: bool  # the caller's own memory: only verified bytes may land there
    dev: DeviceBlock | None = None  # on a device: the rows the chunk fills


@dataclass
class _Group:
    """One digest and every place that needs its bytes."""

    digest: str
    nbytes: int
    ref: ChunkRef  # where the sender serves it
    key: str  # a tensor holding it, for messages
    pieces: list[_Piece] = field(default_factory=list)

    @property
    def packed(self) -> bool:
        return self.ref.offset != 0 or self.ref.blob != self.ref.digest

    @property
    def devices(self) -> dict[str, Device]:
        """The devices some piece of it lives on, by name."""
        return {p.dev.device.name: p.dev.device for p in self.pieces if p.dev is not None}

    def host_target(self) -> np.ndarray | None:
        """A piece this receive created in host memory (filled directly, verified there)."""
        return next((p.out for p in self.pieces if not p.live and p.out is not None), None)


@dataclass
class _Item:
    """One GET: bytes [start, start + length) of `blob`, holding `members` at offsets."""

    blob: str
    start: int
    length: int
    members: list[tuple[int, _Group]]
    whole: bool  # the blob's full extent (no Range header)


@dataclass
class _Counts:
    lock: threading.Lock = field(default_factory=threading.Lock)
    network: int = 0
    network_chunks: int = 0
    in_place: int = 0
    in_place_chunks: int = 0
    local: int = 0
    local_chunks: int = 0
    refetched: int = 0

    def add(self, **kw: int) -> None:
        with self.lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)


class LocalChunks:
    """Chunks of a local repository by raw digest: (store, chunk, codec, itemsize)."""

    def __init__(self, store: Store, manifest: Manifest, algorithm: HashAlgorithm) -> None:
        self.store = store
        self.algorithm = algorithm
        self.name = manifest.name
        self.refs: dict[str, tuple[ChunkRef, Codec | None, int]] = {}
        for t in manifest.tensors:
            for c in t.chunks:
                self.refs.setdefault(c.digest, (c, t.codec, t.dtype.itemsize))

    def read(self, digest: str, out: np.ndarray) -> bool:
        """Fill `out` with the chunk of that digest, verified; False if it is not here or
        cannot be read back whole and correct (the caller fetches it elsewhere)."""
        found = self.refs.get(digest)
        if found is None:
            return False
        ref, codec, itemsize = found
        if ref.nbytes != out.nbytes:
            return False
        view = memoryview(out.data).cast("B") if out.nbytes else memoryview(b"")
        try:
            if codec is None:
                got = self.store.read_into_digest(blob_key(ref.blob), ref.offset, view)
                if self.algorithm.name != "xxh3-128":
                    got = self.algorithm.digest(view)
                return got == digest
            stored = np.empty(ref.size, np.uint8)
            sview = memoryview(stored.data).cast("B")
            got = self.store.read_into_digest(blob_key(ref.blob), 0, sview)
            if self.algorithm.name != "xxh3-128":
                got = self.algorithm.digest(sview)
            if got != ref.blob:
                return False
            codec.decode_into(sview, view, itemsize, f"local blob {ref.blob}")
            return self.algorithm.digest(view) == digest
        except (CkptStoreError, OSError, ValueError) as exc:
            log.warning("live heal: local chunk %s unusable (%s); fetching it", digest, exc)
            return False


def open_local(local: Any, algorithm: HashAlgorithm) -> LocalChunks | None:
    """The chunks of `local`'s near tier's latest checkpoint, or None if it has none (or
    uses another hash algorithm than the sender). `local`: a CheckpointStore or a path."""
    if local is None:
        return None
    from ..repository import CheckpointStore

    repo = local if isinstance(local, CheckpointStore) else CheckpointStore(
        os.fspath(local), create=False)
    near = repo.tiers[0]
    if near.hash.name != algorithm.name:
        log.warning("live heal: %s names chunks with %s, the sender with %s; not used",
                    near.uri, near.hash.name, algorithm.name)
        return None
    name = near.latest()
    if name is None:
        return None
    return LocalChunks(near.store, near.manifest(name), algorithm)


class _Work:
    """The network queue (largest first) fed by local misses; the first failure stops all."""

    def __init__(self, items: list[_Item], local_pending: int) -> None:
        self.cv = threading.Condition()
        self.items = sorted(items, key=lambda it: it.length)  # pop() takes the largest
        self.local_pending = local_pending
        self.failed: BaseException | None = None

    def put(self, item: _Item) -> None:
        with self.cv:
            self.items.append(item)  # a local miss: as it comes
            self.cv.notify()

    def local_done(self) -> None:
        with self.cv:
            self.local_pending -= 1
            self.cv.notify_all()

    def next(self) -> _Item | None:
        with self.cv:
            self.cv.wait_for(lambda: self.items or not self.local_pending
                             or self.failed is not None)
            if self.failed is not None or not self.items:
                return None
            return self.items.pop()

    def fail(self, exc: BaseException) -> None:
        with self.cv:
            if self.failed is None:
                self.failed = exc
            self.cv.notify_all()


def _retry_delay(attempt: int, deadline: Deadline) -> None:
    time.sleep(max(0.0, min(0.005 * 2 ** attempt, 0.05, deadline.left())))


def fetch_index(conn: Connection, step: int, deadline: Deadline) -> tuple[bytes, str, int]:
    """The sender's index for `step`, its snapshot token and transfer id. Waits (until the
    deadline) while the sender does not serve that step yet or cannot be reached."""
    what = f"waiting for step {step} from {conn.address.url}"
    attempt = 0
    last = "no answer"
    while True:
        deadline.check(f"{what} ({last})")
        try:
            resp = conn.request("GET", f"v1/{step}/index", what)
            data = conn.read_all(resp, MAX_MANIFEST_BYTES, what)
            token = resp.header("X-Ckpt-Snapshot") or ""
            transfer = resp.header("X-Ckpt-Transfer") or ""
            if len(token) != 32 or not transfer.isdigit():
                raise HealError(f"{conn.address.url} is not a ckptstore live-heal sender "
                                "(no snapshot header)")
            return data, token, int(transfer)
        except Refused as exc:
            if not exc.retry:
                raise HealError(f"live heal of step {step} from {conn.address.url} refused: "
                                f"{exc.message}") from None
            last = exc.message
        except Broken as exc:
            last = f"cannot reach the sender: {exc}"
        _retry_delay(attempt, deadline)
        attempt += 1


def _check_meta(manifest: Manifest, step: int, token: str) -> dict[str, Any]:
    meta = manifest.metadata.get(META_KEY)
    if not isinstance(meta, dict) or meta.get("version") != WIRE_VERSION:
        raise FormatError(f"index of step {step}: not a live-heal index of version "
                          f"{WIRE_VERSION}")
    if meta.get("step") != step or meta.get("snapshot") != token:
        raise FormatError(f"index of step {step}: it describes step {meta.get('step')!r:.20} "
                          "or another snapshot than the one served")
    specs = meta.get("dtensors")
    if not isinstance(specs, dict):
        raise FormatError(f"index of step {step}: malformed dtensors field")
    for key, spec in specs.items():
        dtensors.check_spec(spec, key)
    probes, probe_bytes = meta.get("probes"), meta.get("probe_bytes")
    if not isinstance(probes, dict) or type(probe_bytes) is not int or probe_bytes < 1 or not all(
            is_digest(k) and is_digest(v) for k, v in probes.items()):
        raise FormatError(f"index of step {step}: malformed probes")
    return specs


def _occurrences(node: Any, key: str | None = None) -> Iterator[tuple[str, int]]:
    """(dotted key, tensor index) of every tensor leaf occurrence of a tree."""
    kind, value = tree_mod.node_kind(node)
    if kind in ("dict", "odict"):
        for (_t, k), child in value:
            yield from _occurrences(child, str(k) if key is None else f"{key}.{k}")
    elif kind in ("list", "tuple"):
        for i, child in enumerate(value):
            yield from _occurrences(child, str(i) if key is None else f"{key}.{i}")
    elif kind in ("tensor", "bytes"):
        yield ("" if key is None else key), value


def _torch() -> Any:
    from ..format import torch_types

    return torch_types


def _dest_problem(dest: Any, entry: TensorEntry) -> str | None:
    if tuple(int(s) for s in dest.shape) != entry.shape:
        return f"destination shape {tuple(dest.shape)} != sent {entry.shape}"
    if isinstance(dest, np.ndarray):
        if not entry.dtype.numpy_native or dest.dtype.name != entry.dtype.name:
            return f"destination dtype {dest.dtype} != sent {entry.dtype.name}"
        if not dest.flags.writeable:
            return "destination array is read-only"
        return None
    why: str | None = _torch().check_destination(dest, entry)
    return why


def _new_numpy(entry: TensorEntry) -> tuple[Any, np.ndarray, Callable[[], None] | None]:
    arr = np.empty(entry.shape, dtype=entry.dtype.numpy_dtype)
    return arr, arr.reshape(-1).view(np.uint8), None


def _numpy_into(dest: np.ndarray, entry: TensorEntry
                ) -> tuple[Any, np.ndarray, Callable[[], None] | None]:
    if dest.flags.c_contiguous and dest.dtype.isnative:
        return dest, dest.reshape(-1).view(np.uint8), None
    tmp = np.empty(dest.shape, dtype=entry.dtype.numpy_dtype)
    return dest, tmp.reshape(-1).view(np.uint8), lambda: np.copyto(dest, tmp)


class Receive:
    """One receive (module docstring). `run()` returns (state, ReceiveInfo)."""

    def __init__(self, address: Address, step: int, timeout: float, *, algorithm: HashAlgorithm,
                 destinations: Callable[[], Any] | None, local: LocalChunks | None,
                 workers: int, retries: int, huge_pages: bool = False,
                 staging: Staging | None = None, device: Any = None) -> None:
        self.address = address
        #: page-locked slots through which chunks reach device tensors (staging.py)
        self.staging = staging
        #: where new tensors are made (a device seam; None: beside the destinations)
        self.device = device
        self.marks: dict[str, CopyEvent] = {}
        self.huge_pages = huge_pages
        self.step = step
        self.deadline = Deadline(timeout)
        self.algorithm = algorithm
        self.destinations = destinations
        self.local = local
        self.workers = max(1, workers)
        self.retries = max(0, retries)
        self.counts = _Counts()
        self.what = f"receiving step {step} from {address.url}"
        self.token = ""
        self.transfer = 0
        self.total = 0
        self.probes: dict[str, str] = {}
        self.probe_bytes = 0
        self._stopped = threading.Event()

    # ------------------------------------------------------------------ plan
    def run(self) -> tuple[Any, ReceiveInfo]:
        t0 = time.perf_counter()
        control = Connection(self.address, self.deadline)
        conns = [control]
        try:
            index, self.token, self.transfer = fetch_index(control, self.step, self.deadline)
            manifest = parse_manifest(index, checkpoint_name(self.step), self.algorithm)
            specs = _check_meta(manifest, self.step, self.token)
            meta = manifest.metadata[META_KEY]
            self.probes, self.probe_bytes = meta["probes"], meta["probe_bytes"]
            values, groups, finishers, dest_dtensors = self._materialize(manifest, specs)
            self._fetch(groups, conns)
            self._post_done(control)
        finally:
            for c in conns:
                c.close()
        for fin in finishers:
            fin()
        state = self._decode(manifest, specs, values, dest_dtensors)
        n = self.counts
        info = ReceiveInfo(
            step=self.step, seconds=time.perf_counter() - t0,
            logical_bytes=manifest.logical_bytes, network_bytes=n.network + len(index),
            in_place_bytes=n.in_place, local_bytes=n.local,
            chunks=len(groups), network_chunks=n.network_chunks,
            in_place_chunks=n.in_place_chunks, local_chunks=n.local_chunks,
            refetched_chunks=n.refetched, index_bytes=len(index))
        return state, info

    def _materialize(self, manifest: Manifest, specs: dict[str, Any]
                     ) -> tuple[dict[int, Any], list[_Group], list[Callable[[], None]],
                                dict[str, Any]]:
        """Destination or new buffer of every tensor; the chunks grouped by digest."""
        occurrences = list(_occurrences(manifest.tree))
        key_of: dict[int, str] = {}
        for key, i in occurrences:
            key_of.setdefault(i, key)
        dest_state = self.destinations() if self.destinations is not None else None
        dest_dtensors: dict[str, Any] = {}
        dests: dict[str, Any] = {}
        if dest_state is not None:
            stripped, _dest_specs, dest_dtensors = dtensors.strip(dest_state)
            dests = tree_mod.flatten_arrays(stripped)
        problems = []
        all_keys = {k for k, _i in occurrences}
        absent = sorted(k for k in dests if k not in all_keys)
        if absent:
            problems.append(f"not in the state sent: {absent[:10]}"
                            + (f" and {len(absent) - 10} more" if len(absent) > 10 else ""))
        fresh = 0
        for i, entry in enumerate(manifest.tensors):
            if entry.codec is not None or entry.chunk_shape is not None:
                raise FormatError(f"index of step {self.step}: tensor {entry.key!r} is "
                                  "compressed or gridded, which a live heal never sends")
            key = key_of.get(i, entry.key)
            dest = dests.get(key)
            if dest is None:
                fresh += entry.nbytes if entry.storage is None else 0
                continue
            why = _dest_problem(dest, entry)
            sent_dt, dest_dt = key in specs, key in dest_dtensors
            if why is None and sent_dt and dest_dt:
                why = dtensors.mismatch(dest_dtensors[key], specs[key], key)
            elif why is None and sent_dt != dest_dt:
                why = ("the sender sent a DTensor, the destination is a plain tensor" if sent_dt
                       else "the destination is a DTensor, the sender sent a plain tensor")
            if why:
                problems.append(f"{key}: {why}")
        if problems:
            raise KeyMismatchError(f"cannot receive step {self.step} into the destinations: "
                                   + "; ".join(problems[:10]))
        fresh += sum({e.storage.id: e.storage.nbytes for e in manifest.tensors
                      if e.storage is not None}.values())
        new_on = self._new_device(dests)
        if fresh > physical_memory() and new_on is None:
            raise FormatError(f"index of step {self.step} declares {fresh} bytes of new "
                              "tensors, more than this machine's memory")

        values: dict[int, Any] = {}
        finishers: list[Callable[[], None]] = []
        groups: dict[str, _Group] = {}
        mat = None
        for i, entry in enumerate(manifest.tensors):
            key = key_of.get(i, entry.key)
            dest = dests.get(key)
            try:
                if entry.kind == "torch" or (dest is not None
                                             and not isinstance(dest, np.ndarray)):
                    if mat is None:
                        mat = _torch().TorchMaterializer(new_on)
                    value, buf, fin = mat.into(dest, entry) if dest is not None else mat.new(entry)
                elif dest is not None:
                    value, buf, fin = _numpy_into(dest, entry)
                else:
                    value, buf, fin = _new_numpy(entry)
            except (MemoryError, RuntimeError, ValueError, OverflowError) as exc:
                raise FormatError(f"tensor {key!r}: cannot allocate {entry.dtype.name} of "
                                  f"shape {list(entry.shape)}: {type(exc).__name__}: {exc}"
                                  ) from None
            values[i] = dest if dest is not None else value
            if fin is not None:
                finishers.append(fin)
            live = dest is not None and fin is None
            device = on_device(buf)
            if not live and not device and self.huge_pages:  # memory this receive created
                advise_huge(buf)
            row = entry.row_bytes if entry.shape else entry.dtype.itemsize
            for c, ref in enumerate(entry.chunks):
                if device:  # only verified bytes are copied up, from a page-locked slot
                    rows = block_of(buf)
                    if entry.shape:
                        rows = rows[c * entry.chunk_rows : (c + 1) * entry.chunk_rows]
                    if rows.nbytes != ref.nbytes:
                        raise FormatError(f"index of step {self.step}: chunk {c} of "
                                          f"{entry.key!r} declares {ref.nbytes} bytes, its "
                                          f"rows hold {rows.nbytes}")
                    piece = _Piece(None, live, rows)
                else:
                    lo = c * entry.chunk_rows * row if entry.shape else 0
                    piece = _Piece(buf[lo : lo + ref.nbytes], live)
                g = groups.get(ref.digest)
                if g is None:
                    g = groups[ref.digest] = _Group(ref.digest, ref.nbytes, ref, key)
                elif g.nbytes != ref.nbytes:
                    raise FormatError(f"index of step {self.step}: digest {ref.digest} "
                                      "declared with two sizes")
                g.pieces.append(piece)
        self.total = sum(g.nbytes for g in groups.values())
        # copies to a device wait for the work this thread issued there before the receive
        # (e.g. the kernels that built the destinations)
        self.marks = marks_for(p.dev for g in groups.values() for p in g.pieces
                               if p.dev is not None)
        if self.marks and self.staging is None:
            self.staging = Staging(DEFAULT_CHUNK_BYTES)
        return values, list(groups.values()), finishers, dest_dtensors

    def _new_device(self, dests: dict[str, Any]) -> Any:
        """Where new torch tensors are made: `device` if given, else the one device holding
        the destinations' tensors (None: host memory, also when they are on several)."""
        if self.device is not None:
            return self.device
        found: dict[str, Any] = {}
        for dest in dests.values():
            if not isinstance(dest, np.ndarray) and callable(getattr(dest, "detach", None)):
                dev = _torch().device_of(dest.detach())
                if dev is not None:
                    found.setdefault(dev.name, dev)
        return next(iter(found.values())) if len(found) == 1 else None

    # ------------------------------------------------------------------ fetch
    def _fetch(self, groups: list[_Group], conns: list[Connection]) -> None:
        net: list[_Item] = []
        local_groups: list[_Group] = []
        packs: dict[str, list[_Group]] = {}
        for g in groups:
            has_live = any(p.live for p in g.pieces)
            if g.packed:  # small: checked in place now, fetched in merged ranges
                if has_live and self._in_place(g):
                    continue
                packs.setdefault(g.ref.blob, []).append(g)
            elif has_live or (self.local is not None and g.digest in self.local.refs):
                local_groups.append(g)
            else:
                net.append(_Item(g.ref.blob, 0, g.nbytes, [(0, g)], True))
        for blob, members in packs.items():
            for run in merge_ranges(((g.ref.offset, g.ref.size, g) for g in members),
                                    MERGE_GAP, 16 << 20):
                net.append(_Item(blob, run.start, run.length,
                                 [(off - run.start, g) for off, _n, g in run.parts], False))
        n_local = min(LOCAL_THREADS, len(local_groups))
        work = _Work(net, n_local)
        todo = iter(sorted(local_groups, key=lambda g: -g.nbytes))
        todo_lock = threading.Lock()

        def local_worker() -> None:
            scratch: list[np.ndarray] = []
            try:
                while work.failed is None:
                    with todo_lock:
                        g = next(todo, None)
                    if g is None:
                        return
                    if not (self._in_place(g) or self._from_local(g, scratch)):
                        work.put(_Item(g.ref.blob, 0, g.nbytes, [(0, g)], True))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                work.fail(exc)
            finally:
                work.local_done()

        def net_worker(conn: Connection) -> None:
            scratch: list[np.ndarray] = []
            try:
                while (item := work.next()) is not None:
                    self._get(conn, item, scratch)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                work.fail(exc)

        # the new tensors the sender fills, in the order the connections will take them
        fresh: list[np.ndarray] = []
        for it in reversed(work.items):
            if len(it.members) == 1 and it.whole:  # _get receives these in place
                out = it.members[0][1].host_target()
                if out is not None and out.size:
                    fresh.append(out)

        def fault_worker() -> None:  # back them ahead of the transfer (memory.py)
            for buf in fresh:
                if work.failed is not None or self._stopped.is_set() or not populate(buf):
                    return

        while len(conns) < self.workers:
            conns.append(Connection(self.address, self.deadline))
        threads = [threading.Thread(target=local_worker, name="ckpt-heal-local", daemon=True)
                   for _ in range(n_local)]
        if fresh and _spare_core():
            threads.append(threading.Thread(target=fault_worker, name="ckpt-heal-fault",
                                            daemon=True))
        threads += [threading.Thread(target=net_worker, args=(c,), name="ckpt-heal-get",
                                     daemon=True) for c in conns]
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.0, self.deadline.left()) + 5.0)
        if work.failed is not None or any(t.is_alive() for t in threads):
            self._stopped.set()  # a thread still reading a local chunk lands nothing now
        if work.failed is not None:
            raise work.failed
        if any(t.is_alive() for t in threads):
            work.fail(HealError("stopped"))
            self.deadline.check(self.what)
            raise HealError(f"{self.what}: workers did not finish")

    def _land(self, g: _Group, src: np.ndarray, pinned: bool = False,
              holder: DeviceBlock | None = None) -> None:
        """Copy verified bytes `src` to every piece of `g` not already holding them (not
        once the receive has failed: its caller may be using the destinations again). A
        piece on a device gets them from a page-locked slot (`src` itself when `pinned`),
        and this returns once that copy completed; `holder`, a device piece the bytes were
        read from, gets no copy."""
        if self._stopped.is_set():
            raise HealError(f"{self.what}: stopped")
        addr = src.ctypes.data if src.size else 0
        ups = []
        for p in g.pieces:
            if p.dev is not None:
                if p.dev is not holder:
                    ups.append(p.dev)
            elif p.out is not None and p.out.size and p.out.ctypes.data != addr:
                np.copyto(p.out, src)
        if not ups:
            return
        what = f"tensor {g.key!r}: the copy to {ups[0].device.name}"
        if pinned:
            for block in ups:
                copy_up(src, block, self.marks.get(block.device.name), what)
            return
        with self._slot(g) as slot:
            np.copyto(slot, src)
            for block in ups:
                copy_up(slot, block, self.marks.get(block.device.name), what)

    def _slot(self, g: _Group, nbytes: int | None = None) -> Any:
        """A page-locked slot of `nbytes` (default: the chunk's) for `g`'s devices."""
        assert self.staging is not None
        return self.staging.slot(g.nbytes if nbytes is None else nbytes, g.devices.values())

    def _in_place(self, g: _Group) -> bool:
        """Whether a destination already holds the chunk (its probe first: snapshot.py)."""
        probe = self.probes.get(g.digest)
        for p in g.pieces:
            if p.dev is not None:  # its bytes copied into a slot, hashed there
                if p.live and self._in_place_on_device(g, p.dev, probe):
                    return True
                continue
            if not p.live or p.out is None or not p.out.size:
                continue
            view = memoryview(p.out.data).cast("B")
            if probe is not None and self.algorithm.digest(view[: self.probe_bytes]) != probe:
                continue
            if self.algorithm.digest(view) == g.digest:
                self._land(g, p.out)
                self.counts.add(in_place=g.nbytes, in_place_chunks=1)
                return True
        return False

    def _in_place_on_device(self, g: _Group, block: DeviceBlock, probe: str | None) -> bool:
        if not block.nbytes:
            return False
        what = f"tensor {g.key!r}: the copy from {block.device.name} to host memory"
        with self._slot(g) as slot:
            stage_to_host([(block, 0)], slot, self.marks, what)
            view = memoryview(slot.data).cast("B")
            if probe is not None and self.algorithm.digest(view[: self.probe_bytes]) != probe:
                return False
            if self.algorithm.digest(view) != g.digest:
                return False
            self._land(g, slot, pinned=True, holder=block)  # the other pieces, if any
        self.counts.add(in_place=g.nbytes, in_place_chunks=1)
        return True

    def _from_local(self, g: _Group, scratch: list[np.ndarray]) -> bool:
        if self.local is None or g.digest not in self.local.refs:
            return False
        target = g.host_target()
        if target is None and g.devices:  # read into a page-locked slot, copied up from it
            with self._slot(g) as slot:
                if not self.local.read(g.digest, slot):
                    return False
                self._land(g, slot, pinned=True)
            self.counts.add(local=g.nbytes, local_chunks=1)
            return True
        if target is None:
            target = _scratch(scratch, g.nbytes)
        if not self.local.read(g.digest, target):
            return False
        self._land(g, target)
        self.counts.add(local=g.nbytes, local_chunks=1)
        return True

    def _get(self, conn: Connection, item: _Item, scratch: list[np.ndarray]) -> None:
        """Fetch, verify and land one item (module docstring: retries, errors). An item with
        a member on a device and no new host tensor to receive into is received into a
        page-locked slot, verified there and copied up from it."""
        direct = None
        if len(item.members) == 1 and item.whole:
            direct = item.members[0][1].host_target()
        if direct is None and self.staging is not None:
            devices: dict[str, Device] = {}
            for _off, g in item.members:
                devices.update(g.devices)
            if devices:
                with self.staging.slot(item.length, devices.values()) as slot:
                    self._get_into(conn, item, slot, True)
                return
        self._get_into(conn, item, direct if direct is not None else
                       _scratch(scratch, item.length), False)

    def _get_into(self, conn: Connection, item: _Item, buf: np.ndarray, pinned: bool) -> None:
        broken = 0
        attempt = 0
        while True:
            view = memoryview(buf.data).cast("B") if item.length else memoryview(b"")
            headers = {} if item.whole else {
                "Range": f"bytes={item.start}-{item.start + item.length - 1}"}
            path = f"v1/{self.step}/{self.token}/blob/{item.blob}?t={self.transfer}"
            # one chunk: hashed piece by piece as it arrives, while the piece is in the cache
            hasher = StreamingDigest(self.algorithm) if len(item.members) == 1 else None
            try:
                resp = conn.request("GET", path, self.what, headers)
                conn.read_into(resp, view, self.what, hasher)
            except Broken as exc:
                if broken < 1 and self.deadline.left() > 0:
                    broken += 1
                    continue
                raise HealError(
                    f"live heal of step {self.step} from {self.address.url} failed: the "
                    f"sender stopped answering mid-transfer ({exc}); {self.counts.network} of "
                    f"{self.total} chunk bytes had arrived") from None
            except Refused as exc:
                raise HealError(f"live heal of step {self.step} from {self.address.url} "
                                f"failed mid-transfer: {exc.message}") from None
            self.counts.add(network=item.length)
            if hasher is not None:
                g = item.members[0][1]
                bad = [] if hasher.digest() == g.digest else [g]
            else:
                bad = [g for off, g in item.members
                       if self.algorithm.digest(view[off : off + g.nbytes]) != g.digest]
            if not bad:
                break
            if attempt >= self.retries:
                g = bad[0]
                raise IntegrityError(
                    f"tensor {g.key!r}: chunk {g.digest} from {self.address.url} failed its "
                    f"digest {attempt + 1} time(s) (corrupted on the way, or the sender's state "
                    "changed while it was served); nothing of it was loaded into a "
                    "destination tensor")
            attempt += 1
            self.counts.add(refetched=len(bad))
            log.warning("live heal: chunk %s of %r from %s failed its digest; fetching it "
                        "again", bad[0].digest, bad[0].key, self.address.url)
        for off, g in item.members:
            self._land(g, buf[off : off + g.nbytes], pinned)
        self.counts.add(network_chunks=len(item.members))

    def _post_done(self, conn: Connection) -> None:
        try:
            conn.request("POST", f"v1/{self.step}/{self.token}/done?t={self.transfer}",
                         self.what)
        except (Broken, Refused, HealError, OSError) as exc:
            log.debug("live heal: done not delivered (%s)", exc)

    # ------------------------------------------------------------------ result
    def _decode(self, manifest: Manifest, specs: dict[str, Any], values: dict[int, Any],
                dest_dtensors: dict[str, Any]) -> Any:
        for i, entry in enumerate(manifest.tensors):
            if entry.kind == "bytes" and isinstance(values[i], np.ndarray):
                values[i] = values[i].tobytes()
        dt_key = {i: k for k, i in _occurrences(manifest.tree) if k in specs}
        rebuilt: dict[int, Any] = {}
        rebuilder: dtensors.Rebuilder | None = None

        def leaf(i: int) -> Any:
            key = dt_key.get(i)
            if key is None:
                return values[i]
            if i not in rebuilt:
                if key in dest_dtensors:
                    rebuilt[i] = dest_dtensors[key]
                else:
                    nonlocal rebuilder
                    if rebuilder is None:
                        rebuilder = dtensors.Rebuilder(dest_dtensors)
                    rebuilt[i] = rebuilder.build(values[i], specs[key], key)
            return rebuilt[i]

        return tree_mod.decode(manifest.tree, leaf)


def _scratch(pool: list[np.ndarray], nbytes: int) -> np.ndarray:
    """A per-thread reusable buffer of at least `nbytes`, cut to `nbytes`."""
    if not pool or pool[0].nbytes < nbytes:
        pool[:] = [np.empty(nbytes, np.uint8)]
    return pool[0][:nbytes]


