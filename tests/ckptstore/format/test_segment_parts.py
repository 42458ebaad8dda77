"""Parted index segments (docs/format.md §3.4, "Parted segments"): a segment of many chunks,
where tensors hold many each (a collective save's: every rank a slice of every tensor), keeps
its records in its head and its chunk rows in parts, part p holding the same slice of every
tensor's chunk list, so a rank reads its part, not every rank's rows.

What is checked (each fails when its rule is broken):
* parted entries decode equal to the entries encoded, and encode back to the same blobs; a
  segment built from columns (a collective save's builder) is the same head and parts;
* a read of one chunk fetches the head and the one part holding it; a rank's slice of every
  tensor fetches at most two parts (its own, and part 0 for tensors of one chunk);
* a rule broken in one row of a part is refused, when that part is read, with the message a
  ChunkRef gets; the other parts still serve; a missing or wrongly framed part is refused;
* chunk tables (gc, space) and chunk columns (incremental saves) of a parted segment equal
  those of the same entries unparted, and name the parts among the checkpoint's blobs;
* through a repository: a parted checkpoint loads back, verify checks every part (and names
  a damaged one), gc keeps the parts while the checkpoint lives and frees them after, a copy
  carries them; a load of some rows of its tensors reads their segments side by side and
  only the parts holding those rows.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from ckptstore import CheckpointStore, FormatError, Shard
from ckptstore.format import segment_encoding
from ckptstore.format.codecs import Codec
from ckptstore.format.dtypes import DTYPES
from ckptstore.format.hashing import hash_algorithm
from ckptstore.format.manifest import ChunkTable, TensorEntry, entry_problem
from ckptstore.format.segment_encoding import (
    PART_CHUNKS,
    EncodedSegment,
    IndexBlob,
    encode,
    part_count,
)
from ckptstore.format.segments import PartedRows, chunk_columns, chunk_table, decode
from ckptstore.layout import blob_key
from ckptstore.stores.local import LocalStore
from ckptstore.tools.copying import copy_checkpoints
from tests.helpers import encoded_from_columns, valid_entry

F32 = DTYPES["float32"]
ALG = hash_algorithm("xxh3-128")
WORLD = 96  # "ranks": tensors of WORLD chunks, as FSDP row shards give


def entry(key: str, shape: tuple[int, ...], rows: int, seed: int,
          codec: Codec | None = None, grid: tuple[int, ...] | None = None) -> TensorEntry:
    e: TensorEntry = valid_entry(key, shape, rows, grid, codec, seed)
    return e


# 60 tensors sharded over WORLD ranks (one chunk each), a compressed one, an N-D grid, and
# replicated tensors of one chunk
ENTRIES = [entry(f"layers.{i}.w", (WORLD * 4, 8), 4, seed=i) for i in range(60)] + [
    entry("zstd", (WORLD * 2,), 2, seed=100, codec=Codec("zstd", 3)),
    entry("grid", (WORLD, 16), 2, seed=101, grid=(2, 8)),
    *(entry(f"norm.{i}", (8,), 8, seed=200 + i) for i in range(5))]
ENCODED = encode(ENTRIES, ALG)


class Source:
    """Index blobs by digest, counting what is fetched."""

    def __init__(self, encoded: EncodedSegment) -> None:
        self.blobs = {ref.digest: data for ref, data in encoded.blobs()}
        self.fetched: list[str] = []

    def __call__(self, ref: IndexBlob) -> bytes:
        self.fetched.append(ref.digest)
        if ref.digest not in self.blobs:
            raise FormatError(f"index blob {ref.digest} has no good copy: missing")
        return self.blobs[ref.digest]


def decoded(encoded: EncodedSegment = ENCODED) -> tuple[list[TensorEntry], Source]:
    source = Source(encoded)
    return decode(encoded.head, encoded.ref, "x", source), source


def test_a_segment_of_many_sharded_tensors_is_parted_and_decodes_equal() -> None:
    total = sum(len(e.chunks) for e in ENTRIES)
    assert len(ENCODED.parts) == part_count([len(e.chunks) for e in ENTRIES]) == \
        -(-total // PART_CHUNKS) > 1
    got, source = decoded()
    assert source.fetched == []  # the head alone so far
    assert all(type(e.chunks) is PartedRows for e in got)
    assert got == ENTRIES
    for g, want in zip(got, ENTRIES):
        assert list(g.chunks) == list(want.chunks)
        assert [g.chunks[i] for i in range(-len(want.chunks), len(want.chunks))] == [
            *want.chunks, *want.chunks]
        assert g.chunks[3:50:7] == want.chunks[3:50:7]
        assert hash(g) == hash(want)
        with pytest.raises(IndexError):
            g.chunks[len(want.chunks)]
    again = encode(got, ALG)
    assert again == ENCODED


def test_a_small_segment_or_one_of_single_chunk_tensors_is_not_parted() -> None:
    assert not encode(ENTRIES[:4], ALG).parts  # few chunks
    many = [entry(f"t{i}", (4,), 4, seed=i) for i in range(5000)]  # one chunk each
    assert part_count([1] * 5000) == 1 and not encode(many, ALG).parts


def test_one_chunk_reads_the_head_and_one_part_and_a_rank_reads_at_most_two() -> None:
    got, source = decoded()
    parts = len(ENCODED.parts)
    rank = 77
    assert got[5].chunks[rank].digest == ENTRIES[5].chunks[rank].digest
    assert source.fetched == [ENCODED.parts[rank * parts // WORLD][0].digest]
    used = 0
    for e, want in zip(got, ENTRIES):  # rank `rank`'s rows of every tensor: all of one chunk
        rows = (0, e.shape[0]) if len(e.chunks) == 1 else (e.shape[0] * rank // WORLD,
                                                             e.shape[0] * (rank + 1) // WORLD)
        for c, _box, _slices in e.chunks_over([rows, *((0, d) for d in e.shape[1:])]):
            assert e.chunks[c] == want.chunks[c]
            used += 1
    assert used == 60 + 1 + 2 + 5  # its chunk of each sharded tensor (two of the grid's)
    assert len(set(source.fetched)) <= 2, source.fetched
    assert ENCODED.parts[0][0].digest in source.fetched  # the replicated tensors' part


def test_segments_built_from_columns_are_the_same_head_and_parts() -> None:
    for entries in (ENTRIES, ENTRIES[::-1]):  # two first-use orders of the blob tables
        built = encoded_from_columns(entries, ALG)
        assert built == encode(entries, ALG) and built.parts


@pytest.mark.parametrize("victim, k", [(7, 50), (60, 90), (61, 40)])
def test_a_broken_row_is_refused_when_its_part_is_read_as_a_chunk_ref_is(
        victim: int, k: int) -> None:
    e = ENTRIES[victim]
    bad = replace(e, chunks=(*e.chunks[:k], replace(e.chunks[k], nbytes=e.chunks[k].nbytes + 4),
                             *e.chunks[k + 1:]))
    message = entry_problem(bad)
    assert message is not None and f"chunk {k}" in message
    entries = [bad if x is e else x for x in ENTRIES]
    encoded = encode(entries, ALG)
    got, _source = decoded(encoded)  # the head holds no rows: it decodes
    parts = len(encoded.parts)
    home = k * parts // len(e.chunks)
    with pytest.raises(FormatError) as err:
        got[victim].chunks[k]
    assert message in str(err.value) and f"part {home}" in str(err.value)
    assert repr(e.key) in str(err.value)
    other = next(c for c in range(len(e.chunks)) if c * parts // len(e.chunks) != home)
    assert got[victim].chunks[other] == e.chunks[other]  # other parts still serve
    with pytest.raises(FormatError):
        list(got[victim].chunks)


def test_a_missing_or_misframed_part_is_refused_on_use() -> None:
    got, source = decoded()
    first = ENCODED.parts[0][0].digest
    del source.blobs[first]
    with pytest.raises(FormatError, match="part 0.*no good copy"):
        got[0].chunks[0]
    assert got[0].chunks[len(got[0].chunks) - 1] == ENTRIES[0].chunks[-1]
    # a part's bytes that frame fewer rows than the records place there
    got, source = decoded()
    ref1, data1 = ENCODED.parts[1]
    source.blobs[ref1.digest] = data1[:-60]
    with pytest.raises(FormatError, match="part 1"):
        list(got[0].chunks)
    got, source = decoded()
    source.blobs[ref1.digest] = b"CKSTSEG\x01" + data1[8:]  # not a part
    with pytest.raises(FormatError, match="part 1.*not a part"):
        list(got[0].chunks)


def test_a_head_with_rows_of_its_own_or_bad_part_refs_is_refused() -> None:
    head = ENCODED.head
    # the part list, then a head claiming one chunk row besides its parts
    own_row = head[:16] + (1).to_bytes(4, "little") + head[20:] + bytes(44)
    with pytest.raises(FormatError, match="chunk rows of its own"):
        decode(own_row, replace(ENCODED.ref, size=len(own_row)), "x", Source(ENCODED))
    text = head.replace(ENCODED.parts[0][0].digest.encode(), b"not-a-digest-at-all-000000000000")
    assert len(text) == len(head)
    with pytest.raises(FormatError, match="part 0 must be"):
        decode(text, ENCODED.ref, "x", Source(ENCODED))


def test_chunk_tables_and_columns_equal_the_unparted_ones_and_name_the_parts() -> None:
    source = Source(ENCODED)
    table = chunk_table(ENCODED.head, ENCODED.ref, "x", source)
    want = ChunkTable.of(ENTRIES)
    assert sorted(table.ranges()) == sorted(want.ranges())
    assert table.extents() == want.extents()
    assert [p.digest for p in table.parts] == [ref.digest for ref, _d in ENCODED.parts]
    cols = chunk_columns(ENCODED.head, ENCODED.ref, "x", Source(ENCODED))
    flat = [c for e in ENTRIES for c in e.chunks]
    assert [cols.ref(j) for j in range(len(flat))] == flat
    assert cols.digests == [c.digest for c in flat]
    by = cols.by_codec()
    assert by[None][ENTRIES[3].chunks[9].digest] == 3 * WORLD + 9
    zstd = ENTRIES[60]
    assert by[zstd.codec][zstd.chunks[1].digest] == 60 * WORLD + 1
    with pytest.raises(FormatError, match="not available"):
        chunk_table(ENCODED.head, ENCODED.ref, "x")


# through a repository ------------------------------------------------------------------

def _parted_state() -> dict[str, torch.Tensor]:
    """Five tensors of 100 one-row chunks and 1,030 small ones (a version-3 manifest)."""
    g = torch.Generator().manual_seed(3)
    state = {f"big{i}": torch.randn(100, 16, generator=g) for i in range(5)}
    state.update({f"small{i:04d}": torch.randn(4, generator=g) for i in range(1030)})
    return state


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A repository holding checkpoint "a" of `_parted_state`, its segment of the big
    tensors parted (the writer's thresholds lowered, so that a few hundred chunk files
    do)."""
    root = tmp_path_factory.mktemp("parted") / "r"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(segment_encoding, "PART_ABOVE_CHUNKS", 256)
        mp.setattr(segment_encoding, "PART_CHUNKS", 64)
        CheckpointStore(str(root), chunk_bytes=64).save("a", _parted_state(), parent=None)
    return root


