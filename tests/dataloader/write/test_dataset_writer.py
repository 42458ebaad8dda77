"""Writing datasets: layout, round trip through zarr-python, clear errors for bad samples."""

from __future__ import annotations

import json
import uuid

import numpy as np
import pytest
import zarr

import dataloader
from ckptstore import FormatError, ObjectExistsError, open_store
from ckptstore.toolkit import digest
from dataloader.format import INDEX_KEY, DatasetIndex
from dataloader.format.zarr_adapter import ZarrStoreAdapter


def _uri() -> str:
    return f"memory://w-{uuid.uuid4().hex}"


def test_index_records_counts_digests_and_fingerprint(small_uri, small_samples):
    store = open_store(small_uri)
    raw = store.get(INDEX_KEY)
    doc = json.loads(raw)
    assert doc["num_samples"] == len(small_samples)
    assert doc["fingerprint"] == DatasetIndex.from_bytes(raw).fingerprint
    kinds = {f["name"]: f["kind"] for f in doc["fields"]}
    assert kinds == {
        "id": "scalar",
        "score": "scalar",
        "tokens": "ragged",
        "image": "fixed",
        "blob": "bytes",
        "text": "str",
    }
    idx = DatasetIndex.from_bytes(raw)
    # every recorded chunk digest matches the bytes at the location the shard index gives
    for path, a in idx.arrays.items():
        for s, shard in enumerate(a.shards):
            data = store.get(a.shard_key(s))
            assert len(data) == shard.nbytes
            tail = data[-a.index_nbytes :]
            assert digest(tail) == shard.index_digest
            table = np.frombuffer(tail[:-4], "<u8").reshape(-1, 2)
            for i, d in enumerate(shard.chunks):
                if d is not None:
                    off, n = (int(x) for x in table[i])
                    assert digest(data[off : off + n]) == d, (path, s, i)


def test_zarr_python_reads_the_columns(small_uri, small_samples):
    g = zarr.open_group(store=ZarrStoreAdapter(open_store(small_uri)), mode="r")
    assert list(g["id"][:]) == [s["id"] for s in small_samples]
    assert np.array_equal(g["image"][7], small_samples[7]["image"])
    offs = g["tokens/offsets"][:]
    data = g["tokens/data"][:]
    for i in (0, 100, 522):
        assert np.array_equal(data[offs[i] : offs[i + 1]], small_samples[i]["tokens"])
    boffs, bdata = g["text/offsets"][:], g["text/data"][:]
    assert bytes(bdata[boffs[5] : boffs[6]]).decode() == small_samples[5]["text"]


def test_same_content_same_fingerprint_and_different_content_differs(small_samples):
    a = dataloader.write_dataset(_uri(), small_samples[:50], rows_per_chunk=8)
    b = dataloader.write_dataset(_uri(), small_samples[:50], rows_per_chunk=8)
    c = dataloader.write_dataset(_uri(), small_samples[1:51], rows_per_chunk=8)
    assert a.fingerprint == b.fingerprint != c.fingerprint


def test_zstd_and_fixed_and_multidim_ragged_roundtrip():
    samples = [
        {"m": np.arange(i * 6, dtype=np.float32).reshape(i, 6), "k": np.int16(i)} for i in range(40)
    ]
    uri = _uri()
    dataloader.write_dataset(uri, samples, rows_per_chunk=7, compression="zstd")
    ds = dataloader.StreamingDataset(uri)
    got = list(ds)
    assert len(got) == 40
    for s, g in zip(samples, got, strict=True):
        assert np.array_equal(s["m"], g["m"]) and g["m"].dtype == np.float32
        assert g["k"] == s["k"] and g["k"].dtype == np.int16


@pytest.mark.parametrize(
    ("bad", "exc", "words"),
    [
        ({"id": "x", "v": np.zeros(2)}, TypeError, ["sample 3", "'id'"]),
        ({"id": 1}, ValueError, ["sample 3", "missing", "'v'"]),
        ({"id": 1, "v": np.zeros(2), "z": 1}, ValueError, ["sample 3", "unexpected", "'z'"]),
        ({"id": 1, "v": np.zeros((2, 2))}, ValueError, ["sample 3", "'v'", "dimensions"]),
        ({"id": 1, "v": np.zeros(2, dtype=np.complex64)}, TypeError, ["sample 3", "'v'", "dtype"]),
        ({"id": 1, "v": [1.0, 2.0]}, TypeError, ["sample 3", "'v'", "numpy array"]),
        ({"id": 2**70, "v": np.zeros(2)}, ValueError, ["sample 3", "'id'"]),
        (["not", "a", "dict"], TypeError, ["sample 3", "dict"]),
    ],
)
def test_bad_samples_name_the_sample_and_field(bad, exc, words):
    good = [{"id": i, "v": np.zeros(i, dtype=np.float64)} for i in range(3)]
    with pytest.raises(exc) as info:
        dataloader.write_dataset(_uri(), [*good, bad])
    for w in words:
        assert w in str(info.value)


