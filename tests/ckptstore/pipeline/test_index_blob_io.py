"""Index blobs (segments, tree pages) move side by side: a commit puts them through one
deferred batch (CheckpointWriter.put_index_blobs), and a pass over every segment of a
checkpoint (an incremental save learning its parent's chunks, space accounting) reads them
a few at a time (SegmentedEntries._each_segment). The speed must change nothing else:

- on a remote-like store the puts and the reads really overlap (a whole load's segment
  reads with its tree pages' too, a restarted incremental save's parent segment reads with
  the encoding of its state);
- a put that fails leaves no checkpoint and no index blob of the batch in the folder, the
  earlier checkpoint loads, and the same save then commits;
- a root over its cap leaves none of the save's index blobs visible;
- an unchanged index blob is not put again by the next save (it is reused like data);
- a segment that cannot be read fails the pass that needs it, naming it.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from ckptstore import CheckpointStore, CkptStoreError, FormatError
from ckptstore.errors import ObjectNotFoundError
from ckptstore.format.manifest import BlobUnion, Manifest
from ckptstore.format.tree import TreeEncoder
from ckptstore.layout import blob_key
from ckptstore.maintenance import checks
from ckptstore.maintenance.checks import chunk_blobs
from ckptstore.pipeline import writer as writer_module
from ckptstore.stores.base import DeferredPuts
from ckptstore.stores.local import LocalStore
from ckptstore.stores.memory import MemoryStore
from ckptstore.tools import inspection
from tests.helpers import InFlight, assert_same, wait_until

TENSORS = 3000  # segmented (version 3): about a dozen segments and a few tree pages


def small_state(seed: int, n: int = TENSORS) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"blocks.{i // 100}.p{i % 100}": torch.randn(16, generator=g) for i in range(n)}


def index_digests(repo: CheckpointStore, name: str) -> set[str]:
    return {ref.digest for ref in repo.manifest(name).index_blobs()}


class _SlowIndexStore(MemoryStore):
    """A memory store whose puts of `index_keys` take a while, as a round trip to S3 does:
    `flight` counts them."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.index_keys: set[str] = set()
        self.flight = InFlight()

    def put(self, key, data):
        if key not in self.index_keys:
            return super().put(key, data)
        with self.flight.call(key, 0.02):
            return super().put(key, data)


def test_index_blobs_are_put_side_by_side_and_reused_when_unchanged():
    # the index blobs' keys are learned from a first save into another store (same bytes)
    first = CheckpointStore(MemoryStore(f"learn-{os.getpid()}"))
    state = small_state(0)
    first.save("a", state)
    keys = {blob_key(d) for d in index_digests(first, "a")}
    assert len(keys) >= 8
    store = _SlowIndexStore(f"slow-{os.getpid()}")
    store.index_keys = keys
    repo = CheckpointStore(store)
    repo.save("a", state)
    assert sorted(store.flight.keys) == sorted(keys)  # every one put, once
    assert store.flight.most > 1
    assert_same(repo.load("a"), state)
    # one tensor changed: only the index blobs that changed are put again
    store.flight.reset()
    changed = dict(state)
    changed["blocks.0.p0"] = changed["blocks.0.p0"] + 1
    repo.save("b", changed)
    again = index_digests(repo, "b") & index_digests(repo, "a")
    assert again, "an unchanged segment must be reused"
    assert not {blob_key(d) for d in again} & set(store.flight.keys)
    assert_same(repo.load("b"), changed)


def test_a_root_over_the_cap_leaves_none_of_its_index_blobs_visible(
        tmp_path: Path, monkeypatch):
    repo = CheckpointStore(str(tmp_path))
    state = small_state(4)
    index_keys = {blob_key(d) for d in index_digests(_learn(state, tmp_path / "learn"), "next")}
    monkeypatch.setattr(writer_module, "MAX_MANIFEST_BYTES", 600)  # the root is larger
    with pytest.raises(FormatError, match="its manifest would be .* nothing was committed"):
        repo.save("a", state)
    left = _files(tmp_path / "blobs") if (tmp_path / "blobs").exists() else set()
    assert left and not {f"blobs/{f}" for f in left} & index_keys  # the data blobs only
    assert not [f for f in _files(tmp_path) if os.path.basename(f).startswith(".")]
    assert repo.names() == []
    monkeypatch.undo()
    repo.save("a", state)
    assert_same(CheckpointStore(str(tmp_path), create=False).load("a"), state)


