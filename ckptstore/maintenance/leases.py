"""Leases: how saves and garbage collection in different processes keep out of each other's way.

The grace period alone does not make gc safe: with `--grace 0` a save's fresh blobs are
deleted before its manifest commits, and even with a long grace a save may reuse (or re-put)
a blob that gc has already chosen to delete. Leases close that gap (restic's lock design):

* A lease is an object ``locks/<kind>-<32 hex>.json`` in the store, kind ``save`` or ``gc``,
  holding ``{"kind", "host", "pid", "pidns", "created"}`` (no secrets). Its holder re-writes
  it every `refresh` seconds. A lease is stale, and ignored, when its object was last written
  more than `stale_after` + SKEW_MARGIN seconds ago, or at once when it was written on this
  machine, in this PID namespace (same boot id and namespace), by a process that no longer
  exists (a save killed with SIGKILL does not block gc).
* Ages are read on the store's clock, never the observer's: "now" is the modification time of
  an object the observer has just written (its own lease, or a probe). Hosts whose clocks
  disagree by minutes therefore judge every lease alike (SKEW_MARGIN covers the store's own
  granularity: S3 keeps whole seconds).
* A save (anything that writes blobs and then commits a manifest) writes its lease, then
  lists the leases; while a live gc lease exists it waits, keeping its own lease.
* gc writes its lease, then lists; if a live save lease exists it removes its own lease and
  retries every `poll` seconds until `wait` runs out, then raises LeaseBusyError.
* A request can outlive the process that sent it: on S3 a commit or a delete already on the
  wire when the holder was killed lands a moment later. So a party that finds a lease of the
  other kind whose holder just died (known dead, not yet aged out) waits the store's
  `in_flight_settle` (0 for local folders, 15 s on S3) once, removes that lease and looks
  again; only then does it trust what it lists.
* Each party writes its own lease before it lists the other's, and listings are
  read-after-write consistent (POSIX folders, S3 since 2020, MinIO), so of two racing parties
  at least one sees the other: gc never deletes while a lease-holding save is between its
  first blob write and its commit.
* Belt and braces for the case where that reasoning fails (a lease misjudged, a party that
  takes none): a gc that holds its lease writes the sweep marker ``locks/sweep.json``
  (``{"gc": <lease key>, "state": "deleting"}``, then ``"done"`` when it releases). A save
  reads the marker when it takes its lease and again just before its commit
  (`Lease.sweep_may_have_run`); if it changed, or says "deleting", the save confirms that the
  blobs it reuses from earlier checkpoints still exist before it commits.

Contract for holders: call `Lease.check()` right before an irreversible step (a commit, a
deletion batch); it raises if the lease could not be refreshed for so long that others may
consider it stale.

Why one module: the lease objects, the store clock and the rules of who waits for whom
(saves, gc, a dead holder's settle time) are one protocol (docs/format.md section 6); split,
each rule would read another module's private state.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

from ..errors import CkptStoreError, LeaseBusyError, ObjectNotFoundError, StoreError
from ..layout import LEASE_KINDS, LOCK_PREFIX, SWEEP_KEY, clock_probe_key, lease_key, lease_kind
from ..stores.base import ObjectInfo, Store

KINDS = LEASE_KINDS
STALE_AFTER = 300.0
REFRESH = 30.0
#: Added to `stale_after` before a lease counts as stale: the store clock's granularity and
#: the time between writing one's own lease and listing the others.
SKEW_MARGIN = 30.0



@dataclass(frozen=True)
class LeaseInfo:
    """A lease seen in a listing."""

    key: str
    kind: str
    age: float  # seconds since its object was last written
    holder: str  # "host:pid" when readable, else "?"
    dead: bool = False  # its process is known to be gone (same machine and PID namespace)

    def aged_out(self, stale_after: float) -> bool:
        """Not re-written for longer than any live holder could stay silent."""
        return self.age > stale_after + SKEW_MARGIN

    def live(self, stale_after: float) -> bool:
        return not self.dead and not self.aged_out(stale_after)


def _pid_namespace() -> str:
    """Boot id + PID-namespace inode: equal only for processes that see the same PIDs.
    Empty where /proc does not tell (then liveness is judged by age alone)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return ""


