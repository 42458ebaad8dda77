"""GC safety at the worst instants: a gc between a save's blob writes and its commit, and a
chunk that comes back after its only checkpoint was deleted and swept."""

from __future__ import annotations

import uuid

import numpy as np

from ckptstore import CheckpointStore
from ckptstore.maintenance import checks as maintenance
from tests.ckptstore.maintenance.test_leases import _GcBeforeCommit


def test_an_unleased_save_survives_gc_at_the_worst_instant() -> None:
    store = _GcBeforeCommit(uuid.uuid4().hex)
    repo = CheckpointStore(store)
    state = {"w": np.arange(100_000, dtype=np.float32)}
    repo.save("a", state)
    assert np.array_equal(repo.load("a")["w"], state["w"])


def test_a_chunk_that_comes_back_after_delete_and_gc_is_written_again(tmp_path) -> None:
    repo = CheckpointStore(tmp_path / "r")
    x = np.arange(100_000, dtype=np.float32)
    repo.save("a", {"x": x})
    repo.save("b", {"x": x + 1})
    repo.delete("a")
    report = maintenance.gc(repo.store, repo.referenced_blobs, grace_seconds=0, now=1e10)
    assert report.deleted_blobs > 0
    repo.save("c", {"x": x})  # the same content as the deleted `a`
    assert np.array_equal(repo.load("c")["x"], x)
