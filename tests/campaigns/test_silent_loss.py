"""The silent-loss paths an adversarial audit found, each reproduced and closed:

1. gc trusting its own clock (skewed hosts deleted a running save's blobs);
2. retention deleting a rolled-back run, and a restart resuming the abandoned one;
3. one stray or torn file under checkpoints/ stopping every save, list, gc and restore;
6. dotted keys that collide (`{"a": {"b": x}, "a.b": y}`) filling one tensor with another's data;
7. a store that failed to answer (an index blob's read, or a far tier's, failing with HTTP 500
   on every retry) taken for damage: restore resumed from the step before without an error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch

from ckptstore import CheckpointManager, CheckpointStore, UnsupportedTypeError
from ckptstore.errors import StoreError
from ckptstore.layout import blob_key
from ckptstore.maintenance import leases
from ckptstore.maintenance.checks import MIN_BLOB_AGE
from ckptstore.pipeline.writer import CheckpointWriter
from ckptstore.stores.local import LocalStore


def state_of(seed: int, n: int = 4096) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n, generator=g), "b": torch.randn(16, generator=g)}


# ------------------------------------------------------------------ 1. clocks
SKEWED_GC = textwrap.dedent("""
    import sys, time
    real = time.time
    time.time = lambda: real() + float(sys.argv[2])  # this host's clock is wrong
    from ckptstore import CheckpointStore
    from ckptstore.maintenance.leases import LeaseBusyError
    repo = CheckpointStore(sys.argv[1], create=False)
    deadline = real() + float(sys.argv[3])
    runs = busy = deleted = 0
    while real() < deadline:
        try:
            deleted += repo.gc(grace_seconds=0).deleted_blobs
            runs += 1
        except LeaseBusyError:
            busy += 1
        time.sleep(0.02)
    print(runs, busy, deleted)
