"""repository/catalog.py: one store's manifests, their commit order, bounded caching."""

from __future__ import annotations

import pytest
import torch

import ckptstore.pipeline.writer as writer_module
import ckptstore.repository.catalog as catalog_module
from ckptstore import CheckpointStore, FormatError, MemoryStore


class CountingStore(MemoryStore):
    def __init__(self) -> None:
        super().__init__()
        self.head_reads: list[str] = []

    def get_range(self, key: str, start: int, length: int) -> bytes:
        self.head_reads.append(key)
        return super().get_range(key, start, length)


def test_commit_order_reads_each_manifest_head_once(tmp_path):
    store = CountingStore()
    with CheckpointStore(store) as repo:
        for i in range(5):
            repo.save(f"s{i}", {"w": torch.full((4,), float(i))})
    fresh = CheckpointStore(store)  # a restarted process: nothing cached
    store.head_reads.clear()
    fresh.save("s5", {"w": torch.zeros(4)})
    assert len(store.head_reads) == 5  # the five existing manifests, once each
    store.head_reads.clear()
    fresh.save("s6", {"w": torch.ones(4)})
    fresh.history()
    assert store.head_reads == []  # then never again: the listing says they are unchanged
    assert fresh.history() == [f"s{i}" for i in range(7)]


def test_the_manifest_cache_is_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(catalog_module, "CACHE_TENSORS", 10)
    repo = CheckpointStore(tmp_path / "r")
    for i in range(4):
        repo.save(f"s{i}", {f"t{j}": torch.full((2,), float(i)) for j in range(4)})
    for i in range(4):
        repo.load(f"s{i}")
    cached = repo.catalog._manifests
    assert sum(len(m.tensors) for m in cached.values()) <= 10
    assert list(cached)[-1] == "s3"  # the most recently used stays


def test_a_manifest_over_the_cap_is_refused_before_anything_is_committed(tmp_path,
                                                                         monkeypatch):
    repo = CheckpointStore(tmp_path / "r")
    repo.save("small", {"w": torch.ones(2)})
    monkeypatch.setattr(writer_module, "MAX_MANIFEST_BYTES", 2000)
    with pytest.raises(FormatError, match="nothing was committed"):
        repo.save("big", {f"t{i}": torch.ones(2) for i in range(50)})
    assert repo.names() == ["small"]  # no unreadable manifest left behind
    assert repo.gc(grace_seconds=0).deleted_blobs >= 0  # gc still runs
