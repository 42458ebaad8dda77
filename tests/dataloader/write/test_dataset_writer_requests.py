"""The writer's requests: each object is put once (each shard when full, each zarr.json in its
final form), and the result is what zarr itself reads back; a put failing on a background
thread fails the write."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import zarr

import dataloader
from ckptstore.stores.base import Buffer, DeferredPuts
from ckptstore.stores.local import LocalStore
from ckptstore.toolkit import canonical_json
from dataloader.format import INDEX_KEY, DatasetIndex


class CountingStore(LocalStore):
    """A real local store that counts puts per key, plain and deferred."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.puts: Counter[str] = Counter()
        self.plain_puts = 0

    def put(self, key: str, data: Buffer) -> None:
        self.puts[key] += 1
        self.plain_puts += 1
        super().put(key, data)

    def deferred(self) -> DeferredPuts:
        batch = super().deferred()
        real = batch.put

        def counted(key: str, data: Buffer) -> None:
            self.puts[key] += 1
            real(key, data)

        batch.put = counted  # type: ignore[method-assign]
        return batch


def _samples(n: int) -> list[dict[str, object]]:
    rng = np.random.default_rng(5)
    return [
        {"x": np.full(3, i, np.int32), "blob": rng.bytes(int(rng.integers(1, 300)))}
        for i in range(n)
    ]


@pytest.mark.parametrize("workers", [None, 2])
def test_every_object_is_put_once(tmp_path: Path, workers: int | None) -> None:
    store = CountingStore(tmp_path / "ds")
    samples = _samples(3000)
    # small shards: each array is resized (its zarr.json rewritten by zarr) several times
    dataloader.write_dataset(
        store, samples, schema={"x": "fixed"}, rows_per_chunk=64, shard_bytes=4096,
        workers=workers, partition_rows=1500 if workers else None,
    )
    assert max(store.puts.values()) == 1, [k for k, v in store.puts.items() if v > 1][:5]
    assert store.plain_puts == 0  # every object went through a deferred batch
    assert not list(store.temp_files())  # every batch was committed
    metadata = [k for k in store.puts if k.endswith("zarr.json")]
    # per stream: the root group, the blob group, x, blob/data, blob/offsets
    assert len(metadata) == (5 if workers is None else 10)
    ds = dataloader.StreamingDataset(str(tmp_path / "ds"))
    assert len(ds) == 3000 and ds[2999]["blob"] == samples[2999]["blob"]
    # the metadata on disk is the final one: zarr reads every row back
    root = "parts/000000/" if workers else ""
    x = zarr.open_array(str(tmp_path / "ds" / root / "x"), mode="r")
    assert x.shape == (1500 if workers else 3000, 3)
    assert int(x[-1, 0]) == (1499 if workers else 2999)


class RangeCountingStore(LocalStore):
    """A real local store that records its range reads."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, create=False)
        self.ranges: list[tuple[str, int, int]] = []

    def get_range(self, key: str, start: int, length: int) -> bytes:
        self.ranges.append((key, start, length))
        return super().get_range(key, start, length)


def _strip_tables(root: Path) -> None:
    """Rewrite dataset.json as a writer without recorded shard tables made it (same arrays,
    the fingerprint over the body without them)."""
    doc = json.loads((root / INDEX_KEY).read_bytes())
    for arrays in [doc.get("arrays", {})] + [p["arrays"] for p in doc.get("partitions", [])]:
        for a in arrays.values():
            for shard in a["shards"]:
                del shard["table"]
    body = {k: v for k, v in doc.items() if k != "fingerprint"}
    (root / INDEX_KEY).write_bytes(
        canonical_json({**body, "fingerprint": DatasetIndex.compute_fingerprint(body)})
    )


@pytest.mark.parametrize("workers", [None, 2])
def test_first_window_needs_no_shard_index_requests(tmp_path: Path, workers: int | None) -> None:
    samples = _samples(700)
    root = tmp_path / "ds"
    dataloader.write_dataset(
        str(root), samples, rows_per_chunk=64, shard_bytes=4096, workers=workers,
        partition_rows=300 if workers else None,
    )

    def read_all() -> tuple[list[bytes], list[tuple[str, int, int]]]:
        store = RangeCountingStore(root)
        ds = dataloader.StreamingDataset(store, shuffle=True, seed=3)
        got = [b for batch in dataloader.StreamingLoader(ds, batch_size=50, num_workers=2)
               for b in batch["blob"]]
        tails = [(k, s, n) for k, s, n in store.ranges
                 if s + n == store.stat(k).size and "/c/" in k]
        return got, tails

    new, tails = read_all()
    assert not tails  # every shard index came from dataset.json
    _strip_tables(root)  # a dataset written before the tables: still read, the same samples
    old, tails = read_all()
    assert tails and sorted(old) == sorted(new) == sorted(s["blob"] for s in samples)
    assert old == new


class FailingStore(LocalStore):
    """A real local store whose deferred puts fail from the `fail_at`-th shard on."""

    def __init__(self, root: Path, fail_at: int) -> None:
        super().__init__(root)
        self.fail_at, self.shard_puts = fail_at, 0

    def deferred(self) -> DeferredPuts:
        batch = super().deferred()
        real = batch.put

        def failing(key: str, data: Buffer) -> None:
            if "/c/" in key:
                self.shard_puts += 1
                if self.shard_puts >= self.fail_at:
                    raise OSError(28, "No space left on device (injected)")
            real(key, data)

        batch.put = failing  # type: ignore[method-assign]
        return batch


@pytest.mark.parametrize("workers", [None, 1, 2])
def test_a_shard_put_failing_in_the_background_fails_the_write(tmp_path: Path, workers):
    """Shards are put on background threads: a failed put still fails the write with its
    own error, nothing is committed, and no thread is left hanging."""
    store = FailingStore(tmp_path / "ds", fail_at=5)
    with pytest.raises(OSError, match="injected"):
        dataloader.write_dataset(store, _samples(3000), schema={"x": "fixed"},
                                 rows_per_chunk=64, shard_bytes=4 << 10, workers=workers,
                                 partition_rows=512)
    assert not store.exists(INDEX_KEY)
    assert store.shard_puts >= 5
