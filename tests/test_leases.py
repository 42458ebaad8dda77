"""Save/gc leases (maintenance/leases.py): gc never deletes while a lease-holding save is in
flight, saves wait for a running gc, stale leases of dead processes are ignored."""

from __future__ import annotations

import random
import threading
import time
import uuid

import numpy as np
import pytest

from ckptstore import CheckpointStore, StoreError
from ckptstore.maintenance import checks as maintenance
from ckptstore.maintenance.leases import (
    Lease,
    LeaseBusyError,
    acquire_gc,
    acquire_save,
    gc_lease,
    list_leases,
    remove_stale,
    save_lease,
)
from ckptstore.stores import MemoryStore


def mem() -> MemoryStore:
    return MemoryStore(uuid.uuid4().hex)


def test_gc_refuses_while_a_save_lease_is_live_and_runs_after() -> None:
    store = mem()
    with save_lease(store):
        with pytest.raises(LeaseBusyError, match="1 save"):
            acquire_gc(store, wait=0)
        assert [lease.kind for lease in list_leases(store)] == ["save"]  # gc backed off
    with gc_lease(store) as lease:
        assert lease.kind == "gc"
    assert list_leases(store) == []


def test_save_waits_for_a_running_gc() -> None:
    store = mem()
    gc = acquire_gc(store)
    with pytest.raises(LeaseBusyError, match="a gc is running"):
        acquire_save(store, wait=0, poll=0.01)
    threading.Timer(0.3, gc.release).start()
    t0 = time.monotonic()
    with save_lease(store, wait=5, poll=0.02):
        assert time.monotonic() - t0 >= 0.25
    assert list_leases(store) == []


def test_gc_retries_within_its_wait() -> None:
    store = mem()
    save = acquire_save(store)
    threading.Timer(0.3, save.release).start()
    with gc_lease(store, wait=5, poll=0.02):
        pass


def test_stale_leases_are_ignored_and_removed() -> None:
    store = mem()
    dead = Lease(store, "save")
    dead.write()  # a save whose process died: never refreshed, never released
    store.set_mtime(dead.key, time.time() - 3600)
    assert list_leases(store) == []
    with gc_lease(store, wait=0):
        pass
    assert remove_stale(store) == 1
    assert not store.exists(dead.key)


def test_heartbeat_keeps_a_lease_live_and_check_reports_a_lost_one() -> None:
    store = mem()
    lease = Lease(store, "save", stale_after=1.0, refresh=0.05)
    lease.write()
    lease.start_heartbeat()
    time.sleep(1.3)
    assert [x.key for x in list_leases(store, stale_after=1.0)] == [lease.key]
    lease.check()

    def failing_put(key: str, data: object) -> None:
        raise StoreError("network down")

    store.put = failing_put  # type: ignore[method-assign]
    time.sleep(0.7)
    with pytest.raises(StoreError, match="could not be refreshed"):
        lease.check()
    lease.release()


def test_saves_and_gcs_are_never_inside_together() -> None:
    """Racing threads: whenever a gc holds its lease, no save holds one, and vice versa."""
    store = mem()
    inside = {"save": 0, "gc": 0}
    lock = threading.Lock()
    violations: list[str] = []

    def enter(kind: str) -> None:
        with lock:
            inside[kind] += 1
            if inside["save"] and inside["gc"]:
                violations.append(str(inside))

    def leave(kind: str) -> None:
        with lock:
            inside[kind] -= 1

    def saver(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(15):
            with save_lease(store, wait=10, poll=0.001):
                enter("save")
                time.sleep(rng.random() * 0.004)
                leave("save")

    def collector(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(15):
            try:
                with gc_lease(store, wait=0.05, poll=0.001):
                    enter("gc")
                    time.sleep(rng.random() * 0.004)
                    leave("gc")
            except LeaseBusyError:
                pass

    threads = [threading.Thread(target=saver, args=(i,)) for i in range(3)]
    threads += [threading.Thread(target=collector, args=(10 + i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not violations
    assert list_leases(store) == []


class _GcBeforeCommit(MemoryStore):
    """Runs a lease-respecting `gc --grace 0` at the worst instant: every blob of a save is
    written, its manifest is not yet committed."""

    def create(self, key: str, data) -> None:  # type: ignore[override]
        if key.startswith("checkpoints/"):
            other = CheckpointStore(MemoryStore(self.uri[len("memory://"):]), create=False)
            try:
                with gc_lease(self, wait=0):
                    maintenance.gc(other.store, other.referenced_blobs, grace_seconds=0)
            except LeaseBusyError:
                pass
        super().create(key, data)


def test_a_leased_save_survives_gc_at_the_worst_instant() -> None:
    store = _GcBeforeCommit(uuid.uuid4().hex)
    repo = CheckpointStore(store)
    state = {"w": np.arange(100_000, dtype=np.float32)}
    with save_lease(store):
        repo.save("a", state)
    assert np.array_equal(repo.load("a")["w"], state["w"])


def test_a_lease_of_a_killed_process_on_this_machine_is_stale_at_once() -> None:
    import subprocess
    import sys

    store = mem()
    code = ("import json, sys; from ckptstore.maintenance.leases import Lease; "
            "from ckptstore.stores import MemoryStore; l = Lease(MemoryStore('x'), 'save'); "
            "print(l._body.decode())")
    body = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip()  # written by a process that has exited
    store.put("locks/save-" + "0" * 32 + ".json", body.encode())
    assert list_leases(store) == []
    with gc_lease(store, wait=0):
        pass
    assert remove_stale(store) == 1
    alive = Lease(store, "save")  # this process: alive, so it counts
    alive.write()
    assert [x.key for x in list_leases(store)] == [alive.key]
    alive.release()
