"""Threads: early exit, errors handed to the consumer, torch integration, metrics, CLI, S3."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import dataloader
from tests.dataloader.conftest import ids_of, make_samples


def _our_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("dataloader-") and t.is_alive()]


def _wait_no_threads(timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while _our_threads() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _our_threads(), _our_threads()


def test_early_exit_shuts_workers_down(small_uri):
    loader = dataloader.StreamingLoader(
        dataloader.StreamingDataset(small_uri, shuffle=True),
        batch_size=4,
        num_workers=3,
        prefetch_batches=1,
    )
    for i, _ in enumerate(loader):
        if i == 2:
            break
    gc.collect()
    _wait_no_threads()
    it = iter(loader)  # explicit close of a half-read iterator
    next(it)
    it.close()
    _wait_no_threads()
    assert len(ids_of(loader)) == 523  # still usable afterwards


def test_worker_exception_reaches_consumer(small_uri, monkeypatch):
    ds = dataloader.StreamingDataset(small_uri, shuffle_window=32)
    real = ds.reader.load_blocks
    calls = {"n": 0}

    def failing(blocks, executor):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom in an I/O thread")
        return real(blocks, executor)

    monkeypatch.setattr(ds.reader, "load_blocks", failing)
    loader = dataloader.StreamingLoader(ds, batch_size=8, num_workers=2)
    got = 0
    with pytest.raises(RuntimeError, match="boom in an I/O thread"):
        for b in loader:
            got += len(b["id"])
    assert got > 0
    _wait_no_threads()


def test_slow_consumer_and_abandon_does_not_hang(small_uri):
    loader = dataloader.StreamingLoader(
        dataloader.StreamingDataset(small_uri), batch_size=2, num_workers=2, prefetch_batches=1
    )
    it = iter(loader)
    next(it)
    time.sleep(0.2)  # producer is now blocked on the full queue
    t0 = time.monotonic()
    del it
    gc.collect()
    _wait_no_threads()
    assert time.monotonic() - t0 < 3


def test_metrics_report_throughput_and_wait(small_uri):
    loader = dataloader.StreamingLoader(dataloader.StreamingDataset(small_uri), batch_size=32)
    list(loader)
    m = loader.stats()
    assert m["samples"] == 523 and m["batches"] == 17
    assert m["samples_per_s"] > 0 and m["bytes_read"] > 0 and m["bytes_per_s"] > 0
    assert 0 <= m["wait_s"] <= m["elapsed_s"] and m["time_to_first_batch_s"] is not None


# torch warns when a DataLoader has more worker processes than the machine has cores (3 here,
# on purpose: the dataset must refuse a worker count it was not made for)
@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
def test_torch_collate_and_torch_dataloader(small_uri):
    torch = pytest.importorskip("torch")
    loader = dataloader.StreamingLoader(
        dataloader.StreamingDataset(small_uri), batch_size=16, collate="torch"
    )
    b = next(iter(loader))
    assert isinstance(b["image"], torch.Tensor) and b["image"].shape == (16, 2, 3)
    assert isinstance(b["tokens"][0], torch.Tensor) and isinstance(b["text"][0], str)
    # torch's own DataLoader with worker processes: each sample exactly once, in the order
    # the dataset (told the DataLoader's num_workers and batch_size) delivers when iterated
    # directly
    ds = dataloader.StreamingDataset(
        small_uri, fields=["id", "image"], shuffle=True, seed=5, torch_batch_size=8,
        io_threads=1, torch_workers=2,
    )
    want = [
        int(s["_index"])
        for s in dataloader.StreamingDataset(
            small_uri, fields=["id"], shuffle=True, seed=5, torch_batch_size=8, torch_workers=2
        )
    ]
    dl = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=2)
    got = [int(x) for b in dl for x in b["id"]]
    assert got == want and sorted(got) == list(range(523))
    failing = iter(torch.utils.data.DataLoader(ds, batch_size=8, num_workers=3))
    try:
        with pytest.raises(Exception, match="num_workers=3"):  # told another worker count
            list(failing)
    finally:
        # torch's own cleanup, now: left to the garbage collector (the traceback holds the
        # iterator in a cycle) it runs in a later test and waits 5 s for each worker
        failing._shutdown_workers()


def test_dataset_state_for_torch_dataloader(small_uri):
    ds = dataloader.StreamingDataset(small_uri, shuffle=True, seed=2, fields=["id"])
    it = iter(ds)
    head = [int(next(it)["id"]) for _ in range(100)]
    state = ds.state_dict()
    ds2 = dataloader.StreamingDataset(small_uri, shuffle=True, seed=2, fields=["id"])
    ds2.load_state_dict(state)
    tail = [int(s["id"]) for s in ds2]
    full = [
        int(s["id"])
        for s in dataloader.StreamingDataset(small_uri, shuffle=True, seed=2, fields=["id"])
    ]
    assert head + tail == full
    ds3 = dataloader.StreamingDataset(small_uri, shuffle=True, seed=2, fields=["id"])
    ds3.load_state_dict(ds3.state_dict(consumed=100))  # explicit count from the main process
    assert [int(s["id"]) for s in ds3] == tail


def test_state_saves_inside_a_checkpoint(small_uri, tmp_path):
    import ckptstore

    loader = dataloader.StreamingLoader(
        dataloader.StreamingDataset(small_uri, shuffle=True), batch_size=10
    )
    it = iter(loader)
    head = [x for _ in range(5) for x in next(it)["_index"].tolist()]
    it.close()
    state = loader.state_dict()
    if hasattr(ckptstore, "CheckpointStore"):
        repo = ckptstore.CheckpointStore(str(tmp_path / "ck"))
        repo.save("step-5", {"data": state})
        state = repo.load("step-5")["data"]
    else:  # the checkpoint layer is not there yet: the state is plain JSON either way
        state = json.loads(json.dumps(state))
    l2 = dataloader.StreamingLoader(
        dataloader.StreamingDataset(small_uri, shuffle=True), batch_size=10
    )
    l2.load_state_dict(state)
    full = ids_of(
        dataloader.StreamingLoader(
            dataloader.StreamingDataset(small_uri, shuffle=True), batch_size=10
        )
    )
    assert head + ids_of(l2) == full


def test_cli_convert_info_verify(tmp_path, capsys):
    from dataloader.cli import main

    src = tmp_path / "src"
    src.mkdir()
    with open(src / "a.jsonl", "w") as f:
        for i in range(30):
            f.write(json.dumps({"id": i, "text": f"t{i}", "toks": list(range(i % 5))}) + "\n")
    dest = str(tmp_path / "ds")
    assert main(["convert", str(src), dest, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["num_samples"] == 30 and {f["name"] for f in info["fields"]} == {
        "id",
        "text",
        "toks",
    }
    assert main(["info", dest]) == 0
    out = capsys.readouterr().out
    assert "samples      30" in out and "toks" in out
    assert main(["verify", dest]) == 0
    assert "verified" in capsys.readouterr().out
    npy = tmp_path / "npy"
    npy.mkdir()
    for i in range(5):
        np.save(npy / f"{i:03d}.npy", np.arange(i + 1, dtype=np.int16))
    assert main(["convert", str(npy), str(tmp_path / "ds2"), "--field", "tokens"]) == 0
    got = [s["tokens"] for s in dataloader.StreamingDataset(str(tmp_path / "ds2"))]
    assert [len(g) for g in got] == [1, 2, 3, 4, 5] and got[0].dtype == np.int16
    assert main(["info", str(tmp_path / "nothing")]) == 2
    assert "dataset.json" in capsys.readouterr().err
    with open(src / "b.jsonl", "w") as f:
        f.write('{"id": {"nested": 1}}\n')
    assert main(["convert", str(src), str(tmp_path / "ds3")]) == 2
    assert "b.jsonl:1" in capsys.readouterr().err
    # the module entry point works as a program
    run = subprocess.run(
        [sys.executable, "-m", "dataloader", "info", dest, "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(run.stdout)["num_samples"] == 30


def test_s3_round_trip_and_resume(s3_any_uri, s3_endpoint):
    pytest.importorskip("ckptstore.stores.s3")
    opts = {"endpoint_url": s3_endpoint}
    samples = make_samples(300, seed=4)
    dataloader.write_dataset(
        s3_any_uri, samples, rows_per_chunk=16, store_options=opts, schema={"image": "fixed"}
    )
    ds = dataloader.StreamingDataset(s3_any_uri, shuffle=True, seed=1, store_options=opts)
    loader = dataloader.StreamingLoader(ds, batch_size=20, num_workers=4)
    full = []
    for b in loader:
        for j, i in enumerate(b["_index"]):
            assert b["blob"][j] == samples[i]["blob"]
            assert np.array_equal(b["tokens"][j], samples[i]["tokens"])
        full.extend(b["_index"].tolist())
    assert sorted(full) == list(range(300))
    l1 = dataloader.StreamingLoader(
        dataloader.StreamingDataset(s3_any_uri, shuffle=True, seed=1, store_options=opts),
        batch_size=20,
    )
    it = iter(l1)
    head = [x for _ in range(4) for x in next(it)["_index"].tolist()]
    it.close()
    l2 = dataloader.StreamingLoader(
        dataloader.StreamingDataset(s3_any_uri, shuffle=True, seed=1, store_options=opts),
        batch_size=20,
    )
    l2.load_state_dict(l1.state_dict())
    assert head + ids_of(l2) == full


def test_s3_corrupt_and_missing(s3_any_uri, s3_endpoint):
    pytest.importorskip("ckptstore.stores.s3")
    import ckptstore

    opts = {"endpoint_url": s3_endpoint}
    dataloader.write_dataset(s3_any_uri, make_samples(100), rows_per_chunk=16, store_options=opts)
    store = ckptstore.open_store(s3_any_uri, **opts)
    data = bytearray(store.get("tokens/data/c/0"))
    data[3] ^= 0x55
    store.put("tokens/data/c/0", bytes(data))
    with pytest.raises(ckptstore.IntegrityError):
        list(dataloader.StreamingDataset(s3_any_uri, store_options=opts))
    store.delete("id/c/0")
    with pytest.raises(dataloader.MissingShardError):
        list(dataloader.StreamingDataset(s3_any_uri, store_options=opts))