class _FailingBatch(DeferredPuts):
    """A deferred batch whose `fail_at`-th put fails (a full disk), wrapping the real one."""

    def __init__(self, store: LocalStore, inner: DeferredPuts, fail_at: int) -> None:
        super().__init__(store)
        self.inner, self.fail_at = inner, fail_at
        self.puts = 0
        self.lock = threading.Lock()

    def put(self, key, data):
        with self.lock:
            self.puts += 1
            fail = self.puts == self.fail_at
        if fail:
            raise OSError(28, "No space left on device")
        self.inner.put(key, data)

    def commit(self):
        self.inner.commit()

    def abandon(self):
        self.inner.abandon()


class _FailingIndexStore(LocalStore):
    fail_at = 0

    def deferred(self):
        inner = super().deferred()
        return _FailingBatch(self, inner, self.fail_at) if self.fail_at else inner


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def test_a_failed_index_put_commits_nothing_and_leaves_no_index_blob(tmp_path: Path):
    store = _FailingIndexStore(str(tmp_path))
    repo = CheckpointStore(store)
    base = small_state(1)
    repo.save("base", base)
    before = _files(tmp_path)
    store.fail_at = 5  # a put in the middle of the batch: others ran, some after it
    state = small_state(2)
    with pytest.raises(OSError, match="No space left"):
        repo.save("next", state)
    assert [c.name for c in repo.list()] == ["base"]
    reopened = CheckpointStore(str(tmp_path), create=False)
    assert [c.name for c in reopened.list()] == ["base"]
    assert_same(reopened.load("base"), base)
    # the data blobs of the failed save may stay (gc reclaims them); its index blobs, put
    # through the abandoned batch, never became visible, and no temp file of them is left
    index_keys = {blob_key(d) for d in index_digests(
        _learn(state, tmp_path / "learn"), "next")}
    left = _files(tmp_path) - before
    assert not left & index_keys
    assert not [f for f in left if os.path.basename(f).startswith(".")]
    store.fail_at = 0
    repo.save("next", state)
    assert_same(CheckpointStore(str(tmp_path), create=False).load("next"), state)


def _learn(state: dict[str, torch.Tensor], folder: Path) -> CheckpointStore:
    """A store holding `state` saved alone as "next" (its index blobs' digests)."""
    repo = CheckpointStore(str(folder))
    repo.save("next", state, parent=None)
    return repo


