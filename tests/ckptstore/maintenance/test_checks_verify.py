"""maintenance/checks.verify over many version-3 checkpoints: one checkpoint's entries at a
time (nothing kept once it is checked), each blob read once unless a later checkpoint uses a
part of it not yet checked, and a bad blob named with every checkpoint and key using it."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from ckptstore import CheckpointStore
from ckptstore.format.segment_encoding import SEGMENTED_ABOVE_TENSORS
from ckptstore.format.segments import SegmentedEntries
from ckptstore.layout import BLOB_PREFIX, blob_key
from ckptstore.maintenance import checks
from ckptstore.stores.base import Store

N = SEGMENTED_ABOVE_TENSORS + 600


def state(bump: int) -> dict[str, Any]:
    """Version-3 states: small arrays (packs) plus one 4 MiB array in a blob of its own;
    `bump` gives arrays `bump` to `bump + 49` values no other state has."""
    out: dict[str, Any] = {f"w.{i}": np.full((8,), i + 0.5 * (bump <= i < bump + 50),
                                             np.float32) for i in range(N)}
    out["big"] = np.arange(1 << 20, dtype=np.float32)
    return out


class Counting:
    """A store that counts the blob reads it serves (everything else passes through)."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self.reads: Counter[str] = Counter()

    def get(self, key: str) -> bytes:
        if key.startswith(BLOB_PREFIX):
            self.reads[key] += 1
        return self._store.get(key)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def _saved(tmp_path: Path) -> tuple[CheckpointStore, list[Any]]:
    repo = CheckpointStore(str(tmp_path))
    for i, bump in enumerate((N, 100, 300)):  # N: nothing changed in the first
        repo.save(f"c{i}", state(bump))
    fresh = CheckpointStore(str(tmp_path))
    return fresh, [fresh.manifest(f"c{i}") for i in range(3)]


def test_verify_keeps_no_entries_and_reads_shared_blobs_once(tmp_path: Path) -> None:
    repo, manifests = _saved(tmp_path)
    store = Counting(repo.store)
    report = checks.verify(store, manifests, repo.hash)  # type: ignore[arg-type]
    assert report.ok and report.checkpoints == ["c0", "c1", "c2"]
    for m in manifests:  # nothing parsed was kept on the manifests
        assert isinstance(m.tensors, SegmentedEntries) and not m.tensors._parsed
    big = blob_key(next(t for t in manifests[0].tensors if t.key == "big").chunks[0].blob)
    assert store.reads[big] == 1  # used by all three, read once
    # every chunk blob was read, and no blob more often than the checkpoints using it
    blobs = checks.chunk_blobs(manifests)
    assert {blob_key(b) for b in blobs} <= set(store.reads)
    users = Counter(b for m in manifests for b in {c.blob for t in m.tensors for c in t.chunks})
    assert all(store.reads[blob_key(b)] <= users[b] for b in blobs)


def test_a_bad_shared_blob_names_every_checkpoint_and_key(tmp_path: Path) -> None:
    repo, manifests = _saved(tmp_path)
    big = next(t for t in manifests[0].tensors if t.key == "big").chunks[0].blob
    path = tmp_path / blob_key(big)
    data = bytearray(path.read_bytes())
    data[5] ^= 1
    path.write_bytes(bytes(data))
    changed = next(t for t in manifests[2].tensors if t.key == "w.300").chunks[0].blob
    (tmp_path / blob_key(changed)).unlink()  # a pack only the last checkpoint uses
    store = Counting(repo.store)
    report = checks.verify(store, manifests, repo.hash)  # type: ignore[arg-type]
    problems = {p.blob: p for p in report.problems}
    assert problems[big].problem == "corrupt" and problems[big].keys == ("big",)
    assert problems[big].checkpoints == ("c0", "c1", "c2")
    assert store.reads[blob_key(big)] == 1  # found bad once, not read again
    assert problems[changed].problem == "missing"
    assert problems[changed].checkpoints == ("c2",)
    assert "w.300" in problems[changed].keys
    assert set(problems) == {big, changed}


def test_a_sample_checks_some_blobs_and_only_those(tmp_path: Path) -> None:
    repo, manifests = _saved(tmp_path)
    store = Counting(repo.store)
    everything = len(checks.chunk_blobs(manifests))
    report = checks.verify(store, manifests, repo.hash, sample=0.5)  # type: ignore[arg-type]
    index = {b.digest for m in manifests for b in m.index_blobs()}
    chunk_reads = {k for k in store.reads if k[-32:] not in index}
    assert report.ok and 0 < len(chunk_reads) <= round(everything * 0.5)
