"""A hypothesis state machine of savers, deleters, gc and retention sharing one store.

Actors are separate CheckpointStore objects on the same folder (or S3 prefix), as separate
processes would be. Interleavings are rules: a save can be *begun* (it runs in the background
and is held just before its create-only commit, blobs written and synced, lease held: the
worst instant for gc) and *finished* later, with any other rules in between: synchronous
saves, deletes, leased gc (`CheckpointStore.gc`), lease-less gc (the maintenance module's gc,
only while no save is in flight, as documented), retention (`CheckpointManager(keep_last=2)`)
and the passing of time (blob mtimes moved back with os.utime).

Invariants after every rule: every listed checkpoint verifies (no blob it references was
deleted), every committed and undeleted checkpoint is listed, no deleted one is. At the end:
in-flight saves commit, every listed checkpoint restores bit-exact, and after deleting all
but one checkpoint and ageing the blobs past the grace period, gc reclaims >= 95% of the
unreferenced blob bytes.

Clock skew: in the skewed variant some actors' rules run with `time.time` patched to real +
offset (+-400 s). gc must judge ages by the store's clock (object mtimes), not its host's.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar
from unittest import mock

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from ckptstore import CheckpointManager, CheckpointStore, LocalStore, Store

from .common import (
    Profile,
    gc_at,
    lease_busy_error,
    make_state,
    state_digest,
    unreferenced_blob_bytes,
)

pytestmark = pytest.mark.reliability

CHUNK = 8 << 10
SIZES = {"base_bytes": 32 << 10, "delta_bytes": 16 << 10, "small": 4}
GRACE = 600.0  # the final gc's grace period (longer than any minimum blob age of gc)
ACTORS = ("A", "B", "C")
_REAL_TIME = time.time


# -- a store whose commits can be held ---------------------------------------------------------


class Gate:
    """Holds the next manifest commit of one store until released."""

    def __init__(self) -> None:
        self.armed = False
        self.arrived = threading.Event()
        self.release = threading.Event()


class GateMixin:
    gate: Gate

    def create(self, key: str, data: Any) -> None:
        gate = self.gate
        if gate.armed and key.startswith("checkpoints/"):
            gate.armed = False
            gate.arrived.set()
            if not gate.release.wait(120):
                raise TimeoutError("the model never released this commit")
        super().create(key, data)  # type: ignore[misc]


class GatedLocalStore(GateMixin, LocalStore):
    pass


def _gated_s3_class() -> type[Store]:
    from ckptstore.stores.s3 import S3Store

    class GatedS3Store(GateMixin, S3Store):
        pass

    return GatedS3Store


@dataclass
class InFlight:
    name: str
    digest: str
    handle: Any
    gate: Gate


def content(name: str) -> dict[str, Any]:
    return make_state(name, **SIZES)


# -- the machine --------------------------------------------------------------------------------


class GcMachine(RuleBasedStateMachine):
    """Local store, every clock right."""

    BACKEND: ClassVar[str] = "local"
    S3_ENDPOINT: ClassVar[str | None] = None
    WORKDIR: ClassVar[str | None] = None
    FINAL_SKEW: ClassVar[float] = 0.0  # clock offset of the final gc
    stats: ClassVar[dict[str, int]] = {}

    def __init__(self) -> None:
        super().__init__()
        self.tag = uuid.uuid4().hex[:8]
        self.root = Path(tempfile.mkdtemp(prefix="gcsm-", dir=self.WORKDIR))
        self.gates = {a: Gate() for a in ACTORS}
        self.repos = {a: self._open(a) for a in ACTORS}
        self.checker = self._open(None)
        self.manager = CheckpointManager(self.repos["C"], keep_last=2)
        self.committed: dict[str, str] = {}  # name -> digest: committed, not deleted
        self.deleted: set[str] = set()
        self.inflight: dict[str, InFlight] = {}
        self.step_no = 0
        self.counter = 0
        self._count("examples")

    # -- plumbing ---------------------------------------------------------------------------
    def _count(self, what: str) -> None:
        type(self).stats[what] = type(self).stats.get(what, 0) + 1

    def _store(self, gate: Gate | None) -> Store:
        if self.BACKEND == "local":
            store: Store = GatedLocalStore(self.root)
        else:
            assert self.S3_ENDPOINT is not None
            store = _gated_s3_class().from_uri(  # type: ignore[attr-defined]
                f"s3://{self.s3_bucket()}/{self.tag}", endpoint_url=self.S3_ENDPOINT)
        store.gate = gate or Gate()  # type: ignore[attr-defined]
        return store

    @classmethod
    def s3_bucket(cls) -> str:
        return "gcsm-" + (cls.S3_ENDPOINT or "").rsplit(":", 1)[-1]

    def _open(self, actor: str | None) -> CheckpointStore:
        return CheckpointStore(self._store(self.gates[actor] if actor else None),
                               chunk_bytes=CHUNK)

    def _name(self, actor: str) -> str:
        self.counter += 1
        return f"{actor.lower()}{self.counter}"

    def _clock(self, offset: float) -> Any:
        return mock.patch("time.time", new=lambda: _REAL_TIME() + offset)

    def _listed(self) -> set[str]:
        return set(self.checker.names())

    def _blob_files(self) -> list[Path]:
        return [p for p in (self.root / "blobs").rglob("*") if p.is_file()]

    # -- rules: saving ----------------------------------------------------------------------
    @precondition(lambda self: len(self.inflight) < len(ACTORS))
    @rule(data=st.data())
    def save(self, data: st.DataObject) -> None:
        actor = data.draw(st.sampled_from([a for a in ACTORS if a not in self.inflight]))
        name = self._name(actor)
        state = content(name)
        self.repos[actor].save(name, state)
        self.committed[name] = state_digest(state)
        self._count("saves")

    @precondition(lambda self: len(self.inflight) < len(ACTORS))
    @rule(data=st.data())
    def begin_save(self, data: st.DataObject) -> None:
        """A save that stops right before its commit (blobs durable, lease held)."""
        actor = data.draw(st.sampled_from([a for a in ACTORS if a not in self.inflight]))
        name = self._name(actor)
        state = content(name)
        gate = self.gates[actor]
        gate.arrived.clear()
        gate.release.clear()
        gate.armed = True
        handle = self.repos[actor].save_async(name, state)
        if not gate.arrived.wait(60):
            gate.armed = False
            handle.wait(60)  # raises the save's error, if that is why it never arrived
            raise AssertionError(f"save {name} never reached its commit")
        self.inflight[actor] = InFlight(name, state_digest(state), handle, gate)
        self._count("begun_saves")

    @precondition(lambda self: bool(self.inflight))
    @rule(data=st.data())
    def finish_save(self, data: st.DataObject) -> None:
        actor = data.draw(st.sampled_from(sorted(self.inflight)))
        self._finish(actor)

    def _finish(self, actor: str) -> None:
        flight = self.inflight.pop(actor)
        flight.gate.release.set()
        flight.handle.wait(120)
        self.committed[flight.name] = flight.digest
        self._count("finished_saves")

    @precondition(lambda self: "C" not in self.inflight)
    @rule()
    def manager_save(self) -> None:
        """CheckpointManager with keep_last=2: retention deletes older steps and sweeps their
        blobs (skipped while another save holds a lease)."""
        self.step_no += 1
        name = CheckpointManager.name_of(self.step_no)
        state = content(name)
        self.manager.save(self.step_no, state)
        self.committed[name] = state_digest(state)
        steps = sorted(int(n[5:]) for n in self.committed if n.startswith("step-"))
        for s in steps[:-2]:
            self.committed.pop(f"step-{s}")
            self.deleted.add(f"step-{s}")
        self._count("manager_saves")

    # -- rules: deleting and collecting -------------------------------------------------------
    @precondition(lambda self: bool(self.committed))
    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.committed)))
        actor = data.draw(st.sampled_from(ACTORS))
        self.repos[actor].delete(name)
        del self.committed[name]
        self.deleted.add(name)
        self._count("deletes")

    @rule(actor=st.sampled_from(ACTORS), grace=st.sampled_from([0.0, 60.0, 3600.0]),
          first=st.sampled_from([0.0, 1000.0]))
    def gc(self, actor: str, grace: float, first: float) -> None:
        """Leased gc, after `first` seconds passed (gc never takes blobs younger than a few
        minutes: without time passing it has nothing to do)."""
        if first and self.BACKEND == "local":
            self.time_passes(first)
        self._gc(actor, grace, 0.0)

    def _gc(self, actor: str, grace: float, offset: float) -> None:
        try:
            with self._clock(offset):
                report = self.repos[actor].gc(grace_seconds=grace)
        except lease_busy_error():
            assert self.inflight, "gc refused by a lease although no save is in flight"
            self._count("gc_busy")
            return
        self._count("gc_runs")
        if report.deleted_blobs:
            self._count("gc_runs_that_deleted")
            type(self).stats["gc_deleted_blobs"] = (type(self).stats.get("gc_deleted_blobs", 0)
                                                    + report.deleted_blobs)

    @precondition(lambda self: not self.inflight)
    @rule(grace=st.sampled_from([0.0, 60.0, 3600.0]))
    def gc_unleased(self, grace: float) -> None:
        """The maintenance module's gc takes no lease: safe only while nothing saves."""
        report = gc_at(self.checker, grace, leased=False)
        self._count("gc_unleased")
        type(self).stats["gc_deleted_blobs"] = (type(self).stats.get("gc_deleted_blobs", 0)
                                                + report.deleted_blobs)

    @precondition(lambda self: self.BACKEND == "local")
    @rule(seconds=st.sampled_from([120.0, 1000.0, 7200.0]))
    def time_passes(self, seconds: float) -> None:
        """Every blob gets `seconds` older (mtime moved back): in-flight saves' too."""
        for path in self._blob_files():
            st_ = path.stat()
            os.utime(path, (st_.st_atime - seconds, st_.st_mtime - seconds))
        self._count("time_passes")

    # -- invariants --------------------------------------------------------------------------
    @invariant()
    def listed_checkpoints_are_whole(self) -> None:
        listed = self._listed()
        lost = set(self.committed) - listed
        assert not lost, f"committed checkpoints not listed: {sorted(lost)}"
        back = self.deleted & listed
        assert not back, f"deleted checkpoints listed: {sorted(back)}"
        for name in sorted(listed):
            report = self.checker.verify(name)
            assert report.ok, f"{name} lost blobs: {report.problems[:3]}"

    # -- the end ----------------------------------------------------------------------------
    def teardown(self) -> None:
        # hypothesis calls teardown in a `finally`: if a rule or an invariant already failed,
        # only clean up (checks here would fail too and hide the first error)
        failing = sys.exc_info()[1] is not None
        try:
            if not failing:
                for actor in sorted(self.inflight):
                    self._finish(actor)
                self._final_checks()
        finally:
            for gate in self.gates.values():
                gate.release.set()
            for repo in [*self.repos.values(), self.checker]:
                try:
                    repo.close()
                except Exception:  # noqa: BLE001 - closing after a failure: keep the first
                    pass
            shutil.rmtree(self.root, ignore_errors=True)


    def _final_checks(self) -> None:
        listed = self._listed()
        assert listed == set(self.committed), (sorted(listed), sorted(self.committed))
        for name in sorted(listed):
            got = state_digest(self.checker.load(name))
            assert got == self.committed[name], f"{name} restored other bytes"
        keep = max(listed, key=lambda n: self.checker.manifest(n).created, default=None)
        for name in sorted(listed - {keep}):
            self.checker.delete(name)
        before = unreferenced_blob_bytes(self.checker)
        if self.BACKEND == "local":
            for path in self._blob_files():  # older than the grace period, by 2 minutes
                old = _REAL_TIME() - GRACE - 120
                os.utime(path, (old, old))
            with self._clock(self.FINAL_SKEW):
                self.repos["A"].gc(grace_seconds=GRACE)
        else:  # S3 mtimes cannot be moved back: tell gc the store's time instead
            gc_at(self.checker, GRACE, now=_REAL_TIME() + 10 * GRACE)
        after = unreferenced_blob_bytes(self.checker)
        if before:
            reclaimed = (before - after) / before
            type(self).stats["reclaim_checks"] = type(self).stats.get("reclaim_checks", 0) + 1
            assert reclaimed >= 0.95, f"gc reclaimed {reclaimed:.0%} of {before} bytes"
        if keep is not None:
            assert self.checker.verify(keep).ok
            assert state_digest(self.checker.load(keep)) == self.committed[keep]


