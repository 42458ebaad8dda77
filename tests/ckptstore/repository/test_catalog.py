"""repository/catalog.py: one store's manifests, their commit order, bounded caching."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch

import ckptstore.pipeline.writer as writer_module
import ckptstore.repository.catalog as catalog_module
import ckptstore.repository.order_hint as order_hint
from ckptstore import CheckpointNotFoundError, CheckpointStore, FormatError, MemoryStore
from ckptstore.format.canonical import canonical_json, seal
from ckptstore.layout import ORDER_HINT_KEY
from tests.helpers import InFlight


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
    assert sum(len(m.tensors) for m, _identity in cached.values()) <= 10
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


def saved(repo: CheckpointStore, names: list[str]) -> None:
    for n in names:
        repo.save(n, {"w": torch.full((4,), float(len(n)))})


def test_a_fresh_process_starts_from_the_commit_order_a_saving_process_recorded(monkeypatch):
    monkeypatch.setattr(catalog_module, "WRITE_AFTER_HEADS", 3)
    store = CountingStore()
    with CheckpointStore(store) as repo:
        saved(repo, [f"s{i}" for i in range(6)])
    assert not store.exists(ORDER_HINT_KEY)  # no process read more than 3 heads yet
    CheckpointStore(store).history()  # a reader: reads every head, records nothing
    assert not store.exists(ORDER_HINT_KEY)
    store.head_reads.clear()
    saved(CheckpointStore(store), ["s6"])  # a fresh saving process: 6 heads, then records
    assert len(store.head_reads) == 6 and store.exists(ORDER_HINT_KEY)
    store.head_reads.clear()
    fresh = CheckpointStore(store)
    saved(fresh, ["s7"])
    assert store.head_reads == ["checkpoints/s6.json"]  # only what the hint did not hold
    assert fresh.history() == [f"s{i}" for i in range(8)]
    assert fresh.latest() == "s7"


def test_the_hint_is_used_only_for_the_very_object_it_describes(tmp_path, monkeypatch):
    """A manifest deleted and committed again under the same name is a new object (another
    modification time): its head is read, so it orders as the newest, not where the hint
    had it."""
    monkeypatch.setattr(catalog_module, "WRITE_AFTER_HEADS", 1)
    with CheckpointStore(tmp_path / "r") as repo:
        saved(repo, ["a", "b", "c"])
    saved(CheckpointStore(tmp_path / "r"), ["d"])  # records a, b, c
    with CheckpointStore(tmp_path / "r") as repo:
        repo.delete("a")
        saved(repo, ["a"])
    fresh = CheckpointStore(tmp_path / "r")
    assert fresh.history() == ["b", "c", "d", "a"]
    assert fresh.latest() == "a"


@pytest.mark.parametrize("damage", ["flip", "forged", "not-json", "huge"])
def test_a_damaged_or_forged_hint_is_ignored(damage, monkeypatch):
    monkeypatch.setattr(catalog_module, "WRITE_AFTER_HEADS", 1)
    store = CountingStore()
    with CheckpointStore(store) as repo:
        saved(repo, ["a", "b", "c"])
    saved(CheckpointStore(store), ["d"])
    data = store.get(ORDER_HINT_KEY)
    if damage == "flip":
        data = data.replace(b'"a"', b'"z"', 1)  # the seal no longer matches
    elif damage == "forged":  # sealed, but says "a" is the newest and names a missing one
        doc = json.loads(data)
        rows = [[n, s, m, 1e10 if n == "a" else c] for n, s, m, c in doc["entries"]]
        rows.append(["ghost", 1, 1.0, 2e10])
        data = seal(canonical_json({"entries": rows, "format": "ckptstore.order"}))
    elif damage == "not-json":
        data = seal(b'{"entries":[["a",1]],"format":"ckptstore.order"}')
    else:
        monkeypatch.setattr(order_hint, "MAX_HINT_BYTES", 10)
    store.put(ORDER_HINT_KEY, data)
    store.head_reads.clear()
    fresh = CheckpointStore(store)
    history = fresh.history()
    if damage == "forged":  # a sealed hint is taken for the objects it matches, no more
        assert history == ["b", "c", "d", "a"] and "ghost" not in history
        assert store.head_reads == ["checkpoints/d.json"]  # committed after the hint
    else:
        assert history == ["a", "b", "c", "d"]
        assert len(store.head_reads) == 4  # every head read again


class _SlowManifestStore(MemoryStore):
    """A memory store whose whole-manifest reads take a while once `slow` is set (a remote
    store's round trip): `flight` counts them."""

    def __init__(self) -> None:
        super().__init__()
        self.slow = False
        self.flight = InFlight()

    def get(self, key: str) -> bytes:
        if not (self.slow and key.startswith("checkpoints/")):
            return super().get(key)
        with self.flight.call(key, 0.01):
            return super().get(key)


def _history(count: int) -> tuple[_SlowManifestStore, list[str]]:
    store = _SlowManifestStore()
    with CheckpointStore(store) as repo:
        for i in range(count):
            repo.save(f"s{i:02d}", {"w": torch.full((4,), float(i))}, metadata={"i": i})
    store.slow = True
    return store, [f"s{i:02d}" for i in range(count)]


def test_a_pass_over_every_manifest_reads_them_side_by_side_in_order():
    store, names = _history(20)
    infos = CheckpointStore(store).list()  # a fresh process: nothing cached
    assert [i.name for i in infos] == names
    assert [i.metadata["i"] for i in infos] == list(range(20))
    assert 1 < store.flight.most <= catalog_module.MANIFEST_READ_AHEAD
    assert sorted(store.flight.keys) == sorted(f"checkpoints/{n}.json" for n in names)
    store.flight.reset()
    problems: list = []
    scanned = [m.name for m in CheckpointStore(store).each_manifest(problems)]
    assert scanned == names and problems == []
    assert len(store.flight.keys) == 20  # each manifest once


def test_a_pass_skips_what_it_cannot_read_and_keeps_going(caplog):
    store, names = _history(12)
    store.put("checkpoints/s05.json", b"{torn")  # damaged in the middle of the pass
    store.delete("checkpoints/s08.json")  # deleted after the listing would have seen it
    with caplog.at_level("WARNING", logger="ckptstore"):
        listed = [i.name for i in CheckpointStore(store).list()]
    assert listed == [n for n in names if n not in ("s05", "s08")]
    assert "skipping unreadable manifest" in caplog.text and "s05" in caplog.text
    problems: list = []
    scanned = [m.name for m in CheckpointStore(store).each_manifest(problems)]
    assert scanned == listed
    assert [p.key for p in problems] == ["checkpoints/s05.json"]


def test_a_manifest_larger_than_the_read_ahead_is_read_in_its_turn(monkeypatch):
    store, names = _history(10)
    monkeypatch.setattr(catalog_module, "READ_AHEAD_MANIFEST_BYTES", 10)  # all of them
    infos = CheckpointStore(store).list()
    assert [i.name for i in infos] == names
    assert store.flight.most == 1  # each read when the pass reached it
    assert len(store.flight.keys) == 10


def test_a_pass_stopped_early_leaves_no_read_running():
    store, names = _history(20)
    before = threading.active_count()
    problems: list = []
    scan = CheckpointStore(store).each_manifest(problems)
    assert next(scan).name == names[0]
    scan.close()
    assert threading.active_count() == before and store.flight.now == 0
    assert len(store.flight.keys) <= 1 + catalog_module.MANIFEST_READ_AHEAD


def _age_every_blob(root: Path, seconds: float) -> None:
    old = time.time() - seconds
    for path in (root / "blobs").rglob("*"):
        if path.is_file():
            os.utime(path, (old, old))


def test_a_name_saved_again_elsewhere_is_read_again_not_taken_from_the_cache(tmp_path):
    # two store objects on one folder stand for two processes; `mine` cached what it saved
    mine, other = CheckpointStore(tmp_path / "r"), CheckpointStore(tmp_path / "r")
    mine.save("x", {"w": torch.zeros(1000)})
    mine.save("y", {"w": torch.full((1000,), 2.0)})
    other.delete("x")
    other.save("x", {"w": torch.ones(1000)})  # now the newest
    _age_every_blob(tmp_path / "r", 7200)
    # gc took the cached "x" for the stored one and deleted the new "x"'s blob
    assert mine.gc(grace_seconds=3600).deleted_blobs == 1  # the old "x"'s only
    assert CheckpointStore(tmp_path / "r").verify().ok
    assert torch.equal(mine.load("x")["w"], torch.ones(1000))
    assert mine.latest() == "x" and mine.history() == ["y", "x"]


def test_a_parent_deleted_and_collected_elsewhere_is_not_reused(tmp_path):
    mine, other = CheckpointStore(tmp_path / "r"), CheckpointStore(tmp_path / "r")
    w = torch.randn(100_000)
    mine.save("p", {"w": w})
    other.delete("p")
    _age_every_blob(tmp_path / "r", 7200)
    assert other.gc(grace_seconds=3600).deleted_blobs == 1
    with pytest.raises(CheckpointNotFoundError, match="'p'"):
        mine.save("c", {"w": w}, parent="p")
    other.save("p", {"w": w})  # saved again: its chunks written again, and reused
    assert mine.save("c", {"w": w}, parent="p").written_bytes == 0
    assert torch.equal(CheckpointStore(tmp_path / "r").load("c")["w"], w)


def test_a_cached_manifest_deleted_elsewhere_is_not_found(tmp_path):
    mine, other = CheckpointStore(tmp_path / "r"), CheckpointStore(tmp_path / "r")
    mine.save("x", {"w": torch.zeros(4)})
    other.delete("x")
    with pytest.raises(CheckpointNotFoundError):
        mine.load("x")
    assert mine.latest() is None


def test_metadata_from_list_is_the_callers_own(tmp_path):
    repo = CheckpointStore(tmp_path / "r")
    repo.save("x", {"a": torch.ones(2)}, metadata={"step": 1, "tags": ["a"]})
    info = repo.list()[0]
    info.metadata["step"] = 99  # a caller post-processing what it was given
    info.metadata["tags"].append("b")
    assert repo.manifest("x").metadata == {"step": 1, "tags": ["a"]}
    assert repo.list()[0].metadata == {"step": 1, "tags": ["a"]}
