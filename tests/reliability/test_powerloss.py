"""Simulated power loss at every crash point of a save/delete/gc sequence on a local store.

For each crash point N of a scenario (its N-th disk-changing operation never happens; see
tests/reliability/powerloss.py) the folder is rewritten to what a power cut would leave, the
store is reopened, and: every checkpoint whose save() returned before the crash is listed and
restores bit-exact; no checkpoint whose delete() returned is listed again; every listed
checkpoint loads, holds what its name says and verifies (no partial checkpoint); the
repository marker survives once CheckpointStore() returned.

The harness has teeth: with ONE fsync of the library skipped (the folder fsync after the
create-only commit, a blob's data fsync, the blob folders' fsync) it finds a lost or torn
acknowledged checkpoint.
"""

from __future__ import annotations

import itertools
import random
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import ckptstore.stores.local as local_module
from ckptstore import CheckpointManager, CheckpointStore, CkptStoreError
from ckptstore.errors import RepositoryNotFoundError
from ckptstore.format import segment_encoding
from ckptstore.format.manifest import SEGMENTED_VERSION
from ckptstore.format.segment_encoding import SEGMENTED_ABOVE_TENSORS
from ckptstore.pipeline.writer_process import WriterProcess

from .common import Profile, gc_at, make_state, state_digest
from .powerloss import PowerCut, PowerLossHarness

pytestmark = pytest.mark.reliability

CHUNK = 16 << 10
SIZES = {"base_bytes": 64 << 10, "delta_bytes": 32 << 10, "small": 6}
#: names starting "v3-" hold enough small arrays to be written as version 3 (a root naming
#: index segments and a tree blob)
SEGMENTED_SIZES = {**SIZES, "small": SEGMENTED_ABOVE_TENSORS + 40}


def content(name: str) -> dict[str, Any]:
    """The state checkpoint `name` holds: `x.of.y` holds the content of `y` (a chunk set that
    comes back under another name after gc removed it)."""
    base = name.split(".of.")[-1]
    return make_state(base, **(SEGMENTED_SIZES if base.startswith("v3-") else SIZES))


@dataclass
class Expect:
    """What the process was told before the power went off."""

    opened: bool = False
    acked: dict[str, str] = field(default_factory=dict)  # save() returned: name -> digest
    deleting: set[str] = field(default_factory=set)  # delete started (or retention may drop)
    deleted: set[str] = field(default_factory=set)  # delete returned
    steps_done: int = 0


# -- scenarios --------------------------------------------------------------------------------


Step = tuple[str, ...]
SAVES = ("save", "save_async", "save_overlap", "save_overlap_replaced")
#: store folders a writer process renamed a blob into just before it was replaced
REPLACED_WRITERS_FOLDERS: set[str] = set()


@contextmanager
def writer_replaced_after_first_put() -> Iterator[None]:
    """The writer process dies while idle, right after the first blob of a save is written
    (SIGKILL's effect: ThreadWriter.kill); the save's next put starts another writer."""
    original = WriterProcess.put
    puts = itertools.count(1)
    one_at_a_time = threading.Lock()  # so that no request is in flight at the kill

    def put(self: WriterProcess, key: str, data: Any) -> None:
        with one_at_a_time:
            original(self, key, data)
            if next(puts) != 1:
                return
            REPLACED_WRITERS_FOLDERS.add(key.rpartition("/")[0])
            conn = self._conn
            assert conn is not None
            conn.proc.kill()
            conn.proc.wait()

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(WriterProcess, "put", put)
        yield


def fixed_scenario() -> list[Step]:
    """Every kind of operation once or more: sync and async saves, overlapped saves written
    by a writer process (one of them replaced between two of its blob writes),
    CheckpointManager saves whose retention deletes and sweeps, delete, leased gc, a gc that
    reclaims, and a chunk set saved again after gc removed it."""
    return [("save", "a"), ("save_async", "b"), ("manager", "1"), ("manager", "2"),
            ("manager", "3"), ("delete", "a"), ("gc",), ("gc_reclaim",), ("save", "c.of.a"),
            ("save_overlap", "e"), ("delete", "b"), ("save_async", "d"),
            ("save_overlap_replaced", "f")]


def random_scenario(seed: int) -> list[Step]:
    rng = random.Random(seed)
    steps: list[Step] = []
    names: list[str] = []
    step_no = 0
    for i in range(rng.randint(8, 14)):
        op = rng.choice(["save", "save", "save_async", "save_overlap", "save_overlap_replaced",
                         "manager", "delete", "gc", "gc_reclaim"])
        if op in SAVES:
            name = (f"n{i}" if not names or rng.random() < 0.7
                    else f"n{i}.of.{rng.choice(names)}")
            names.append(name)
            steps.append((op, name))
        elif op == "manager":
            step_no += 1
            steps.append((op, str(step_no)))
        elif op == "delete" and names:
            steps.append((op, names.pop(rng.randrange(len(names)))))
        elif op in ("gc", "gc_reclaim"):
            steps.append((op,))
    return steps


