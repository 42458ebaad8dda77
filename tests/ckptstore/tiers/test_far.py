"""A tiered store opened while its far tier (S3) is down: an endpoint on a port where nothing
listens. Saves to and restores from tier 0 go on; replication retries and
`wait_replicated` raises its error; a reopen once S3 is back finishes the replication."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptstore
from ckptstore.errors import ObjectNotFoundError, StoreError
from ckptstore.stores import LocalStore, Store
from ckptstore.tiers import pending
from ckptstore.tiers.far import FarTier, TierUnreachableError
from ckptstore.tiers.replication import ReplicationError, RetryPolicy
from tests.reliability.s3chaos import ChaosServer, moto_app

FAST_RETRY = RetryPolicy(attempts=2, first_delay=0.05, max_delay=0.1)
QUICK_S3 = {"max_attempts": 1, "connect_timeout": 1.0, "read_timeout": 2.0}


def dead_endpoint() -> str:
    """http://127.0.0.1:<a port nobody listens on>."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def test_open_save_restore_while_far_tier_is_down(tmp_path: Path, s3_uri: str,
                                                  moto_endpoint: str) -> None:
    near = str(tmp_path / "near")
    w = np.arange(100_000, dtype=np.float32)
    t0 = time.monotonic()
    repo = ckptstore.CheckpointStore([near, s3_uri], endpoint_url=dead_endpoint(),
                                     replication_retry=FAST_RETRY, **QUICK_S3)
    try:
        assert not repo.tiers[1].reachable
        repo.save("a", {"w": w})  # tier 0 commits; replication fails in the background
        assert repo.latest() == "a" and repo.where("a") == [near]
        assert np.array_equal(repo.load("a")["w"], w)
        with pytest.raises(ReplicationError, match="unreachable"):
            repo.wait_replicated(timeout=60)
        assert repo.replication_pending("a")  # its record stays for the next open
    finally:
        repo.close(wait_replication=False)
    assert time.monotonic() - t0 < 30

    with ckptstore.CheckpointStore([near, s3_uri], endpoint_url=moto_endpoint) as back:
        back.wait_replicated(timeout=60)  # S3 is back: the reopen finishes the replication
        assert back.where("a") == [near, s3_uri]
        assert back.tiers[1].verify("a").ok


def test_far_tier_opens_on_first_use_after_the_outage(tmp_path: Path) -> None:
    attempts: list[int] = []

    def opener() -> Store:
        attempts.append(1)
        if len(attempts) <= 2:
            raise StoreError("connection refused")
        return LocalStore(tmp_path / "far")

    checked: list[str] = []
    tier = FarTier("far://x", opener, lambda s: checked.append(s.uri), retry_after=0.2)
    assert not tier.open_now() and not tier.reachable  # the repository's open: attempt 1
    with pytest.raises(TierUnreachableError, match="connection refused"):
        tier.put("k", b"x")  # a call on the tier itself tries: attempt 2
    assert not tier.reachable
    tier.put("k", b"x")  # the far tier is back
    assert tier.reachable and tier.get("k") == b"x" and len(attempts) == 3
    assert len(checked) == 1  # the marker check ran once, on the open
    tier.close()


def test_a_far_tier_failing_after_open_is_down_for_a_while_then_tried_again(
        tmp_path: Path) -> None:
    far = LocalStore(tmp_path / "far")
    calls: list[str] = []

    class Flaky(Store):  # a far store whose every call fails while `down`
        uri = "flaky://far"
        down = False

        def _go(self, what: str) -> None:
            calls.append(what)
            if self.down:
                raise StoreError("connection reset")

        def get(self, key: str) -> bytes:
            self._go("get")
            return far.get(key)

        def get_range(self, key: str, start: int, length: int) -> bytes:
            self._go("get_range")
            return far.get_range(key, start, length)

        def put(self, key: str, data: Any) -> None:
            self._go("put")
            far.put(key, data)

        def create(self, key: str, data: Any) -> None:
            self._go("create")
            far.create(key, data)

        def exists(self, key: str) -> bool:
            self._go("exists")
            return far.exists(key)

        def stat(self, key: str) -> Any:
            self._go("stat")
            return far.stat(key)

        def list(self, prefix: str = "") -> Any:
            self._go("list")
            return far.list(prefix)

        def delete(self, key: str) -> None:
            self._go("delete")
            far.delete(key)

    flaky = Flaky()
    tier = FarTier("flaky://far", lambda: flaky, lambda s: None, retry_after=0.2)
    assert tier.open_now() and tier.reachable
    tier.put("k", b"v")
    flaky.down = True
    with pytest.raises(TierUnreachableError, match="connection reset"):
        tier.get("k")
    assert not tier.reachable  # the repository's reads skip it now, without a request
    time.sleep(0.25)
    assert tier.reachable  # retry_after passed: the next read tries again
    with pytest.raises(TierUnreachableError):
        tier.exists("k")
    time.sleep(0.25)
    assert not tier.reachable  # twice as long after a second failure
    flaky.down = False
    with pytest.raises(ObjectNotFoundError):
        tier.get("missing")  # an answer: the tier is up again at once
    assert tier.reachable and tier.get("k") == b"v"
    tier.close()


