"""Partitioned datasets: write_partition / commit_dataset / gc_partitions, the threaded
write_dataset(workers=N) built on them, and small datasets that are not padded."""

from __future__ import annotations

import json
import multiprocessing
import os
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

import dataloader
from ckptstore import open_store
from ckptstore.errors import FormatError, ObjectExistsError
from ckptstore.stores import MemoryStore
from dataloader.read.blocks import BlockReader
from tests.dataloader.conftest import ids_of, make_samples
from tests.dataloader.resume_contract import assert_resumes_exactly

OPTS = {"schema": {"image": "fixed"}, "rows_per_chunk": 16, "data_chunk_bytes": 512,
        "shard_bytes": 4096}
SIZES = [40, 0, 57, 16, 23]  # partition 1 is empty; 40 and 57 end in a short block


def _split(samples: list[dict], sizes: list[int]) -> list[list[dict]]:
    out, at = [], 0
    for n in sizes:
        out.append(samples[at : at + n])
        at += n
    return out


def _uri() -> str:
    return f"memory://parts-{uuid.uuid4().hex}"


def _read_all(uri: str, **kw) -> list[dict]:
    ds = dataloader.StreamingDataset(uri, **kw)
    out: list[dict] = []
    for b in dataloader.StreamingLoader(ds, batch_size=7):
        for j in range(len(b["_index"])):
            out.append({k: (v[j] if not isinstance(v, dict) else v) for k, v in b.items()})
    return out


