"""Tiered repositories: a local near tier and moto S3 as the far tier (real HTTP), with S3
faults injected during replication, damaged near chunks restored from far, and kill -9 of a
saving process while its replication is in flight."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptstore
from ckptstore.errors import CheckpointNotFoundError, IntegrityError, InvalidNameError
from ckptstore.layout import blob_key
from ckptstore.stores.local import LocalStore
from ckptstore.tiers import pending
from ckptstore.tiers.replication import ReplicationError, RetryPolicy
from tests.helpers import reap
from tests.reliability.s3chaos import ChaosPlan, ChaosServer, moto_app

FAST_RETRY = RetryPolicy(attempts=3, first_delay=0.05, max_delay=0.2)


def state(seed: int, n: int = 300_000) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal(n).astype(np.float32),
            "frozen": np.arange(n // 2, dtype=np.float32),  # same in every checkpoint
            "step": seed}


def same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["step"] == b["step"]
    for k in ("w", "frozen"):
        assert a[k].tobytes() == b[k].tobytes()


@pytest.fixture
def chaos() -> Any:
    server = ChaosServer(moto_app(), seed=1)
    try:
        yield server
    finally:
        server.close()


def test_save_returns_on_tier0_and_replicates_only_new_chunks(tmp_path: Path, s3_uri: str,
                                                               moto_endpoint: str) -> None:
    uris = [str(tmp_path / "near"), s3_uri]
    with ckptstore.CheckpointStore(uris, endpoint_url=moto_endpoint, chunk_bytes=256 << 10
                                   ) as repo:
        for i in range(3):
            repo.save(f"s{i}", state(i))
        repo.wait_replicated()
        assert repo.where("s1") == [repo.tiers[0].uri, repo.tiers[1].uri]
        results = {r.name: r for r in repo._replicator.results}  # type: ignore[union-attr]
        # the frozen tensor's chunks travel once: later checkpoints send only what changed
        assert results["s1"].blobs_sent < results["s1"].blobs_needed
        assert results["s0"].blobs_sent == results["s0"].blobs_needed
        assert not repo.replication_pending("s2")
    # every tier is an ordinary repository: the far one alone lists, loads and verifies
    far = ckptstore.CheckpointStore(s3_uri, endpoint_url=moto_endpoint, create=False)
    assert far.history() == ["s0", "s1", "s2"]
    for i in range(3):
        same(far.load(f"s{i}"), state(i))
        assert far.verify(f"s{i}").ok


def test_replication_survives_s3_faults(tmp_path: Path, s3_uri: str, chaos: Any) -> None:
    plan: ChaosPlan = chaos.plan
    plan.configure(rate=0.2, seed=7)  # 503s, 500s, lost replies, resets, truncated bodies
    uris = [str(tmp_path / "near"), s3_uri]
    with ckptstore.CheckpointStore(uris, endpoint_url=chaos.endpoint, chunk_bytes=128 << 10,
                                   replication_retry=RetryPolicy(attempts=8, first_delay=0.05)
                                   ) as repo:
        for i in range(3):
            repo.save(f"s{i}", state(i, 100_000))
        repo.wait_replicated()
    assert sum(plan.injected.values()) > 10, plan.injected  # faults really happened
    plan.configure(rate=0.0, seed=0)
    far = ckptstore.CheckpointStore(s3_uri, endpoint_url=chaos.endpoint, create=False)
    for i in range(3):
        assert far.verify(f"s{i}").ok
        same(far.load(f"s{i}"), state(i, 100_000))


def test_replication_that_gives_up_is_raised_and_resumes(tmp_path: Path, s3_uri: str,
                                                        chaos: Any) -> None:
    plan: ChaosPlan = chaos.plan
    uris = [str(tmp_path / "near"), s3_uri]
    repo = ckptstore.CheckpointStore(uris, endpoint_url=chaos.endpoint, max_attempts=1,
                                     replication_retry=FAST_RETRY)
    plan.add("503", "PUT", "", times=10_000)  # every write to the far tier fails
    info = repo.save("s0", state(0))
    assert info.name == "s0"  # the save itself succeeded: tier 0 committed
    with pytest.raises(ReplicationError, match="s0"):
        repo.wait_replicated()
    assert repo.where("s0") == [repo.tiers[0].uri]  # far never lists what it lacks
    assert repo.replication_pending("s0")  # the record stays for a retry or a reopen
    plan.reset()
    assert repo.replicate_pending() == ["s0"]
    repo.wait_replicated()
    assert repo.where("s0") == [t.uri for t in repo.tiers]
    assert not repo.replication_pending("s0")
    repo.close()


def test_restore_repairs_damaged_near_chunks_from_far(tmp_path: Path, s3_uri: str,
                                                     moto_endpoint: str) -> None:
    near = tmp_path / "near"
    with ckptstore.CheckpointStore([str(near), s3_uri], endpoint_url=moto_endpoint,
                                   chunk_bytes=256 << 10) as repo:
        repo.save("s0", state(0))
        repo.wait_replicated()
        blobs = sorted(repo.manifest("s0").blob_digests())
        flipped, gone = blobs[0], blobs[1]
        path = near / blob_key(flipped)
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 0x10
        path.write_bytes(bytes(raw))
        (near / blob_key(gone)).unlink()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            same(repo.load("s0"), state(0))
        messages = " ".join(str(w.message) for w in caught)
        assert flipped in messages and gone in messages
        info = repo.last_load
        assert info is not None and set(info.repaired) == {flipped, gone}
        assert info.bytes_by_tier[repo.tiers[1].uri] > 0
        # repaired near: the next restore is local again, and tier 0 alone verifies
        same(repo.load("s0"), state(0))
        assert repo.last_load is not None
        assert repo.last_load.bytes_by_tier[repo.tiers[1].uri] == 0
        assert repo.tiers[0].verify("s0").ok


def test_checkpoint_only_on_far_restores_and_bad_everywhere_fails(
        tmp_path: Path, s3_uri: str, moto_endpoint: str) -> None:
    near = tmp_path / "near"
    with ckptstore.CheckpointStore([str(near), s3_uri], endpoint_url=moto_endpoint) as repo:
        repo.save("s0", state(0))
        repo.save("s1", state(1))
        repo.wait_replicated()
    shutil.rmtree(near)  # the node's disk is gone
    with ckptstore.CheckpointStore([str(near), s3_uri], endpoint_url=moto_endpoint) as repo:
        assert repo.latest() == "s1" and repo.where("s1") == [repo.tiers[1].uri]
        same(repo.load("s1"), state(1))
        assert repo.last_load is not None
        assert repo.last_load.bytes_by_tier[repo.tiers[0].uri] == 0
        assert not repo.last_load.repaired  # tier 0 does not hold s1: nothing to repair
        # a chunk bad on the far tier too: the existing IntegrityError
        blob = sorted(repo.manifest("s0").blob_digests())[0]
        repo.tiers[1].store.put(blob_key(blob), b"garbage")
        with pytest.raises(IntegrityError, match=blob):
            repo.load("s0")
        repo.delete("s1")
        assert repo.where("s1") == [] and "s1" not in repo.names()
        with pytest.raises(CheckpointNotFoundError):
            repo.delete("s1")


def test_delete_one_tier_and_saves_not_meant_for_far(tmp_path: Path) -> None:
    uris = [str(tmp_path / "near"), str(tmp_path / "far")]
    with ckptstore.CheckpointStore(uris) as repo:
        repo.save("a", state(0), tiers=[0])  # tier 0 only
        repo.save("b", state(1))
        repo.wait_replicated()
        assert repo.where("a") == [repo.tiers[0].uri]
        repo.delete("b", tier=0)
        assert repo.where("b") == [repo.tiers[1].uri]
        assert repo.history() == ["a", "b"]
        # a save never reuses chunks tier 0 lacks, even when the union's latest is far-only
        repo.save("c", state(1))
        assert repo.tiers[0].verify("c").ok
        with pytest.raises(ValueError):
            repo.save("d", state(2), tiers=[5])
        with pytest.raises(ValueError):
            repo.delete("a", tier=2)
    with pytest.raises(InvalidNameError, match="rank"):
        ckptstore.CheckpointStore([str(tmp_path / "n{rank}"), str(tmp_path / "far")])
    with pytest.raises(InvalidNameError, match="twice"):
        ckptstore.CheckpointStore([str(tmp_path / "near"), str(tmp_path / "near")])


WORKER = textwrap.dedent("""
    import sys, numpy as np, ckptstore
    from ckptstore.tiers.replication import RetryPolicy
    near, far, endpoint, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    repo = ckptstore.CheckpointStore([near, far], endpoint_url=endpoint,
                                     chunk_bytes=256 << 10)
    for i in range(n):
        rng = np.random.default_rng(i)
        repo.save(f"s{i}", {"w": rng.standard_normal(300_000).astype(np.float32)})
        print(f"saved s{i}", flush=True)
    repo.wait_replicated()
    print("replicated", flush=True)
