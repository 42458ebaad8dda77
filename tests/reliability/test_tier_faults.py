"""Tier fault campaign: a training loop saving every step to `[near, s3]` while the far tier
goes down and comes back at random moments, and the trainer is SIGKILLed at random moments.

The far tier is moto behind the fault proxy (s3chaos.ChaosServer): while `plan.down` is set
every request's connection is dropped. The trainer (tests/reliability/tier_trainer.py) saves
with `CheckpointManager([near, far], keep_last=[2, 5])`. The campaign checks the rule of
docs/recovery.md, "When a far tier is down":

* no save fails because of the far tier (0 `save-failed` events);
* every restart restores the newest checkpoint acknowledged before the kill (or the one
  after it, committed by a save the kill cut off before it could say so);
* after the outage the replication catches up: the far tier holds the newest five
  acknowledged steps and tier 0 the newest two, no pending record is left, and every
  checkpoint listed on either tier loads bit-exact and verifies (0 acknowledged
  checkpoints lost on either tier).

Quick profile in CI; `--soak` / CKPT_SOAK=1 runs hundreds of saves.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptstore
from ckptstore.tiers import pending

from ..conftest import new_bucket_uri
from .common import Profile, read_json_lines
from .s3chaos import ChaosServer, moto_app
from .tier_trainer import state

pytestmark = pytest.mark.reliability
ROOT = Path(__file__).resolve().parents[2]


class Outages:
    """Switches the proxy's outage on and off at random moments (0.2-1.2 s apart) on a
    thread, recording the intervals it was down."""

    def __init__(self, server: ChaosServer, seed: int) -> None:
        self.server = server
        self.rng = random.Random(seed)
        self.intervals: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="outages")

    def _run(self) -> None:
        while not self._stop.wait(self.rng.uniform(0.2, 1.2)):
            down = not self.server.plan.down
            self.server.plan.down = down
            if down:
                self.intervals.append((time.time(), float("inf")))
            else:
                self.intervals[-1] = (self.intervals[-1][0], time.time())

    def __enter__(self) -> Outages:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        if self.server.plan.down:
            self.server.plan.down = False
            self.intervals[-1] = (self.intervals[-1][0], time.time())

    def was_down(self, t: float) -> bool:
        return any(a <= t <= b for a, b in self.intervals)


def trainer(near: Path, far: str, endpoint: str, events: Path, saves: int,
            final: bool = False) -> subprocess.Popen[bytes]:
    args = [sys.executable, "-m", "tests.reliability.tier_trainer", str(near), far, endpoint,
            str(events), str(saves)] + (["--final"] if final else [])
    return subprocess.Popen(args, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))


def wait_for(events: Path, what: str, count: int, proc: subprocess.Popen[bytes],
             timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while sum(e["event"] == what for e in read_json_lines(events)) < count:
        assert proc.poll() is None, f"the trainer exited ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} event within {timeout}s"
        time.sleep(0.02)


def test_saves_go_on_through_far_outages_and_kills(
        tmp_path: Path, moto_endpoint: str, profile: Profile,
        campaign_report: Callable[..., Any]) -> None:
    soak = profile.name == "soak"
    kills, saves_per_run = (20, 40) if soak else (3, 12)
    rng = random.Random(7)
    server = ChaosServer(moto_app())
    far = new_bucket_uri(moto_endpoint)
    near = tmp_path / "near"
    events = tmp_path / "events.jsonl"
    restarts: list[tuple[int | None, int | None]] = []  # (newest acked before, restored)
    t0 = time.monotonic()
    try:
        with Outages(server, seed=11) as outages:
            for _ in range(kills):
                acked_before = [e["step"] for e in read_json_lines(events)
                                if e["event"] == "ack"]
                n_restored = sum(e["event"] == "restored" for e in read_json_lines(events))
                proc = trainer(near, far, server.endpoint, events, saves_per_run)
                wait_for(events, "restored", n_restored + 1, proc)
                restored = [e for e in read_json_lines(events)
                            if e["event"] == "restored"][-1]["step"]
                restarts.append((max(acked_before, default=None), restored))
                time.sleep(rng.uniform(0.1, 0.2 * saves_per_run))
                proc.send_signal(signal.SIGKILL)
                proc.wait(30)
        assert not server.plan.down
        n_restored = sum(e["event"] == "restored" for e in read_json_lines(events))
        acked_before = [e["step"] for e in read_json_lines(events) if e["event"] == "ack"]
        proc = trainer(near, far, server.endpoint, events, 3, final=True)
        assert proc.wait(120) == 0
        restored = [e for e in read_json_lines(events) if e["event"] == "restored"][-1]
        restarts.append((max(acked_before, default=None), restored["step"]))
    finally:
        server.close()

    log = read_json_lines(events)
    acked = [e for e in log if e["event"] == "ack"]
    failed = [e for e in log if e["event"] == "save-failed"]
    assert not failed, failed[:3]  # no save failed because of the far tier
    assert log[-1]["event"] == "replicated", log[-1]
    bad_restores = [(a, r) for a, r in restarts if r not in ({a, a + 1} if a else {None, 1})]
    assert not bad_restores, bad_restores  # every restart took the newest checkpoint

    # after the outage: replication caught up, retention applied, nothing lost or torn
    steps = sorted({e["step"] for e in acked})
    newest = steps[-1]
    with ckptstore.CheckpointStore(str(near)) as tier0, ckptstore.CheckpointStore(
            far, endpoint_url=moto_endpoint) as tier1:
        on_near = sorted(int(n.split("-")[1]) for n in tier0.names())
        on_far = sorted(int(n.split("-")[1]) for n in tier1.names())
        assert pending.read_records(tier0.store) == []
        for tier, listed in ((tier0, on_near), (tier1, on_far)):
            for step in listed:
                loaded = tier.load(f"step-{step}")
                assert torch.equal(loaded["model"]["w"], state(step)["model"]["w"])
                assert tier.verify(f"step-{step}").ok
    assert on_near == [s for s in (newest - 1, newest)], on_near  # keep_last 2
    assert on_far == list(range(newest - 4, newest + 1)), on_far  # keep_last 5, caught up
    during = [e["step"] for e in acked if outages.was_down(e["t"])]
    campaign_report(
        "tier-faults", saves_attempted=len(acked) + len(failed), committed_tier0=len(acked),
        failed=len(failed), saved_while_far_down=len(during),
        of_them_on_far_after_recovery=len(set(during) & set(on_far)),
        outages=len(outages.intervals), kills=kills, restarts=len(restarts),
        restores_of_the_newest=len(restarts) - len(bad_restores), lost=0,
        pending_after_recovery=0, seconds=round(time.monotonic() - t0, 1))
