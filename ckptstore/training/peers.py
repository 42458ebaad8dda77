"""Peer replicas: each rank's tier-0 checkpoint also held on the tier 0 of ranks on other
nodes, sent over the checkpoint process group (gloo; JSON headers and uint8 tensors, no
pickle), and fetched back from them when a rank lost its folder (docs/recovery.md).

In peer mode every rank has its own tiered repository (`{rank}`/`{node}` in the tier URIs)
and saves its own state as an ordinary checkpoint there. Rank r's copies go to the ranks
`(r + k * ranks_per_node) % world`, k = 1..replicas, which keep them in a nested ordinary
repository `<their tier 0>/peers/rank-<r>` (content addressed: what they hold already is not
sent). Every function here is collective: all ranks call it, in the same order.

Exchange (`replicate`) of checkpoint `name`:
  1. all-gather {ok, manifest, blobs: {digest: size}} (a rank whose save failed sends ok=false:
     nobody sends or waits for its part);
  2. each receiver all-gathers the digests it lacks per sender;
  3. every missing blob travels as one uint8 tensor (isend / irecv pairs in a fixed order);
  4. the receiver re-hashes each blob against its name (IntegrityError otherwise: nothing
     committed), writes it, syncs, then creates the sender's manifest create-only.

Restore (`fetch`): a rank whose tier 0 lacks the chosen checkpoint gets manifest and the blobs
its tier 0 lacks from the first live holder of its copy. They stay in memory
(`ReceivedBlobs`): the state is loaded straight from them (the load verifies every chunk it
reads; a bad or missing one comes from tier 0, then the far tier), and only then `persist`
re-hashes each blob against its name and writes it to tier 0 in the background (blobs, sync,
manifest last), which makes the checkpoint whole there again; `settle` waits for that write
(the manager calls it before its next save, restore or wait). A failed write (or a corrupt
blob) is a warning and commits no manifest: the copy on the peer and the far tier are
untouched.

Why one module: the peer exchange is one collective protocol (headers, wants, transfers, the
restore's agreement) that every rank runs in the same order; split, the order would be
spread over files.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..errors import (
    CkptStoreError,
    CollectiveError,
    FormatError,
    IntegrityError,
    ObjectExistsError,
    ObjectNotFoundError,
    PeerExchangeError,
    UnrestorableCheckpointError,
)
from ..format.manifest_parse import parse_manifest
from ..format.names import validate_key, validate_prefix
from ..layout import blob_key, manifest_key
from ..pipeline.options import METADATA_THREADS
from ..repository import CheckpointStore
from ..stores.base import Buffer, ObjectInfo, Store, check_range, short_read
from .distributed import all_gather_json

#: blob bytes moved per round of point-to-point transfers (memory bound of an exchange)
ROUND_BYTES = 256 << 20


def ranks_per_node() -> int:
    """Ranks sharing a node: $LOCAL_WORLD_SIZE (torchrun sets it), else 1 (tests: one folder
    per rank stands for one node)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


@dataclass(frozen=True)
class PeerMap:
    """Who holds whose copies."""

    world: int
    per_node: int
    replicas: int

    def __post_init__(self) -> None:
        nodes = self.world // self.per_node
        if self.replicas < 1 or nodes < self.replicas + 1:
            raise ValueError(f"peer_replicas={self.replicas} needs at least "
                             f"{self.replicas + 1} nodes; this job has {nodes} "
                             f"({self.world} ranks, {self.per_node} per node)")

    def holders(self, rank: int) -> list[int]:
        """The ranks holding copies of `rank`'s checkpoints, first choice first."""
        return [(rank + k * self.per_node) % self.world for k in range(1, self.replicas + 1)]

    def held_by(self, rank: int) -> list[int]:
        """The ranks whose copies `rank` holds."""
        return [r for r in range(self.world) if rank in self.holders(r)]