class _SlowReadStore(MemoryStore):
    """A memory store whose reads of `slow_keys` take a while (a remote store's round trip):
    `flight` counts them. `missing` keys are not there."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.slow_keys: set[str] = set()
        self.missing: set[str] = set()
        self.flight = InFlight()

    def exists(self, key):
        return key not in self.missing and super().exists(key)

    def get(self, key):
        if key in self.missing:
            raise ObjectNotFoundError(f"no object {key!r}")
        if key not in self.slow_keys:
            return super().get(key)
        with self.flight.call(key, 0.01):
            return super().get(key)


def test_a_pass_over_every_segment_reads_them_side_by_side():
    store = _SlowReadStore(f"slowread-{os.getpid()}")
    state = small_state(3)
    CheckpointStore(store).save("a", state)
    segments = CheckpointStore(store).manifest("a").segment_refs()
    assert len(segments) >= 8
    store.slow_keys = {blob_key(r.digest) for r in segments}
    # a restarted process's incremental save learns the parent's chunks from its segments
    changed = dict(state)
    changed["blocks.3.p7"] = changed["blocks.3.p7"] * 2
    info = CheckpointStore(store).save("b", changed)
    assert len(store.flight.keys) >= len(segments) and store.flight.most > 1
    assert info.written_bytes < info.logical_bytes / 10  # the parent's chunks were reused
    assert_same(CheckpointStore(store).load("b"), changed)
    # space accounting over a fresh process's view reads them the same way
    store.flight.reset()
    extents = CheckpointStore(store).manifest("a").blob_extents()
    assert len(store.flight.keys) == len(segments) and store.flight.most > 1
    assert {r.digest for r in segments} <= set(extents)


def test_a_restarted_incremental_save_reads_its_parent_while_it_encodes_its_state(
        monkeypatch: pytest.MonkeyPatch):
    store = _SlowReadStore(f"ahead-{os.getpid()}")
    state = small_state(13)
    CheckpointStore(store).save("a", state)
    segments = CheckpointStore(store).manifest("a").segment_refs()
    store.slow_keys = {blob_key(r.digest) for r in segments}
    real = TreeEncoder.encode_state
    seen_while_encoding: list[int] = []

    def encode_state(self: TreeEncoder, obj):
        # the encoding of the state waits until the parent's segments are being read: they
        # are only if their reads began before it (else this times out)
        wait_until(lambda: len(store.flight.keys) >= 8, what="segment reads while encoding")
        seen_while_encoding.append(len(store.flight.keys))
        return real(self, obj)

    monkeypatch.setattr(TreeEncoder, "encode_state", encode_state)
    changed = {**state, "blocks.3.p7": state["blocks.3.p7"] * 2}
    info = CheckpointStore(store).save("b", changed)  # a fresh process's view: no memory
    assert seen_while_encoding and store.flight.most > 1
    assert sorted(store.flight.keys) == sorted(blob_key(r.digest) for r in segments)  # once
    assert info.written_bytes < info.logical_bytes / 10  # the parent's chunks were reused
    monkeypatch.setattr(TreeEncoder, "encode_state", real)
    assert_same(CheckpointStore(store).load("b"), changed)


def test_a_parent_index_over_the_read_ahead_budget_is_read_ahead_in_part():
    store = _SlowReadStore(f"ahead-budget-{os.getpid()}")
    state = small_state(14)
    CheckpointStore(store).save("a", state)
    manifest = CheckpointStore(store).manifest("a")
    segments = manifest.segment_refs()
    store.slow_keys = {blob_key(r.digest) for r in segments}
    budget = segments[0].size + segments[1].size  # the first two, in order
    with manifest.tensors.bytes_read_ahead(workers=8, budget=budget):
        wait_until(lambda: len(store.flight.keys) == 2, what="the first two segments read")
        time.sleep(0.05)
        assert sorted(store.flight.keys) == sorted(blob_key(r.digest) for r in segments[:2])
        tables = list(manifest.chunk_tables())  # the pass takes them, reads the rest
    assert len(tables) == len(segments)
    assert sorted(store.flight.keys) == sorted(blob_key(r.digest) for r in segments)  # once
    fresh = CheckpointStore(store).manifest("a")  # the same chunks as without a read-ahead
    assert [(t.blobs, t.offsets.tolist(), t.sizes.tolist()) for t in fresh.chunk_tables()] == [
        (t.blobs, t.offsets.tolist(), t.sizes.tolist()) for t in tables]


def _three_checkpoints(store: _SlowReadStore
                       ) -> tuple[CheckpointStore, list[set[str]], dict[str, torch.Tensor]]:
    """Checkpoints a, b, c of one state, each changing a tensor of another segment; the
    digests of each one's index segments, and c's state."""
    repo = CheckpointStore(store)
    state = small_state(15)
    repo.save("a", state)
    for name, changed in (("b", "blocks.2.p1"), ("c", "blocks.25.p3")):
        state = {**state, changed: state[changed] + 1}
        repo.save(name, state)
    fresh = CheckpointStore(store)
    return repo, [{r.digest for r in fresh.manifest(n).segment_refs()} for n in "abc"], state


def test_gc_reads_a_segment_shared_by_checkpoints_once_and_finds_the_same_blobs():
    store = _SlowReadStore(f"shared-{os.getpid()}")
    repo, refs, state = _three_checkpoints(store)
    segments = set().union(*refs)
    assert set.intersection(*refs) and len(segments) < sum(map(len, refs))  # shared ones
    fresh = CheckpointStore(store)
    each = set().union(*(fresh.manifest(n).blob_digests() for n in "abc"))  # each read whole
    store.slow_keys = {blob_key(d) for d in segments}
    assert CheckpointStore(store).referenced_blobs() == each
    assert sorted(store.flight.keys) == sorted(blob_key(d) for d in segments)  # each once
    repo.delete("a")
    assert CheckpointStore(store).gc(grace_seconds=0).referenced_blobs > 0
    assert_same(CheckpointStore(store).load("c"), state)
    assert CheckpointStore(store).verify("b").ok


@pytest.mark.parametrize("scan", ["gc", "du", "verify"])
def test_a_pass_over_checkpoints_reads_the_next_ones_new_segments_while_it_adds_one(
        monkeypatch: pytest.MonkeyPatch, scan: str):
    store = _SlowReadStore(f"next-{scan}-{os.getpid()}")
    _repo, (in_a, in_b, in_c), _state = _three_checkpoints(store)
    new_in_b, new_in_c = in_b - in_a, in_c - in_a - in_b
    assert new_in_b and new_in_c
    each = set().union(*(CheckpointStore(store).manifest(n).blob_digests() for n in "abc"))
    store.slow_keys = {blob_key(d) for d in in_a | in_b | in_c}
    added: list[str] = []

    def waiting(real):
        def add(*args):
            # taking in a checkpoint waits until the next one's new segments are being read:
            # they are only if their reads began before it (else this times out)
            manifest = next(a for a in args if isinstance(a, Manifest))
            following = {"a": new_in_b, "b": new_in_c}.get(manifest.name, set())
            wait_until(lambda: {blob_key(d) for d in following} <= set(store.flight.keys),
                       what=f"the segments after {manifest.name} read while it is added")
            added.append(manifest.name)
            return real(*args)
        return add

    if scan == "verify":
        monkeypatch.setattr(checks, "_unchecked_uses", waiting(checks._unchecked_uses))
    else:
        pass_class = BlobUnion if scan == "gc" else inspection.UsageScan
        monkeypatch.setattr(pass_class, "add", waiting(pass_class.add))
    repo = CheckpointStore(store)
    manifests = [repo.manifest(n) for n in "abc"]
    if scan == "gc":
        assert repo.referenced_blobs() == each
    elif scan == "du":
        assert inspection.usage(manifests).referenced_blobs == len(each)
    else:
        assert checks.verify(store, manifests).ok
    assert added == ["a", "b", "c"]
    # each distinct segment read once, the shared ones not again for the next checkpoint
    assert sorted(store.flight.keys) == sorted(blob_key(d) for d in in_a | in_b | in_c)


def test_space_accounting_reads_a_segment_shared_by_checkpoints_once():
    store = _SlowReadStore(f"usage-{os.getpid()}")
    _repo, (in_a, in_b, in_c), _state = _three_checkpoints(store)
    fresh = [CheckpointStore(store).manifest(n) for n in "abc"]  # each read whole below
    extents = [m.blob_extents() for m in fresh]
    ranges = {r for m in fresh for t in m.chunk_tables() for r in t.ranges()} | {
        (r.digest, 0, r.size) for m in fresh for r in m.segment_refs()}
    store.slow_keys = {blob_key(d) for d in in_a | in_b | in_c}
    repo = CheckpointStore(store)
    use = inspection.usage([repo.manifest(n) for n in "abc"])
    assert sorted(store.flight.keys) == sorted(blob_key(d) for d in in_a | in_b | in_c)
    assert [(u.name, u.referenced_bytes, u.blobs) for u in use.checkpoints] == [
        (n, sum(ext.values()), len(ext)) for n, ext in zip("abc", extents)]
    assert use.referenced_blobs == len(set().union(*extents))
    assert any(u.unique_blobs for u in use.checkpoints)  # each changed a tensor of its own
    store.flight.reset()
    live = inspection.live_bytes(CheckpointStore(store).manifest(n) for n in "abc")
    assert live == sum(size for _blob, _offset, size in ranges)
    assert sorted(store.flight.keys) == sorted(blob_key(d) for d in in_a | in_b | in_c)


def test_verifys_counts_read_a_segment_shared_by_checkpoints_once():
    # `ckpt verify` counts the blobs it will check and the bytes it checked over every
    # checkpoint: both read each distinct segment once (the check itself reads each
    # checkpoint's entries)
    store = _SlowReadStore(f"verify-counts-{os.getpid()}")
    _repo, (in_a, in_b, in_c), _state = _three_checkpoints(store)
    fresh = [CheckpointStore(store).manifest(n) for n in "abc"]
    whole = {b for m in fresh for t in m.chunk_tables() for b in t.blobs}
    extents: dict[str, int] = {}
    for m in fresh:
        for blob, end in m.blob_extents().items():
            extents[blob] = max(end, extents.get(blob, -1))
    store.slow_keys = {blob_key(d) for d in in_a | in_b | in_c}
    assert chunk_blobs([CheckpointStore(store).manifest(n) for n in "abc"]) == whole
    assert sorted(store.flight.keys) == sorted(blob_key(d) for d in in_a | in_b | in_c)
    store.flight.reset()
    assert inspection.blob_extents([CheckpointStore(store).manifest(n) for n in "abc"]) == extents
    assert sorted(store.flight.keys) == sorted(blob_key(d) for d in in_a | in_b | in_c)


def test_a_missing_segment_of_the_next_checkpoint_stops_gc_deleting_nothing():
    store = _SlowReadStore(f"next-missing-{os.getpid()}")
    repo, (in_a, in_b, in_c), _state = _three_checkpoints(store)
    repo.delete("a")  # its own blobs would go
    lost = sorted(in_c - in_a - in_b)[0]
    store.missing = {blob_key(lost)}
    before = {o.key for o in store.list("blobs/")}
    later = time.time() + 3600  # every blob old enough to go, unless referenced
    with pytest.raises(CkptStoreError, match="gc stopped, nothing deleted"):
        CheckpointStore(store).gc(grace_seconds=0, now=later)
    assert {o.key for o in store.list("blobs/")} == before
    store.missing = set()
    assert CheckpointStore(store).gc(grace_seconds=0, now=later).deleted_blobs > 0
    assert CheckpointStore(store).verify("b").ok and CheckpointStore(store).verify("c").ok


def test_a_missing_segment_fails_the_incremental_save_that_reads_it():
    store = _SlowReadStore(f"missing-{os.getpid()}")
    state = small_state(4)
    CheckpointStore(store).save("a", state)
    segments = CheckpointStore(store).manifest("a").segment_refs()
    lost = segments[len(segments) // 2].digest
    store.missing = {blob_key(lost)}
    with pytest.raises(FormatError, match=f"index blob {lost} has no good copy: missing"):
        CheckpointStore(store).save("b", small_state(5))
    assert [c.name for c in CheckpointStore(store).list()] == ["a"]


def test_a_whole_load_reads_the_tree_pages_side_by_side_and_a_partial_one_few():
    store = _SlowReadStore(f"pages-{os.getpid()}")
    state = small_state(6, n=4300)  # one dict of 4,300 keys: 9 pages of 512
    CheckpointStore(store).save("a", state)
    pages = CheckpointStore(store).manifest("a").tree_page_refs()
    assert len(pages) >= 8
    store.slow_keys = {blob_key(r.digest) for r in pages}
    assert_same(CheckpointStore(store).load("a"), state)
    assert len(store.flight.keys) == len(pages) and store.flight.most > 1
    store.flight.reset()
    wanted = ["blocks.1.p3", "blocks.9.p99"]  # names sort far apart: first and last page
    got = CheckpointStore(store).load("a", keys=wanted)
    assert_same(got, {k: state[k] for k in wanted})
    assert len(store.flight.keys) == 2  # the two pages whose names reach them


class _PagesAndSegmentsStore(MemoryStore):
    """A memory store whose reads of tree pages and of segments take a while, each kind
    counted apart: `overlapped` once a read of one kind starts while the other runs."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.kinds: dict[str, InFlight] = {}
        self.kind_of: dict[str, str] = {}
        self.overlapped = False

    def get(self, key):
        kind = self.kind_of.get(key)
        if kind is None:
            return super().get(key)
        other = self.kinds["segment" if kind == "page" else "page"]
        self.overlapped |= other.now > 0
        with self.kinds[kind].call(key, 0.01):
            return super().get(key)