def _repo(saved: Path, at: Path) -> CheckpointStore:
    """A copy of the saved repository (a fresh process's view of it)."""
    shutil.copytree(saved, at)
    return CheckpointStore(str(at), create=False)


def _parts_of(repo: CheckpointStore, name: str) -> list[str]:
    m = repo.manifest(name)
    return [p.digest for table in m.chunk_tables() for p in table.parts]


def test_a_parted_checkpoint_loads_verifies_gcs_and_copies(saved: Path, tmp_path: Path
                                                           ) -> None:
    repo, state = _repo(saved, tmp_path / "r"), _parted_state()
    parts = _parts_of(repo, "a")
    assert len(parts) > 1
    assert all(os.path.exists(tmp_path / "r" / blob_key(p)) for p in parts)
    got = CheckpointStore(str(tmp_path / "r"), create=False).load("a")
    assert all(torch.equal(got[k], v) for k, v in state.items())
    assert repo.verify().ok
    assert set(parts) <= repo.manifest("a").blob_digests()
    repo.gc(grace_seconds=0)  # everything referenced: the parts stay
    assert all(os.path.exists(tmp_path / "r" / blob_key(p)) for p in parts)
    again = CheckpointStore(str(tmp_path / "r"), create=False).load("a")
    assert all(torch.equal(again[k], v) for k, v in state.items())

    copy = CheckpointStore(str(tmp_path / "copy"))
    copy_checkpoints(repo, copy, ["a"])
    assert all(os.path.exists(tmp_path / "copy" / blob_key(p)) for p in parts)
    copied = copy.load("a")
    assert all(torch.equal(copied[k], v) for k, v in state.items())

    repo.delete("a")
    repo.gc(grace_seconds=0, now=time.time() + 86_400)  # past the least blob age
    assert not any(os.path.exists(tmp_path / "r" / blob_key(p)) for p in parts)


