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


# ------------------------------------------------------------------ a killed holder's last request
def _dead_lease_body(kind: str) -> bytes:
    """A lease document written by a process that has exited (a SIGKILLed holder, in effect)."""
    import subprocess
    import sys

    code = ("from ckptstore.maintenance.leases import Lease; "
            "from ckptstore.stores import MemoryStore; "
            f"print(Lease(MemoryStore('x'), {kind!r})._body.decode())")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip().encode()


class _RemoteLikeMemoryStore(MemoryStore):
    """A memory store that says its requests can outlive their sender, as S3 does."""

    @property
    def in_flight_settle(self) -> float:
        return 5.0


class _SettleStore(MemoryStore):
    """Requests outlive their sender for 0.3 s: short enough to wait for in a test."""

    @property
    def in_flight_settle(self) -> float:
        return 0.3


@pytest.fixture(params=["memory", "moto"])
def remote_store(request: pytest.FixtureRequest):
    if request.param == "memory":
        yield _RemoteLikeMemoryStore(uuid.uuid4().hex)
        return
    from ckptstore.stores import open_store
    from tests.conftest import _ENDPOINTS

    uri = request.getfixturevalue("s3_uri")
    store = open_store(uri, endpoint_url=_ENDPOINTS[uri], in_flight_settle=5.0)
    yield store
    store.close()


def test_gc_lets_the_commit_of_a_killed_save_land_before_it_lists(
        remote_store, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save killed right after sending its commit: the commit lands on the server a moment
    after the process is gone. A gc --grace 0 that trusted the dead holder at once would list
    the manifests first, delete the new checkpoint's blobs and leave it listed but broken."""
    from ckptstore.layout import manifest_key
    from ckptstore.maintenance import leases as leases_module
    from ckptstore.maintenance.checks import TEMP_MIN_AGE

    repo = CheckpointStore(remote_store)
    old = np.arange(50_000, dtype=np.float32)
    new = np.arange(50_000, dtype=np.float32) * -3.0
    repo.save("old", {"w": old})
    repo.save("new", {"w": new})
    key = manifest_key("new")
    commit = remote_store.get(key)
    remote_store.delete(key)  # the commit is still on its way when the writer dies
    remote_store.put("locks/save-" + "1" * 32 + ".json", _dead_lease_body("save"))

    waited: list[float] = []

    def sleep_while_the_commit_lands(seconds: float) -> None:
        if not waited:
            remote_store.create(key, commit)
        waited.append(seconds)

    monkeypatch.setattr(leases_module.time, "sleep", sleep_while_the_commit_lands)
    repo.gc(grace_seconds=0, now=time.time() + 2 * TEMP_MIN_AGE)
    monkeypatch.undo()
    assert waited and 4.0 < waited[0] <= 5.0  # the store's settle time, once
    assert {info.name for info in repo.list()} == {"old", "new"}
    assert repo.verify("new").ok
    assert np.array_equal(repo.load("new")["w"], new)
    assert list_leases(remote_store, include_stale=True) == []  # the dead lease was removed
    repo.gc(grace_seconds=0, now=time.time() + 2 * TEMP_MIN_AGE)  # and is not waited for again


def test_a_local_store_does_not_wait_for_a_killed_holder(monkeypatch: pytest.MonkeyPatch,
                                                          tmp_path) -> None:
    from ckptstore.maintenance import leases as leases_module
    from ckptstore.stores import open_store

    store = open_store(str(tmp_path / "s"), create=True)
    assert store.in_flight_settle == 0.0  # a local write is done when its call returns
    store.put("locks/save-" + "2" * 32 + ".json", _dead_lease_body("save"))
    monkeypatch.setattr(leases_module.time, "sleep",
                        lambda s: pytest.fail(f"slept {s}s for a local store"))
    with gc_lease(store, wait=0):
        pass


def test_a_sweep_that_must_not_block_is_busy_until_the_settle_time_has_passed() -> None:
    store = _SettleStore(uuid.uuid4().hex)
    dead = "locks/save-" + "3" * 32 + ".json"
    store.put(dead, _dead_lease_body("save"))
    t0 = time.monotonic()
    with pytest.raises(LeaseBusyError, match="was killed"):
        acquire_gc(store, wait=0, settle_block=False)
    assert time.monotonic() - t0 < store.in_flight_settle  # it did not sleep
    assert store.exists(dead)
    time.sleep(store.in_flight_settle + 0.05)  # counted from when this process first saw it
    later = "locks/save-" + "5" * 32 + ".json"
    store.put(later, _dead_lease_body("save"))  # another one dies now: it gets its full time
    with pytest.raises(LeaseBusyError, match="was killed"):
        acquire_gc(store, wait=0, settle_block=False)
    assert store.exists(dead) and store.exists(later)
    time.sleep(store.in_flight_settle + 0.05)
    with gc_lease(store, wait=0, settle_block=False):
        pass
    assert not store.exists(dead) and not store.exists(later)


def test_a_save_waits_out_a_killed_gc_before_it_starts() -> None:
    """A gc killed mid-sweep may have deletes on their way: a save that reuses blobs must not
    start checking them until those have landed."""
    store = _SettleStore(uuid.uuid4().hex)
    store.put("locks/gc-" + "4" * 32 + ".json", _dead_lease_body("gc"))
    t0 = time.monotonic()
    with save_lease(store, wait=0):
        assert time.monotonic() - t0 >= store.in_flight_settle
    assert list_leases(store, include_stale=True) == []