def run_scenario(root: Path, steps: list[Step], expect: Expect) -> None:
    """Run `steps` on a store at `root`, recording in `expect` what was acknowledged."""
    repo = CheckpointStore(root, chunk_bytes=CHUNK, workers=1, async_writer="process")
    expect.opened = True
    manager = CheckpointManager(repo, keep_last=2)
    try:
        for step in steps:
            op = step[0]
            if op in SAVES:
                name = step[1]
                state = content(name)
                if op == "save":
                    repo.save(name, state)
                elif op == "save_async":
                    repo.save_async(name, state).wait()
                else:
                    replaced = (writer_replaced_after_first_put() if op.endswith("_replaced")
                                else nullcontext())
                    with replaced:
                        repo.save_async(name, state, staging="overlap").wait()
                expect.acked[name] = state_digest(state)
            elif op == "manager":
                k = int(step[1])
                older = [f"step-{s}" for s in range(1, k - 1)]
                expect.deleting.update(older)  # retention (keep_last=2) drops these
                state = content(f"step-{k}")
                manager.save(k, state)
                expect.acked[f"step-{k}"] = state_digest(state)
                expect.deleted.update(n for n in older if n in expect.acked)
            elif op == "delete":
                expect.deleting.add(step[1])
                repo.delete(step[1])
                expect.deleted.add(step[1])
            elif op == "gc":
                repo.gc(grace_seconds=0)
            elif op == "gc_reclaim":  # nothing runs concurrently: a clock far ahead is safe
                gc_at(repo, 0.0, now=time.time() + 10 * 86400)
            expect.steps_done += 1
    finally:
        try:
            repo.close()
        except BaseException:  # noqa: BLE001 - a dead process closes nothing
            pass


def check_after_cut(root: Path, expect: Expect) -> list[str]:
    """The invariants after the power came back; the violations found (empty: all hold)."""
    violations: list[str] = []
    try:
        repo = CheckpointStore(root, create=False)
    except RepositoryNotFoundError:
        return ["repository marker lost"] if expect.opened else []
    except CkptStoreError as exc:
        return [f"repository unreadable: {exc!r}"]
    try:
        names = set(repo.names())
        for name in sorted(names):
            try:
                got = state_digest(repo.load(name))
            except CkptStoreError as exc:
                violations.append(f"listed checkpoint {name} does not load: {exc!r}")
                continue
            if got != state_digest(content(name)):
                violations.append(f"listed checkpoint {name} holds other values")
            elif not repo.verify(name).ok:
                violations.append(f"listed checkpoint {name} does not verify")
        for name in sorted(expect.acked):
            if name not in names and name not in expect.deleting:
                violations.append(f"acknowledged checkpoint {name} lost")
        for name in sorted(expect.deleted & names):
            violations.append(f"deleted checkpoint {name} is listed again")
    finally:
        repo.close()
    return violations


@dataclass
class CrashResult:
    crash_at: int | None
    ops: int
    steps_done: int
    violations: list[str]
    skipped: int = 0


def crash_once(folder: Path, steps: list[Step], crash_at: int | None, mode: str,
               skip_fsync: Callable[[str, bool], bool] | None = None) -> CrashResult:
    root = folder / f"at-{crash_at}"
    root.mkdir()
    harness = PowerLossHarness(root, crash_at=crash_at, mode=mode, skip_fsync=skip_fsync)
    expect = Expect()
    with harness.installed():
        try:
            run_scenario(root, steps, expect)
        except BaseException:  # the power cut, or what it made another thread raise
            if not harness.dead:
                raise
    harness.power_cut()
    result = CrashResult(crash_at, len(harness.ops), expect.steps_done,
                         check_after_cut(root, expect), harness.skipped)
    shutil.rmtree(root)
    return result


def sweep(folder: Path, steps: list[Step], mode: str, every: int = 1,
          skip_fsync: Callable[[str, bool], bool] | None = None) -> Iterator[CrashResult]:
    """A run without a crash (its op count M), then crash points 1..M+1 (every `every`-th,
    and always M+1: a power cut after the scenario ended)."""
    full = crash_once(folder, steps, None, mode, skip_fsync)
    yield full
    points = list(range(1, full.ops + 1, every)) + [full.ops + 1]
    for n in points:
        yield crash_once(folder, steps, n, mode, skip_fsync)