def test_manager_saves_and_restores_while_far_tier_is_down(tmp_path: Path, s3_uri: str) -> None:
    tiers = [str(tmp_path / "near"), s3_uri]
    mgr = ckptstore.CheckpointManager(tiers, keep_last=[2, 5], endpoint_url=dead_endpoint(),
                                      replication_retry=FAST_RETRY, **QUICK_S3)
    try:
        for step in (1, 2, 3):
            mgr.save(step, {"w": np.full(1000, step, dtype=np.float32)})
        # retention ran on tier 0 only: the pending replications keep every checkpoint there
        assert sorted(mgr.steps()) == [1, 2, 3]
        into = {"w": np.zeros(1000, dtype=np.float32)}
        assert mgr.restore(into) == 3 and into["w"][0] == 3
        with pytest.raises(ReplicationError):
            mgr.wait()
    finally:
        mgr.repo.close(wait_replication=False)


# -- a far tier that goes down after the store opened (issue 21: items 1-3) ------------------
#
# The rule (docs/recovery.md, "When a far tier is down"): with a far tier unreachable,
# everything tier 0 can answer goes on; only calls that need the far tier itself fail, and
# replication catches up when it returns.


@pytest.fixture
def far_proxy() -> Any:
    """moto behind a proxy whose `plan.down` switches an outage on and off."""
    server = ChaosServer(moto_app())
    try:
        yield server
    finally:
        server.close()


def far_requests(server: Any) -> int:
    return int(server.plan.request_count)


def test_saves_load_verify_go_on_when_the_far_tier_goes_down_after_open(
        tmp_path: Path, s3_uri: str, far_proxy: Any) -> None:
    near = str(tmp_path / "near")
    w = np.arange(50_000, dtype=np.float32)
    # no replicator: every request the far tier sees comes from the calls under test
    repo = ckptstore.CheckpointStore([near, s3_uri], endpoint_url=far_proxy.endpoint,
                                     replicate=False, **QUICK_S3)
    try:
        repo.save("a", {"w": w})
        far_proxy.plan.down = True  # S3 is gone from here on
        before = far_requests(far_proxy)
        info = repo.save("b", {"w": w, "v": w + 1})  # used to raise StoreError first
        assert info.reused_bytes == w.nbytes  # still incremental against tier 0's "a"
        assert far_requests(far_proxy) == before  # a save asks the far tier nothing
        h = repo.save_async("c", {"w": w + 2})
        h.wait()
        assert repo.latest() == "c"
        assert {c.name for c in repo.list()} == {"a", "b", "c"}
        assert np.array_equal(repo.load("b")["v"], w + 1)
        report = repo.verify("c")  # tier 0's copy: used to raise
        assert report.ok and report.blobs_checked > 0
        with pytest.raises(StoreError):
            repo.verify("c", tier=1)  # that one needs the far tier itself
        assert repo.replication_pending("b") and repo.replication_pending("c")
    finally:
        repo.close(wait_replication=False)
    far_proxy.plan.down = False
    with ckptstore.CheckpointStore([near, s3_uri], endpoint_url=far_proxy.endpoint) as back:
        back.wait_replicated(timeout=60)  # the records of the outage's saves are sent now
        assert back.where("c") == [near, s3_uri] and back.tiers[1].verify("b").ok


def test_a_name_only_the_unreachable_far_tier_holds(tmp_path: Path, s3_uri: str,
                                                     far_proxy: Any, moto_endpoint: str) -> None:
    """Known on the far tier (seen by this store): refused. Unknown (written there by someone
    else meanwhile): the save proceeds on tier 0 and replication reports the conflict, never
    touching the far copy."""
    near = str(tmp_path / "near")
    repo = ckptstore.CheckpointStore([near, s3_uri], endpoint_url=far_proxy.endpoint,
                                     replication_retry=FAST_RETRY, **QUICK_S3)
    try:
        repo.save("old", {"w": np.ones(10)})
        repo.wait_replicated(timeout=60)
        repo.delete("old", tier=0)  # the far tier keeps the only copy
        with ckptstore.CheckpointStore(s3_uri, endpoint_url=moto_endpoint) as other:
            other.save("theirs", {"w": np.zeros(10)})
            theirs = other.store.get("checkpoints/theirs.json")
        far_proxy.plan.down = True
        with pytest.raises(ckptstore.CheckpointExistsError):
            repo.save("old", {"w": np.full(10, 2.0)})
        repo.save("theirs", {"w": np.full(10, 3.0)})  # cannot be checked: commits on tier 0
        assert repo.where("theirs") == [near]
        far_proxy.plan.down = False
        with pytest.raises(ReplicationError, match="exists"):
            repo.wait_replicated(timeout=60)
    finally:
        repo.close(wait_replication=False)
    with ckptstore.CheckpointStore(s3_uri, endpoint_url=moto_endpoint) as far:
        assert far.store.get("checkpoints/theirs.json") == theirs  # untouched


