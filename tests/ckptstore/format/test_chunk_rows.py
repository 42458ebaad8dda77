"""Entries of many chunks read from an index segment keep their chunks as the segment's
columns (ChunkRows, format/manifest.py): a ChunkRef is built only for a chunk that is used.

What is checked (each fails when its rule is broken):
* such entries decode equal to the entries that were encoded (indexing, slices, iteration,
  hashing), and encode back to the same bytes; entries of few chunks still get ChunkRefs;
* every chunk rule broken in one row of the columns is refused with the message the same
  chunk gets as a ChunkRef (the one statement of the rules, checked on all rows at once),
  in an entry of many chunks and in one of few (whose rows are checked segment-wide);
* the raw size of every chunk computed on columns equals the chunk-by-chunk computation for
  any shape and grid;
* a flipped byte of such a segment is refused or decodes to entries obeying the rules;
* a segment encoded from columns (a collective save's builder) is byte for byte the one
  encoded from the same entries, blob table order included;
* a load of some rows of a tensor held in many chunks builds the ChunkRefs of those rows
  only, and reads them right.
"""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptstore import CheckpointStore, FormatError, Shard
from ckptstore.format.codecs import Codec
from ckptstore.format.dtypes import DTYPES
from ckptstore.format.hashing import hash_algorithm
from ckptstore.format.manifest import (
    ROWS_ABOVE,
    ChunkRows,
    _chunk_sizes,
    chunk_region,
    entry_problem,
    expected_chunk_count,
)
from ckptstore.format.segment_encoding import SegmentRef, encode
from ckptstore.format.segments import decode
from tests.helpers import encoded_from_columns, valid_entry

F32 = DTYPES["float32"]
ZSTD = Codec("zstd", 3)


entry = valid_entry


ENTRIES = [entry("rows", (131, 6), 2, seed=1), entry("grid", (31, 52), 3, (3, 5), seed=2),
           entry("zstd", (200,), 2, codec=ZSTD, seed=3), entry("few", (4, 3), 1, seed=4),
           entry("scalar", (), 1, seed=5), entry("fewz", (3, 2), 2, codec=ZSTD, seed=6)]
ALG = hash_algorithm("xxh3-128")
SEGMENT = encode(ENTRIES, ALG).head
REF = SegmentRef("0" * 32, len(SEGMENT), len(ENTRIES), sum(e.nbytes for e in ENTRIES))


def test_entries_of_many_chunks_decode_to_columns_equal_to_their_chunk_refs() -> None:
    got = decode(SEGMENT, REF, "x")
    assert got == ENTRIES and ENTRIES == got
    assert [type(e.chunks) for e in got] == [ChunkRows] * 3 + [tuple] * 3
    assert all(len(e.chunks) > ROWS_ABOVE for e in got[:3])
    for g, want in zip(got, ENTRIES):
        assert list(g.chunks) == list(want.chunks)
        assert [g.chunks[i] for i in range(-len(want.chunks), len(want.chunks))] == [
            *want.chunks, *want.chunks]
        assert g.chunks[5:70:7] == want.chunks[5:70:7]
        assert hash(g) == hash(want)
        assert copy.deepcopy(g) == copy.copy(g) == want  # immutable views: copies are free
        with pytest.raises(IndexError):
            g.chunks[len(want.chunks)]
    assert encode(got, ALG).head == SEGMENT


def test_entries_decoded_from_a_mutable_buffer_do_not_change_with_it() -> None:
    buffer = bytearray(SEGMENT)
    got = decode(buffer, REF, "x")  # type: ignore[arg-type]
    buffer[:] = bytes(len(buffer))  # the caller reuses its buffer
    assert got == ENTRIES


BREAKS = {
    "raw bytes": lambda c: replace(c, nbytes=c.nbytes + 4),
    "offset range": lambda c: replace(c, offset=1 << 63),
    "stored size of a raw chunk": lambda c: replace(c, size=c.size + 1),
    "compressed offset": lambda c: replace(c, offset=1),
    "compressed size": lambda c: replace(c, size=2 * c.nbytes + 65_537),
}


@pytest.mark.parametrize("which", range(len(ENTRIES)))
@pytest.mark.parametrize("rule", sorted(BREAKS))
def test_a_rule_broken_in_one_row_is_refused_as_a_chunk_ref_is(which: int, rule: str) -> None:
    """Entries of many chunks (ChunkRows) and of few (ChunkRef tuples, whose rows a decode
    checks for the whole segment at once) alike."""
    victim = ENTRIES[which]
    # past ROWS_ABOVE only the columns' check can see it; of few chunks, the last one
    k = len(victim.chunks) - (3 if len(victim.chunks) > ROWS_ABOVE else 1)
    bad = replace(victim, chunks=(*victim.chunks[:k], BREAKS[rule](victim.chunks[k]),
                                  *victim.chunks[k + 1:]))
    message = entry_problem(bad)
    if message is None:  # this rule does not apply to this codec (e.g. offsets of raw chunks)
        assert (rule.startswith("compressed")) != (victim.codec is not None)
        return
    assert f"chunk {k}" in message, message
    entries = [bad if e is victim else e for e in ENTRIES]
    data = encode(entries, ALG).head
    ref = SegmentRef("0" * 32, len(data), len(entries), REF.nbytes + bad.nbytes - victim.nbytes)
    with pytest.raises(FormatError) as err:
        decode(data, ref, "x")
    assert message in str(err.value)