def test_a_whole_load_reads_its_segments_while_it_reads_its_tree_pages():
    store = _PagesAndSegmentsStore(f"waves-{os.getpid()}")
    state = small_state(8, n=4300)
    CheckpointStore(store).save("a", state)
    manifest = CheckpointStore(store).manifest("a")
    pages, segments = manifest.tree_page_refs(), manifest.segment_refs()
    assert len(pages) >= 8 and len(segments) >= 8
    store.kinds = {"page": InFlight(), "segment": InFlight()}
    store.kind_of = {**{blob_key(r.digest): "page" for r in pages},
                     **{blob_key(r.digest): "segment" for r in segments}}
    # two reading threads for data; index reads mostly wait, so they go 8 at a time anyway
    assert_same(CheckpointStore(store, workers=2).load("a"), state)
    assert store.overlapped  # one wave, not pages then segments
    assert store.kinds["segment"].most > 2
    assert sorted(store.kinds["segment"].keys) == sorted(blob_key(r.digest) for r in segments)
    assert len(store.kinds["page"].keys) == len(pages)  # each read once
    # a partial load learns from the pages which segments it needs: it reads those alone
    store.kinds = {"page": InFlight(), "segment": InFlight()}
    store.overlapped = False
    wanted = ["blocks.1.p3", "blocks.9.p99"]
    assert_same(CheckpointStore(store).load("a", keys=wanted), {k: state[k] for k in wanted})
    assert len(store.kinds["segment"].keys) <= 2 and not store.overlapped