def test_reopen_during_an_outage_after_a_save_killed_before_its_commit(
        tmp_path: Path, s3_uri: str, far_proxy: Any) -> None:
    """A pending record without a tier-0 manifest (a save killed between its record and its
    commit) must not make the open ask the far tier (it used to raise TierUnreachableError)."""
    near = str(tmp_path / "near")
    with ckptstore.CheckpointStore([near, s3_uri], endpoint_url=far_proxy.endpoint,
                                   **QUICK_S3) as repo:
        repo.save("a", {"w": np.ones(10)})
    pending.write_record(LocalStore(near), "killed", (1,))  # the state the kill leaves
    far_proxy.plan.down = True
    repo = ckptstore.CheckpointStore([near, s3_uri], endpoint_url=far_proxy.endpoint,
                                     replication_retry=FAST_RETRY, **QUICK_S3)
    try:
        assert repo.latest() == "a" and not repo.tiers[1].reachable
        assert repo.replicating() == []  # nothing to send: "killed" never committed
        assert pending.has_record(repo.tiers[0].store, "killed")  # young: kept for now
        repo.save("b", {"w": np.zeros(10)})
    finally:
        repo.close(wait_replication=False)


def test_manager_keeps_saving_through_a_far_outage_and_catches_up(
        tmp_path: Path, s3_uri: str, far_proxy: Any, moto_endpoint: str) -> None:
    tiers = [str(tmp_path / "near"), s3_uri]
    mgr = ckptstore.CheckpointManager(tiers, keep_last=[2, 5], endpoint_url=far_proxy.endpoint,
                                      replication_retry=FAST_RETRY, **QUICK_S3)
    try:
        for step in (1, 2):
            mgr.save(step, {"w": np.full(1000, step, dtype=np.float32)})
        mgr.wait()
        far_proxy.plan.down = True
        for step in (3, 4, 5, 6):  # used to raise StoreError from the first of them
            mgr.save(step, {"w": np.full(1000, step, dtype=np.float32)})
        # tier 0 keeps every checkpoint still waiting for the far tier
        assert {3, 4, 5, 6} <= set(mgr.steps())
        into = {"w": np.zeros(1000, dtype=np.float32)}
        assert mgr.restore(into) == 6 and into["w"][0] == 6
        far_proxy.plan.down = False
        mgr.save(7, {"w": np.full(1000, 7, dtype=np.float32)})
        mgr.wait()  # replication caught up with every step saved during the outage
    finally:
        mgr.close()
    with ckptstore.CheckpointStore(s3_uri, endpoint_url=moto_endpoint) as far:
        assert sorted(far.names()) == [f"step-{s}" for s in (3, 4, 5, 6, 7)]  # keep_last 5
    with ckptstore.CheckpointStore(tiers[0]) as near:
        assert sorted(near.names()) == ["step-6", "step-7"]  # keep_last 2, all replicated


def test_a_long_outage_keeps_tier0_near_the_far_tiers_keep_last(tmp_path: Path, s3_uri: str,
                                                                 moto_endpoint: str) -> None:
    """Pending checkpoints that the far tier's policy would delete anyway once the newer
    ones arrive are not kept for it: tier 0 holds what the far tier will keep, not every
    save of the outage, and the catch-up sends only that."""
    tiers = [str(tmp_path / "near"), s3_uri]
    mgr = ckptstore.CheckpointManager(tiers, keep_last=[1, 2], endpoint_url=dead_endpoint(),
                                      replication_retry=FAST_RETRY, **QUICK_S3)
    try:
        for step in range(1, 7):
            mgr.save(step, {"w": np.full(100, step, dtype=np.float32)})
        # not 1..6: the far tier keeps only 2 (plus at most the one being sent right now,
        # which retention leaves for its next round rather than wait for the replicator)
        steps = set(mgr.steps())
        assert {5, 6} <= steps and len(steps) <= 3, steps
        assert sorted(r.name for r in pending.read_records(mgr.repo.tiers[0].store)) == [
            "step-5", "step-6"]
    finally:
        mgr.repo.close(wait_replication=False)
    with ckptstore.CheckpointManager(tiers, keep_last=[1, 2], endpoint_url=moto_endpoint) as back:
        back.wait()
        assert sorted(back.repo.tiers[1].names()) == ["step-5", "step-6"]
        assert sorted(back.repo.tiers[0].names()) == ["step-6"]