def test_verify_names_a_damaged_part_and_a_load_refuses_it(saved: Path, tmp_path: Path
                                                          ) -> None:
    repo = _repo(saved, tmp_path / "r")
    victim = _parts_of(repo, "a")[1]
    path = tmp_path / "r" / blob_key(victim)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    os.chmod(path, 0o644)
    path.write_bytes(bytes(data))
    report = CheckpointStore(str(tmp_path / "r"), create=False).verify()
    assert not report.ok
    assert [p.blob for p in report.problems] == [victim]
    assert "(index segment part)" in report.problems[0].keys
    with pytest.raises(FormatError, match=victim):
        CheckpointStore(str(tmp_path / "r"), create=False).load("a")


class SlowIndexReads(LocalStore):
    """A local store whose whole-object gets (index blobs, manifests) take 30 ms, counting the
    blobs fetched and the most fetched at once."""

    def __init__(self, root: str, watch: frozenset[str] = frozenset()) -> None:
        super().__init__(root, create=False)
        self.blobs: list[str] = []
        self.at_once = self.most = 0
        self.watch = watch  # blobs whose fetches are counted apart (`most_watched`)
        self.watched_at_once = self.most_watched = 0
        self._count = threading.Lock()

    def get(self, key: str) -> bytes:
        name = key.rsplit("/", 1)[-1]
        watched = name in self.watch
        with self._count:
            self.at_once += 1
            self.most = max(self.most, self.at_once)
            self.watched_at_once += watched
            self.most_watched = max(self.most_watched, self.watched_at_once)
            self.blobs.append(name)
        try:
            time.sleep(0.03)
            return super().get(key)
        finally:
            with self._count:
                self.at_once -= 1
                self.watched_at_once -= watched