class PeerReplicas:
    """The peer side of one rank's CheckpointManager (module docstring)."""

    def __init__(self, repo: CheckpointStore, group: Any, peers: PeerMap) -> None:
        self.repo = repo
        self.group = group
        self.map = peers
        self.rank = dist.get_rank()
        root = repo.tiers[0].store
        self._copies: dict[int, CheckpointStore] = {}
        self._persisting: cf.Future[None] | None = None
        self._writer = cf.ThreadPoolExecutor(1, thread_name_prefix="ckpt-peer-persist")
        for sender in peers.held_by(self.rank):
            self._copies[sender] = CheckpointStore(_nested(root, f"peers/rank-{sender}"),
                                                   hash=repo.hash.name)

    def copies_of(self, sender: int) -> CheckpointStore:
        return self._copies[sender]

    def close(self) -> None:
        try:
            self.settle()
        finally:
            self._writer.shutdown(wait=True)
            for copy in self._copies.values():
                copy.close()

    # ------------------------------------------------------------------ save side
    def replicate(self, name: str, ok: bool) -> int:
        """Send this rank's checkpoint `name` to its holders and store the copies this rank
        holds (collective). `ok`: this rank's save committed. Returns bytes received."""
        header: dict[str, Any] = {"ok": False}
        if ok:
            near = self.repo.tiers[0]
            raw = near.store.get(manifest_key(name))
            manifest = near.manifest(name)
            header = {"ok": True, "manifest": raw.decode(),
                      "blobs": _sizes(near.store, manifest)}
        headers = self._gather_for_save(header, name)
        wants: dict[str, list[str]] = {}
        for sender, copy in self._copies.items():
            h = headers[sender]
            if h["ok"] and not copy.exists(name):
                wants[str(sender)] = _missing(copy.store, sorted(h["blobs"]))
        all_wants = self._gather_for_save(wants, name)
        try:
            received = self._transfer(headers, all_wants,
                                      lambda sender: self._copies[sender].store)
        except (CkptStoreError, RuntimeError) as exc:  # this rank's save itself committed
            warnings.warn(f"the peer copies of checkpoint {name!r} held by rank {self.rank} "
                          f"were not stored: {exc}", RuntimeWarning, stacklevel=2)
            return 0
        for sender, copy in self._copies.items():
            h = headers[sender]
            if h["ok"] and str(sender) in wants:
                copy.store.sync()
                copy.store.create(manifest_key(name), h["manifest"].encode())
        return received

    def prune_copies(self, sender: int, keep: set[str]) -> None:
        """Drop the copies held for `sender` not in `keep` (names) and sweep their blobs."""
        copy = self._copies[sender]
        dropped = [n for n in copy.names() if n not in keep]
        if dropped:
            doomed: set[str] = set()
            for n in dropped:
                try:
                    doomed |= copy.manifest(n).blob_digests()
                    copy.delete(n)
                except (FileNotFoundError, FormatError):  # gone, or unreadable: left alone
                    continue
            try:
                still = copy.referenced_blobs()
            except CkptStoreError:  # an unreadable manifest could use any blob: keep them
                return
            copy.store.delete_many(blob_key(blob) for blob in sorted(doomed - still))
            copy.store.sync()

    # ------------------------------------------------------------------ restore side
    def held_steps(self) -> dict[int, list[Held]]:
        """{sender rank: the copies this rank holds for it that are whole}: a manifest that
        parses and every blob it references present at its size (a damaged or partial copy
        is not offered, so that the restore takes another holder or the far tier)."""
        out: dict[int, list[Held]] = {}
        for sender, copy in self._copies.items():
            out[sender] = [held for name in copy.names()
                           if (held := _whole(copy, name)) is not None]
        return out

    def _gather(self, obj: Any, what: str) -> list[Any]:
        """all_gather_json on the peer group during a restore; a rank that left or stopped
        answering (within the group's timeout) is an UnrestorableCheckpointError."""
        try:
            return all_gather_json(obj, self.group)
        except CollectiveError as exc:
            raise UnrestorableCheckpointError(
                f"the restore stopped while the ranks {what}: a rank left or did not answer "
                f"within the peer timeout ({_short(exc)}); nothing usable was loaded") from exc

    def _gather_for_save(self, obj: Any, name: str) -> list[Any]:
        try:
            return all_gather_json(obj, self.group)
        except CollectiveError as exc:
            raise PeerExchangeError(
                f"checkpoint {name!r} is committed on rank {self.rank}, but its copy to the "
                f"peers stopped: a rank left or did not answer within the peer timeout "
                f"({_short(exc)})") from exc

    def agree(self, outcome: str | None) -> list[str | None]:
        """Every rank's outcome of loading the chosen step (None: loaded whole)."""
        return self._gather(outcome, "compared their loads")

    def gather_views(self, mine: dict[str, Any]) -> list[dict[str, Any]]:
        return self._gather(mine, "listed their checkpoints")

    def fetch(self, name: str) -> ReceivedBlobs | None:
        """Collective: every rank whose tier 0 lacks `name` gets it from the first holder of
        its copy whose copy is whole: manifest and blobs, in memory (load from them, then
        `persist`; the load verifies every chunk, and a bad one comes from the tiers). None
        on a rank that needed nothing, that no peer could serve, or whose transfer failed
        (a warning names the holder; the load then falls back to the far tier)."""
        self.settle()
        near = self.repo.tiers[0]
        need = not near.exists(name)
        held = {str(s): _whole(c, name) is not None for s, c in self._copies.items()}
        status = self._gather({"need": need, "held": held}, "looked for peer copies")
        source = {}
        for r, st in enumerate(status):
            if st["need"]:
                for h in self.map.holders(r):
                    if status[h]["held"].get(str(r)):
                        source[r] = h
                        break
        offer: dict[str, Any] = {}
        for r, h in source.items():
            if h == self.rank:
                try:
                    copy = self._copies[r]
                    raw = copy.store.get(manifest_key(name))
                    offer[str(r)] = {"manifest": raw.decode(),
                                     "blobs": _sizes(copy.store, copy.manifest(name))}
                except CkptStoreError as exc:  # damaged since it was checked: no offer
                    warnings.warn(f"rank {self.rank}'s copy of rank {r}'s checkpoint {name!r} "
                                  f"cannot be sent: {exc}", RuntimeWarning, stacklevel=2)
        offers = self._gather(offer, "offered peer copies")
        wants: dict[str, list[str]] = {}
        holder = source.get(self.rank)
        mine = offers[holder].get(str(self.rank)) if holder is not None else None
        if mine is not None:
            try:
                parse_manifest(mine["manifest"].encode(), name, self.repo.hash)
                wants[str(holder)] = _missing(near.store, sorted(mine["blobs"]))
            except CkptStoreError as exc:
                warnings.warn(f"the copy of checkpoint {name!r} offered by rank {holder} is "
                              f"damaged ({exc}); loading from this rank's own tiers",
                              RuntimeWarning, stacklevel=2)
                mine = None
        all_wants = self._gather(wants, "asked for peer blobs")
        received = ReceivedBlobs(f"peer://rank-{holder if holder is not None else -1}"
                                 f"/for-{self.rank}")
        try:
            self._transfer_fetch(offers, all_wants, received)
        except (CkptStoreError, RuntimeError) as exc:
            who = f"rank {holder}" if mine is not None else "a peer"
            warnings.warn(f"receiving checkpoint {name!r} from {who} failed or timed out "
                          f"({_short(exc)}); loading from this rank's own tiers",
                          RuntimeWarning, stacklevel=2)
            return None
        if mine is None:
            return None
        received.create(manifest_key(name), mine["manifest"].encode())
        return received

    def persist(self, name: str, received: ReceivedBlobs) -> None:
        """Write what `fetch` received to tier 0 in the background: blobs, sync, then the
        manifest create-only (a crash in between leaves only unreferenced blobs)."""
        self.settle()
        self._persisting = self._writer.submit(self._persist, name, received)

    def settle(self) -> None:
        """Wait for the background write of `persist`; its failure is a warning (the
        checkpoint still lives on the peer and, once replicated, on the far tier)."""
        job, self._persisting = self._persisting, None
        if job is None:
            return
        try:
            job.result()
        except CkptStoreError as exc:
            warnings.warn(f"writing the checkpoint received from a peer to "
                          f"{self.repo.tiers[0].uri} failed: {exc}", RuntimeWarning,
                          stacklevel=2)

    def _persist(self, name: str, received: ReceivedBlobs) -> None:
        store = self.repo.tiers[0].store
        blobs = [k for k in received.keys() if k != manifest_key(name)]

        def write(key: str) -> None:
            data = received.view(key)
            if blob_key(self.repo.hash.digest(data)) != key:
                raise IntegrityError(f"{key} received from a peer is corrupt; checkpoint "
                                     f"{name!r} was not written to tier 0")
            store.put(key, data)

        with cf.ThreadPoolExecutor(self.repo.save_options.workers,
                                   thread_name_prefix="ckpt-peer-write") as pool:
            list(pool.map(write, blobs))
        store.sync()
        store.create(manifest_key(name), received.get(manifest_key(name)))

    # ------------------------------------------------------------------ transfers
    def _transfer(self, headers: list[dict[str, Any]], all_wants: list[dict[str, list[str]]],
                  dest_of: Any) -> int:
        """Senders send each receiver the blobs it asked for; receivers verify and write."""
        plan = []  # (sender, receiver, digest, size)
        for receiver, wants in enumerate(all_wants):
            for sender_s, digests in wants.items():
                sender = int(sender_s)
                for d in digests:
                    plan.append((sender, receiver, d, int(headers[sender]["blobs"][d])))
        return self._run_plan(plan, lambda s, r, d: self.repo.tiers[0].store,
                              lambda s, r, d: dest_of(s))

    def _transfer_fetch(self, offers: list[dict[str, Any]],
                        all_wants: list[dict[str, list[str]]], into: ReceivedBlobs) -> int:
        plan = []
        for receiver, wants in enumerate(all_wants):
            for holder_s, digests in wants.items():
                holder = int(holder_s)
                sizes = offers[holder][str(receiver)]["blobs"]
                for d in digests:
                    plan.append((holder, receiver, d, int(sizes[d])))
        return self._run_plan(plan, lambda s, r, d: self._copies[r].store,
                              lambda s, r, d: into, verify=False)

    def _run_plan(self, plan: list[tuple[int, int, str, int]], src_of: Any, dst_of: Any,
                  verify: bool = True) -> int:
        """Run the blob moves of `plan` in rounds of at most ROUND_BYTES (the same rounds on
        every rank: the plan is global), two rounds in flight: round k+1 is read and posted
        before round k is awaited, and round k is verified and written while k+1 travels.
        Memory: about two rounds. Errors are raised once every posted transfer ended.
        `verify=False`: the receiver stores without hashing (its caller verifies later)."""
        rounds: list[list[tuple[int, int, str, int]]] = []
        start, total = 0, 0
        for i, move in enumerate(plan):
            total += move[3]
            if total >= ROUND_BYTES or i == len(plan) - 1:
                rounds.append(plan[start : i + 1])
                start, total = i + 1, 0
        received = 0
        previous: _Round | None = None
        error: BaseException | None = None
        with cf.ThreadPoolExecutor(self.repo.save_options.workers,
                                   thread_name_prefix="ckpt-peer") as pool:
            for moves in rounds + [[]]:
                current = self._post(moves, src_of, dst_of) if moves else None
                if previous is not None:
                    previous.wait()
                    try:
                        if error is None:
                            received += sum(pool.map(lambda item: self._store_one(
                                item, verify), previous.inbound))
                    except BaseException as exc:  # keep draining: the others are posted
                        error = exc
                previous = current
        if error is not None:
            raise error
        return received

    def _post(self, plan: list[tuple[int, int, str, int]], src_of: Any, dst_of: Any
              ) -> _Round:
        """Post the sends (read straight into their tensors) and receives of this rank."""
        ops: list[Any] = []
        inbound: list[tuple[torch.Tensor, str, Store]] = []
        outbound: list[torch.Tensor] = []
        reads: list[tuple[Store, str, torch.Tensor]] = []
        for sender, receiver, digest, size in plan:
            if sender == self.rank and receiver != self.rank:
                t = torch.empty(size, dtype=torch.uint8)
                if size:
                    reads.append((src_of(sender, receiver, digest), digest, t))
                outbound.append(t)
                ops.append(dist.P2POp(dist.isend, t, receiver, self.group))
            elif receiver == self.rank and sender != self.rank:
                buf = torch.empty(size, dtype=torch.uint8)
                inbound.append((buf, digest, dst_of(sender, receiver, digest)))
                ops.append(dist.P2POp(dist.irecv, buf, sender, self.group))
        if reads:  # straight into the send tensors, in parallel
            with cf.ThreadPoolExecutor(self.repo.load_options.workers,
                                       thread_name_prefix="ckpt-peer-read") as pool:
                list(pool.map(_read_or_zeros, reads))
        works = dist.batch_isend_irecv(ops) if ops else []
        return _Round(works, inbound, outbound)

    def _store_one(self, item: tuple[torch.Tensor, str, Store], verify: bool = True) -> int:
        buf, digest, store = item
        data = buf.numpy().data
        if verify and self.repo.hash.digest(data) != digest:
            raise IntegrityError(f"blob {digest} received from a peer is corrupt; its copy "
                                 "was not committed")
        store.put(blob_key(digest), data)
        return len(data)


