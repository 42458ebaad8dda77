"""Partitions pay for their fsyncs once, through a deferred batch (`Store.deferred`): a writer
SIGKILLed mid-conversion leaves temp files and uncommitted partitions, which `gc_partitions`
removes, and the same conversion then succeeds and reads back."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np

import dataloader
from ckptstore.stores import LocalStore
from dataloader.format import INDEX_KEY

ROOT = Path(__file__).resolve().parents[3]

_CHILD = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    import dataloader
    from ckptstore.stores import local
    real = local._fsync

    def slow_fsync(fd, what):  # a slow disk, that says when it starts each fsync
        os.write(1, b".")
        time.sleep(0.02)
        real(fd, what)

    local._fsync = slow_fsync
    samples = ({"x": np.full(1000, i, np.int32)} for i in range(200_000))
    dataloader.write_dataset(sys.argv[1], samples, schema={"x": "fixed"}, rows_per_chunk=64,
                             shard_bytes=64 << 10, workers=2, partition_rows=256)
""")


def _samples(n: int) -> list[dict[str, np.ndarray]]:
    return [{"x": np.full(1000, i, np.int32)} for i in range(n)]


def test_sigkilled_conversion_leaves_only_what_gc_removes(tmp_path: Path) -> None:
    uri = str(tmp_path / "ds")
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, uri], stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert proc.stdout is not None
        for _ in range(60):  # killed while the 60th fsync waits: its temp is not renamed
            assert proc.stdout.read(1) == b"."
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    store = LocalStore(uri)
    assert not store.exists(INDEX_KEY)
    assert list(store.list("parts/")), "the child wrote no partition before the kill"
    assert list(store.temp_files()), "the kill found no write waiting for its fsync"
    dataloader.gc_partitions(uri, grace_seconds=0)
    assert list(store.list("")) == [] and list(store.temp_files()) == []
    samples = _samples(600)
    dataloader.write_dataset(uri, samples, schema={"x": "fixed"}, rows_per_chunk=64,
                             shard_bytes=64 << 10, workers=2, partition_rows=256)
    ds = dataloader.StreamingDataset(uri)
    assert len(ds) == 600 and int(ds[599]["x"][0]) == 599
    assert list(store.temp_files()) == []


def test_gc_keeps_young_temps(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "ds")
    batch = store.deferred()  # a write in flight: its temp is young
    batch.put("parts/000000/x/c/0", b"in flight")
    dataloader.gc_partitions(store, grace_seconds=3600)
    assert len(list(store.temp_files())) == 1
    dataloader.gc_partitions(store, grace_seconds=3600, now=time.time() + 7200)
    assert list(store.temp_files()) == []
    batch.abandon()