def test_a_shard_load_reads_its_segments_and_parts_concurrently_and_no_other_part(
        saved: Path, tmp_path: Path) -> None:
    repo = _repo(saved, tmp_path / "r")
    state = _parted_state()
    parts = _parts_of(repo, "a")
    store = SlowIndexReads(str(tmp_path / "r"))
    shards = {f"big{i}": Shard(torch.zeros(10, 16), offset=40, global_shape=(100, 16))
              for i in range(5)}
    t0 = time.perf_counter()
    CheckpointStore(store).load("a", into=shards, keys=list(shards))
    took = time.perf_counter() - t0
    for key, shard in shards.items():
        assert torch.equal(shard.data, state[key][40:50])
    read_parts = [b for b in store.blobs if b in parts]
    assert read_parts and len(set(read_parts)) < len(parts)  # rows 40-49: their part only
    assert store.most >= 2, store.blobs  # heads, then parts, fetched side by side
    # and the whole checkpoint: every segment and part, concurrently
    store = SlowIndexReads(str(tmp_path / "r"))
    got = CheckpointStore(store).load("a")
    assert all(torch.equal(got[k], v) for k, v in state.items())
    assert set(parts) <= set(store.blobs) and store.most >= 2
    assert took < 30  # (a guard against a hang, not a benchmark)