@dataclass
class _Round:
    """Posted transfers of one round; `outbound` keeps the send tensors alive."""

    works: list[Any]
    inbound: list[tuple[torch.Tensor, str, Store]]
    outbound: list[torch.Tensor]

    def wait(self) -> None:
        for work in self.works:
            work.wait()


class ReceivedBlobs(Store):
    """Objects received from a peer, held in memory without a copy (a `put` keeps the
    caller's buffer): the `prefer` store of a restore, filled by `fetch`. A Store like any
    other (the contract suite runs on it): keys validated, `create` create-only. Thread-safe.
    """

    def __init__(self, uri: str) -> None:
        self.uri = uri
        self._objects: dict[str, memoryview] = {}
        self._mtime = time.time()
        self._lock = threading.Lock()

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._objects)

    def view(self, key: str) -> memoryview:
        validate_key(key)
        with self._lock:
            found = self._objects.get(key)
        if found is None:
            raise ObjectNotFoundError(f"{self.uri}: no object {key!r}")
        return found

    def get(self, key: str) -> bytes:
        return bytes(self.view(key))

    def get_range(self, key: str, start: int, length: int) -> bytes:
        out = bytearray(length)
        self.read_into(key, start, memoryview(out))
        return bytes(out)

    def read_into(self, key: str, start: int, out: memoryview) -> None:
        check_range(key, start, len(out))
        data = self.view(key)
        if start + len(out) > len(data):
            raise short_read(key, start, len(out), max(0, len(data) - start))
        out[:] = data[start : start + len(out)]

    def put(self, key: str, data: Buffer) -> None:
        view = memoryview(data).cast("B")
        validate_key(key)
        with self._lock:
            self._objects[key] = view

    def create(self, key: str, data: Buffer) -> None:
        view = memoryview(data).cast("B")
        validate_key(key)
        with self._lock:
            found = self._objects.get(key)
            if found is None:
                self._objects[key] = view
                return
        if bytes(found) != bytes(view):
            raise ObjectExistsError(f"{self.uri}: {key!r} exists")

    def exists(self, key: str) -> bool:
        validate_key(key)
        with self._lock:
            return key in self._objects

    def stat(self, key: str) -> ObjectInfo:
        return ObjectInfo(key, len(self.view(key)), self._mtime)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        validate_prefix(prefix)
        for key in sorted(self.keys()):
            if key.startswith(prefix):
                yield ObjectInfo(key, len(self._objects[key]), self._mtime)

    def delete(self, key: str) -> None:
        validate_key(key)
        with self._lock:
            self._objects.pop(key, None)


