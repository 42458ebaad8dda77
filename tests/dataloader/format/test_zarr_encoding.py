"""The writer's own zarr encoding against zarr-python: for every array shape the writer makes,
the objects stored (every shard and the array's zarr.json) must be byte for byte the ones zarr
stores when it writes the same rows itself. Rows are appended in uneven pieces (whole arrays,
and runs of small array and bytes pieces), so shards are filled across appends, and include
all-zero chunks (the fill value, which zarr still stores with write_empty_chunks)."""

from __future__ import annotations

import numpy as np
import pytest
import zarr
from zarr.codecs import ZstdCodec

from ckptstore.stores import MemoryStore
from dataloader.format import ShardInfo
from dataloader.format.zarr_adapter import ZarrStoreAdapter
from dataloader.format.zarr_encoding import (
    array_metadata,
    encode_shard,
    group_metadata,
    tail_nbytes,
)
from dataloader.write.array_writer import ArrayWriter, ObjectWrites

CASES = [
    # dtype, inner shape, rows per chunk, chunks per shard, rows in all
    ("<i4", (), 4, 4, 1),
    ("<i4", (), 4, 4, 3),
    ("<i4", (), 4, 4, 16),
    ("<i4", (), 4, 4, 10),
    ("<i4", (), 4, 4, 37),
    ("<i8", (), 5, 7, 36),
    ("|u1", (), 1024, 3, 5000),
    ("<f8", (3,), 2, 5, 23),
    ("<i4", (2049,), 8, 4, 70),
    ("|b1", (2, 5), 3, 2, 13),
    ("<f4", (), 7, 1, 15),
    ("<u2", (), 4, 1024, 4100),
]


