"""The read path: every value comes back, integrity, missing shards, cache, range merging."""

from __future__ import annotations

import json
import uuid

import numpy as np
import pytest

import dataloader
from ckptstore import IntegrityError, StoreError, open_store
from ckptstore.toolkit import canonical_json, merge_ranges
from dataloader.format import DatasetIndex
from dataloader.read.cache import ChunkCache
from tests.dataloader.conftest import make_samples


def _check_sample(got: dict, want: dict) -> None:
    assert int(got["id"]) == want["id"]
    assert float(got["score"]) == want["score"]
    assert np.array_equal(got["tokens"], want["tokens"]) and got["tokens"].dtype == np.int32
    assert np.array_equal(got["image"], want["image"])
    assert got["blob"] == want["blob"]
    assert got["text"] == want["text"]


def test_every_sample_round_trips_in_order(small_uri, small_samples):
    ds = dataloader.StreamingDataset(small_uri, io_threads=2)
    got = list(ds)
    assert len(got) == len(small_samples)
    for g, w in zip(got, small_samples, strict=True):
        _check_sample(g, w)


def test_loader_batches_collate_columns(small_uri, small_samples):
    loader = dataloader.StreamingLoader(dataloader.StreamingDataset(small_uri), batch_size=50)
    batches = list(loader)
    assert [len(b["id"]) for b in batches] == [50] * 10 + [23]
    b = batches[1]
    assert b["image"].shape == (50, 2, 3) and b["id"].dtype == np.int64
    assert isinstance(b["tokens"], list) and isinstance(b["blob"][0], bytes)
    for j, i in enumerate(b["_index"]):
        assert b["text"][j] == small_samples[i]["text"]


def test_field_subset_reads_only_those_columns(small_uri):
    ds = dataloader.StreamingDataset(small_uri, fields=["id"])
    assert set(next(iter(ds))) == {"_index", "id"}
    with pytest.raises(KeyError):
        dataloader.StreamingDataset(small_uri, fields=["nope"])


def _copy(uri: str) -> str:
    src, dst_uri = open_store(uri), f"memory://copy-{uuid.uuid4().hex}"
    dst = open_store(dst_uri)
    for info in src.list():
        dst.put(info.key, src.get(info.key))
    return dst_uri


def test_corrupt_chunk_raises_integrity_error(small_uri):
    uri = _copy(small_uri)
    store = open_store(uri)
    key = "tokens/data/c/0"
    data = bytearray(store.get(key))
    data[10] ^= 0xFF
    store.put(key, bytes(data))
    loader = dataloader.StreamingLoader(
        dataloader.StreamingDataset(uri), batch_size=8, num_workers=2
    )
    with pytest.raises(IntegrityError, match="tokens/data"):
        list(loader)


def test_corrupt_shard_index_raises_integrity_error(small_uri):
    """Where the index records no shard tables (datasets written before them), the reader
    fetches each shard index and refuses a corrupt one. Where it records them, the stored
    tail is not read: the samples come out whole (each chunk checked against its digest)."""
    uri = _copy(small_uri)
    store = open_store(uri)
    key = "id/c/0"
    data = bytearray(store.get(key))
    data[-10] ^= 0x01
    store.put(key, bytes(data))
    assert len(list(dataloader.StreamingDataset(uri, io_threads=0))) == 523
    doc = json.loads(store.get("dataset.json"))
    for a in doc["arrays"].values():
        for shard in a["shards"]:
            del shard["table"]
    body = {k: v for k, v in doc.items() if k != "fingerprint"}
    store.put("dataset.json", canonical_json(
        {**body, "fingerprint": DatasetIndex.compute_fingerprint(body)}
    ))
    with pytest.raises(IntegrityError, match="shard index"):
        list(dataloader.StreamingDataset(uri, io_threads=0))


def test_missing_shard_gives_clear_error(small_uri):
    uri = _copy(small_uri)
    open_store(uri).delete("id/c/1")
    loader = dataloader.StreamingLoader(
        dataloader.StreamingDataset(uri), batch_size=16, num_workers=2
    )
    with pytest.raises(dataloader.MissingShardError, match=r"id/c/1.*missing"):
        list(loader)


