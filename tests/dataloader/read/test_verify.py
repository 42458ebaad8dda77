"""`ckpt-data verify` checks what a plain zarr reader relies on (shard index tails read from the
object's end, every group and array zarr.json, every chunk), tied to what zarr-python reads."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import google_crc32c
import numpy as np
import pytest
import zarr

import dataloader
from ckptstore.stores import open_store
from dataloader.cli import main
from dataloader.format import DatasetIndex
from dataloader.format.zarr_adapter import ZarrStoreAdapter
from tests.dataloader.conftest import make_samples

N, R = 64, 16  # N % R == 0: the offsets arrays' last row (N) sits alone in chunk N // R


def _write(path: Path, **kw: object) -> list[dict]:
    samples = make_samples(N, seed=3)
    dataloader.write_dataset(str(path), samples, schema={"image": "fixed"}, rows_per_chunk=R,
                             data_chunk_bytes=512, shard_bytes=4096, **kw)
    return samples


def _verify(capsys: pytest.CaptureFixture[str], path: Path, *extra: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["verify", str(path), "--no-progress", *extra])
    out, err = capsys.readouterr()
    return code, out, err


def _failed(capsys: pytest.CaptureFixture[str], path: Path, *needles: str) -> str:
    """verify exits 1; every stderr line is a 'verify failed' problem; needles all appear."""
    code, _, err = _verify(capsys, path)
    assert code == 1, err
    lines = err.splitlines()
    assert lines and all(x.startswith("ckpt-data: verify failed: ") for x in lines), err
    for needle in needles:
        assert needle in err, err
    return err


def _zarr_rows(path: Path) -> dict[str, list]:
    """Every field of every sample, as zarr-python reads the stored arrays."""
    g = zarr.open_group(store=ZarrStoreAdapter(open_store(str(path))), mode="r")

    def cut(f: str) -> list[np.ndarray]:
        offsets, data = g[f"{f}/offsets"][:], g[f"{f}/data"][:]
        return [data[a:b] for a, b in zip(offsets[:-1], offsets[1:])]

    return {
        "id": list(g["id"][:]), "score": list(g["score"][:]), "image": list(g["image"][:]),
        "tokens": cut("tokens"), "blob": [bytes(b) for b in cut("blob")],
        "text": [bytes(t).decode() for t in cut("text")],
    }


def _equal_rows(rows: dict[str, list], samples: list[dict]) -> bool:
    return all(
        len(rows[k]) == len(samples)
        and all(np.array_equal(np.asarray(x), np.asarray(s[k])) for x, s in zip(rows[k], samples))
        for k in samples[0]
    )


def _rewrite_tail(shard: Path, chunks_per_shard: int, edit: Callable[[np.ndarray], None]) -> None:
    """Edit the (offset, nbytes) pairs of a shard's index tail; the CRC-32C is made valid."""
    raw = bytearray(shard.read_bytes())
    n = 16 * chunks_per_shard + 4
    table = np.frombuffer(bytes(raw[-n:-4]), "<u8").reshape(-1, 2).copy()
    edit(table)
    pairs = table.tobytes()
    raw[-n:] = pairs + int(google_crc32c.value(pairs)).to_bytes(4, "little")
    shard.write_bytes(bytes(raw))


def _index(path: Path) -> DatasetIndex:
    return DatasetIndex.from_bytes((path / "dataset.json").read_bytes())