class SkewedGcMachine(GcMachine):
    """As GcMachine, plus rules run with the actor's clock off by +-400 s, and a final gc whose
    clock is 400 s behind."""

    FINAL_SKEW: ClassVar[float] = -400.0
    stats: ClassVar[dict[str, int]] = {}

    @rule(actor=st.sampled_from(ACTORS), offset=st.sampled_from([-400.0, 400.0]),
          grace=st.sampled_from([0.0, 60.0, 300.0]))
    def skewed_gc(self, actor: str, offset: float, grace: float) -> None:
        self._gc(actor, grace, offset)
        self._count("skewed_gc")

    @precondition(lambda self: len(self.inflight) < len(ACTORS))
    @rule(data=st.data(), offset=st.sampled_from([-400.0, 400.0]))
    def skewed_begin_save(self, data: st.DataObject, offset: float) -> None:
        with self._clock(offset):
            self.begin_save(data)
        self._count("skewed_saves")


class S3GcMachine(GcMachine):
    BACKEND: ClassVar[str] = "s3"
    stats: ClassVar[dict[str, int]] = {}


# -- the tests ----------------------------------------------------------------------------------


def _settings(profile: Profile, shrink: bool = True, share: float = 1.0) -> settings:
    phases = [Phase.explicit, Phase.reuse, Phase.generate] + ([Phase.shrink] if shrink else [])
    quick = profile.name == "quick"  # CI: the same examples every run
    return settings(max_examples=max(1, int(profile.sm_examples * share)),
                    stateful_step_count=profile.sm_steps, deadline=None, derandomize=quick,
                    database=None if quick else settings().database,
                    phases=phases, report_multiple_bugs=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def _run(machine: type[GcMachine], profile: Profile, tmp_path: Path,
         report: Callable[..., Any], label: str, shrink: bool = True,
         share: float = 1.0) -> None:
    machine.WORKDIR = str(tmp_path)
    machine.stats = {}
    t0 = time.monotonic()
    try:
        run_state_machine_as_test(  # type: ignore[no-untyped-call]
            machine, settings=_settings(profile, shrink, share))
    finally:
        report(label, seconds=round(time.monotonic() - t0, 1), **dict(sorted(
            machine.stats.items())))


def test_gc_state_machine_local(tmp_path: Path, profile: Profile,
                                campaign_report: Callable[..., Any]) -> None:
    _run(GcMachine, profile, tmp_path, campaign_report, "gc-state-machine-local")
    assert GcMachine.stats.get("gc_runs_that_deleted", 0) > 0, "gc never deleted anything"
    assert GcMachine.stats.get("gc_busy", 0) > 0, "no gc ever met a save in flight"
    assert GcMachine.stats.get("reclaim_checks", 0) > 0


def test_gc_state_machine_skewed_clocks(tmp_path: Path, profile: Profile,
                                        campaign_report: Callable[..., Any]) -> None:
    _run(SkewedGcMachine, profile, tmp_path, campaign_report, "gc-state-machine-skewed",
         shrink=profile.name == "soak")


def test_gc_state_machine_s3(tmp_path: Path, profile: Profile, soak_only: None,
                             rel_moto_endpoint: str,
                             campaign_report: Callable[..., Any]) -> None:
    import boto3

    S3GcMachine.S3_ENDPOINT = rel_moto_endpoint
    client = boto3.client("s3", endpoint_url=rel_moto_endpoint, region_name="us-east-1")
    client.create_bucket(Bucket=S3GcMachine.s3_bucket())
    client.close()
    _run(S3GcMachine, profile, tmp_path, campaign_report, "gc-state-machine-s3", share=0.3)