def test_a_manifest_of_one_document_names_no_parts(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Parts exist only for a version-3 manifest's segments: a version-2 manifest whose
    entries would be parted as segments names none (a peer or a copy would look for them)."""
    monkeypatch.setattr(segment_encoding, "PART_ABOVE_CHUNKS", 256)
    monkeypatch.setattr(segment_encoding, "PART_CHUNKS", 64)
    repo = CheckpointStore(str(tmp_path), chunk_bytes=64)
    repo.save("a", {f"w{i}": torch.randn(100, 16) for i in range(3)}, parent=None)
    for m in (repo.manifest("a"), CheckpointStore(str(tmp_path), create=False).manifest("a")):
        assert m.version == 2
        assert all((tmp_path / blob_key(b)).exists() for b in m.blob_extents())


def test_region_reads_fetch_their_parts_side_by_side_and_no_other(saved: Path,
                                                                   tmp_path: Path) -> None:
    """The region path (a DTensor's N-D shard, column shards): rows 40-49, columns 4-11 of
    each big tensor, read through RegionReads as a load does."""
    from ckptstore.pipeline.reader import CheckpointReader
    from ckptstore.pipeline.regions import RegionReads

    _repo(saved, tmp_path / "r")
    state = _parted_state()
    store = SlowIndexReads(str(tmp_path / "r"))
    repo = CheckpointStore(store)
    m = repo.manifest("a")
    parts = [p.digest for table in CheckpointStore(str(tmp_path / "r"), create=False)
             .manifest("a").chunk_tables() for p in table.parts]
    entries = {e.key: e for e in m.tensors if e.key.startswith("big")}  # heads read here
    store.blobs.clear()
    store.most = 0
    reads = RegionReads(CheckpointReader(store))
    out = {}
    for key, e in entries.items():
        out[key] = np.zeros(10 * 8 * 4, np.uint8)
        reads.add(e, out[key], (10, 8), (((0, 40, 10),), ((0, 4, 8),)))
    reads.run()
    for key, buf in out.items():
        assert np.array_equal(buf.view(np.float32).reshape(10, 8),
                              state[key][40:50, 4:12].numpy()), key
    read_parts = {b for b in store.blobs if b in parts}
    assert read_parts and len(read_parts) < len(parts)
    assert store.most >= 2, store.blobs


def test_whole_checkpoint_passes_read_every_part_side_by_side(saved: Path,
                                                              tmp_path: Path) -> None:
    """What needs every part of a segment (gc's and space accounting's blob list, verify)
    reads them several at a time, not one round trip after another."""
    _repo(saved, tmp_path / "r")
    parts = _parts_of(CheckpointStore(str(tmp_path / "r"), create=False), "a")
    for needs_all in ("blobs", "verify"):
        store = SlowIndexReads(str(tmp_path / "r"), watch=frozenset(parts))
        repo = CheckpointStore(store)
        if needs_all == "blobs":
            assert set(parts) <= repo.manifest("a").blob_digests()
        else:
            assert repo.verify("a").ok
        assert set(parts) <= set(store.blobs)
        fetched = [b for b in store.blobs if b in parts]
        assert len(fetched) == len(set(fetched)), (needs_all, fetched)  # each part once
        assert store.most_watched >= 2, needs_all  # parts fetched side by side