def _same(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g["id"] == w["id"] and g["score"] == w["score"] and g["text"] == w["text"]
        assert g["blob"] == w["blob"]
        np.testing.assert_array_equal(g["tokens"], w["tokens"])
        np.testing.assert_array_equal(g["image"], w["image"])


@pytest.fixture(scope="module")
def samples() -> list[dict]:
    return make_samples(sum(SIZES), seed=4)


def _write_all(uri: str, samples: list[dict], order: list[int]) -> list[dict]:
    parts = _split(samples, SIZES)
    return [dataloader.write_partition(uri, p, parts[p], **OPTS) for p in order]


def test_any_order_same_dataset_reads_back(samples: list[dict]) -> None:
    a, b = _uri(), _uri()
    ra = _write_all(a, samples, [0, 1, 2, 3, 4])
    rb = _write_all(b, samples, [4, 2, 0, 3, 1])
    assert json.loads(json.dumps(ra)) == ra  # receipts are plain JSON
    ia = dataloader.commit_dataset(a, ra, {"source": "test"})
    ib = dataloader.commit_dataset(b, list(reversed(rb)), {"source": "test"})
    assert ia.fingerprint == ib.fingerprint
    assert ia.num_samples == len(samples) and len(ia.partitions) == 4  # the empty one skipped
    assert list(ia.block_rows()) == [16, 16, 8, 16, 16, 16, 9, 16, 16, 7]
    got = _read_all(a)
    assert [int(g["_index"]) for g in got] == list(range(len(samples)))
    _same(got, samples)
    assert open_store(a).get("dataset.json") == open_store(b).get("dataset.json")


def test_partitioned_dataset_shuffles_and_resumes(samples: list[dict]) -> None:
    uri = _uri()
    dataloader.commit_dataset(uri, _write_all(uri, samples, [0, 1, 2, 3, 4]))
    ds = dataloader.StreamingDataset(uri, shuffle=True, seed=3, shuffle_window=40)
    ids = ids_of(dataloader.StreamingLoader(ds, batch_size=5))
    assert sorted(ids) == list(range(len(samples))) and ids != sorted(ids)

    def make() -> dataloader.StreamingLoader:
        d = dataloader.StreamingDataset(uri, shuffle=True, seed=3, shuffle_window=40)
        return dataloader.StreamingLoader(d, batch_size=5, num_workers=2)

    assert_resumes_exactly(make, lambda b: b["id"].tolist(), stops=[0, 3, 17])
    toks = dataloader.TokenDataset(uri, 8, field="tokens")
    n = sum(len(b["tokens"]) for b in dataloader.StreamingLoader(toks, batch_size=4))
    assert n == sum(len(s["tokens"]) for s in samples) // 8


def test_rewriting_a_partition_is_harmless(samples: list[dict]) -> None:
    uri = _uri()
    receipts = _write_all(uri, samples, [0, 1, 2, 3, 4])
    again = dataloader.write_partition(uri, 2, _split(samples, SIZES)[2], **OPTS)
    assert again == receipts[2]
    index = dataloader.commit_dataset(uri, [*receipts, again])  # a duplicate report
    _same(_read_all(uri), samples)
    # committing the same receipts again is a no-op; a different dataset is refused
    assert dataloader.commit_dataset(uri, receipts).fingerprint == index.fingerprint
    with pytest.raises(ObjectExistsError):
        dataloader.commit_dataset(uri, receipts[:2])


def test_commit_checks_receipts_against_the_store(samples: list[dict]) -> None:
    uri = _uri()
    receipts = _write_all(uri, samples, [0, 1, 2, 3, 4])
    store = open_store(uri)
    # a shard that is missing
    key = "parts/000003/id/c/0"
    saved = store.get(key)
    store.delete(key)
    with pytest.raises(FormatError, match="missing"):
        dataloader.commit_dataset(uri, receipts)
    # a shard that differs (same size, other bytes)
    store.put(key, saved[:-1] + bytes([saved[-1] ^ 1]))
    with pytest.raises(FormatError, match="does not match"):
        dataloader.commit_dataset(uri, receipts)
    store.put(key, saved)
    # a receipt that lies about a size, or names another partition's prefix
    bad = json.loads(json.dumps(receipts[3]))
    bad["arrays"]["id"]["shards"][0]["nbytes"] += 8
    with pytest.raises(FormatError):
        dataloader.commit_dataset(uri, [*receipts[:3], bad])
    bad = {**receipts[3], "prefix": "parts/000009"}
    with pytest.raises(FormatError, match="prefix"):
        dataloader.commit_dataset(uri, [bad])
    with pytest.raises(FormatError, match="receipt"):
        dataloader.commit_dataset(uri, [{"partition": 0}])
    # a partition written with another schema
    other = [{**s, "score": int(s["id"])} for s in _split(samples, SIZES)[4]]
    odd = dataloader.write_partition(uri, 7, other, **OPTS)
    with pytest.raises(FormatError, match="schema"):
        dataloader.commit_dataset(uri, [receipts[0], odd])
    with pytest.raises(ValueError, match="no samples"):
        dataloader.commit_dataset(uri, [receipts[1]])
    assert not store.exists("dataset.json")  # nothing above committed anything
    dataloader.commit_dataset(uri, receipts)
    _same(_read_all(uri), samples)


def test_tampered_partitioned_index_is_refused(samples: list[dict]) -> None:
    uri = _uri()
    dataloader.commit_dataset(uri, _write_all(uri, samples, [0, 1, 2, 3, 4]))
    store = open_store(uri)
    raw = store.get("dataset.json")
    for change in (
        lambda d: d["partitions"].reverse(),
        lambda d: d["partitions"][0].update(prefix="../x"),
        lambda d: d.update(num_samples=d["num_samples"] + 1),
        lambda d: d["partitions"][1].update(num_samples=0),
    ):
        d = json.loads(raw)
        change(d)
        store.put("dataset.json", json.dumps(d).encode())
        with pytest.raises(FormatError):
            dataloader.StreamingDataset(uri)
    store.put("dataset.json", raw)
    dataloader.StreamingDataset(uri)


def test_gc_removes_old_orphans_only(samples: list[dict]) -> None:
    uri = _uri()
    receipts = _write_all(uri, samples, [0, 1, 2, 3, 4])
    parts = _split(samples, SIZES)
    dataloader.write_partition(uri, 11, parts[0], **OPTS)  # an orphan (never committed)
    store = open_store(uri)
    assert dataloader.gc_partitions(uri, grace_seconds=3600) == []  # all young: kept
    # before any commit every partition is an orphan, but only old ones go
    later = max(i.mtime for i in store.list("parts/")) + 7200
    assert dataloader.gc_partitions(uri, grace_seconds=3600, now=later, dry_run=True) == [
        "parts/000000", "parts/000002", "parts/000003", "parts/000004", "parts/000011"]
    dataloader.commit_dataset(uri, receipts)
    assert dataloader.gc_partitions(uri, grace_seconds=3600, now=later) == ["parts/000011"]
    assert not list(store.list("parts/000011/"))
    assert dataloader.gc_partitions(uri, grace_seconds=3600, now=later) == []
    _same(_read_all(uri), samples)


def test_write_dataset_workers_same_bytes(tmp_path: Path, samples: list[dict]) -> None:
    def files(root: Path) -> dict[str, bytes]:
        return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}

    opts = {**OPTS, "partition_rows": 48}  # three blocks per partition
    fps = set()
    for w in (1, 2, 4):
        idx = dataloader.write_dataset(str(tmp_path / f"w{w}"), samples, workers=w, **opts)
        fps.add(idx.fingerprint)
    idx = dataloader.write_dataset(
        str(tmp_path / "p2"), samples, workers=2, executor="processes", **opts)
    fps.add(idx.fingerprint)
    assert len(fps) == 1
    assert files(tmp_path / "w1") == files(tmp_path / "w2") == files(tmp_path / "w4")
    assert files(tmp_path / "w1") == files(tmp_path / "p2")
    _same(_read_all(str(tmp_path / "w2")), samples)
    # defaults (rows_per_chunk chosen from the data) agree too; overwrite is supported
    a = dataloader.write_dataset(str(tmp_path / "d1"), samples, workers=1)
    b = dataloader.write_dataset(str(tmp_path / "d2"), iter(samples), workers=3)
    assert a.fingerprint == b.fingerprint
    with pytest.raises(ObjectExistsError):
        dataloader.write_dataset(str(tmp_path / "d2"), samples, workers=2)
    c = dataloader.write_dataset(
        str(tmp_path / "d2"), samples[:5], workers=2, overwrite=True, metadata={"v": 2})
    assert c.num_samples == 5 and dataloader.StreamingDataset(str(tmp_path / "d2")).num_samples == 5
    with pytest.raises(TypeError, match="sample 3"):
        dataloader.write_dataset(_uri(), [*samples[:3], "nope"], workers=2)
    with pytest.raises(ValueError, match="no samples"):
        dataloader.write_dataset(_uri(), [], workers=2)
    with pytest.raises(ValueError, match="memory"):
        dataloader.write_dataset(_uri(), samples, workers=2, executor="processes")
    with pytest.raises(TypeError, match="sample 52, field 'id'"):  # found by the probe
        bad = [*samples[:52], {**samples[52], "id": "x"}]
        dataloader.write_dataset(str(tmp_path / "bad"), bad, workers=2, executor="processes")
    bad = samples * 9 + [{**samples[0], "id": "x"}]  # past the probe: found by a child
    with pytest.raises(RuntimeError, match="TypeError: sample 1224, field 'id'"):
        dataloader.write_dataset(str(tmp_path / "bad"), bad, workers=2, executor="processes",
                                 **opts)
    with pytest.raises(TypeError, match="sample 1224, field 'id'"):
        dataloader.write_dataset(_uri(), bad, workers=2, **opts)