log = logging.getLogger("ckptstore")
_PIDNS = _pid_namespace()
_HOST = socket.gethostname()
#: (store URI, lease key) -> time.monotonic() when this process first saw its holder dead
_DEAD_SEEN: dict[tuple[str, str], float] = {}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True


def store_clock(store: Store) -> float:
    """The store's current time: the modification time of a probe object written and removed
    here. Falls back to this host's clock where nothing can be written (a read-only store:
    then nothing is deleted on its judgement either)."""
    key = clock_probe_key(uuid.uuid4().hex)
    try:
        store.put(key, b"{}")
    except CkptStoreError:
        return time.time()
    try:
        return store.stat(key).mtime
    finally:
        try:
            store.delete(key)
        except CkptStoreError:
            pass  # a stray probe is ignored by every reader


def list_leases(store: Store, stale_after: float = STALE_AFTER,
                include_stale: bool = False, now: float | None = None) -> list[LeaseInfo]:
    """Leases in `store` (live ones only unless `include_stale`), oldest first. `now` is the
    store's clock (see `store_clock`, taken here when None)."""
    if now is None:
        now = store_clock(store)
    return _judge(store, list(store.list(LOCK_PREFIX)), now, stale_after, include_stale)


def _judge(store: Store, listing: list[ObjectInfo], now: float, stale_after: float,
           include_stale: bool) -> list[LeaseInfo]:
    out = []
    for info in listing:
        kind = lease_kind(info.key)
        if kind is None:
            continue
        lease = LeaseInfo(info.key, kind, now - info.mtime, "?")
        if lease.aged_out(stale_after):  # stale whoever holds it: not worth a read
            if include_stale:
                out.append(lease)
            continue
        holder, dead = _holder(store, info)
        lease = replace(lease, holder=holder, dead=dead)
        if include_stale or not dead:
            out.append(lease)
    return sorted(out, key=lambda lease: -lease.age)


def _holder(store: Store, info: ObjectInfo) -> tuple[str, bool]:
    """("host:pid", whether that process is known to be gone)."""
    try:
        doc = json.loads(store.get(info.key))
        host, pid, pidns = doc["host"], doc["pid"], doc.get("pidns", "")
    except (CkptStoreError, ValueError, KeyError, TypeError):
        return "?", False
    dead = (bool(_PIDNS) and pidns == _PIDNS and host == _HOST and type(pid) is int
            and pid != os.getpid() and not _alive(pid))
    return f"{host}:{pid}", dead


def describe(leases: list[LeaseInfo]) -> str:
    parts = [f"{lease.holder} ({lease.age:.0f}s ago)" for lease in leases[:3]]
    more = f" and {len(leases) - 3} more" if len(leases) > 3 else ""
    return ", ".join(parts) + more