def _rows(dtype: str, inner: tuple[int, ...], n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, 200, size=(n, *inner)).astype(dtype)
    rows[n // 3 : n // 3 + 9] = 0  # a run of fill values: whole empty chunks in most cases
    return rows


def _zarr_objects(
    dtype: str, inner: tuple[int, ...], chunk: int, per_shard: int, rows: np.ndarray,
    compressor: str | None,
) -> dict[str, bytes]:
    store = MemoryStore()
    group = zarr.open_group(store=ZarrStoreAdapter(store), mode="w")
    array = group.create_array(
        "x",
        shape=(0, *inner),
        dtype=dtype,
        chunks=(chunk, *inner),
        shards=(chunk * per_shard, *inner),
        compressors=[ZstdCodec(level=1)] if compressor else None,
        fill_value=0,
        config={"write_empty_chunks": True},
    )
    array.resize(rows.shape)
    array[:] = rows
    return {info.key: store.get(info.key) for info in store.list("")}


def _our_objects(
    dtype: str, inner: tuple[int, ...], chunk: int, per_shard: int, rows: np.ndarray,
    compressor: str | None, seed: int,
) -> tuple[dict[str, bytes], tuple[ShardInfo, ...]]:
    store = MemoryStore()
    writes = ObjectWrites(store)
    writer = ArrayWriter(writes, "x", np.dtype(dtype), inner, chunk, per_shard, compressor)
    rng = np.random.default_rng(seed)
    at = 0
    while at < len(rows):  # uneven appends, some crossing shard boundaries
        n = int(rng.integers(1, 2 * chunk * per_shard + 2))
        piece = rows[at : at + n]
        if rng.integers(2):
            writer.append(piece)
        else:  # the same rows as pieces of 1-3 rows, arrays and bytes (no join)
            cuts = np.cumsum(rng.integers(1, 4, size=len(piece)))
            parts = np.split(piece, cuts[cuts < len(piece)])
            writer.append_parts(p.tobytes() if i % 2 else p for i, p in enumerate(parts))
        at += n
    info = writer.finish()
    writes.put("zarr.json", group_metadata({}))
    writes.commit()
    return {i.key: store.get(i.key) for i in store.list("")}, info.shards


@pytest.mark.parametrize("compressor", [None, "zstd"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}{c[1]}x{c[4]}/{c[2]}/{c[3]}")
def test_objects_match_zarr_byte_for_byte(
    case: tuple[str, tuple[int, ...], int, int, int], compressor: str | None
) -> None:
    dtype, inner, chunk, per_shard, n = case
    rows = _rows(dtype, inner, n, seed=n)
    theirs = _zarr_objects(dtype, inner, chunk, per_shard, rows, compressor)
    ours, shards = _our_objects(dtype, inner, chunk, per_shard, rows, compressor, seed=n + 1)
    shard_keys = sorted(k for k in theirs if "/c/" in k)
    assert len(shard_keys) == -(-n // (chunk * per_shard)) == len(shards)
    assert sorted(ours) == sorted(theirs)
    for key in sorted(theirs):
        assert ours[key] == theirs[key], key
    # the recorded sizes, tables and digests describe the stored bytes
    for s, key in enumerate(sorted(shard_keys, key=lambda k: int(k.split("/")[2]))):
        data = theirs[key]
        assert shards[s].nbytes == len(data)
        assert shards[s].table == ShardInfo.table_of(data[-tail_nbytes(per_shard):], per_shard)
    # and zarr reads back the rows
    back = zarr.open_group(store=ZarrStoreAdapter(_store_of(ours)), mode="r")["x"][:]
    np.testing.assert_array_equal(back, rows)


def _store_of(objects: dict[str, bytes]) -> MemoryStore:
    store = MemoryStore()
    for key, data in objects.items():
        store.put(key, data)
    return store


def test_raw_shard_is_built_in_the_callers_buffer() -> None:
    """A raw shard is a view of the buffer the rows were written into: no copy of the rows."""
    buffer = np.zeros(4 * 8 * 2 + tail_nbytes(2), np.uint8)
    buffer[:40] = np.arange(40, dtype=np.uint8)
    shard = encode_shard(buffer, 40, 32, 2, None)
    assert np.shares_memory(np.frombuffer(shard.data, np.uint8), buffer)
    assert len(shard.data) == 64 + tail_nbytes(2)
    assert bytes(shard.data[40:64]) == bytes(24)  # the last chunk's padding


@pytest.mark.parametrize(
    ("nbytes", "size", "match"),
    [(0, 100, "1 to 32 bytes"), (33, 100, "1 to 32 bytes"), (8, 20, "smaller than a raw shard")],
)
def test_bad_arguments_are_refused(nbytes: int, size: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        encode_shard(np.zeros(size, np.uint8), nbytes, 16, 2, None)
    with pytest.raises(ValueError, match="unknown compressor"):
        encode_shard(np.zeros(100, np.uint8), 8, 16, 2, "lz4")


DTYPES = ["|b1", "|i1", "<i2", "<i4", "<i8", "|u1", "<u2", "<u4", "<u8", "<f2", "<f4", "<f8",
          "<c8", "<c16"]


@pytest.mark.parametrize("compressor", [None, "zstd"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_metadata_matches_zarr_for_every_dtype(dtype: str, compressor: str | None) -> None:
    """Every dtype the writer accepts: the array's and the group's zarr.json as zarr writes
    them (attributes as the writer sets them on its groups)."""
    store = MemoryStore()
    group = zarr.open_group(store=ZarrStoreAdapter(store), mode="w", attributes={"dataloader": 1})
    array = group.create_array(
        "x", shape=(0, 2, 3), dtype=dtype, chunks=(5, 2, 3), shards=(35, 2, 3),
        compressors=[ZstdCodec(level=1)] if compressor else None, fill_value=0,
        config={"write_empty_chunks": True},
    )
    array.resize((12, 2, 3))
    ours = array_metadata(np.dtype(dtype), (12, 2, 3), 5, 7, compressor)
    assert ours == store.get("x/zarr.json")
    assert group_metadata({"dataloader": 1}) == store.get("zarr.json")


def test_metadata_refuses_what_it_cannot_encode() -> None:
    with pytest.raises(ValueError, match="no zarr encoding"):
        array_metadata(np.dtype(">i4"), (3,), 1, 1, None)
    with pytest.raises(ValueError, match="no zarr encoding"):
        array_metadata(np.dtype("U3"), (3,), 1, 1, None)
    with pytest.raises(ValueError, match="unknown compressor"):
        array_metadata(np.dtype("<i4"), (3,), 1, 1, "gzip")


def test_a_piece_that_is_not_whole_rows_is_refused() -> None:
    writer = ArrayWriter(ObjectWrites(MemoryStore()), "x", np.dtype("<i4"), (3,), 2, 2, None)
    with pytest.raises(ValueError, match="not a whole number of 12-byte rows"):
        writer.append_parts([bytes(12), bytes(13)])
    with pytest.raises(ValueError, match=r"rows of shape \(2,\), expected \(3,\)"):
        writer.append(np.zeros((1, 2), np.int32))