def test_write_dataset_workers_on_s3(s3_any_uri: str, s3_endpoint: str,
                                     samples: list[dict]) -> None:
    so = {"endpoint_url": s3_endpoint}
    idx = dataloader.write_dataset(s3_any_uri, samples, workers=2, store_options=so,
                                   partition_rows=64, **OPTS)
    assert len(idx.partitions) == 3
    _same(_read_all(s3_any_uri, store_options=so), samples)


def _mp_task(args: tuple[str, str, int, int, int]) -> None:
    """One process writes one partition of a source it can address by sample number and
    leaves its receipt as a JSON file (nothing but the job's numbers crosses processes)."""
    uri, receipts_dir, p, lo, hi = args
    part = make_samples(hi, seed=4)[lo:hi]
    receipt = dataloader.write_partition(uri, p, part, first_sample=lo, **OPTS)
    Path(receipts_dir, f"{p}.json").write_text(json.dumps(receipt))


def test_partitions_written_by_processes(tmp_path: Path, samples: list[dict]) -> None:
    uri, receipts_dir = str(tmp_path / "mp"), tmp_path / "receipts"
    receipts_dir.mkdir()
    bounds = np.cumsum([0, *SIZES])
    jobs = [(uri, str(receipts_dir), p, int(bounds[p]), int(bounds[p + 1]))
            for p in range(len(SIZES))]
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        pool.map(_mp_task, jobs)
    receipts = [json.loads(f.read_text()) for f in receipts_dir.glob("*.json")]
    by_threads = _uri()
    want = dataloader.commit_dataset(by_threads, _write_all(by_threads, samples, [0, 1, 2, 3, 4]))
    assert dataloader.commit_dataset(uri, receipts).fingerprint == want.fingerprint
    _same(_read_all(uri), samples)


