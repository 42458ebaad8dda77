"""Replication: copying a committed checkpoint to a later tier, and the background worker.

`replicate_checkpoint(name, sources, dst)` is one step: the copy protocol of
maintenance/transfer.py for one checkpoint (idempotent, resumable; the sources, nearer
tiers, take no lease: retention never deletes a checkpoint from tier 0 while its pending
record exists, so its blobs stay referenced there, and a lease would make every retention
sweep on tier 0 skip while replication runs). A far tier never lists a checkpoint whose
chunks it lacks, at any instant.

`Replicator` runs those steps on one background thread, in submission order, retrying
transient store errors (StoreError/OSError other than integrity and conflicts) with
exponential backoff; a checkpoint whose replication gives up keeps its pending record on
tier 0 (so a reopen tries again) and its error is raised by `wait()`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..errors import (
    CheckpointExistsError,
    CkptStoreError,
    FormatError,
    IntegrityError,
    InvalidNameError,
    ReplicationError,
)
from ..format.hashing import HashAlgorithm
from ..layout import manifest_key
from ..maintenance import leases
from ..maintenance.transfer import transfer
from ..stores.base import Store
from . import pending

MiB = 1 << 20
log = logging.getLogger("ckptstore")
Progress = Callable[[int], None]


@dataclass(frozen=True)
class ReplicationResult:
    """One checkpoint copied (or found) on one tier. Byte counts are stored bytes."""

    name: str
    target: str
    created: float  # the manifest's `created` (commit order), the same on every tier
    blobs_needed: int
    blobs_sent: int
    bytes_sent: int
    already_there: bool
    seconds: float


#: errors that retrying cannot fix: bad data, a conflicting name, a bad name
PERMANENT = (IntegrityError, CheckpointExistsError, FormatError, InvalidNameError)


def replicate_checkpoint(name: str, sources: Sequence[Store], dst: Store,
                         algorithm: HashAlgorithm, *, workers: int = 8,
                         max_inflight_bytes: int = 256 * MiB,
                         progress: Progress | None = None,
                         on_total: Progress | None = None) -> ReplicationResult | None:
    """Copy checkpoint `name` from the nearest of `sources` that holds it to `dst`: the one
    copy protocol (maintenance/transfer.py), for one checkpoint. Returns None when no source
    holds the checkpoint any more (deleted)."""
    done = transfer([name], sources, dst, algorithm, workers=workers,
                    max_inflight_bytes=max_inflight_bytes, progress=progress,
                    on_total=on_total)
    if done.gone:
        return None
    return ReplicationResult(name, dst.uri, done.created[name], done.blobs_needed,
                             done.blobs_sent, done.bytes_sent, bool(done.skipped),
                             done.seconds)


@dataclass(frozen=True)
class RetryPolicy:
    """Whole-step retries of a replication (each request is already retried by the store)."""

    attempts: int = 6
    first_delay: float = 0.5
    max_delay: float = 30.0


class Replicator:
    """Background replication of checkpoints from tier 0 to later tiers (module docstring).

    `submit(name, targets)` queues a checkpoint (targets: indexes of later tiers); `wait()`
    blocks until the queue is empty and raises the first error not yet raised; `close()`
    stops the thread (after the queue drains with `wait=True`). Thread-safe.

    Catching up: a checkpoint whose replication gave up (a far tier down for longer than the
    retries last) keeps its record; once a later replication to that tier succeeds (the
    tier is back), every recorded checkpoint is queued again, and the error of one that
    then arrives is forgotten. `on_replicated(name, tier, created)` hears of each copy made
    or found on a tier."""

    def __init__(self, stores: Sequence[Store], algorithm: HashAlgorithm, *,
                 retry: RetryPolicy | None = None, workers: int = 8,
                 max_inflight_bytes: int = 256 * MiB,
                 on_replicated: Callable[[str, int, float], None] | None = None) -> None:
        if len(stores) < 2:
            raise ValueError("replication needs at least two tiers")
        self.stores = list(stores)
        self.algorithm = algorithm
        self.retry = retry or RetryPolicy()
        self.workers = workers
        self.max_inflight_bytes = max_inflight_bytes
        self.results: list[ReplicationResult] = []
        self._queue: list[tuple[str, tuple[int, ...]]] = []
        self._active: str | None = None
        self._errors: dict[str, ReplicationError] = {}  # by name, until it arrives after all
        self._gave_up: set[int] = set()  # tiers with a replication that gave up since
        self._on_replicated = on_replicated
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ queue
    def submit(self, name: str, targets: Sequence[int]) -> None:
        todo = tuple(sorted({t for t in targets if 0 < t < len(self.stores)}))
        if not todo:
            return
        with self._cond:
            if self._closed:
                raise CkptStoreError("the replicator is closed")
            if (name, todo) not in self._queue:
                self._queue.append((name, todo))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="ckpt-replicate")
                self._thread.start()
            self._cond.notify_all()

    def resume(self) -> list[str]:
        """Queue every checkpoint with a pending record on tier 0 (after a crash or a
        failed replication). Drops records of saves that never committed anywhere (older
        than pending.ORPHAN_AGE). Returns the names queued."""
        queued: list[str] = []
        near = self.stores[0]
        records = pending.read_records(near)
        if not records:
            return queued
        now: float | None = None
        for rec in records:
            # Only tier 0 is asked: the record is written before the tier-0 commit, and
            # every later tier is fed from tier 0, so a record whose checkpoint tier 0 does
            # not hold belongs to a save that never committed (or one still running in
            # another process, if young). A far tier that is down is never asked here.
            if not near.exists(manifest_key(rec.name)):
                now = leases.store_clock(near) if now is None else now
                if now - rec.mtime > pending.ORPHAN_AGE:
                    pending.clear_record(near, rec.name)
                continue
            self.submit(rec.name, rec.tiers)
            queued.append(rec.name)
        return queued

    def cancel(self, name: str) -> None:
        """Drop `name` from the queue and wait until a step replicating it has ended (so a
        deletion is not undone by a replication that read the manifest before)."""
        with self._cond:
            self._queue = [(n, t) for n, t in self._queue if n != name]
            while self._active == name:
                self._cond.wait()

    def discard(self, name: str) -> None:
        """Drop `name` from the queue without waiting (a replication of it in progress goes
        on): its record no longer asks for it."""
        with self._cond:
            self._queue = [(n, t) for n, t in self._queue if n != name]

    def pending(self) -> list[str]:
        """Names queued or being replicated, in order."""
        with self._cond:
            active = [self._active] if self._active is not None else []
            return active + [n for n, _t in self._queue if n not in active]

    def is_pending(self, name: str) -> bool:
        return name in self.pending()

    def wait(self, timeout: float | None = None) -> None:
        """Block until nothing is queued or running; raise the first ReplicationError not
        raised before (TimeoutError if `timeout` runs out first)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or self._active is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"replication still running after {timeout}s: "
                                       f"{self.pending()}")
                self._cond.wait(left)
            if self._errors:
                first = next(iter(self._errors.values()))
                self._errors = {}
                raise first

    def close(self, wait: bool = True) -> None:
        """Stop the worker. With `wait`, first let it finish the queue (errors are then
        raised as by `wait()`); without, queued work is left to the next open (its pending
        records stay on tier 0) and a step in progress is abandoned at its next check."""
        try:
            if wait:
                self.wait()
        finally:
            with self._cond:
                self._closed = True
                self._queue.clear()
                self._cond.notify_all()
                thread = self._thread
            if thread is not None and wait:
                thread.join()

    # ------------------------------------------------------------------ worker
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                name, targets = self._queue.pop(0)
                self._active = name
            try:
                self._replicate_all(name, targets)
            finally:
                with self._cond:
                    self._active = None
                    self._cond.notify_all()

    def _replicate_all(self, name: str, targets: tuple[int, ...]) -> None:
        catch_up = False
        for t in targets:
            try:
                result = self._with_retries(name, t)
            except ReplicationError as exc:
                log.error("%s", exc)
                with self._cond:
                    self._errors[name] = exc
                    self._gave_up.add(t)
                return  # later tiers are fed from nearer ones: stop here, record stays
            if result is None:
                break  # deleted meanwhile
            with self._cond:
                self.results.append(result)
                catch_up = catch_up or t in self._gave_up
                self._gave_up.discard(t)
            if self._on_replicated is not None:
                self._on_replicated(name, t, result.created)
        with self._cond:
            self._errors.pop(name, None)
        try:
            pending.clear_record(self.stores[0], name)
        except CkptStoreError as exc:  # a stale record only costs a no-op replication later
            log.warning("could not clear the pending record of %r: %s", name, exc)
        if catch_up:  # a tier is back: send what gave up while it was down
            log.info("a far tier is reachable again; replicating what waited for it")
            try:
                self.resume()
            except CkptStoreError as exc:  # tried again at the next catch-up or open
                log.warning("could not queue the pending replications: %s", exc)

    def _with_retries(self, name: str, target: int) -> ReplicationResult | None:
        policy = self.retry
        delay = policy.first_delay
        dst = self.stores[target]
        for attempt in range(1, policy.attempts + 1):
            try:
                return replicate_checkpoint(name, self.stores[:target], dst, self.algorithm,
                                            workers=self.workers,
                                            max_inflight_bytes=self.max_inflight_bytes)
            except PERMANENT as exc:
                raise ReplicationError(name, dst.uri, exc, attempt) from exc
            except (OSError, CkptStoreError) as exc:
                if attempt == policy.attempts:
                    raise ReplicationError(name, dst.uri, exc, attempt) from exc
                log.warning("replication of %r to %s failed (%s: %s); retrying in %.1fs",
                            name, dst.uri, type(exc).__name__, exc, delay)
                with self._cond:
                    if self._cond.wait_for(lambda: self._closed, delay):
                        raise ReplicationError(name, dst.uri, exc, attempt) from exc
                delay = min(delay * 2, policy.max_delay)
        raise AssertionError("unreachable")
