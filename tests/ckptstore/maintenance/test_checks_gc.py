"""Garbage collection frees only unreferenced blobs older than the grace period."""

from __future__ import annotations

import time

import pytest
import torch

from ckptstore import CheckpointStore, CkptStoreError
from ckptstore.maintenance.checks import MIN_BLOB_AGE


def test_gc_frees_only_unreferenced_old_blobs(store_uri, store_options):
    repo = CheckpointStore(store_uri, chunk_bytes=1 << 16, **store_options)
    shared = torch.randn(256, 128)
    repo.save("a", {"shared": shared, "own": torch.randn(256, 128)})
    repo.save("b", {"shared": shared, "own": torch.randn(256, 128)})
    blobs_a = repo.manifest("a").blob_digests()
    blobs_b = repo.manifest("b").blob_digests()
    repo.delete("a")
    assert [c.name for c in repo.list()] == ["b"]
    young = repo.gc(grace_seconds=3600)
    assert young.deleted_blobs == 0 and young.kept_young_blobs == len(blobs_a - blobs_b)
    dry = repo.gc(grace_seconds=0, dry_run=True, now=time.time() + 2 * MIN_BLOB_AGE)
    assert set(dry.deleted) == blobs_a - blobs_b
    assert all(repo.store.exists(f"blobs/{d[:2]}/{d}") for d in blobs_a)
    report = repo.gc(grace_seconds=0, now=time.time() + 2 * MIN_BLOB_AGE)
    assert set(report.deleted) == blobs_a - blobs_b and report.freed_bytes > 0
    assert torch.equal(repo.load("b")["shared"], shared)
    assert repo.verify("b").ok
    assert repo.gc(grace_seconds=0, now=time.time() + 2 * MIN_BLOB_AGE).deleted_blobs == 0
    repo.close()


def test_gc_stops_on_unreadable_manifest(tmp_path):
    repo = CheckpointStore(tmp_path / "r")
    repo.save("a", {"x": torch.randn(100, 1000)})
    repo.save("b", {"x": torch.randn(100, 1000)})
    (tmp_path / "r" / "checkpoints" / "a.json").write_text("{broken")
    fresh = CheckpointStore(tmp_path / "r")
    with pytest.raises(CkptStoreError, match="nothing deleted"):
        fresh.gc(grace_seconds=0, now=time.time() + 2 * MIN_BLOB_AGE)
    assert fresh.verify("b").ok


def test_gc_leaves_foreign_objects_alone(tmp_path):
    repo = CheckpointStore(tmp_path / "r")
    repo.store.put("blobs/zz/not-a-digest", b"keep me")
    repo.store.put("notes.txt", b"keep me too")
    repo.gc(grace_seconds=0, now=time.time() + 2 * MIN_BLOB_AGE)
    assert repo.store.exists("blobs/zz/not-a-digest") and repo.store.exists("notes.txt")