@dataclass(frozen=True)
class RestoreChoice:
    """What a peer-mode restore may load (`choose_steps`), the same on every rank."""

    candidates: list[int]  # whole on every rank and saved by this world size, newest first
    reason: str  # why there is no candidate ("" when there is one)
    history: bool  # some rank can obtain some checkpoint


def choose_steps(views: list[dict[str, Any]], world: int) -> RestoreChoice:
    """The steps every rank can restore. `views[r]` is rank r's report: `own`, the
    [step, created, world size saved with] it can read from its own tiers, and `held`,
    {sender rank: the same for the whole copies it holds for that rank}. A step qualifies
    if every rank can obtain it (its own tiers or a holder's whole copy) and it was saved by
    `world` ranks (peer-mode checkpoints are per rank: another number of ranks cannot use
    them). Candidates are ordered newest first in commit order (the newest `created` of any
    copy), as `latest_step()` on one process."""
    obtainable: list[dict[int, int | None]] = [{} for _ in range(world)]
    when: dict[int, float] = {}
    for r, view in enumerate(views):
        reports = [(r, view["own"])] + [(int(s), held) for s, held in view["held"].items()]
        for owner, entries in reports:
            for step, created, saved_by in entries:
                if 0 <= owner < world:
                    obtainable[owner].setdefault(step, saved_by)
                when[step] = max(when.get(step, created), created)
    history = any(obtainable)
    common = set.intersection(*(set(o) for o in obtainable)) if world else set()
    fits = {s for s in common if all(o[s] in (None, world) for o in obtainable)}
    candidates = sorted(fits, key=lambda s: (when[s], s), reverse=True)
    if candidates or not history:
        return RestoreChoice(candidates, "", history)
    problems = []
    saved = sorted({w for o in obtainable for w in o.values() if w not in (None, world)})
    if saved:
        problems.append(f"the checkpoints found were saved by {', '.join(map(str, saved))} "
                        f"rank(s) and this job has {world} (peer-mode checkpoints are per "
                        "rank: restart with that many ranks)")
    empty = [r for r, o in enumerate(obtainable) if not o]
    if empty:
        problems.append(f"rank(s) {', '.join(map(str, empty))} can obtain no checkpoint from "
                        "their own tiers or a peer's copy")
    if not problems:
        problems.append("no step is whole on every rank (" + "; ".join(
            f"rank {r}: {sorted(o) or 'none'}" for r, o in enumerate(obtainable)) + ")")
    newest = sorted(when, key=lambda s: (when[s], s))[-3:]
    reason = (f"checkpoints exist (newest: steps {', '.join(map(str, newest))}) but none can "
              f"be restored on all {world} ranks: {'; '.join(problems)}. Nothing was loaded. "
              "To start over instead, call restore(..., fresh_ok=True): the old checkpoints "
              "are then kept, never deleted by retention")
    return RestoreChoice([], reason, history)