def test_small_dataset_is_not_padded(tmp_path: Path) -> None:
    root = tmp_path / "small"
    idx = dataloader.write_dataset(str(root), ({"v": i, "f": i / 3} for i in range(50)))
    assert idx.rows_per_chunk == 50 and idx.num_blocks == 1
    size = sum(f.stat().st_size for f in root.rglob("*") if f.is_file())
    assert size < 4096, size
    text = dataloader.write_dataset(str(tmp_path / "t"), ({"s": f"w{i}"} for i in range(50)))
    assert text.arrays["s/data"].chunk_shape[0] <= 200
    size = sum(f.stat().st_size for f in (tmp_path / "t").rglob("*") if f.is_file())
    assert size < 6144, size
    ds = dataloader.StreamingDataset(str(root))
    assert [float(x) for b in dataloader.StreamingLoader(ds, batch_size=8) for x in b["f"]] == [
        i / 3 for i in range(50)]
    assert os.path.getsize(root / "dataset.json") < 2048


def test_partition_numbers_order_numerically(samples: list[dict]) -> None:
    uri = _uri()
    a, b = samples[:30], samples[30:45]
    receipts = [dataloader.write_partition(uri, 1_000_000, b, **OPTS),
                dataloader.write_partition(uri, 999_999, a, **OPTS)]
    index = dataloader.commit_dataset(uri, receipts)
    assert [k for k, _ in index.partitions] == ["parts/999999", "parts/1000000"]
    _same(_read_all(uri), samples[:45])
    store = open_store(uri)
    d = json.loads(store.get("dataset.json"))
    d["partitions"][0]["prefix"] = "parts/0999999"  # same number, not the canonical spelling
    store.put("dataset.json", json.dumps(d).encode())
    with pytest.raises(FormatError, match="prefix"):
        dataloader.StreamingDataset(uri)


def test_concurrent_duplicate_partition_writes(tmp_path: Path, samples: list[dict]) -> None:
    """Two copies of the same task (a speculative duplicate) write at the same time."""
    from concurrent.futures import ThreadPoolExecutor

    uri = str(tmp_path / "dup")
    parts = _split(samples, SIZES)
    with ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(dataloader.write_partition, uri, p, parts[p], **OPTS)
                for p in (0, 2, 2, 3, 3, 4, 0)]
        receipts = [f.result() for f in futs]
    assert receipts[1] == receipts[2] and receipts[3] == receipts[4]
    dataloader.commit_dataset(uri, receipts)
    _same(_read_all(uri), [s for p in (0, 2, 3, 4) for s in parts[p]])