def test_a_whole_load_whose_tree_page_is_missing_leaves_no_segment_read_running():
    store = _SlowReadStore(f"waves-missing-{os.getpid()}")
    state = small_state(9, n=4300)
    CheckpointStore(store).save("a", state)
    manifest = CheckpointStore(store).manifest("a")
    store.slow_keys = {blob_key(r.digest) for r in manifest.segment_refs()}
    lost = manifest.tree_page_refs()[0].digest
    store.missing = {blob_key(lost)}
    before = threading.active_count()
    with pytest.raises(FormatError, match=f"index blob {lost} has no good copy: missing"):
        CheckpointStore(store).load("a")
    assert store.flight.now == 0 and threading.active_count() == before


def test_a_missing_tree_page_fails_the_load_naming_it():
    store = _SlowReadStore(f"page-missing-{os.getpid()}")
    state = small_state(7, n=4300)
    CheckpointStore(store).save("a", state)
    pages = CheckpointStore(store).manifest("a").tree_page_refs()
    lost = pages[len(pages) // 2].digest
    store.missing = {blob_key(lost)}
    with pytest.raises(FormatError, match=f"index blob {lost} has no good copy: missing"):
        CheckpointStore(store).load("a")
    store.missing = set()  # the page is back: nothing of the failure was kept
    assert_same(CheckpointStore(store).load("a"), state)


def test_verify_reads_segments_side_by_side_and_reports_the_one_it_cannot_read():
    store = _SlowReadStore(f"verify-{os.getpid()}")
    state = small_state(8)
    CheckpointStore(store).save("a", state)
    segments = CheckpointStore(store).manifest("a").segment_refs()
    store.slow_keys = {blob_key(r.digest) for r in segments}
    lost = segments[len(segments) // 2]
    store.missing = {blob_key(lost.digest)}
    report = CheckpointStore(store).verify("a")
    assert [(p.blob, p.problem) for p in report.problems] == [(lost.digest, "missing")]
    assert len(store.flight.keys) == len(segments) - 1 and store.flight.most > 1
    # every other segment's tensors had their chunks checked
    assert report.bytes_checked >= sum(t.nbytes for t in state.values()) - lost.nbytes


def test_verify_reads_tree_pages_side_by_side_and_reports_the_one_it_cannot_read():
    store = _SlowReadStore(f"verify-pages-{os.getpid()}")
    g = torch.Generator().manual_seed(9)
    state = {f"t{i}": torch.randn(8, generator=g) for i in range(TENSORS)}  # a paged root
    CheckpointStore(store).save("a", state)
    pages = CheckpointStore(store).manifest("a").tree_page_refs()
    assert len(pages) >= 4
    store.slow_keys = {blob_key(r.digest) for r in pages}
    lost = pages[len(pages) // 2]
    store.missing = {blob_key(lost.digest)}
    report = CheckpointStore(store).verify("a")
    assert [(p.blob, p.problem) for p in report.problems] == [(lost.digest, "missing")]
    assert sorted(store.flight.keys) == sorted(blob_key(r.digest) for r in pages if r != lost)
    assert store.flight.most > 1  # side by side
    store.missing = set()
    assert CheckpointStore(store).verify("a").ok


def test_verify_reads_a_state_tree_checkpoints_share_once_unless_it_is_damaged():
    store = _SlowReadStore(f"verify-trees-{os.getpid()}")
    g = torch.Generator().manual_seed(11)
    state = {f"t{i}": torch.randn(8, generator=g) for i in range(TENSORS)}  # a paged root
    repo = CheckpointStore(store)
    for name in "abc":  # the same keys: the same tree and pages
        state = {**state, "t7": state["t7"] + 1}
        repo.save(name, state)
    manifests = [CheckpointStore(store).manifest(n) for n in "abc"]
    trees = {m.tree_ref() for m in manifests}
    pages = {r for m in manifests for r in m.tree_page_refs()}
    assert len(trees) == 1 and len(pages) >= 4
    store.slow_keys = {blob_key(r.digest) for r in trees | pages}
    assert checks.verify(store, manifests).ok
    assert sorted(store.flight.keys) == sorted(blob_key(r.digest) for r in trees | pages)
    lost = sorted(pages, key=lambda r: r.digest)[0]  # one problem naming every checkpoint
    store.missing = {blob_key(lost.digest)}
    report = checks.verify(store, [CheckpointStore(store).manifest(n) for n in "abc"])
    assert [(p.blob, p.problem, p.checkpoints, p.keys) for p in report.problems] == [
        (lost.digest, "missing", ("a", "b", "c"), ("(state tree page)",))]


def test_verify_reads_a_shared_segment_once_and_names_every_checkpoint_using_a_bad_blob():
    store = _SlowReadStore(f"verify-shared-{os.getpid()}")
    g = torch.Generator().manual_seed(10)
    state = {"a.big": torch.randn(100_000, generator=g), **small_state(16)}  # a blob alone
    repo = CheckpointStore(store)
    repo.save("a", state)
    for name, changed in (("b", "blocks.20.p1"), ("c", "blocks.25.p3")):
        state = {**state, changed: state[changed] + 1}
        repo.save(name, state)
    manifests = [CheckpointStore(store).manifest(n) for n in "abc"]
    refs = [m.segment_refs() for m in manifests]
    assert refs[0][0] == refs[1][0] == refs[2][0]  # "a.big"'s segment: in all three
    segments = {r.digest for rs in refs for r in rs}
    store.slow_keys = {blob_key(d) for d in segments}
    report = checks.verify(store, manifests)
    assert report.ok
    assert sorted(store.flight.keys) == sorted(blob_key(d) for d in segments)  # each once
    big = manifests[0].tensors[0]
    assert big.key == "a.big" and len({c.blob for c in big.chunks}) == 1
    blob = big.chunks[0].blob
    store.put(blob_key(blob), b"\0" + store.get(blob_key(blob))[1:])  # damaged in place
    report = checks.verify(store, [CheckpointStore(store).manifest(n) for n in "abc"])
    assert [(p.blob, p.problem, p.checkpoints, p.keys) for p in report.problems] == [
        (blob, "corrupt", ("a", "b", "c"), ("a.big",))]


def test_verify_reads_a_damaged_segment_once_when_a_later_checkpoint_names_it_again():
    """a and c share a segment that b does not name (c puts a tensor back as it was in a, and
    learns a's chunks): once verify found it damaged in a, c's read-ahead does not fetch it."""
    store = _SlowReadStore(f"verify-bad-ahead-{os.getpid()}")
    first = small_state(17)
    repo = CheckpointStore(store)
    repo.save("a", first)
    repo.save("b", {**first, "blocks.3.p1": first["blocks.3.p1"] + 1})
    repo.save("c", first, parent="a")
    manifests = [CheckpointStore(store).manifest(n) for n in "abc"]
    refs = [{r.digest for r in m.segment_refs()} for m in manifests]
    assert refs[0] == refs[2]
    (lost,) = refs[0] - refs[1]
    store.put(blob_key(lost), b"\0" + store.get(blob_key(lost))[1:])  # damaged in place
    store.slow_keys = {blob_key(lost)}
    report = checks.verify(store, manifests)
    assert [(p.blob, p.problem, p.checkpoints) for p in report.problems] == [
        (lost, "corrupt", ("a", "c"))]
    assert store.flight.keys == [blob_key(lost)]  # read once, by a


def test_a_save_beside_training_puts_its_index_blobs_within_its_turns():
    """A background save takes one core from training (concurrency.Turns): its commit's
    index puts wait for their turn like its data writes, one at a time by default."""
    first = CheckpointStore(MemoryStore(f"learn-bg-{os.getpid()}"))
    state = small_state(9)
    first.save("a", state)
    store = _SlowIndexStore(f"slow-bg-{os.getpid()}")
    store.index_keys = {blob_key(d) for d in index_digests(first, "a")}
    repo = CheckpointStore(store)
    handle = repo.save_async("a", state)
    while not handle.done():  # the trainer goes on: it lends the save no core
        time.sleep(0.01)
    handle.wait()
    assert sorted(store.flight.keys) == sorted(store.index_keys)
    assert store.flight.most == 1
    assert_same(repo.load("a"), state)