# -- the campaign -----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["strict", "eager-names"])
def test_every_crash_point_keeps_acknowledged_checkpoints(
        tmp_path: Path, mode: str, profile: Profile,
        campaign_report: Callable[..., Any]) -> None:
    scenarios = [fixed_scenario()] + [random_scenario(s)
                                      for s in range(1, profile.powerloss_sequences)]
    every = 1 if mode == "strict" else profile.powerloss_eager_every
    t0 = time.monotonic()
    points = 0
    violations: list[str] = []
    ops_per_scenario = []
    for i, steps in enumerate(scenarios):
        results = list(sweep(tmp_path, steps, mode, every=every))
        assert results[0].steps_done == len(steps), "the scenario did not run to its end"
        ops_per_scenario.append(results[0].ops)
        points += len(results) - 1
        for r in results:
            violations += [f"scenario {i}, crash point {r.crash_at}: {v}" for v in r.violations]
    campaign_report(f"powerloss-{mode}", scenarios=len(scenarios), crash_points=points,
                    every=every,
                    ops_per_scenario=ops_per_scenario, violations=len(violations),
                    seconds=round(time.monotonic() - t0, 1))
    assert not violations, "\n".join(violations[:20])


def test_segmented_manifests_survive_every_crash_point(
        tmp_path: Path, profile: Profile, campaign_report: Callable[..., Any],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Version-3 saves, sync and async, a delete, a reclaiming gc and the chunk set saved
    again: at every crash point ("strict" model) the index blobs of a listed checkpoint are
    durable, so it loads and verifies, and acknowledged ones survive. The segment holding
    the tensors of several chunks is parted (the writer's thresholds lowered), so its parts
    are among those blobs. (With the blob folders' or the blobs' fsync skipped, this scenario
    finds a listed checkpoint whose index blob is missing or corrupt at 19 of 63 points:
    checked by hand, as the teeth tests below do for the small scenario.)"""
    monkeypatch.setattr(segment_encoding, "PART_ABOVE_CHUNKS", 8)
    monkeypatch.setattr(segment_encoding, "PART_ABOVE_TENSOR_CHUNKS", 2)
    monkeypatch.setattr(segment_encoding, "PART_CHUNKS", 8)
    steps: list[Step] = [("save", "v3-a"), ("save_async", "v3-b"), ("delete", "v3-a"),
                         ("gc_reclaim",), ("save", "v3-c.of.v3-a")]
    every = 1 if profile.name == "soak" else 9  # ~50 of ~435 crash points in the quick run
    t0 = time.monotonic()
    results = list(sweep(tmp_path, steps, "strict", every=every))
    assert results[0].steps_done == len(steps), "the scenario did not run to its end"
    with CheckpointStore(tmp_path / "check", chunk_bytes=CHUNK) as repo:  # version 3
        repo.save("v3-a", content("v3-a"))
        assert repo.manifest("v3-a").version == SEGMENTED_VERSION
    with CheckpointStore(tmp_path / "check", create=False) as repo:  # ... with parts
        assert any(table.parts for table in repo.manifest("v3-a").chunk_tables())
    violations = [f"crash point {r.crash_at}: {v}" for r in results for v in r.violations]
    campaign_report("powerloss-segmented", crash_points=len(results) - 1, every=every,
                    ops=results[0].ops,
                    violations=len(violations), seconds=round(time.monotonic() - t0, 1))
    assert not violations, "\n".join(violations[:20])


# -- the harness has teeth --------------------------------------------------------------------
#
# Each sabotage makes ONE of the store's fsyncs a no-op (selected by the path fsynced, so it
# does not depend on how local.py is written): the harness must then find an acknowledged
# checkpoint lost or a listed one torn.

SABOTAGE: dict[str, Callable[[str, bool], bool]] = {
    # the folder fsync that makes a create-only manifest commit durable
    "manifest-folder-fsync": lambda path, is_dir: is_dir and path.endswith("/checkpoints"),
    # the data fsync of each blob (temp file before its rename)
    "blob-data-fsync": lambda path, is_dir: not is_dir and "/blobs/" in path,
    # the fsync of the blob folders (`sync()` before the commit)
    "blob-folder-fsync": lambda path, is_dir: is_dir and "/blobs" in path,
}


@pytest.mark.parametrize("sabotage", sorted(SABOTAGE))
def test_harness_finds_a_skipped_fsync(tmp_path: Path, sabotage: str, profile: Profile,
                                       campaign_report: Callable[..., Any]) -> None:
    """Crash points from the last one backwards (all of them in soak) until the harness
    reports a lost or torn acknowledged checkpoint; the same crash point without the sabotage
    must then be clean."""
    steps: list[Step] = [("save", "a"), ("save", "b"), ("save_async", "c")]
    skip = SABOTAGE[sabotage]
    full = crash_once(tmp_path, steps, None, "strict", skip)
    assert full.skipped > 0, "the sabotage never applied"
    found: list[CrashResult] = []
    tried = 0
    for n in range(full.ops + 1, 0, -1):
        tried += 1
        result = crash_once(tmp_path, steps, n, "strict", skip)
        if any("acknowledged" in v or "does not load" in v for v in result.violations):
            found.append(result)
            if not profile.powerloss_teeth_all:
                break
    assert found, f"the harness missed the skipped {sabotage}"
    control = crash_once(tmp_path, steps, found[0].crash_at, "strict")
    assert not control.violations, control.violations  # no false alarm at that point
    campaign_report("powerloss-teeth", sabotage=sabotage, crash_points_tried=tried,
                    points_with_violations=len(found), first_hit=found[0].crash_at,
                    example=found[0].violations[0])


def test_harness_finds_a_replaced_writers_folder_left_unsynced(
        tmp_path: Path, campaign_report: Callable[..., Any]) -> None:
    """The writer process is another process: a blob it renamed into place before it was
    replaced is durable only if some process fsyncs that folder before the commit. Skipping
    exactly those folder fsyncs must lose an acknowledged checkpoint."""
    steps: list[Step] = [("save", "a"), ("save_overlap_replaced", "f")]
    clean = crash_once(tmp_path, steps, None, "strict")
    assert not clean.violations and REPLACED_WRITERS_FOLDERS

    def skip(path: str, is_dir: bool) -> bool:
        return is_dir and any(path.endswith("/" + f) for f in REPLACED_WRITERS_FOLDERS)

    full = crash_once(tmp_path, steps, None, "strict", skip)
    assert full.skipped > 0, "the sabotage never applied"
    after = crash_once(tmp_path, steps, full.ops + 1, "strict", skip)  # power cut at the end
    assert any("acknowledged" in v or "does not load" in v for v in after.violations), \
        "the harness missed the replaced writer's unsynced folder"
    control = crash_once(tmp_path, steps, full.ops + 1, "strict")
    assert not control.violations, control.violations
    campaign_report("powerloss-teeth", sabotage="replaced-writer-folder-fsync",
                    crash_points_tried=1, points_with_violations=1, first_hit=full.ops + 1,
                    example=after.violations[0])


# -- the model itself ---------------------------------------------------------------------------


def test_model_drops_what_was_not_fsynced(tmp_path: Path) -> None:
    """The POSIX model on plain calls through the proxy: data needs the file's fsync, a name
    needs its folder's fsync; a rename is undone without the folder's fsync."""
    root = tmp_path / "m"
    root.mkdir()
    (root / "old").write_bytes(b"old")
    h = PowerLossHarness(root, mode="strict")
    with h.installed():
        os_: Any = local_module.os  # type: ignore[attr-defined]  # the harness's proxy
        fd = os_.open(root / "synced", os_.O_WRONLY | os_.O_CREAT, 0o644)
        os_.write(fd, b"durable")
        os_.fsync(fd)
        os_.write(fd, b"+lost")
        os_.close(fd)
        fd = os_.open(root / "nosync", os_.O_WRONLY | os_.O_CREAT, 0o644)
        os_.write(fd, b"lost")
        os_.close(fd)
        d = os_.open(root, os_.O_RDONLY | os_.O_DIRECTORY)
        os_.fsync(d)  # both names durable now; "nosync" has no durable data
        os_.replace(root / "synced", root / "renamed")  # not followed by a folder fsync
        os_.unlink(root / "old")
        os_.mkdir(root / "sub")
        os_.close(d)
    tree = h.power_cut()
    assert tree == {"old": b"old", "synced": b"durable", "nosync": b""}
    assert sorted(p.name for p in root.iterdir()) == ["nosync", "old", "synced"]
    assert (root / "synced").read_bytes() == b"durable"


def test_model_eager_names_keeps_renames_but_not_data(tmp_path: Path) -> None:
    root = tmp_path / "m"
    root.mkdir()
    h = PowerLossHarness(root, crash_at=5, mode="eager-names")
    with h.installed():
        os_: Any = local_module.os  # type: ignore[attr-defined]  # the harness's proxy
        fd = os_.open(root / "t", os_.O_WRONLY | os_.O_CREAT, 0o644)  # op 1
        os_.write(fd, b"data")  # op 2
        os_.close(fd)
        os_.replace(root / "t", root / "final")  # op 3: no fsync of the data before it
        os_.mkdir(root / "sub")  # op 4
        with pytest.raises(PowerCut):
            os_.unlink(root / "final")  # op 5: never happens
        with pytest.raises(PowerCut):
            os_.stat(root)  # the process is dead
    assert h.power_cut() == {"final": b"", "sub": {}}
    assert h.ops == ["open-create " + str(root / "t"), f"write fd{fd}",
                     f"replace {root / 't'} -> {root / 'final'}", f"mkdir {root / 'sub'}"]