def test_unsupported_first_value_and_fixed_shape_mismatch():
    with pytest.raises(TypeError, match="sample 0, field 'o'.*unsupported type"):
        dataloader.write_dataset(_uri(), [{"o": object()}])
    with pytest.raises(ValueError, match="sample 1, field 'f'.*shape"):
        dataloader.write_dataset(
            _uri(), [{"f": np.zeros(3)}, {"f": np.zeros(4)}], schema={"f": "fixed"}
        )
    with pytest.raises(ValueError, match="invalid field name"):
        dataloader.write_dataset(_uri(), [{"bad name": 1}])


def test_failed_write_leaves_no_dataset_and_existing_is_not_overwritten(small_samples):
    uri = _uri()
    with pytest.raises(ValueError):
        dataloader.write_dataset(uri, [*small_samples[:30], {"id": 1}], rows_per_chunk=4)
    with pytest.raises(dataloader.DatasetNotFoundError):
        dataloader.StreamingDataset(uri)
    dataloader.write_dataset(uri, small_samples[:10])
    with pytest.raises(ObjectExistsError):
        dataloader.write_dataset(uri, small_samples[:5])
    idx = dataloader.write_dataset(uri, small_samples[:5], overwrite=True)
    assert dataloader.StreamingDataset(uri).num_samples == 5 == idx.num_samples


def test_index_is_json_and_tampering_is_detected(small_uri):
    store = open_store(small_uri)
    raw = store.get(INDEX_KEY)
    doc = json.loads(raw)
    doc["num_samples"] += 1
    copy = _uri()
    s2 = open_store(copy)
    for info in store.list():
        s2.put(info.key, store.get(info.key))
    s2.put(INDEX_KEY, json.dumps(doc).encode())
    with pytest.raises(FormatError, match="fingerprint"):
        dataloader.StreamingDataset(copy)


@pytest.mark.parametrize("workers", [None, 2])
def test_a_write_deletes_nothing_it_did_not_write(tmp_path, workers):
    """Files already in the target that no dataset index lists survive a write, with or
    without overwrite= (zarr's group creation used to delete everything under the target)."""
    target = tmp_path / "ds"
    (target / "notes").mkdir(parents=True)
    (target / "notes" / "readme.txt").write_text("mine")
    (target / "top.bin").write_bytes(b"keep")
    samples = [{"x": i} for i in range(50)]
    dataloader.write_dataset(str(target), samples, workers=workers)
    dataloader.write_dataset(str(target), samples[:20], workers=workers, overwrite=True)
    assert (target / "notes" / "readme.txt").read_text() == "mine"
    assert (target / "top.bin").read_bytes() == b"keep"
    assert [int(s["x"]) for s in dataloader.StreamingDataset(str(target))] == list(range(20))


def test_local_shards_go_out_with_o_direct_and_the_bytes_are_the_same(tmp_path, monkeypatch):
    """Writing to a local folder, raw shards of 1 MiB or more are written with O_DIRECT from
    the writer's page-aligned buffers; with direct_io=False every file is the same."""
    from ckptstore.stores import direct_io

    direct: list[int] = []
    real = direct_io.write_direct

    def counting(fd: int, view: memoryview) -> str | None:
        direct.append(len(view))
        return real(fd, view)

    monkeypatch.setattr(direct_io, "write_direct", counting)
    samples = [{"x": np.full(1024, i, np.int32), "b": bytes([i % 256]) * (i % 700)}
               for i in range(3000)]
    for name, opts in (("direct", None), ("buffered", {"direct_io": False})):
        dataloader.write_dataset(str(tmp_path / name), samples, schema={"x": "fixed"},
                                 workers=2, partition_rows=1000, store_options=opts)
        if name == "direct":
            assert direct and min(direct) >= 1 << 20, direct
            seen = len(direct)
    assert len(direct) == seen  # nothing went direct with direct_io=False
    files = sorted(p.relative_to(tmp_path / "direct") for p in (tmp_path / "direct").rglob("*")
                   if p.is_file())
    assert len(files) > 10
    for f in files:
        assert (tmp_path / "direct" / f).read_bytes() == (tmp_path / "buffered" / f).read_bytes()
    ds = dataloader.StreamingDataset(str(tmp_path / "direct"))
    assert int(ds[2999]["x"][5]) == 2999 and bytes(ds[2999]["b"]) == bytes([2999 % 256]) * 199
