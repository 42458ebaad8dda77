"""Restoring into device tensors through the device seam and its asynchronous test double
(see test_device_save.py): chunks are read and verified into page-locked bounce slots, then
copied to the device; reads of the next chunks overlap the copies.

What is checked (each fails when its ordering is broken):
* `load(into=)` with device destinations and `load(device=)` are bit-exact, with no host
  buffer larger than a slot (no full-size temporary), every copy from page-locked memory;
* no copy to the device is issued for bytes that failed verification;
* a bounce slot is reused only once the copy reading it completed;
* reads of later chunks run while earlier copies are in flight;
* a bad `device=` and a failing copy are one clear error each.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from ckptstore import CheckpointStore, IntegrityError, Shard
from ckptstore.errors import UnsupportedTypeError
from ckptstore.format.hashing import digest
from ckptstore.format.regions import index_runs
from ckptstore.format.torch_types import resolve_device
from ckptstore.pipeline import loading
from ckptstore.pipeline.device import DeviceCopyError, FakeDevice
from ckptstore.pipeline.reader import CheckpointReader
from tests.helpers import assert_same

from .test_device_save import CHUNK, WatchedStore, device_state, watched_repo


@pytest.fixture
def dev():
    with FakeDevice(latency=0.001) as device:
        yield device
    assert not device.violations, device.violations


def zeros_on(dev: FakeDevice, state: dict[str, Any]) -> dict[str, Any]:
    out = {k: torch.zeros_like(v) for k, v in state.items()}
    dev.adopt(out)
    return out


def test_restore_into_device_tensors_through_pinned_slots(dev):
    repo = watched_repo(dev, max_inflight_bytes=4 * CHUNK)
    state = device_state(dev)
    repo.save("a", state)
    model = state["model"]
    into = zeros_on(dev, {k: v.detach() for k, v in model.items() if k != "tied"})
    into["t"] = torch.zeros(40, 3000).t()  # a strided destination
    dev.adopt(into["t"])
    issued = len(dev.issued)
    repo.load("a", into={"model": into}, keys=["model"], strict=False)
    for k, v in into.items():
        assert_same(v, model[k].detach(), k)
    ups = [n for kind, _p, n in dev.issued[issued:] if kind == "to_device"]
    slot = loading.LOAD_SLOT_BYTES
    assert len(ups) >= 10 and max(ups) <= slot  # no host buffer of a whole 512 KiB tensor
    assert dev.unpinned == 0  # every copy up from a page-locked slot
    repo.close()


def test_new_tensors_are_made_on_the_device(dev):
    repo = watched_repo(dev)
    state = device_state(dev)
    repo.save("a", state)
    back = repo.load("a", device=dev)
    assert_same(back, state)
    model = back["model"]
    assert all(dev.owns(v) for v in model.values() if v.numel())
    assert dev.owns(back["host"]["cpu"])  # saved from the host, made on the device too
    assert isinstance(back["host"]["np"], np.ndarray)  # numpy stays numpy
    assert model["tied"].untyped_storage().data_ptr() == model["w"].untyped_storage().data_ptr()
    assert isinstance(model["param"], torch.nn.Parameter) and model["param"].requires_grad
    # a ckptstore.Shard on the device reads only its rows
    part = Shard(torch.zeros(100, 256), offset=200, global_shape=(512, 256))
    dev.adopt(part.data)
    repo.load("a", into={"model": {"w": part}}, keys=["model.w"])
    assert torch.equal(part.data, state["model"]["w"][200:300])
    assert dev.unpinned == 0
    repo.close()


@pytest.mark.parametrize("target", ["w", "bias"])  # a chunk of a large tensor; a packed one
def test_no_copy_to_the_device_is_issued_for_unverified_bytes(dev, target):
    dev.latency = 0.003
    store = WatchedStore(dev)
    repo = watched_repo(dev, store)
    state = device_state(dev)
    repo.save("a", state)
    entry = next(e for e in repo.manifest("a").tensors if e.key == f"model.{target}")
    chunk = entry.chunks[len(entry.chunks) // 2]
    key = f"blobs/{chunk.blob[:2]}/{chunk.blob}"
    blob = bytearray(store.get(key))
    blob[chunk.offset + 5] ^= 0xFF  # one flipped bit pattern in the middle chunk
    store.put(key, bytes(blob))
    bad = digest(bytes(blob[chunk.offset : chunk.offset + chunk.size]))
    into = zeros_on(dev, {k: v.detach() for k, v in state["model"].items() if k != "tied"})
    sentinel = 7 if target == "w" else 9
    into[target].fill_(sentinel)
    with pytest.raises(IntegrityError, match=f"model.{target}"):
        repo.load("a", into={"model": into}, keys=["model"], strict=False)
    dev.drain()
    assert bad not in dev.to_device_digests
    flat = into[target].reshape(-1)
    rows = entry.chunk_rows_range(len(entry.chunks) // 2)
    per_row = int(np.prod(entry.shape[1:])) if len(entry.shape) > 1 else 1
    region = flat[rows[0] * per_row : rows[1] * per_row]
    assert torch.all(region == sentinel)  # the corrupt chunk never reached the device
    repo.close()


def test_a_bounce_slot_is_reused_only_after_its_copy_completed(dev):
    """A slow device, a load budget of two slots and 24 chunks: every slot carries many
    chunks; reusing one before the copy that reads it ran would change the bytes that copy
    reads (the device records it) and corrupt the destination."""
    dev.latency = 0.004
    repo = watched_repo(dev, max_inflight_bytes=2 * CHUNK)
    w = torch.randn(24 * CHUNK // 4)
    repo.save("a", {"w": w})
    into = zeros_on(dev, {"w": w})
    repo.load("a", into=into)
    assert torch.equal(into["w"], w)
    repo.close()


def test_reads_overlap_the_copies_to_the_device():
    # one copy engine: copies complete one after another, 10 ms each
    with FakeDevice(latency=0.01, threads=1) as dev:
        store = WatchedStore(dev)
        # slots of two chunks, two jobs in flight: 8 jobs, each read while another's copy
        # is still running (the reads are counted while a copy to the device is pending)
        repo = watched_repo(dev, store, max_inflight_bytes=4 * CHUNK, workers=4)
        w = torch.randn(16 * CHUNK // 4)
        repo.save("a", {"w": w})
        into = zeros_on(dev, {"w": w})
        repo.load("a", into=into)
        assert torch.equal(into["w"], w)
        assert store.reads_during_copies >= 4  # later chunks were read while copies ran
        repo.close()
    assert not dev.violations, dev.violations


def test_region_of_a_chunk_grid_onto_the_device(dev, tmp_path):
    """Runs with several pieces per dim (FSDP2's strided shards): each overlapping chunk is
    read once, verified, copied up whole and its part placed on the device."""
    full = np.arange(40 * 6, dtype=np.float64).reshape(40, 6)
    repo = CheckpointStore(tmp_path / "r", chunk_bytes=4 * 6 * 8)  # 4-row chunks
    repo.save("s", {"w": full})
    entry = repo.manifest("s").tensors[0]
    rows = [8, 9, 10, 11, 24, 25, 26, 27]  # chunks 2 and 6 only
    cols = [1, 2, 4]
    runs = (index_runs(rows), index_runs(cols))
    out = torch.zeros(len(rows), len(cols), dtype=torch.float64)
    dev.adopt(out)
    from ckptstore.format.torch_types import _bits

    reader = CheckpointReader(repo.store, repo.load_options)
    reads = loading.DeviceReads(reader)
    target = _bits(out)
    assert target is not None
    reads.add(entry, target, tuple(out.shape), runs)
    reads.run()
    np.testing.assert_array_equal(out.numpy(), full[np.ix_(rows, cols)])
    assert reader.bytes_read == 2 * 4 * 6 * 8  # the two overlapping chunks, once each
    assert dev.unpinned == 0
    repo.close()


def test_a_failing_copy_to_the_device_is_one_error(dev):
    repo = watched_repo(dev, max_inflight_bytes=4 * CHUNK)  # 2-chunk jobs: 4 copies
    w = torch.randn(8 * CHUNK // 4)
    repo.save("a", {"w": w})
    into = zeros_on(dev, {"w": w})
    dev.fail("to_device", after=2)
    with pytest.raises(DeviceCopyError, match=r"tensor 'w': the copy to fake:0 failed: "
                                              r"FakeDeviceError: injected"):
        repo.load("a", into=into)
    dev.heal()
    repo.load("a", into=into)
    assert torch.equal(into["w"], w)
    repo.close()


def test_bad_devices_are_refused_before_anything_is_read(dev):
    repo = watched_repo(dev)
    repo.save("a", {"w": torch.randn(10)})
    for bad, why in [("cuda:0", "cannot load onto cuda:0: CUDA is not available"),
                     ("meta", "meta device"), (3, "device must be a device name"),
                     ("nonsense", "is not a device")]:
        with pytest.raises(UnsupportedTypeError, match=why):
            repo.load("a", device=bad)
        assert repo.last_load is not None and repo.last_load.bytes_by_tier == {repo.uri: 0}
    assert resolve_device("cpu") is None and resolve_device(None) is None
    assert torch.equal(repo.load("a", device="cpu")["w"], repo.load("a")["w"])
    lost = torch.zeros(10)
    dev.adopt(lost)
    dev.lost = True
    with pytest.raises(Exception, match="destination on fake:0 cannot be written"):
        repo.load("a", into={"w": lost})
    repo.close()
