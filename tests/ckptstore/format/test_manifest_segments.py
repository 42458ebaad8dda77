"""Version-3 manifests: a small root plus binary index segments stored as blobs. A large
state is written that way; what a reader needs is read and nothing else; unchanged segments
are reused; damage to a segment or the root is refused, never loaded; gc, verify and tier
replication keep and copy segments like the blobs they are."""

from __future__ import annotations

import json
import os
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptstore
from ckptstore import CheckpointStore, FormatError
from ckptstore.format import segments as segments_mod
from ckptstore.format.codecs import Codec
from ckptstore.format.hashing import hash_algorithm
from ckptstore.format.manifest import FORMAT_VERSION, SEGMENTED_VERSION
from ckptstore.format.manifest_parse import parse_manifest
from ckptstore.format.segment_encoding import (
    SEGMENTED_ABOVE_TENSORS,
    ChunkTable,
    SegmentRef,
    cut,
    encode,
)
from ckptstore.format.segments import SegmentedEntries, chunk_columns, chunk_table, decode
from ckptstore.layout import blob_key
from ckptstore.tools import inspection
from tests.helpers import sealed_manifest

N = SEGMENTED_ABOVE_TENSORS + 1500  # well above the threshold: several segments


def big_state(n: int = N, bump: int | None = None) -> dict[str, Any]:
    state: dict[str, Any] = {f"layers.{i}.w": np.full((3,), i, dtype=np.float32)
                             for i in range(n)}
    state["model"] = {"emb": torch.arange(12, dtype=torch.float16).reshape(3, 4),
                      "tied": None, "flags": torch.tensor([True, False])}
    state["model"]["tied"] = state["model"]["emb"]  # tied tensors keep one entry
    state["step"] = 7
    if bump is not None:
        state[f"layers.{bump}.w"] = state[f"layers.{bump}.w"] + 1
    return state