def _read_or_zeros(read: tuple[Store, str, torch.Tensor]) -> None:
    """Read a blob into its send tensor; one that cannot be read is sent as zeros (the
    receiver verifies every blob, and falls back where it does not match), so that the
    transfer the other rank waits for still happens."""
    store, digest, out = read
    try:
        store.read_into(blob_key(digest), 0, out.numpy().data)
    except CkptStoreError as exc:
        out.zero_()
        warnings.warn(f"blob {digest} could not be read for a peer ({exc}); sent as zeros, "
                      "which the receiver rejects", RuntimeWarning, stacklevel=2)


@dataclass(frozen=True)
class Held:
    """A checkpoint a rank can restore: its step name, commit time and the world size it
    was saved with (from its metadata; None if it does not say)."""

    name: str
    created: float
    world: int | None


def _whole(repo: CheckpointStore, name: str) -> Held | None:
    """`name` in `repo` if its manifest parses and every blob it references is there at its
    size (stat only: no blob is read), else None."""
    manifest = repo.find_manifest(name)
    if manifest is None:
        return None
    try:
        sizes = _sizes(repo.store, manifest)
    except CkptStoreError:
        return None
    if any(sizes.get(b, -1) < n for b, n in manifest.blob_extents().items()):
        return None
    world = manifest.metadata.get("world_size")
    return Held(name, manifest.created, world if type(world) is int else None)


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def _sizes(store: Store, manifest: Any) -> dict[str, int]:
    """{blob: its size in `store`} for every blob the manifest references (the stored size:
    a pack may be longer than the members this manifest uses)."""
    blobs = sorted(manifest.blob_digests())
    with cf.ThreadPoolExecutor(METADATA_THREADS) as pool:
        sizes = list(pool.map(lambda b: store.stat(blob_key(b)).size, blobs))
    return dict(zip(blobs, sizes))


def _missing(store: Store, digests: list[str]) -> list[str]:
    with cf.ThreadPoolExecutor(METADATA_THREADS) as pool:
        present = list(pool.map(lambda d: store.exists(blob_key(d)), digests))
    return [d for d, ok in zip(digests, present) if not ok]


def _nested(store: Store, prefix: str) -> Store:
    """A store for the folder `prefix` under a local tier 0 (peer copies live with the node
    and are lost with it)."""
    from ..stores.local import LocalStore

    if not isinstance(store, LocalStore):
        raise CkptStoreError(f"peer replicas need a local folder as tier 0, not {store.uri}")
    return LocalStore(store.root / prefix)