""")


def test_gc_on_a_host_whose_clock_runs_400s_ahead_takes_nothing_from_running_saves(
        tmp_path: Path) -> None:
    uri = str(tmp_path / "repo")
    repo = CheckpointStore(uri)
    repo.save("seed", state_of(0))
    gc_proc = subprocess.Popen([sys.executable, "-c", SKEWED_GC, uri, "400", "6"],
                               stdout=subprocess.PIPE, text=True)
    try:
        names = []
        deadline = time.monotonic() + 5
        i = 1
        while time.monotonic() < deadline:
            repo.save(f"s{i}", state_of(i, 1 << 18))  # 1 MiB: several chunks per save
            names.append(f"s{i}")
            i += 1
    finally:
        out, _ = gc_proc.communicate(timeout=60)
    runs, busy, deleted = map(int, out.split())
    assert runs + busy > 10 and len(names) >= 3
    fresh = CheckpointStore(uri)
    for name in names:  # before the fix: every one of them failed verify
        assert fresh.verify(name).ok, name
        assert torch.equal(fresh.load(name)["w"], state_of(int(name[1:]), 1 << 18)["w"])
    assert deleted == 0  # nothing was old enough on the store's clock


def test_lease_ages_are_read_on_the_store_clock(tmp_path: Path, monkeypatch) -> None:
    repo = CheckpointStore(tmp_path / "repo")
    save = leases.acquire_save(repo.store)
    try:
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() + 400)  # the observer runs ahead
        [seen] = leases.list_leases(repo.store)
        assert seen.key == save.key and seen.age < 60
        with pytest.raises(leases.LeaseBusyError):
            repo.gc(grace_seconds=0)
    finally:
        monkeypatch.undo()
        save.release()


def test_no_blob_younger_than_the_staleness_bound_is_deleted_whatever_grace_says(
        tmp_path: Path) -> None:
    repo = CheckpointStore(tmp_path / "repo")
    repo.save("a", state_of(1))
    blobs = repo.manifest("a").blob_digests()
    repo.delete("a")
    report = repo.gc(grace_seconds=0)
    assert report.deleted_blobs == 0 and report.kept_young_blobs == len(blobs)
    assert report.min_age_seconds == MIN_BLOB_AGE
    for blob in blobs:  # age them past the bound on the store's own clock (file mtimes)
        path = tmp_path / "repo" / blob_key(blob)
        old = time.time() - MIN_BLOB_AGE - 5
        os.utime(path, (old, old))
    assert repo.gc(grace_seconds=0).deleted_blobs == len(blobs)


def test_a_save_whose_reused_blobs_vanish_before_its_commit_writes_them_again(
        tmp_path: Path, monkeypatch) -> None:
    """A gc that misjudges leases (or a party that takes none) deletes the chunks a running
    incremental save reuses. The save notices at its commit and writes them again."""
    repo = CheckpointStore(tmp_path / "repo")
    repo.save("base", state_of(1))
    base_blobs = repo.manifest("base").blob_digests()
    original = CheckpointWriter.write_blobs

    def write_then_rogue_gc(self, leaves, plans):
        refs = original(self, leaves, plans)
        rogue = leases.Lease(repo.store, "gc")
        rogue.announce_sweep()  # as every gc does before it deletes
        for blob in base_blobs:
            repo.store.delete(blob_key(blob))
        rogue.release()
        return refs

    monkeypatch.setattr(CheckpointWriter, "write_blobs", write_then_rogue_gc)
    state = state_of(1)
    state["extra"] = torch.ones(3)
    info = repo.save("next", state)
    monkeypatch.undo()
    fresh = CheckpointStore(tmp_path / "repo")
    assert fresh.verify("next").ok
    assert torch.equal(fresh.load("next")["w"], state["w"])
    assert info.reused_bytes == 0  # the second attempt reused nothing


def test_a_save_whose_own_blobs_vanish_before_its_commit_writes_them_again(
        tmp_path: Path, monkeypatch) -> None:
    """A save suspended past its lease's bound (SIGSTOP by a scheduler) finds, on resuming,
    that a gc judged its lease stale and deleted the blobs it had written: it used to commit
    anyway (only the blobs it reused were checked), leaving a checkpoint that cannot load."""
    repo = CheckpointStore(tmp_path / "repo")
    original = CheckpointWriter.write_blobs

    def write_then_gc_while_suspended(self, leaves, plans):
        refs = original(self, leaves, plans)
        monkeypatch.undo()  # once: the save's second attempt is not suspended
        rogue = leases.Lease(repo.store, "gc")
        rogue.announce_sweep()
        for ref in refs.values():
            repo.store.delete(blob_key(ref.blob))
        rogue.release()
        return refs

    monkeypatch.setattr(CheckpointWriter, "write_blobs", write_then_gc_while_suspended)
    state = state_of(2)
    info = repo.save("first", state)
    fresh = CheckpointStore(tmp_path / "repo")
    assert fresh.verify("first").ok
    assert torch.equal(fresh.load("first")["w"], state["w"])
    assert info.written_bytes > 0


def test_without_a_sweep_no_extra_requests_are_made(tmp_path: Path, monkeypatch) -> None:
    repo = CheckpointStore(tmp_path / "repo")
    repo.save("base", state_of(1))
    calls = []
    real_exists = type(repo.store).exists
    monkeypatch.setattr(type(repo.store), "exists",
                        lambda self, key: calls.append(key) or real_exists(self, key))
    repo.save("next", state_of(1))
    assert not [k for k in calls if k.startswith("blobs/")]


# ------------------------------------------------------------------ 2. rollback
def test_a_rolled_back_run_is_kept_and_resumed(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path / "run", keep_last=2)
    for step in (90, 100):
        mgr.save(step, {"w": torch.full((4,), float(step))})
    # loss spike: the run goes back to step 50 and trains on from there
    for step in (51, 52):
        mgr.save(step, {"w": torch.full((4,), float(step))})
        assert step in mgr.steps()  # never deleted the moment it was saved
    assert mgr.steps() == [51, 52]
    mgr.close()
    again = CheckpointManager(tmp_path / "run", keep_last=2)
    state = {"w": torch.zeros(4)}
    assert again.restore(state) == 52  # the live run, not the abandoned step 100
    assert torch.equal(state["w"], torch.full((4,), 52.0))
    again.close()


def test_commit_order_holds_when_a_later_host_has_a_slower_clock(tmp_path: Path,
                                                                 monkeypatch) -> None:
    repo = CheckpointStore(tmp_path / "repo")
    repo.save("first", {"x": 1})
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() - 3600)  # the job restarted elsewhere
    repo.save("second", {"x": 2})
    monkeypatch.undo()
    assert CheckpointStore(tmp_path / "repo").history() == ["first", "second"]
    assert CheckpointStore(tmp_path / "repo").latest() == "second"


# ------------------------------------------------------------------ 3. stray files
@pytest.fixture
def cluttered(tmp_path: Path) -> Path:
    """A run with steps 1..3, a macOS `._` file, a name with a space and a torn step 4."""
    run = tmp_path / "run"
    mgr = CheckpointManager(run)
    for step in (1, 2, 3, 4):
        mgr.save(step, {"w": torch.full((8,), float(step))})
    mgr.close()
    folder = run / "checkpoints"
    (folder / "._step-1.json").write_bytes(b"\x00\x05\x16\x07 AppleDouble")
    (folder / "step 1.json").write_text("{}")
    torn = folder / "step-4.json"
    torn.write_bytes(torn.read_bytes()[:300])
    return run


def test_stray_and_torn_manifests_do_not_stop_saves_lists_or_restores(cluttered: Path) -> None:
    repo = CheckpointStore(cluttered)
    assert [i.name for i in repo.list()] == ["step-1", "step-2", "step-3"]
    assert repo.latest() == "step-3"
    problems = {p.key: p.reason for p in repo.problems()}
    assert set(problems) == {"checkpoints/._step-1.json", "checkpoints/step 1.json",
                             "checkpoints/step-4.json"}
    assert "not valid JSON" in problems["checkpoints/step-4.json"]
    repo.save("plain", {"w": torch.ones(8)})  # parent="latest": the newest whole one

    mgr = CheckpointManager(cluttered, keep_last=10)
    state = {"w": torch.zeros(8)}
    assert mgr.restore(state) == 3  # falls back past the torn step 4
    assert torch.equal(state["w"], torch.full((8,), 3.0))
    mgr.save(5, {"w": torch.full((8,), 5.0)})
    assert mgr.restore(state) == 5
    mgr.close()


def test_ckpt_ls_and_verify_show_what_is_not_a_manifest(cluttered: Path, capsys) -> None:
    from ckptstore.cli import main

    for command in ("ls", "verify"):
        assert main([command, str(cluttered), "--json"]) == 1  # EXIT_FOUND: something is wrong
        doc = json.loads(capsys.readouterr().out)
        listed = doc["errors"] if command == "ls" else doc["manifest_problems"]
        assert sorted(e["name"] for e in listed) == ["._step-1", "step 1", "step-4"]
        if command == "ls":
            assert [c["name"] for c in doc["checkpoints"]] == ["step-1", "step-2", "step-3"]
        else:
            assert doc["checkpoints"] == ["step-1", "step-2", "step-3"]


def test_gc_refuses_while_a_manifest_it_cannot_read_exists(cluttered: Path) -> None:
    repo = CheckpointStore(cluttered)
    with pytest.raises(Exception, match="step-4") as caught:
        repo.gc(grace_seconds=0)
    assert "nothing deleted" in str(caught.value)
    (cluttered / "checkpoints" / "step-4.json").unlink()  # the junk names alone do not stop it
    assert repo.gc(grace_seconds=0).deleted_blobs == 0


def test_restore_falls_back_when_the_newest_checkpoint_lost_a_blob(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path / "run")
    for step in (1, 2):
        mgr.save(step, {"w": torch.full((1024,), float(step))})
    blob = next(iter(mgr.repo.manifest("step-2").blob_digests()))
    (tmp_path / "run" / blob_key(blob)).unlink()
    state = {"w": torch.zeros(1024)}
    with pytest.warns(RuntimeWarning, match="step 2 is damaged"):
        assert mgr.restore(state) == 1
    assert torch.equal(state["w"], torch.full((1024,), 1.0))
    with pytest.raises(Exception, match=blob):  # asked for by step: no silent substitute
        mgr.restore(state, step=2)
    mgr.close()


class _Outage(LocalStore):
    """A folder whose reads of `down` keys fail as a server error does (every retry spent)."""

    down: frozenset[str] = frozenset()

    def _fail(self, key: str) -> None:
        if key in self.down:
            raise StoreError(f"read {key}: HTTP 500 InternalError (every attempt)")

    def get(self, key):
        self._fail(key)
        return super().get(key)

    def read_into(self, key, start, out):
        self._fail(key)
        super().read_into(key, start, out)

    def read_into_digest(self, key, start, out):
        self._fail(key)
        return super().read_into_digest(key, start, out)


@pytest.mark.parametrize("lost", ["index blob", "data blob"])
def test_restore_never_takes_an_older_step_because_the_store_failed_to_answer(
        tmp_path: Path, lost: str) -> None:
    # a 500 on the newest checkpoint's index segment was taken for damage: restore resumed
    # from the step before, silently losing a step, though step 2 loads once the server is back
    store = _Outage(tmp_path / "run")
    mgr = CheckpointManager(CheckpointStore(store))
    for step in (1, 2):  # more than 1,024 tensors: index segments (manifest version 3)
        mgr.save(step, {"w": {f"t{i}": torch.full((4,), float(step + i)) for i in range(1100)}})
    manifests = {s: CheckpointStore(tmp_path / "run").manifest(f"step-{s}") for s in (1, 2)}
    index = {s: {r.digest for r in m.index_blobs()} for s, m in manifests.items()}
    digests = {s: index[s] if lost == "index blob" else m.blob_digests() - index[s]
               for s, m in manifests.items()}
    store.down = frozenset(blob_key(d) for d in digests[2] - digests[1])
    assert store.down
    fresh = CheckpointManager(CheckpointStore(store))
    state = {"w": {f"t{i}": torch.zeros(4) for i in range(1100)}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "step 2 is damaged; resuming from step 1"
        with pytest.raises(StoreError, match="HTTP 500"):
            fresh.restore(state)
    store.down = frozenset()
    assert fresh.restore(state) == 2 and float(state["w"]["t5"][0]) == 7.0
    mgr.close()
    fresh.close()


def test_a_chunk_missing_near_while_the_far_tier_fails_to_answer_is_not_damage(
        tmp_path: Path) -> None:
    far = _Outage(tmp_path / "far")
    mgr = CheckpointManager(CheckpointStore([LocalStore(tmp_path / "near"), far]))
    for step in (1, 2):
        mgr.save(step, {"w": torch.full((1024,), float(step))})
    mgr.repo.wait_replicated()
    (blob,) = (mgr.repo.manifest("step-2").blob_digests()
               - mgr.repo.manifest("step-1").blob_digests())
    (tmp_path / "near" / blob_key(blob)).unlink()
    far.down = frozenset({blob_key(blob)})
    state = {"w": torch.zeros(1024)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(StoreError, match="HTTP 500"):
            mgr.restore(state)
    far.down = frozenset()
    with pytest.warns(RuntimeWarning, match=blob):  # read from far, written near again
        assert mgr.restore(state) == 2
    assert torch.equal(state["w"], torch.full((1024,), 2.0))
    mgr.close()


def test_a_retention_failure_after_the_commit_is_a_warning(tmp_path: Path,
                                                          monkeypatch) -> None:
    mgr = CheckpointManager(tmp_path / "run", keep_last=1)
    mgr.save(1, {"w": torch.ones(2)})

    def broken_delete(name: str) -> None:
        raise OSError("network down")

    monkeypatch.setattr(mgr.repo, "delete", broken_delete)
    with pytest.warns(RuntimeWarning, match="committed.*network down"):
        mgr.save(2, {"w": torch.ones(2)})
    monkeypatch.undo()
    assert mgr.steps() == [1, 2]
    mgr.save(3, {"w": torch.ones(2)})  # retention runs again at the next save
    assert mgr.steps() == [3]
    mgr.close()


# ------------------------------------------------------------------ 6. dotted keys
@pytest.mark.parametrize("state", [
    {"a": {"b": torch.ones(2)}, "a.b": torch.zeros(2)},
    {1: torch.ones(2), "1": torch.zeros(2)},
    {"opt": {"state": {0: {"m": torch.ones(1)}}, "state.0": {"m": torch.zeros(1)}}},
    {"x": [torch.ones(1)], "x.0": 3},
], ids=["dict-vs-dotted", "int-vs-str", "nested", "list-index"])
def test_colliding_dotted_keys_are_refused_at_save_time(tmp_path: Path, state) -> None:
    repo = CheckpointStore(tmp_path / "repo")
    with pytest.raises(UnsupportedTypeError, match="rename one of them"):
        repo.save("c", state)
    assert repo.list() == []


def test_dotted_keys_that_do_not_collide_still_save(tmp_path: Path) -> None:
    repo = CheckpointStore(tmp_path / "repo")
    state = {"layer.0.weight": torch.ones(2), "layer": {"1": torch.zeros(2)}, 3: {"a": 1}}
    repo.save("c", state)
    assert torch.equal(repo.load("c")["layer.0.weight"], torch.ones(2))


# ------------------------------------------------------------------ found by the campaigns
@pytest.mark.parametrize("store_kind", ["local", "memory"])
def test_a_truncated_blob_is_an_integrity_error(tmp_path: Path, store_kind: str) -> None:
    """A blob shorter than its manifest says (truncated, or swapped for a shorter one) is
    damage, reported as IntegrityError like every other kind, not as a store failure."""
    from ckptstore import IntegrityError

    uri = str(tmp_path / "repo") if store_kind == "local" else f"memory://trunc-{tmp_path.name}"
    repo = CheckpointStore(uri)
    repo.save("a", {"w": torch.arange(100_000, dtype=torch.float32)})
    [blob] = repo.manifest("a").blob_digests()
    data = repo.store.get(blob_key(blob))
    repo.store.put(blob_key(blob), data[: len(data) // 2])
    with pytest.raises(IntegrityError, match="shorter than the manifest declares"):
        CheckpointStore(uri).load("a")


def test_gc_removes_the_leases_of_dead_processes(tmp_path: Path) -> None:
    repo = CheckpointStore(tmp_path / "repo")
    code = ("import sys, os; from ckptstore import CheckpointStore; "
            "from ckptstore.maintenance.leases import acquire_save; "
            "acquire_save(CheckpointStore(sys.argv[1]).store); os._exit(0)")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "repo")], check=True)
    assert len(list(repo.store.list("locks/"))) == 1  # left behind by a process that died
    report = repo.gc()
    assert report.removed_stale_leases == 1
    assert [i.key for i in repo.store.list("locks/") if "sweep" not in i.key] == []