def test_partition_zarr_metadata_checked_on_first_read(samples: list[dict]) -> None:
    """Opening a partitioned dataset reads dataset.json only; a partition's zarr.json files
    are checked before any of its chunks is decoded, so a forged one is still refused."""
    uri = _uri()
    dataloader.commit_dataset(uri, _write_all(uri, samples, [0, 1, 2, 3, 4]))
    store = open_store(uri)
    key = "parts/000003/id/zarr.json"
    z = json.loads(store.get(key))
    z["data_type"] = "uint64"  # same size: digests would still match
    store.put(key, json.dumps(z).encode())
    ds = dataloader.StreamingDataset(uri)  # opens: partition 3 is not read yet
    assert ds.reader._parts[0]._meta_checked is False
    with pytest.raises(FormatError, match="data_type"):
        _read_all(uri)
    ok = [s for s in _read_all(uri, fields=["text"])]  # other arrays of partition 3 are fine
    assert len(ok) == sum(SIZES)


class _ChecksWaitForReads(MemoryStore):
    """A store whose zarr.json reads wait (up to 2 s) until a chunk read has started: a
    reader that overlaps them proceeds at once, one that reads after the checks waits."""

    def __init__(self) -> None:
        super().__init__()
        self.chunk_read = threading.Event()
        self.overlapped: list[bool] = []
        self.decoded_before_check_ended: list[bool] = []
        self.decodes = 0
        self.armed = False  # set once the dataset is committed (the commit checks too)

    def read_into(self, key: str, start: int, out: memoryview) -> None:
        if self.armed and key.endswith("/zarr.json") and key.startswith("parts/"):
            self.overlapped.append(self.chunk_read.wait(2))
            time.sleep(0.05)  # the chunk reads finish meanwhile: nothing may decode them yet
            self.decoded_before_check_ended.append(self.decodes > 0)
        elif "/c/" in key:
            self.chunk_read.set()
        super().read_into(key, start, out)


def test_first_window_reads_chunks_with_the_checks(
    samples: list[dict], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With shard tables in dataset.json, a window's chunk reads start together with its
    partitions' zarr.json checks (one round trip), and nothing is decoded before they pass."""
    store = _ChecksWaitForReads()
    dataloader.commit_dataset(store, _write_all(store, samples, [0, 1, 2, 3, 4]))
    store.armed = True
    real = BlockReader._decode

    def counted(self: BlockReader, path: str, data: memoryview) -> np.ndarray:
        store.decodes += 1
        return real(self, path, data)

    monkeypatch.setattr(BlockReader, "_decode", counted)
    ds = dataloader.StreamingDataset(store)
    # threads enough for every request of the first window at once
    got = sum(len(b["_index"]) for b in dataloader.StreamingLoader(ds, batch_size=7,
                                                                   num_workers=64))
    assert got == sum(SIZES)
    assert store.overlapped and all(store.overlapped)
    assert not any(store.decoded_before_check_ended)


def test_a_failed_check_fails_the_overlapped_read(samples: list[dict]) -> None:
    store = _ChecksWaitForReads()
    dataloader.commit_dataset(store, _write_all(store, samples, [0, 1, 2, 3, 4]))
    key = "parts/000000/id/zarr.json"
    z = json.loads(store.get(key))
    z["data_type"] = "uint64"
    store.put(key, json.dumps(z).encode())
    store.armed = True
    ds = dataloader.StreamingDataset(store)
    with pytest.raises(FormatError, match="parts/000000/id/zarr.json.*data_type"):
        list(dataloader.StreamingLoader(ds, batch_size=7, num_workers=64))
    assert store.overlapped and store.decodes == 0