def test_missing_dataset_gives_clear_error(tmp_path):
    with pytest.raises(dataloader.DatasetNotFoundError, match="dataset.json"):
        dataloader.StreamingDataset(str(tmp_path / "nothing"))


def test_transient_corruption_is_retried_once(small_uri, monkeypatch):
    ds = dataloader.StreamingDataset(small_uri)
    calls = {"n": 0}
    real = ds.store.read_into

    def flaky(key, start, out):
        real(key, start, out)
        if calls["n"] == 0 and key.startswith("tokens/data"):
            calls["n"] += 1
            out[0] = out[0] ^ 0xFF  # one bad transfer

    monkeypatch.setattr(ds.store, "read_into", flaky)
    assert len(list(ds)) == 523 and calls["n"] == 1


def test_a_store_failing_on_the_second_try_is_an_outage_not_corruption(small_uri, monkeypatch):
    # a bad transfer, then a server error on the retry: "the data is corrupt" said the
    # IntegrityError, though the stored chunk was whole
    ds = dataloader.StreamingDataset(small_uri)
    real, real_range = ds.store.read_into, ds.store.get_range
    corrupted: list[str] = []

    def bad_transfer(key, start, out):
        real(key, start, out)
        if key.startswith("tokens/data"):
            out[0] = out[0] ^ 0xFF
            corrupted.append(key)

    def server_error(key, start, length):  # the retry of that chunk (index reads go on)
        if corrupted:
            raise StoreError("HTTP 500 InternalError on every attempt")
        return real_range(key, start, length)

    monkeypatch.setattr(ds.store, "read_into", bad_transfer)
    monkeypatch.setattr(ds.store, "get_range", server_error)
    with pytest.raises(StoreError, match="HTTP 500") as caught:
        list(ds)
    assert not isinstance(caught.value, IntegrityError)


def test_local_cache_serves_second_pass_and_evicts(tmp_path, small_uri):
    cache_dir = tmp_path / "cache"
    ds = dataloader.StreamingDataset(small_uri, cache_dir=str(cache_dir), cache_limit_bytes=1 << 20)
    first = [s["id"] for s in ds]
    read_after_first = ds.metrics.bytes_read
    second = [s["id"] for s in ds]
    assert first == second
    assert ds.metrics.bytes_read == read_after_first  # all from the cache
    assert ds.metrics.cache_hits > 0
    small = ChunkCache(cache_dir, limit_bytes=2000)
    assert small.size <= 2000 and small.evictions > 0


def test_cache_rejects_a_tampered_file(tmp_path):
    c = ChunkCache(tmp_path, 1 << 20)
    from ckptstore.toolkit import digest

    data = b"hello world" * 10
    key = digest(data)
    c.put(key, data)
    assert c.get(key) == data
    (tmp_path / key[:2] / key).write_bytes(b"x" * len(data))
    assert c.get(key) is None and not (tmp_path / key[:2] / key).exists()


def test_range_merging_reduces_requests():
    parts = [(0, 10, "a"), (10, 10, "b"), (25, 5, "c"), (1000, 10, "d")]
    merged = merge_ranges(parts, gap=8, max_length=100)
    assert [(m.start, m.length) for m in merged] == [(0, 30), (1000, 10)]
    assert [p[2] for p in merged[0].parts] == ["a", "b", "c"]
    assert len(merge_ranges(parts, gap=0, max_length=100)) == 3
    assert len(merge_ranges(parts, gap=10_000, max_length=20)) == 3


def test_sequential_read_merges_chunks_into_few_requests(tmp_path):
    uri = str(tmp_path / "ds")
    dataloader.write_dataset(uri, make_samples(400), rows_per_chunk=10, shard_bytes=1 << 20)
    ds = dataloader.StreamingDataset(uri, shuffle_window=400)
    n = sum(1 for _ in ds)
    assert n == 400
    chunks = sum(len(s.chunks) for a in ds.index.arrays.values() for s in a.shards)
    assert ds.metrics.requests < chunks / 4
