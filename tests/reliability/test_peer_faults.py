"""Peer fault campaign: a peer-replica job (2-3 real gloo ranks, one process each:
tests/peer_worker.py) restarted again and again while faults land between the restarts:
a rank SIGKILLed at a random moment of a save or of a restore, a lost node folder, a damaged
or missing peer copy, a damaged manifest, a restart on more or on fewer ranks.

After every fault a restart of the job must either restore one step that every rank
obtained whole (each rank checks its values bit-exact against what that step holds), or
fail on every rank with the same UnrestorableCheckpointError, within a bounded time (the
job is killed and the campaign fails after `JOB_TIMEOUT`). Quick profile in CI, `--soak` /
CKPT_SOAK=1 for many rounds.
"""

from __future__ import annotations

import random
import shutil
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.peer_worker import run_job

from .common import Profile

pytestmark = pytest.mark.reliability
JOB_TIMEOUT = 90.0
PEER_TIMEOUT = 5  # seconds; the campaign's bound on any wait for a peer
FAULTS = ("kill-during-save", "kill-during-restore", "lose-node", "damage-peer-copy",
          "drop-peer-copy", "damage-manifest", "more-ranks", "fewer-ranks")


def inject(fault: str, root: Path, world: int, rng: random.Random, step: int) -> int:
    """Apply one fault between restarts; returns the world size of the restart to check."""
    victim = rng.randrange(world)
    if fault in ("kill-during-save", "kill-during-restore"):
        spec: dict[str, Any] = {"restore": {}, "peer_timeout": PEER_TIMEOUT}
        if fault == "kill-during-save":
            spec["save"] = [step, step + 1]
        specs = [dict(spec) for _ in range(world)]
        specs[victim]["die_after"] = rng.uniform(0.0, 1.5)
        results = run_job(world, root, specs, timeout=JOB_TIMEOUT)
        for r, res in enumerate(results):  # survivors finished or failed cleanly
            assert res is None or res["error"] is None or res["error"][0] in (
                "UnrestorableCheckpointError", "PeerExchangeError"), (r, res)
    elif fault == "lose-node":
        shutil.rmtree(root / f"node{victim}", ignore_errors=True)
    elif fault in ("damage-peer-copy", "drop-peer-copy"):
        copies = sorted(p for p in root.glob("node*/peers/rank-*") if p.is_dir())
        if copies:
            copy = rng.choice(copies)
            if fault == "drop-peer-copy":
                shutil.rmtree(copy)
            else:
                blobs = sorted(p for p in (copy / "blobs").rglob("*") if p.is_file())
                if blobs:
                    blob = rng.choice(blobs)
                    data = bytearray(blob.read_bytes())
                    data[len(data) // 2] ^= 0xFF
                    blob.write_bytes(bytes(data))
    elif fault == "damage-manifest":
        manifests = sorted((root / f"node{victim}" / "checkpoints").glob("*.json"))
        if manifests:
            newest = manifests[-1]
            newest.write_bytes(newest.read_bytes()[: rng.randrange(1, 200)])
    elif fault == "more-ranks":
        return world + 1
    elif fault == "fewer-ranks":
        return max(2, world - 1)
    return world


def test_every_restart_restores_one_whole_step_or_fails_alike(
        tmp_path: Path, profile: Profile, campaign_report: Callable[..., Any]) -> None:
    rounds = 40 if profile.name == "soak" else 4
    rng = random.Random(2026)
    root = tmp_path / "job"
    world, step = 2, 1
    assert [r and r["error"] for r in run_job(world, root, {
        "save": [step, step + 1], "peer_timeout": PEER_TIMEOUT}, timeout=JOB_TIMEOUT)] == [
        None, None]
    step += 2
    outcomes: Counter[str] = Counter()
    faults: Counter[str] = Counter()
    slowest = 0.0
    t_all = time.monotonic()
    # the quick profile covers a kill in a save, a kill in a restore and a resize at least
    plan = (["kill-during-save", "damage-peer-copy", "kill-during-restore", "more-ranks"]
            if rounds == 4 else [rng.choice(FAULTS) for _ in range(rounds)])
    for fault in plan:
        faults[fault] += 1
        check_world = inject(fault, root, world, rng, step)
        step += 2
        t0 = time.monotonic()
        results = run_job(check_world, root, {"restore": {}, "save": [step],
                                              "peer_timeout": PEER_TIMEOUT},
                          timeout=JOB_TIMEOUT)
        slowest = max(slowest, time.monotonic() - t0)
        assert all(r is not None for r in results)
        errors = [r["error"] for r in results if r is not None]
        restored = {r["restored"] for r in results if r is not None}
        if all(e is None for e in errors):
            assert len(restored) == 1, restored  # one step on every rank (checked bit-exact)
            outcomes["restored" if restored != {None} else "fresh"] += 1
        else:
            kinds = {tuple(e) if e else None for e in errors}
            assert len(kinds) == 1 and errors[0][0] == "UnrestorableCheckpointError", errors
            outcomes["refused alike"] += 1
            if check_world != world:
                continue  # the job goes on at its own size
            # every rank refused: the history is gone for this world size; start over
            run_job(world, root, {"restore": {"fresh_ok": True}, "save": [step],
                                  "peer_timeout": PEER_TIMEOUT}, timeout=JOB_TIMEOUT)
        step += 1
    assert outcomes["restored"] >= 1
    campaign_report("peer-faults", rounds=len(plan), faults=dict(faults),
                    outcomes=dict(outcomes), mixed_outcomes=0,
                    slowest_restart_seconds=round(slowest, 1), peer_timeout=PEER_TIMEOUT,
                    seconds=round(time.monotonic() - t_all, 1))
