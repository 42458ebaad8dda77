"""A tiered store opened while its far tier (S3) is down: an endpoint on a port where nothing
listens. Saves to and restores from tier 0 go on; replication retries and
`wait_replicated` raises its error; a reopen once S3 is back finishes the replication."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import numpy as np
import pytest

import ckptstore
from ckptstore.errors import StoreError
from ckptstore.stores import LocalStore, Store
from ckptstore.tiers.lazy import LazyTier, TierUnreachableError
from ckptstore.tiers.replication import ReplicationError, RetryPolicy

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


def test_lazy_tier_opens_on_first_use_after_the_outage(tmp_path: Path) -> None:
    attempts: list[int] = []

    def opener() -> Store:
        attempts.append(1)
        if len(attempts) == 1:
            raise StoreError("connection refused")
        return LocalStore(tmp_path / "far")

    checked: list[str] = []
    tier = LazyTier("far://x", opener, lambda s: checked.append(s.uri),
                    StoreError("down at open"), retry_after=0.2)
    with pytest.raises(TierUnreachableError, match="down at open"):
        tier.exists("k")  # within retry_after: fails at once, no attempt
    assert attempts == [] and not tier.reachable
    time.sleep(0.25)
    with pytest.raises(TierUnreachableError, match="connection refused"):
        tier.put("k", b"x")
    time.sleep(0.25)
    tier.put("k", b"x")  # the far tier is back
    assert tier.reachable and tier.get("k") == b"x" and len(attempts) == 2
    assert len(checked) == 1  # the marker check ran once, on the open
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