""")


def slow_puts(server: ChaosServer, delay: float) -> None:
    """Every PUT through `server` waits `delay` seconds first (a slow far tier)."""
    take = server.plan.take

    def slow_take(env: dict[str, Any]) -> Any:
        if env["REQUEST_METHOD"] == "PUT":
            time.sleep(delay)
        return take(env)

    server.plan.take = slow_take  # type: ignore[method-assign]


def test_kill9_while_replicating_leaves_far_whole_and_reopen_finishes(
        tmp_path: Path, s3_uri: str, moto_endpoint: str) -> None:
    server = ChaosServer(moto_app())
    slow_puts(server, 0.3)  # replication is still running when the saves end
    near, n = str(tmp_path / "near"), 5
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    proc = subprocess.Popen([sys.executable, "-c", WORKER, near, s3_uri, server.endpoint,
                             str(n)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        for i in range(n):
            assert proc.stdout.readline().strip() == f"saved s{i}"
        time.sleep(0.2)  # some blobs of the first checkpoints are on their way
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        reap(proc, 10)
        server.close()
    far = ckptstore.CheckpointStore(s3_uri, endpoint_url=moto_endpoint, create=False)
    listed = far.names()
    assert len(listed) < n  # the kill landed while replication was in flight
    for name in listed:  # the far tier shows only whole checkpoints
        assert far.verify(name).ok
    near_repo = ckptstore.CheckpointStore(near, create=False)
    # every checkpoint the far tier lacks has its record (one just copied may keep it too)
    recorded = {r.name for r in pending.read_records(near_repo.store)}
    assert recorded >= {f"s{i}" for i in range(n)} - set(listed)
    with ckptstore.CheckpointStore([near, s3_uri], endpoint_url=moto_endpoint) as repo:
        repo.wait_replicated()  # reopening found the pending records and finished them
        assert sorted(repo.tiers[1].names()) == [f"s{i}" for i in range(n)]
    for i in range(n):
        assert far.verify(f"s{i}").ok
        want = np.random.default_rng(i).standard_normal(300_000).astype(np.float32)
        assert far.load(f"s{i}")["w"].tobytes() == want.tobytes()
    assert pending.read_records(near_repo.store) == []


def test_replication_resends_blobs_a_concurrent_sweep_deleted(tmp_path: Path) -> None:
    """A gc that slipped past the leases (belt and braces, maintenance/leases.py) deletes a
    blob the replication found present on the far tier: the replication sees the changed
    sweep marker, asks again and sends the blob before it creates the manifest."""
    from ckptstore.layout import SWEEP_KEY
    from ckptstore.stores.local import LocalStore
    from ckptstore.tiers.replication import replicate_checkpoint

    near = ckptstore.CheckpointStore(str(tmp_path / "near"))
    near.save("a", state(1))
    near.save("b", state(2))  # shares the frozen tensor's chunks with "a"
    far_root = tmp_path / "far"
    replicate_checkpoint("a", [near.store], LocalStore(far_root), near.hash)
    ckptstore.CheckpointStore(str(far_root)).delete("a")  # its blobs stay until a gc
    frozen = {c.blob for t in near.find_manifest("b").tensors if t.key == "frozen"
              for c in t.chunks}

    class SweptDuringCopy(LocalStore):
        """Deletes the shared blobs and announces a sweep at the first blob write."""
        swept = False

        def put(self, key: str, data: bytes) -> None:
            if key.startswith("blobs/") and not self.swept:
                type(self).swept = True
                for blob in frozen:
                    self.delete(blob_key(blob))
                LocalStore.put(self, SWEEP_KEY, b'{"gc":"x","state":"deleting"}')
            super().put(key, data)

    dst = SweptDuringCopy(far_root)
    result = replicate_checkpoint("b", [near.store], dst, near.hash)
    assert SweptDuringCopy.swept and result is not None
    far = ckptstore.CheckpointStore(str(far_root), create=False)
    assert far.verify("b").ok
    same(far.load("b"), state(2))


def test_verify_of_tier_0_reads_its_index_blobs_from_tier_0_alone(tmp_path: Path) -> None:
    # tier 0's catalog reads an index blob it lacks from the later tiers (a load goes on);
    # its verify did too, and called tier 0's copy good with a segment missing there
    near, far = tmp_path / "near", tmp_path / "far"
    state = {f"t{i}": np.full(4, float(i), np.float32) for i in range(3000)}  # segmented
    with ckptstore.CheckpointStore([str(near), str(far)]) as repo:
        repo.save("s", state)
        repo.wait_replicated()
        segment = repo.manifest("s").segment_refs()[0].digest
    (near / blob_key(segment)).unlink()
    with ckptstore.CheckpointStore([str(near), str(far)]) as repo:
        report = repo.verify("s", tier=0)
        assert [(p.blob, p.problem) for p in report.problems] == [(segment, "missing")]
        assert repo.verify("s", tier=1).ok
        with pytest.warns(RuntimeWarning, match=segment):  # a load still has the far copy
            loaded = repo.load("s")
        assert all(loaded[k].tobytes() == v.tobytes() for k, v in state.items())


class _DeletedDuringItsCopy(LocalStore):
    """A far tier where, once the copy of "s1" has put its first blob, another process
    deletes "s1" from tier 0 (`near`), as `ckpt rm` or a CheckpointManager elsewhere does."""

    near: Path | None = None

    def put(self, key: str, data: Any) -> None:
        super().put(key, data)
        if self.near is not None and key.startswith("blobs/"):
            near, self.near = self.near, None
            ckptstore.CheckpointStore(str(near)).delete("s1")


def test_a_checkpoint_deleted_while_it_replicates_does_not_come_back_on_the_far_tier(
        tmp_path: Path) -> None:
    near, far = tmp_path / "near", _DeletedDuringItsCopy(tmp_path / "far")
    with ckptstore.CheckpointStore([str(near), far]) as repo:
        repo.save("s0", state(0, 1000))
        repo.wait_replicated()
        far.near = near
        repo.save("s1", state(1, 1000))
        repo.wait_replicated()
    assert ckptstore.CheckpointStore(str(tmp_path / "far")).names() == ["s0"]
    with ckptstore.CheckpointStore([str(near), str(tmp_path / "far")]) as repo:
        assert repo.latest() == "s0" and repo.names() == ["s0"]