@pytest.mark.parametrize("rule", sorted(BREAKS))
def test_a_segment_of_few_chunk_entries_only_checks_every_row(rule: str) -> None:
    """The segment-wide check where every row belongs to a ChunkRef tuple (a segment of
    small tensors): the broken row is found wherever it is, with the ChunkRef message."""
    few = ENTRIES[3:]
    for victim in few:
        k = len(victim.chunks) - 1
        bad = replace(victim, chunks=(*victim.chunks[:k], BREAKS[rule](victim.chunks[k])))
        message = entry_problem(bad)
        if message is None:  # the rule is the other codec's
            continue
        entries = [bad if e is victim else e for e in few]
        data = encode(entries, ALG).head
        ref = SegmentRef("0" * 32, len(data), len(entries), sum(e.nbytes for e in entries))
        with pytest.raises(FormatError) as err:
            decode(data, ref, "x")
        assert message in str(err.value) and repr(victim.key) in str(err.value)
    good = encode(few, ALG).head
    assert decode(good, SegmentRef("0" * 32, len(good), len(few),
                                   sum(e.nbytes for e in few)), "x") == few


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 13), min_size=1, max_size=3),
       st.lists(st.integers(1, 6), min_size=3, max_size=3), st.booleans())
def test_chunk_sizes_on_columns_equal_the_chunk_by_chunk_rule(
        shape: list[int], block: list[int], as_grid: bool) -> None:
    dims = tuple(shape)
    grid = tuple(block[:len(dims)]) if as_grid else None
    rows = block[0]
    count = expected_chunk_count(dims, rows, 4, grid)
    full = grid if grid is not None else (rows, *dims[1:])
    want = [math.prod(b - a for a, b in chunk_region(dims, full, i)) * 4 for i in range(count)]
    assert _chunk_sizes(dims, rows, grid, 4, count).tolist() == want


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, len(SEGMENT) - 1), st.integers(1, 255))
def test_a_flipped_byte_is_refused_or_decodes_to_valid_entries(pos: int, xor: int) -> None:
    data = bytearray(SEGMENT)
    data[pos] ^= xor
    try:
        out = decode(bytes(data), REF, "x")
    except FormatError:
        return
    for e in out:  # what decodes obeys every rule, chunk by chunk too
        assert entry_problem(replace(e, chunks=tuple(e.chunks))) is None


@pytest.mark.parametrize("order", ["as saved", "reversed"])
def test_a_segment_encoded_from_columns_is_the_one_encoded_from_entries(order: str) -> None:
    entries = ENTRIES if order == "as saved" else ENTRIES[::-1]  # another first-use order
    data = encoded_from_columns(entries, ALG).head
    assert data == encode(entries, ALG).head
    assert decode(data, SegmentRef("0" * 32, len(data), len(entries), REF.nbytes), "x") == entries


def test_a_load_of_some_rows_builds_the_chunk_refs_of_those_rows_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    repo = CheckpointStore("memory://chunk-rows-load", chunk_bytes=256 << 10)
    w = torch.arange(400 * 65_536, dtype=torch.float32).reshape(400, 65_536)  # 1 row a chunk
    filler = {f"f{i}": torch.full((2,), float(i)) for i in range(1_100)}  # a version-3 root
    repo.save("s", {"w": w, **filler})
    built: list[int] = []
    real = ChunkRows.__getitem__

    def counting(self: ChunkRows, j: int | slice) -> object:
        built.append(1)
        return real(self, j)

    monkeypatch.setattr(ChunkRows, "__getitem__", counting)
    monkeypatch.setattr(ChunkRows, "__iter__", lambda self: pytest.fail("iterated every chunk"))
    fresh = CheckpointStore("memory://chunk-rows-load")
    part = Shard(torch.zeros(5, 65_536), offset=213, global_shape=(400, 65_536))
    fresh.load("s", into={"w": part}, keys=["w"])
    assert torch.equal(part.data, w[213:218])
    assert 5 <= len(built) <= 10  # its 5 chunks (each looked up a few times), not 400
    monkeypatch.undo()
    (e,) = [e for e in fresh.manifest("s").tensors if e.key == "w"]
    assert type(e.chunks) is ChunkRows and len(e.chunks) == 400
    np.testing.assert_array_equal(fresh.load("s", keys=["w"])["w"].numpy(), w.numpy())