def test_zarr_reads_the_verified_dataset_and_a_rewritten_shard_index_is_found(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ds = tmp_path / "ds"
    samples = _write(ds)
    code, out, _ = _verify(capsys, ds)
    assert code == 0 and "verified" in out
    assert _equal_rows(_zarr_rows(ds), samples)  # what verify passed, zarr reads correctly
    shard = ds / "id" / "c" / "0"
    good = shard.read_bytes()
    per = _index(ds).arrays["id"].chunks_per_shard

    def swap(t: np.ndarray) -> None:
        t[[0, 1]] = t[[1, 0]]

    _rewrite_tail(shard, per, swap)  # a valid CRC-32C, but not the tail dataset.json records
    assert list(_zarr_rows(ds)["id"][:R]) == list(range(R, 2 * R))  # zarr reads wrong rows
    assert [int(s["id"]) for s in dataloader.StreamingDataset(str(ds))] == list(range(N))
    _failed(capsys, ds, f"{ds}/id/c/0", "array 'id'", "shard index", "digest")
    # bytes appended after the tail: zarr finds its index at the new end
    shard.write_bytes(good + b"\0" * 16)
    with pytest.raises(Exception):  # noqa: B017 - zarr's own error for a bad index checksum
        _zarr_rows(ds)
    _failed(capsys, ds, f"{ds}/id/c/0", f"{len(good) + 16:,} bytes", f"records {len(good):,}",
            "CRC-32C")
    shard.write_bytes(good)
    assert _verify(capsys, ds)[0] == 0


def test_every_chunk_zarr_reads_is_checked(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """The offsets arrays' last row (the data length) is in a chunk no block reads: zarr
    reads it for the last sample, so verify checks it."""
    ds = tmp_path / "ds"
    samples = _write(ds)
    a = _index(ds).arrays["tokens/offsets"]
    last = N // R
    assert a.num_chunks == last + 1
    assert a.shards[0].table is not None
    off, n = a.shards[0].table[last]  # type: ignore[misc]
    shard = ds / "tokens" / "offsets" / "c" / "0"
    raw = bytearray(shard.read_bytes())
    raw[off] ^= 0x01
    shard.write_bytes(bytes(raw))
    assert not np.array_equal(_zarr_rows(ds)["tokens"][-1], samples[-1]["tokens"])
    err = _failed(capsys, ds, f"{ds}/tokens/offsets/c/0", f"chunk {last} (bytes {off}..{off + n})",
                  "does not match its digest")
    assert err.count("\n") == 1


@pytest.mark.parametrize("partitioned", [False, True])
def test_every_group_zarr_json_is_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          partitioned: bool) -> None:
    ds = tmp_path / "ds"
    _write(ds, **({"workers": 2, "partition_rows": 32} if partitioned else {}))
    root = ds / "parts" / "000001" if partitioned else ds
    assert _verify(capsys, ds)[0] == 0
    (root / "zarr.json").write_bytes(b"")  # truncated to zero bytes
    (root / "text" / "zarr.json").write_text(
        json.dumps({"zarr_format": 3, "node_type": "array", "attributes": {}}))
    (root / "blob" / "zarr.json").unlink()
    group = json.loads((root / "tokens" / "zarr.json").read_text())
    (root / "tokens" / "zarr.json").write_text(json.dumps(
        {**group, "consolidated_metadata": {"kind": "inline", "metadata": {}}, "extra": 1}))
    err = _failed(capsys, ds, f"{root}/zarr.json: empty (0 bytes)",
                  f"{root}/text/zarr.json: node_type is 'array', expected 'group'",
                  f"{root}/blob/zarr.json: missing",
                  f"{root}/tokens/zarr.json: consolidated_metadata",
                  f"{root}/tokens/zarr.json: unknown key 'extra'")
    assert err.count("\n") == 5


def test_every_array_zarr_json_key_a_reader_uses_is_checked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ds = tmp_path / "ds"
    _write(ds, compression="zstd")
    meta = ds / "id" / "zarr.json"
    good = json.loads(meta.read_text())
    codecs = good["codecs"]
    inner = codecs[0]["configuration"]["codecs"]
    bad_zstd = [{**codecs[0], "configuration": {**codecs[0]["configuration"], "codecs": [
        inner[0], {"name": "zstd", "configuration": {"level": "high", "checksum": False}}]}}]
    cases: list[tuple[dict, str]] = [
        ({**good, "fill_value": 7}, "fill_value is 7"),
        ({**good, "codecs": bad_zstd}, "codecs is"),
        ({**good, "dimension_names": [1]}, "dimension_names"),
        ({**good, "attributes": []}, "attributes must be a JSON object"),
        ({**good, "shape": [N + 1]}, "shape is [65]"),
        ({k: v for k, v in good.items() if k != "fill_value"}, "fill_value is None"),
        ({**good, "storage_transformers": [{"name": "x"}]}, "storage_transformers"),
        ({**good, "my_extension": {"must_understand": True}}, "unknown key 'my_extension'"),
    ]
    for doc, needle in cases:
        meta.write_text(json.dumps(doc))
        err = _failed(capsys, ds, f"{ds}/id/zarr.json: {needle}")
        assert err.count("\n") == 1, (needle, err)
    # what a zarr reader ignores or decodes the same way is accepted
    level9 = [{**codecs[0], "configuration": {**codecs[0]["configuration"], "codecs": [
        inner[0], {"name": "zstd", "configuration": {"level": 9, "checksum": True}}]}}]
    meta.write_text(json.dumps({**good, "attributes": {"note": "mine"}, "codecs": level9,
                                "dimension_names": ["row"], "x": {"must_understand": False}}))
    assert _verify(capsys, ds)[0] == 0


def test_verify_json_lists_every_problem(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    ds = tmp_path / "ds"
    _write(ds)
    (ds / "score" / "c" / "0").unlink()
    meta = json.loads((ds / "image" / "zarr.json").read_text())
    (ds / "image" / "zarr.json").write_text(json.dumps({**meta, "data_type": "int8"}))
    code, out, err = _verify(capsys, ds, "--json")
    report = json.loads(out)
    assert code == 1 and report["verified"] is False and report["problem_count"] == 2
    assert any("score/c/0" in p and "missing" in p for p in report["problems"])
    assert any("image/zarr.json: data_type is 'int8'" in p for p in report["problems"])
    assert err.count("ckpt-data: verify failed: ") == 2
    (ds / "dataset.json").write_bytes(b"{}")
    code, out, err = _verify(capsys, ds)
    assert code == 1 and "dataset.json" in err
    (ds / "dataset.json").unlink()
    code, _, err = _verify(capsys, ds)
    assert code == 2 and "no dataset" in err