class Lease:
    """A lease held by this process. Use `acquire_save` / `acquire_gc`, or the context
    managers `save_lease` / `gc_lease`. Thread-safe; `release` is idempotent."""

    def __init__(self, store: Store, kind: str, *, stale_after: float = STALE_AFTER,
                 refresh: float | None = None) -> None:
        if kind not in KINDS:
            raise ValueError(f"lease kind must be one of {KINDS}")
        if stale_after <= 0:
            raise ValueError("stale_after must be positive")
        self.store = store
        self.kind = kind
        self.stale_after = stale_after
        self.refresh = refresh if refresh is not None else min(REFRESH, stale_after / 4)
        self.key = lease_key(kind, uuid.uuid4().hex)
        self._body = json.dumps({"kind": kind, "host": _HOST, "pid": os.getpid(),
                                 "pidns": _PIDNS, "created": time.time()},
                                sort_keys=True).encode()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_ok = 0.0
        self._lock = threading.Lock()
        self._sweeping = False  # a gc lease that has announced deletions (SWEEP_KEY)
        self._sweep_seen: bytes | None = None  # a save lease: SWEEP_KEY when it was taken

    def write(self) -> None:
        """Write (or re-write) the lease object; records when that last succeeded."""
        t = time.monotonic()
        self.store.put(self.key, self._body)
        with self._lock:
            self._last_ok = t

    def store_clock(self) -> float:
        """The store's time when this lease was last written (its object's mtime): a lower
        bound of the store's "now", so ages judged by it err on the young, safe side."""
        return self.store.stat(self.key).mtime

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.refresh):
            try:
                self.write()
            except CkptStoreError:
                pass  # `check` reports it when it matters

    def start_heartbeat(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._heartbeat, daemon=True,
                                            name=f"ckpt-lease-{self.kind}")
            self._thread.start()

    def check(self) -> None:
        """Raise StoreError if the lease may look stale to others (refresh kept failing)."""
        with self._lock:
            age = time.monotonic() - self._last_ok
        if age > self.stale_after / 2:
            raise StoreError(f"{self.kind} lease in {self.store.uri} could not be refreshed for "
                             f"{age:.0f}s; stopping before an unsafe step")

    def others(self, include_stale: bool = False) -> list[LeaseInfo]:
        """The leases of others (live ones only unless `include_stale`), judged on the
        store's clock (this lease's own mtime in the same listing)."""
        listing = list(self.store.list(LOCK_PREFIX))
        own = [info.mtime for info in listing if info.key == self.key]
        now = own[0] if own else self.store_clock()
        return [lease for lease in _judge(self.store, listing, now, self.stale_after,
                                          include_stale)
                if lease.key != self.key]

    def settle_after_dead(self, kind: str, seen: list[LeaseInfo], *,
                          block: bool = True) -> bool:
        """If a `kind` lease in `seen` (`others(include_stale=True)`) belongs to a holder
        that died recently (known dead, not aged out), let the requests it had already sent
        land: once the store's `in_flight_settle` has passed since this process first saw it
        dead (sleeping for the rest if `block`, else raising LeaseBusyError), remove those
        leases and return True: the caller must list again. False when there is nothing to
        wait for (always on stores with settle 0)."""
        settle = self.store.in_flight_settle
        if settle <= 0:
            return False
        dead = [lease for lease in seen
                if lease.kind == kind and lease.dead and not lease.aged_out(self.stale_after)]
        if not dead:
            return False
        now = time.monotonic()
        newest = max(_DEAD_SEEN.setdefault((self.store.uri, lease.key), now)
                     for lease in dead)  # the one seen last gets its full settle time too
        remaining = newest + settle - now
        if remaining > 0:
            if not block:
                raise LeaseBusyError(
                    f"a {kind} in {self.store.uri} was killed {describe(dead)}; requests it "
                    f"sent may still land for {remaining:.0f}s more")
            log.info("%s: waiting %.0fs for the last requests of a killed %s (%s) to land",
                     self.store.uri, remaining, kind, describe(dead))
            time.sleep(remaining)
        for lease in dead:
            try:
                self.store.delete(lease.key)
            except ObjectNotFoundError:
                pass
            _DEAD_SEEN.pop((self.store.uri, lease.key), None)
        return True

    # -------------------------------------------------------------- the sweep marker
    def announce_sweep(self) -> None:
        """gc leases: say that deletions may start now (see the module docstring)."""
        self._sweeping = True
        self.store.put(SWEEP_KEY, self._sweep_doc("deleting"))

    def remember_sweep(self) -> None:
        """Save leases: note the sweep marker as it is when the save starts."""
        self._sweep_seen = _read_sweep(self.store)

    def sweep_may_have_run(self) -> bool:
        """Save leases: True if a gc may have deleted blobs since `remember_sweep` (the marker
        changed, says "deleting" now or then, or cannot be read)."""
        try:
            now = _read_sweep(self.store)
        except CkptStoreError:
            return True
        return now != self._sweep_seen or any(
            m is not None and b'"state":"done"' not in m for m in (now, self._sweep_seen))

    def _sweep_doc(self, state: str) -> bytes:
        return json.dumps({"gc": self.key, "state": state}, sort_keys=True,
                          separators=(",", ":")).encode()

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        if self._sweeping:
            try:
                self.store.put(SWEEP_KEY, self._sweep_doc("done"))
            except CkptStoreError:
                pass  # "deleting" stays: saves then check the blobs they reuse
        try:
            self.store.delete(self.key)
        except CkptStoreError:
            pass  # it goes stale on its own


