"""RayDatasink on a local Ray instance (2 CPUs, started once for this module): each write task
writes one partition, the completion callback commits; the dataset reads back equal."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import dataloader
from ckptstore import open_store

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'ckptstore[ray]')")
pytest.importorskip("ray.data", reason="Ray Data is not installed (pip install 'ray[data]')")

# Ray's DataContext warns about its own deprecated settings whenever it is created
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.data.context")


@pytest.fixture(scope="module", autouse=True)
def local_ray() -> Iterator[None]:
    try:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    except Exception as exc:  # pragma: no cover - depends on the machine
        pytest.skip(f"a local Ray instance cannot start here: {exc}")
    ctx = ray.data.DataContext.get_current()
    old = ctx.execution_options.preserve_order
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = False
    try:
        yield
    finally:
        ctx.execution_options.preserve_order = old
        ray.shutdown()


def _items(n: int) -> list[dict]:
    rng = np.random.default_rng(7)
    return [
        {
            "id": i,
            "score": i / 4,
            "tokens": rng.integers(0, 1000, int(rng.integers(1, 30))).astype(np.int32),
            "image": np.full((2, 3), i % 200, dtype=np.uint8),
            "text": f"row {i} é",
            "blob": bytes([i % 256]) * (i % 5),
        }
        for i in range(n)
    ]


def _check(uri: str, items: list[dict], **kw: object) -> None:
    ds = dataloader.StreamingDataset(uri, **kw)  # type: ignore[arg-type]
    got = [
        (b, j) for b in dataloader.StreamingLoader(ds, batch_size=32) for j in range(len(b["id"]))
    ]
    assert len(got) == len(items)
    for (b, j), want in zip(got, items, strict=True):
        assert int(b["id"][j]) == want["id"] and float(b["score"][j]) == want["score"]
        np.testing.assert_array_equal(b["tokens"][j], want["tokens"])
        np.testing.assert_array_equal(b["image"][j], want["image"])
        assert b["text"][j] == want["text"] and b["blob"][j] == want["blob"]


def test_ray_to_local_folder(tmp_path: Path) -> None:
    items = _items(300)
    uri = str(tmp_path / "ds")
    sink = dataloader.RayDatasink(uri, rows_per_chunk=32, metadata={"by": "ray"})
    ray.data.from_items(items, override_num_blocks=4).write_datasink(sink)
    index = dataloader.StreamingDataset(uri).index
    assert index.metadata == {"by": "ray"} and len(index.partitions) >= 2
    _check(uri, items)
    # the same data written again elsewhere gives the same dataset
    uri2 = str(tmp_path / "ds2")
    ray.data.from_items(items, override_num_blocks=4).write_datasink(
        dataloader.RayDatasink(uri2, rows_per_chunk=32, metadata={"by": "ray"}))
    assert dataloader.StreamingDataset(uri2).fingerprint == index.fingerprint
    # a dataset is never overwritten
    with pytest.raises(Exception, match="exists"):
        ray.data.from_items(items[:5]).write_datasink(dataloader.RayDatasink(uri))


def test_ray_to_s3(s3_any_uri: str, s3_endpoint: str) -> None:
    items = _items(200)
    so = {"endpoint_url": s3_endpoint}
    ray.data.from_items(items, override_num_blocks=3).write_datasink(
        dataloader.RayDatasink(s3_any_uri, store_options=so, compression="zstd"))
    _check(s3_any_uri, items, store_options=so)
    assert open_store(s3_any_uri, **so).exists("dataset.json")


def test_ray_is_imported_lazily() -> None:
    import subprocess

    code = "import dataloader, sys; assert 'ray' not in sys.modules; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"
