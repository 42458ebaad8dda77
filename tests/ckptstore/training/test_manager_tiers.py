"""CheckpointManager over tiers: per-tier intervals and retention, no tier-0 deletion before
replication, no loss of a last copy, restore from whatever tier is whole."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptstore
from ckptstore.tiers.replication import ReplicationError, RetryPolicy
from ckptstore.training.retention import TieredRetention
from tests.reliability.s3chaos import ChaosServer, moto_app


def steps_on(mgr: Any, tier: int) -> list[int]:
    return sorted(int(n.split("-")[1]) for n in mgr.repo.tiers[tier].names())


def model_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(200, 50, generator=g), "b": torch.randn(50, generator=g)}


def test_every_and_keep_last_per_tier(tmp_path: Path) -> None:
    uris = [str(tmp_path / "near"), str(tmp_path / "far")]
    with ckptstore.CheckpointManager(uris, keep_last=[2, 3], every=[1, 3]) as mgr:
        for step in range(1, 11):
            mgr.save(step, model_state(step))
        mgr.wait()
        assert steps_on(mgr, 0) == [9, 10]
        assert steps_on(mgr, 1) == [4, 7, 10]  # saves 1, 4, 7, 10 went far; the last 3 kept
    # a restarted job resumes the interval count from the listings
    with ckptstore.CheckpointManager(uris, keep_last=[2, 3], every=[1, 3]) as mgr:
        for step in range(11, 14):
            mgr.save(step, model_state(step))
        mgr.wait()
        assert steps_on(mgr, 1) == [7, 10, 13]


def test_bad_policies_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="every\\[0\\]"):
        TieredRetention.of(2, None, None, [2, 10])
    with pytest.raises(ValueError, match="2 tier"):
        TieredRetention.of(2, [1, 2, 3], None, 1)
    with pytest.raises(ValueError, match="positive"):
        TieredRetention.of(2, [1, 0], None, 1)


def test_tier0_keeps_what_is_not_replicated_yet(tmp_path: Path, s3_uri: str) -> None:
    server = ChaosServer(moto_app())
    try:
        uris = [str(tmp_path / "near"), s3_uri]
        repo = ckptstore.CheckpointStore(uris, endpoint_url=server.endpoint, max_attempts=1,
                                         replication_retry=RetryPolicy(2, 0.02, 0.05))
        server.plan.add("503", "PUT", "", times=100_000)  # the far tier refuses every write
        mgr = ckptstore.CheckpointManager(repo, keep_last=[1, 5])
        for step in range(1, 4):
            mgr.save(step, model_state(step))
        with pytest.raises(ReplicationError):
            mgr.wait()
        assert steps_on(mgr, 0) == [1, 2, 3]  # nothing reached far: tier 0 deletes nothing
        assert steps_on(mgr, 1) == []
        server.plan.reset()
        repo.replicate_pending()
        mgr.wait()
        assert steps_on(mgr, 1) == [1, 2, 3]
        assert steps_on(mgr, 0) == [3]  # replicated now: tier 0's keep_last applies
        mgr.close()
    finally:
        server.close()


def test_far_keeps_last_copy_near_policy_wants_and_restore_uses_it(tmp_path: Path) -> None:
    near, far = tmp_path / "near", tmp_path / "far"
    uris = [str(near), str(far)]
    with ckptstore.CheckpointManager(uris, keep_last=[3, 1]) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, model_state(step))
        mgr.wait()
        assert steps_on(mgr, 0) == [1, 2, 3] and steps_on(mgr, 1) == [3]
    shutil.rmtree(near)  # the node and its checkpoints are gone
    with ckptstore.CheckpointManager(uris, keep_last=[3, 1]) as mgr:
        dest = {"w": torch.zeros(200, 50), "b": torch.zeros(50)}
        assert mgr.restore(dest) == 3  # the newest whole checkpoint, from the far tier
        want = model_state(3)
        assert torch.equal(dest["w"], want["w"]) and torch.equal(dest["b"], want["b"])
        mgr.save(4, model_state(4))
        mgr.wait()
        # far's keep_last=1 would drop step 3, but it is the only copy of a checkpoint that
        # tier 0's keep_last=3 keeps: it stays
        assert steps_on(mgr, 1) == [3, 4]
        assert steps_on(mgr, 0) == [4]