def _read_sweep(store: Store) -> bytes | None:
    try:
        return store.get(SWEEP_KEY)
    except ObjectNotFoundError:
        return None


def acquire_save(store: Store, *, wait: float | None = None, poll: float = 0.5,
                 stale_after: float = STALE_AFTER) -> Lease:
    """Take a save lease; wait while a live gc lease exists (at most `wait` seconds; None:
    as long as the gc keeps its lease alive). Raises LeaseBusyError when the wait runs out.
    A gc killed moments ago is waited out as well (`Lease.settle_after_dead`)."""
    lease = Lease(store, "save", stale_after=stale_after)
    lease.write()
    lease.start_heartbeat()
    deadline = None if wait is None else time.monotonic() + wait
    try:
        while True:
            seen = lease.others(include_stale=True)
            gcs = [o for o in seen if o.kind == "gc" and o.live(lease.stale_after)]
            if not gcs and lease.settle_after_dead("gc", seen):  # its last deletes may be late
                continue
            if not gcs:
                lease.remember_sweep()
                return lease
            if deadline is not None and time.monotonic() >= deadline:
                raise LeaseBusyError(f"a gc is running in {store.uri}: {describe(gcs)}")
            time.sleep(poll)
    except BaseException:
        lease.release()
        raise


def acquire_gc(store: Store, *, wait: float = 0.0, poll: float = 1.0,
               stale_after: float = STALE_AFTER, settle_block: bool = True) -> Lease:
    """Take a gc lease once no live save lease exists, retrying for at most `wait` seconds.
    Raises LeaseBusyError naming the saves in progress. A save killed moments ago is waited
    for (`Lease.settle_after_dead`); with `settle_block=False` that is LeaseBusyError too."""
    deadline = time.monotonic() + wait
    while True:
        lease = Lease(store, "gc", stale_after=stale_after)
        lease.write()
        try:
            seen = lease.others(include_stale=True)
            saves = [o for o in seen if o.kind == "save" and o.live(stale_after)]
            if not saves and lease.settle_after_dead("save", seen, block=settle_block):
                saves = [o for o in lease.others() if o.kind == "save"]  # new while it waited
        except BaseException:
            lease.release()
            raise
        if not saves:
            lease.start_heartbeat()
            try:
                lease.announce_sweep()
            except BaseException:
                lease.release()
                raise
            return lease
        lease.release()  # back off: saves have priority, so they never wait on a waiting gc
        if time.monotonic() >= deadline:
            raise LeaseBusyError(f"{len(saves)} save(s) in progress in {store.uri}: "
                                 f"{describe(saves)}; nothing was deleted")
        time.sleep(min(poll, max(0.0, deadline - time.monotonic())))


@contextmanager
def save_lease(store: Store, **kwargs: float | None) -> Iterator[Lease]:
    """`with save_lease(repo.store): repo.save(...)` — protects the save from concurrent gc."""
    lease = acquire_save(store, **kwargs)  # type: ignore[arg-type]
    try:
        yield lease
    finally:
        lease.release()


@contextmanager
def gc_lease(store: Store, *, wait: float = 0.0, poll: float = 1.0,
             settle_block: bool = True) -> Iterator[Lease]:
    """`acquire_gc` for a `with` block; released (sweep marked done) when it ends."""
    lease = acquire_gc(store, wait=wait, poll=poll, settle_block=settle_block)
    try:
        yield lease
    finally:
        lease.release()


def remove_stale(store: Store, stale_after: float = STALE_AFTER) -> int:
    """Delete stale lease objects (left by dead processes)."""
    n = 0
    for lease in list_leases(store, stale_after, include_stale=True):
        if not lease.live(stale_after):
            try:
                store.delete(lease.key)
                n += 1
            except ObjectNotFoundError:
                pass
    return n