def root(path: Path, name: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((path / "checkpoints" / f"{name}.json").read_bytes())
    return doc


def segment_path(repo: Path, digest: str) -> Path:
    return repo / blob_key(digest)


def assert_loaded(out: dict[str, Any], state: dict[str, Any]) -> None:
    for k, v in state.items():
        if k.startswith("layers."):
            assert out[k].tobytes() == v.tobytes(), k
    assert torch.equal(out["model"]["emb"], state["model"]["emb"])
    assert out["model"]["tied"] is out["model"]["emb"]
    assert torch.equal(out["model"]["flags"], state["model"]["flags"])
    assert out["step"] == 7


def test_small_manifests_stay_one_document(tmp_path: Path) -> None:
    repo = CheckpointStore(str(tmp_path))
    repo.save("small", {"w": np.arange(10)})
    doc = root(tmp_path, "small")
    assert doc["version"] == FORMAT_VERSION and "tensors" in doc


def test_large_state_round_trips_through_a_small_root(tmp_path: Path) -> None:
    state = big_state()
    with CheckpointStore(str(tmp_path)) as repo:
        repo.save("a", state)
        written = repo.manifest("a")
    doc = root(tmp_path, "a")
    assert doc["version"] == SEGMENTED_VERSION and "tensors" not in doc
    assert len(doc["segments"]) >= 4
    assert sum(s["tensors"] for s in doc["segments"]) == N + 2  # tied: one entry
    assert all(segment_path(tmp_path, s["digest"]).stat().st_size == s["size"]
               for s in doc["segments"])
    fresh = CheckpointStore(str(tmp_path))
    parsed = fresh.manifest("a")
    assert isinstance(parsed.tensors, SegmentedEntries)
    assert list(parsed.tensors) == list(written.tensors)  # entries decode to what was written
    assert parsed.blob_digests() == written.blob_digests()
    assert parsed.to_bytes() == (tmp_path / "checkpoints" / "a.json").read_bytes()
    assert_loaded(fresh.load("a"), state)


def test_partial_load_reads_only_the_segments_it_needs(tmp_path: Path) -> None:
    """Every segment but the one holding the asked key is deleted: the partial load still
    works (it never touched them), a whole load is refused naming a missing segment."""
    state = big_state()
    CheckpointStore(str(tmp_path)).save("a", state)
    key = f"layers.{N // 2}.w"
    parsed = CheckpointStore(str(tmp_path)).manifest("a")
    index = next(i for i, t in enumerate(parsed.tensors) if t.key == key)
    starts = np.cumsum([0] + [r.tensors for r in parsed.segment_refs()])
    holding = int(np.searchsorted(starts, index, side="right")) - 1
    for s, ref in enumerate(parsed.segment_refs()):
        if s != holding:
            segment_path(tmp_path, ref.digest).unlink()
    fresh = CheckpointStore(str(tmp_path))
    out = fresh.load("a", keys=[key])
    assert list(out) == [key] and out[key].tobytes() == state[key].tobytes()
    assert [c.name for c in fresh.list()] == ["a"]  # listing reads roots only
    with pytest.raises(FormatError, match="index blob .* has no good copy: missing from"):
        CheckpointStore(str(tmp_path)).load("a")


def test_unchanged_segments_are_reused_not_rewritten(tmp_path: Path) -> None:
    with CheckpointStore(str(tmp_path)) as repo:
        repo.save("a", big_state())
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "blobs").rglob("*") if p.is_file()}
    time.sleep(0.01)
    with CheckpointStore(str(tmp_path)) as repo:  # a restarted process: knows the parent
        repo.save("b", big_state(bump=N // 3))
    a, b = (root(tmp_path, n)["segments"] for n in ("a", "b"))
    changed = {s["digest"] for s in b} - {s["digest"] for s in a}
    assert len(changed) == 1 and len(b) == len(a)
    after = {p: p.stat().st_mtime_ns for p in before}
    assert after == before  # no segment (and no unchanged chunk) written again
    out = CheckpointStore(str(tmp_path)).load("b", keys=[f"layers.{N // 3}.w"])
    assert out[f"layers.{N // 3}.w"][0] == N // 3 + 1


def test_inserting_a_tensor_changes_few_segments() -> None:
    """Cuts depend on the keys (content-defined), not on positions: an inserted tensor
    changes the segment it lands in (and at most its neighbour), not every later one."""
    repo = CheckpointStore("memory://cut-stability")
    state = big_state()
    repo.save("a", state)
    state["layers.1000.extra"] = np.zeros(2, dtype=np.float32)
    repo.save("b", state)
    a = {r.digest for r in repo.manifest("a").segment_refs()}
    b = [r.digest for r in repo.manifest("b").segment_refs()]
    assert len([d for d in b if d not in a]) <= 2 < len(b)


def test_corrupt_segment_is_refused_and_found_by_verify(tmp_path: Path) -> None:
    state = big_state()
    CheckpointStore(str(tmp_path)).save("a", state)
    ref = root(tmp_path, "a")["segments"][1]
    p = segment_path(tmp_path, ref["digest"])
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0x40
    p.write_bytes(bytes(data))
    with pytest.raises(FormatError, match="corrupt"):
        CheckpointStore(str(tmp_path)).load("a")
    report = CheckpointStore(str(tmp_path)).verify("a")
    assert report.problems and "corrupt" in str(report.problems[0])


def test_the_saving_process_verifies_what_the_store_holds_not_what_it_wrote(
        tmp_path: Path) -> None:
    """The store caches a save's manifest with the index blobs it wrote: a verify in the same
    process must still read them from the store, and find them damaged there."""
    repo = CheckpointStore(str(tmp_path))
    repo.save("a", big_state())
    doc = root(tmp_path, "a")
    segment, tree = doc["segments"][1]["digest"], doc["tree_blob"]["digest"]
    for digest in (segment, tree):
        p = segment_path(tmp_path, digest)
        data = bytearray(p.read_bytes())
        data[len(data) // 2] ^= 0x40
        p.write_bytes(bytes(data))
    report = repo.verify("a")
    assert {(p.blob, p.problem, p.checkpoints) for p in report.problems} == {
        (segment, "corrupt", ("a",)), (tree, "corrupt", ("a",))}
    assert repo.verify().problems == report.problems  # "latest" names the same


def test_gc_keeps_segments_of_live_checkpoints_and_reclaims_the_rest(tmp_path: Path) -> None:
    with CheckpointStore(str(tmp_path)) as repo:
        repo.save("a", big_state())
        repo.save("b", big_state(bump=5))
    only_a = ({s["digest"] for s in root(tmp_path, "a")["segments"]}
              - {s["digest"] for s in root(tmp_path, "b")["segments"]})
    assert only_a
    old = time.time() - 30 * 86400
    for p in (tmp_path / "blobs").rglob("*"):
        os.utime(p, (old, old))
    with CheckpointStore(str(tmp_path)) as repo:
        repo.delete("a")
        report = repo.gc(grace_seconds=0)
    assert only_a <= set(report.deleted)
    assert all(segment_path(tmp_path, s["digest"]).exists()
               for s in root(tmp_path, "b")["segments"])
    out = CheckpointStore(str(tmp_path)).load("b")
    assert out["layers.5.w"][0] == 6


def test_space_accounting_counts_segments_and_builds_no_entries(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ckpt ls / du and gc read a version-3 checkpoint's chunk tables straight from its
    segments (no TensorEntry is built) and count the segments as the referenced blobs they
    are: after two saves nothing is unreferenced, and each checkpoint's unique bytes are its
    own segments and changed chunks."""
    with CheckpointStore(str(tmp_path)) as repo:
        repo.save("a", big_state())
        repo.save("b", big_state(bump=5))
        want = {n: repo.manifest(n).blob_extents() for n in ("a", "b")}  # entries parsed
    seg = {n: {s["digest"]: s["size"] for s in root(tmp_path, n)["segments"]} for n in "ab"}
    for n in "ab":
        assert seg[n].items() <= want[n].items()

    def no_entries(*_args: Any) -> None:
        raise AssertionError("a listing decoded an index segment's entries")

    monkeypatch.setattr("ckptstore.format.segments.decode", no_entries)
    fresh = CheckpointStore(str(tmp_path), create=False)
    assert {n: fresh.manifest(n).blob_extents() for n in "ab"} == want
    usage = inspection.usage(
        [fresh.manifest(n) for n in "ab"],
        {p.name: p.stat().st_size for p in (tmp_path / "blobs").rglob("*") if p.is_file()})
    assert usage.unreferenced_blobs == 0 and usage.missing_blobs == ()
    only_a = set(want["a"]) - set(want["b"])
    assert set(seg["a"]) - set(seg["b"]) <= only_a
    a_use = usage.checkpoints[0]
    assert a_use.unique_bytes == sum(want["a"][b] for b in only_a)
    assert fresh.gc(grace_seconds=0, dry_run=True).deleted == []


def replicated(tmp_path: Path) -> tuple[Path, Path, dict[str, Any]]:
    """The near and far folders of a tiered store holding big_state() as "a", replicated."""
    near, far = tmp_path / "near", tmp_path / "far"
    state = big_state()
    with ckptstore.CheckpointStore([str(near), str(far)]) as repo:
        repo.save("a", state)
        repo.wait_replicated(timeout=60)
    return near, far, state


def test_replication_to_a_far_tier_carries_the_segments(tmp_path: Path) -> None:
    _near, far, state = replicated(tmp_path)
    assert_loaded(CheckpointStore(str(far)).load("a"), state)
    assert CheckpointStore(str(far)).verify("a").problems == []


def test_a_segment_bad_on_the_near_tier_is_read_from_the_far_tier(tmp_path: Path) -> None:
    near, far, state = replicated(tmp_path)
    refs = root(near, "a")["segments"]
    damaged = segment_path(near, refs[0]["digest"])
    damaged.write_bytes(damaged.read_bytes()[:-1] + b"?")
    segment_path(near, refs[1]["digest"]).unlink()
    segment_path(near, root(near, "a")["tree_blob"]["digest"]).unlink()  # the tree, too
    with ckptstore.CheckpointStore([str(near), str(far)]) as repo:
        with pytest.warns(RuntimeWarning, match="read from") as seen:
            assert_loaded(repo.load("a"), state)
    assert len({str(w.message).split(":")[0] for w in seen}) == 3  # each blob, named
    segment_path(far, refs[1]["digest"]).unlink()  # now no tier has a good copy
    with ckptstore.CheckpointStore([str(near), str(far)]) as repo, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # segment 0: from far, as above
        with pytest.raises(FormatError, match="no good copy: missing from .*near.*; missing"):
            repo.load("a")


def test_the_tree_is_a_blob_of_its_own_read_on_first_use(tmp_path: Path) -> None:
    """A version-3 root names its state tree's blob instead of holding the tree, so it stays
    small; listing never reads the tree; a load or verify without a good copy of it fails
    naming it, and nothing else is affected."""
    state = big_state()
    with CheckpointStore(str(tmp_path)) as repo:
        repo.save("a", state)
        written = repo.manifest("a")  # the writer's own, its tree in memory
    doc = root(tmp_path, "a")
    assert "tree" not in doc and set(doc["tree_blob"]) == {"digest", "size"}
    assert (tmp_path / "checkpoints" / "a.json").stat().st_size < 8 * 1024
    tree = segment_path(tmp_path, doc["tree_blob"]["digest"])
    assert tree.stat().st_size == doc["tree_blob"]["size"]
    assert tree.read_bytes() == written.tree_blob()[1]
    kept = tree.read_bytes()
    tree.unlink()
    fresh = CheckpointStore(str(tmp_path))
    assert [c.name for c in fresh.list()] == ["a"] and fresh.latest() == "a"
    assert fresh.manifest("a").logical_bytes > 0  # the root alone
    with pytest.raises(FormatError, match="index blob .* has no good copy: missing"):
        fresh.load("a")
    report = fresh.verify("a")
    assert [(p.blob, p.problem, p.keys) for p in report.problems] == [
        (doc["tree_blob"]["digest"], "missing", ("(state tree)",))]
    tree.write_bytes(kept)
    assert_loaded(CheckpointStore(str(tmp_path)).load("a"), state)


@pytest.mark.parametrize("damage", ["not-json", "bad-node", "index-out-of-range"])
def test_a_tree_blob_that_breaks_the_tree_rules_is_refused(tmp_path: Path,
                                                           damage: str) -> None:
    """A tree blob whose digest matches but whose content is not a valid state tree (made
    here by a root re-sealed to point at it) is refused when the tree is used."""
    CheckpointStore(str(tmp_path)).save("a", big_state())
    doc = root(tmp_path, "a")
    doc.pop("self_digest")
    repo = CheckpointStore(str(tmp_path))
    bad = {"not-json": b"{not json", "bad-node": b'{"what":1}',
           "index-out-of-range": b'{"tensor":999999}'}[damage]
    digest = repo.hash.digest(bad)
    repo.store.put(blob_key(digest), bad)
    doc["tree_blob"] = {"digest": digest, "size": len(bad)}
    from ckptstore.layout import segments_in
    m = parse_manifest(sealed_manifest(doc), "a", repo.hash,
                       segments_in([repo.store], repo.hash))
    assert len(m.tensors) == N + 2  # the root is fine; the tree is read when used
    with pytest.raises(FormatError, match="state tree"):
        _ = m.tree


def test_root_damage_is_refused(tmp_path: Path) -> None:
    CheckpointStore(str(tmp_path)).save("a", big_state())
    doc = root(tmp_path, "a")
    doc.pop("self_digest")
    repo = CheckpointStore(str(tmp_path))

    def parse(d: dict[str, Any]) -> Any:
        from ckptstore.layout import segments_in
        m = parse_manifest(sealed_manifest(d), "a", repo.hash,
                           segments_in([repo.store], repo.hash))
        return list(m.tensors)

    wrong_count = json.loads(json.dumps(doc))
    wrong_count["segments"][0]["tensors"] += 1
    with pytest.raises(FormatError, match="the root lists"):
        parse(wrong_count)
    wrong_bytes = json.loads(json.dumps(doc))
    wrong_bytes["segments"][0]["nbytes"] += 4
    with pytest.raises(FormatError, match="the root lists"):
        parse(wrong_bytes)
    wrong_size = json.loads(json.dumps(doc))
    wrong_size["segments"][0]["size"] += 1
    with pytest.raises(FormatError, match="corrupt"):
        parse(wrong_size)
    both = json.loads(json.dumps(doc))
    both["tensors"] = []
    with pytest.raises(FormatError, match="unknown field"):
        parse(both)
    missing = json.loads(json.dumps(doc))
    del missing["segments"]
    with pytest.raises(FormatError, match="missing field"):
        parse(missing)
    for bad in ([{"digest": "zz", "nbytes": 0, "size": 1, "tensors": 1}],
                [{"digest": "0" * 32, "nbytes": 0, "size": 0, "tensors": 1}],
                [{"digest": "0" * 32, "nbytes": 0, "size": 10, "tensors": 0}], "x",
                [{"digest": "0" * 32, "size": 10, "tensors": 1}]):  # no nbytes
        d = json.loads(json.dumps(doc))
        d["segments"] = bad
        with pytest.raises(FormatError):
            parse(d)
    d = json.loads(json.dumps(doc))
    d["version"] = 2  # a v2 header over a v3 body
    with pytest.raises(FormatError):
        parse(d)
    # without a source only the root is usable, and says so
    m = parse_manifest((tmp_path / "checkpoints" / "a.json").read_bytes(), "a", repo.hash)
    with pytest.raises(FormatError, match="not available"):
        m.tensors[0]


SAMPLE = CheckpointStore("memory://segment-sample")
SAMPLE.save("s", big_state(n=SEGMENTED_ABOVE_TENSORS + 20))
ENTRIES = list(SAMPLE.manifest("s").tensors)[:40]
ALG = hash_algorithm("xxh3-128")
SEGMENT = encode(ENTRIES, ALG).head
REF = SegmentRef("0" * 32, len(SEGMENT), len(ENTRIES), sum(t.nbytes for t in ENTRIES))


def test_encode_decode_is_exact_and_deterministic() -> None:
    assert decode(SEGMENT, REF, "x") == ENTRIES
    assert encode(decode(SEGMENT, REF, "x"), ALG).head == SEGMENT
    spans = cut(ENTRIES)
    assert [i for s in spans for i in s] == list(range(len(ENTRIES)))


def test_a_chunk_table_read_from_the_bytes_equals_the_entries_chunks() -> None:
    table, want = chunk_table(SEGMENT, REF, "x"), ChunkTable.of(ENTRIES)
    assert list(table.ranges()) == list(want.ranges()) == [
        (c.blob, c.offset, c.size) for t in ENTRIES for c in t.chunks]
    assert table.extents() == want.extents()
    assert table.extents() == {b: max(c.offset + c.size for t in ENTRIES for c in t.chunks
                                      if c.blob == b)
                               for b in {c.blob for t in ENTRIES for c in t.chunks}}


def test_chunk_columns_give_every_chunk_with_its_codec() -> None:
    zstd = Codec("zstd", 3)
    entries = [replace(t, codec=zstd, chunks=tuple(replace(c, size=c.size - 1)
                                                   for c in t.chunks)) if i % 3 == 0 else t
               for i, t in enumerate(ENTRIES)]
    data = encode(entries, ALG).head
    ref = SegmentRef("0" * 32, len(data), len(entries), REF.nbytes)
    cols = chunk_columns(data, ref, "x")
    chunks = [(c, t.codec) for t in entries for c in t.chunks]
    assert [cols.ref(j) for j in range(len(chunks))] == [c for c, _codec in chunks]
    found = cols.by_codec()
    assert set(found) == {None, zstd}
    for codec, by_digest in found.items():
        assert {d: cols.ref(j).digest for d, j in by_digest.items()} == {
            c.digest: c.digest for c, k in chunks if k == codec}
    # a raw chunk whose stored size is not its raw size would be read wrong: refused
    bad = [replace(t, chunks=(replace(t.chunks[0], size=t.chunks[0].size + 1),
                              *t.chunks[1:])) if i == 1 else t for i, t in enumerate(ENTRIES)]
    data = encode(bad, ALG).head
    with pytest.raises(FormatError, match="raw chunk's stored size"):
        chunk_columns(data, SegmentRef("0" * 32, len(data), len(bad), REF.nbytes), "x")


def test_an_incremental_save_reads_its_parent_as_chunk_columns(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save from a fresh process learns its parent's chunks from the segments' columns
    (no entry is decoded) and still reuses exactly what it may: every chunk with the same
    codec, none written with another one."""
    state = big_state()
    state["big"] = torch.zeros(1 << 18)  # 1 MiB: compressed with zstd
    CheckpointStore(str(tmp_path)).save("a", state, compression="zstd")
    decoded: list[int] = []
    real = segments_mod._decode
    monkeypatch.setattr(segments_mod, "_decode",
                        lambda data, ref: decoded.append(1) or real(data, ref))
    same = CheckpointStore(str(tmp_path)).save("b", state, compression="zstd")
    assert decoded == [] and same.written_bytes == 0
    raw = CheckpointStore(str(tmp_path)).save("c", state, compression=None)
    assert decoded == [] and raw.written_bytes == 1 << 20  # only the compressed one again
    monkeypatch.undo()
    for name in ("b", "c"):
        out = CheckpointStore(str(tmp_path)).load(name)
        assert torch.equal(out["big"], state["big"])
        assert_loaded(out, state)


def test_a_damaged_parent_chunk_reference_is_never_committed_again(tmp_path: Path) -> None:
    """A parent whose segment (sealed, digest-correct: only a writer bug makes one) holds a
    chunk reference that breaks the entry rules but not the columns' framing: a save that
    would reuse it fails before anything is committed, naming the tensor."""
    state = big_state()
    CheckpointStore(str(tmp_path)).save("a", state)
    doc = root(tmp_path, "a")
    m = CheckpointStore(str(tmp_path)).manifest("a")
    entries = list(m.tensors[:doc["segments"][0]["tensors"]])
    victim = entries[3]
    entries[3] = replace(victim, chunks=(replace(victim.chunks[0], offset=1 << 63),))
    data = encode(entries, ALG).head
    repo = CheckpointStore(str(tmp_path))
    digest = repo.hash.digest(data)
    repo.store.put(blob_key(digest), data)
    doc["segments"][0] = {**doc["segments"][0], "digest": digest, "size": len(data)}
    (tmp_path / "checkpoints" / "a.json").write_bytes(sealed_manifest(doc))
    with pytest.raises(FormatError, match=f"{victim.key}.*nothing was committed"):
        CheckpointStore(str(tmp_path)).save("b", state)
    assert not (tmp_path / "checkpoints" / "b.json").exists()
    with pytest.raises(FormatError):  # and a reader refuses the parent's entry itself
        CheckpointStore(str(tmp_path)).load("a", keys=[victim.key])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, len(SEGMENT) - 1), st.integers(1, 255))
def test_a_flipped_byte_is_refused_or_decodes_to_valid_entries(pos: int, xor: int) -> None:
    """decode (past the digest check) never raises anything but FormatError, and anything it
    returns passes the entry rules."""
    data = bytearray(SEGMENT)
    data[pos] ^= xor
    try:
        table = chunk_table(bytes(data), REF, "x")
        assert len(table.blob_index) == len(table.offsets) == len(table.sizes)
        assert all(0 <= i < len(table.blobs) for i in table.blob_index.tolist())
    except FormatError:
        pass
    try:
        cols = chunk_columns(bytes(data), REF, "x")
        assert all(len(cols.ref(j).blob) == 32 for j in range(len(cols.digests)))
    except FormatError:
        pass
    try:
        out = decode(bytes(data), REF, "x")
    except FormatError:
        return
    assert len(out) == len(ENTRIES)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, len(SEGMENT) - 1))
def test_a_truncated_segment_is_refused(n: int) -> None:
    ref = SegmentRef("0" * 32, n, len(ENTRIES), REF.nbytes)
    with pytest.raises(FormatError):
        decode(SEGMENT[:n], ref, "x")
    with pytest.raises(FormatError):
        chunk_table(SEGMENT[:n], ref, "x")
    with pytest.raises(FormatError):
        chunk_columns(SEGMENT[:n], ref, "x")
