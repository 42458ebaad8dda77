"""Live healing of device tensors through the store's device seam, with its asynchronous test
double FakeDevice (pipeline/device.py) standing for a GPU: CPU tensors the fake device
adopted are treated exactly as CUDA tensors are.

What is checked (each fails when its rule is broken):
* a state on the device heals bit-exactly into destinations on the device, and the tensors
  the destinations lack are made on the device; no tensor is read to the host whole
  (`sync_reads`), every copy goes through a page-locked slot;
* the sender's host memory for device tensors stays within its budget (the staging pool's
  slots and the budget's peak), also while several receivers fetch at once;
* a corrupt chunk never reaches a device tensor (no copy to the device is even issued);
* a destination on the device that already holds a chunk is recognised in place;
* `disallow_checkpoint` then a change of the state does not leak into a transfer, and a
  state changed while it is served fails the receive instead of mixing two steps;
* a failing device copy on the sender is one clear error on the receiver.

FakeDevice's own checks (`violations`: a slot reused or read before its copy completed, a host
buffer changed before the copy up that reads it ran) must stay empty in every test.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from ckptstore.errors import IntegrityError
from ckptstore.format.hashing import hash_algorithm
from ckptstore.format.manifest_parse import parse_manifest
from ckptstore.healing.snapshot import checkpoint_name
from ckptstore.pipeline.device import FakeDevice
from ckptstore.torchft import HealError, Transport

from .test_torchft import T, _flip_all, new, same

CHUNK = 256 << 10  # the smallest chunk_bytes (the pack threshold): many chunks, small state


@pytest.fixture
def dev() -> Iterator[FakeDevice]:
    with FakeDevice(latency=0.001) as device:
        yield device
    assert not device.violations, device.violations


def device_state(dev: FakeDevice, seed: int = 0) -> dict[str, Any]:
    """About 5 MiB on the fake device: row-blocked tensors (one non-contiguous, one tied),
    small packed ones, an optimizer-like part, plain values."""
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(1024, 512, generator=g)  # 2 MiB: 8 chunks of 256 KiB
    model = {"w": w, "tied": w, "t": torch.rand(300, 700, generator=g).t(),
             "b": torch.rand(10, generator=g), "i": torch.arange(100),
             "bf": torch.rand(3000, generator=g).to(torch.bfloat16),
             "s": torch.tensor(3.5)}
    optim = {"m": torch.rand(512, 512, generator=g), "v": torch.rand(64, generator=g),
             "step": torch.tensor(7.0)}
    state = {"model": model, "optim": optim, "step": 7, "lr": [0.1, (0.9, 0.99)]}
    dev.adopt(state)
    return state


def snapshot_of(state: dict[str, Any]) -> dict[str, Any]:
    """A host copy, with the same ties, to compare with later."""
    out: dict[str, Any] = {}
    for k, v in state.items():
        out[k] = snapshot_of(v) if isinstance(v, dict) else (
            v.clone() if isinstance(v, torch.Tensor) else v)
    if "tied" in out:
        out["tied"] = out["w"]
    return out


def zeros_on(dev: FakeDevice, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {k: torch.zeros_like(v) for k, v in tensors.items()}
    dev.adopt(out)
    return out


def ups_issued(dev: FakeDevice) -> int:
    return sum(1 for kind, _p, _n in dev.issued if kind == "to_device")


def test_a_device_state_heals_bit_exactly_into_device_tensors(
        dev: FakeDevice, transports: list[Transport]) -> None:
    state = device_state(dev)
    budget = 4 * CHUNK
    sender = new(transports, chunk_bytes=CHUNK, device_host_bytes=budget)
    sender.send_checkpoint([1], 7, state, T)
    assert dev.sync_reads == 0  # no tensor was read to the host whole
    assert sender.last_send is not None
    assert sender.last_send.device_bytes == sender.last_send.logical_bytes

    # the replacement built its model on the device; it has no optimizer state yet
    model = zeros_on(dev, {k: v for k, v in state["model"].items() if k != "tied"})
    dest = {"model": model, "optim": {}}
    receiver = new(transports, chunk_bytes=CHUNK, destinations=lambda: dest)
    got = receiver.recv_checkpoint(0, sender.metadata(), 7, T)
    same(got, state)
    for k, v in model.items():  # filled in place on the device
        assert got["model"][k] is v
    for k, v in got["optim"].items():  # new tensors: made on the device
        assert dev.owns(v), k
    assert dev.owns(got["model"]["tied"])
    assert dev.sync_reads == 0 and dev.unpinned == 0  # every copy through a pinned slot
    assert ups_issued(dev) >= 8  # chunk by chunk, not one copy of a whole tensor
    staging = sender._send_staging
    assert staging.pool.allocated * staging.slot_bytes <= budget
    assert sender.device_host_peak <= budget


def test_the_senders_host_memory_stays_within_its_budget(
        dev: FakeDevice, transports: list[Transport]) -> None:
    g = torch.Generator().manual_seed(1)
    state = {f"w{i}": torch.rand(512, 512, generator=g) for i in range(8)}  # 8 MiB, 32 chunks
    state.update({f"s{i}": torch.rand(1000, generator=g) for i in range(40)})  # packed
    dev.adopt(state)
    expected = snapshot_of(state)
    budget = 2 * CHUNK
    sender = new(transports, chunk_bytes=CHUNK, device_host_bytes=budget, hash_workers=2)
    sender.send_checkpoint([1], 3, state, T)
    results: list[Any] = []

    def receive() -> None:
        r = new(transports, chunk_bytes=CHUNK, workers=4)
        results.append(r.recv_checkpoint(0, sender.metadata(), 3, T))

    threads = [threading.Thread(target=receive) for _ in range(3)]  # 12 connections at once
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(results) == 3
    for got in results:
        same(got, expected)
    staging = sender._send_staging
    assert staging.budget is not None and staging.budget.peak <= budget
    assert staging.pool.allocated * staging.slot_bytes <= budget  # the pool's peak
    assert sender.device_host_peak <= budget < 8 << 20  # far below the state's 8 MiB
    assert dev.sync_reads == 0


def test_a_corrupt_chunk_never_reaches_a_device_tensor(
        dev: FakeDevice, transports: list[Transport]) -> None:
    state = device_state(dev)
    sender = new(transports, chunk_bytes=CHUNK, serve_hook=_flip_all)
    sender.send_checkpoint([1], 2, state, T)
    model = zeros_on(dev, {k: v for k, v in state["model"].items() if k != "tied"})
    receiver = new(transports, chunk_bytes=CHUNK, destinations=lambda: {"model": model},
                   retries=1)
    before = ups_issued(dev)
    with pytest.raises(IntegrityError, match="failed its digest 2 time"):
        receiver.recv_checkpoint(0, sender.metadata(), 2, T)
    dev.drain()
    assert ups_issued(dev) == before  # no copy to the device was even issued
    for k, v in model.items():
        assert not v.any(), k  # the device tensors are untouched


def test_a_chunk_corrupted_once_is_fetched_again_and_lands_verified(
        dev: FakeDevice, transports: list[Transport]) -> None:
    lock = threading.Lock()
    flipped: list[str] = []

    def flip_once(d: str, offset: int, data: memoryview) -> bytes | None:
        with lock:
            if flipped:
                return None
            flipped.append(d)
        return _flip_all(d, offset, data)

    state = device_state(dev)
    sender = new(transports, chunk_bytes=CHUNK, serve_hook=flip_once)
    sender.send_checkpoint([1], 2, state, T)
    model = zeros_on(dev, {"w": state["model"]["w"]})
    receiver = new(transports, chunk_bytes=CHUNK, destinations=lambda: {"model": model})
    got = receiver.recv_checkpoint(0, sender.metadata(), 2, T)
    same(got, state)
    assert flipped and receiver.last_receive is not None
    assert receiver.last_receive.refetched_chunks == 1
    # every copy up read verified bytes: each a chunk (or a pack member) of the index
    snap = sender._server.state.snapshot
    assert snap is not None
    index = parse_manifest(snap.index, checkpoint_name(2), hash_algorithm("xxh3-128"))
    good = {c.digest for t in index.tensors for c in t.chunks}
    assert dev.to_device_digests and set(dev.to_device_digests) <= good


def test_a_device_destination_holding_the_chunks_is_used_in_place(
        dev: FakeDevice, transports: list[Transport]) -> None:
    g = torch.Generator().manual_seed(3)
    base = {f"base{i}": torch.rand(512, 512, generator=g) for i in range(4)}  # frozen, 4 MiB
    state = {**base, "lora": torch.rand(512, 8, generator=g)}
    dev.adopt(state)
    sender = new(transports, chunk_bytes=CHUNK)
    sender.send_checkpoint([1], 5, state, T)
    mine = {k: v.clone() for k, v in base.items()}  # the replacement loaded the base itself
    mine["lora"] = torch.zeros(512, 8)
    dev.adopt(mine)
    receiver = new(transports, chunk_bytes=CHUNK, destinations=lambda: mine)
    ups = ups_issued(dev)
    got = receiver.recv_checkpoint(0, sender.metadata(), 5, T)
    same(got, state)
    info = receiver.last_receive
    base_bytes = sum(v.nbytes for v in base.values())
    assert info is not None and info.in_place_bytes == base_bytes
    assert info.network_bytes < 0.1 * info.logical_bytes
    assert ups_issued(dev) - ups == 1  # only the adapter was copied up


def test_disallow_then_a_state_change_does_not_leak_into_the_transfer(
        dev: FakeDevice, transports: list[Transport]) -> None:
    reads: list[float] = []

    def slow(d: str, offset: int, data: memoryview) -> None:
        reads.append(time.monotonic())
        time.sleep(0.02)

    state = device_state(dev)
    old = snapshot_of(state)
    sender = new(transports, chunk_bytes=CHUNK, serve_hook=slow)
    sender.send_checkpoint([1], 4, state, T)
    model = zeros_on(dev, {k: v for k, v in state["model"].items() if k != "tied"})
    receiver = new(transports, chunk_bytes=CHUNK, workers=2, destinations=lambda: {
        "model": model})
    result: list[Any] = []
    t = threading.Thread(target=lambda: result.append(
        receiver.recv_checkpoint(0, sender.metadata(), 4, T)))
    t.start()
    while not reads:
        time.sleep(0.002)
    sender.disallow_checkpoint()  # the transfer started: it may finish, from the old step
    returned = time.monotonic()
    copies = len(dev.issued)
    with torch.no_grad():  # the next training step changes the state in place
        for v in state["model"].values():
            v.add_(1)
        state["optim"]["m"].mul_(2)
    t.join(10)
    assert result, "the receive did not finish"
    same(result[0], old)  # the old step, whole: nothing of the new one
    assert max(reads) < returned
    assert all(kind == "to_device" for kind, _p, _n in dev.issued[copies:])  # no read since
    with pytest.raises(HealError, match="no longer served"):
        new(transports).recv_checkpoint(0, sender.metadata(), 4, T)


def test_a_state_changed_while_served_fails_the_receive(
        dev: FakeDevice, transports: list[Transport]) -> None:
    state = device_state(dev)
    sender = new(transports, chunk_bytes=CHUNK)
    sender.send_checkpoint([1], 4, state, T)
    with torch.no_grad():  # changed without disallow_checkpoint: a broken trainer
        state["model"]["w"].add_(1)
    w = torch.zeros(1024, 512)
    dev.adopt(w)
    receiver = new(transports, chunk_bytes=CHUNK, destinations=lambda: {"model": {"w": w}})
    with pytest.raises(IntegrityError, match="changed while it was served"):
        receiver.recv_checkpoint(0, sender.metadata(), 4, T)
    dev.drain()
    assert not w.any()  # no byte of either step reached the destination


def test_a_failing_device_copy_on_the_sender_is_one_clear_error(
        dev: FakeDevice, transports: list[Transport]) -> None:
    state = device_state(dev)
    sender = new(transports, chunk_bytes=CHUNK)
    sender.send_checkpoint([1], 4, state, T)
    dev.fail("to_host", sticky=True)  # the device is lost while it serves
    receiver = new(transports, chunk_bytes=CHUNK)
    with pytest.raises(HealError, match="could not read step 4: .*FakeDeviceError"):
        receiver.recv_checkpoint(0, sender.metadata(), 4, T)
    dev.heal()


@pytest.mark.parametrize("wait", [True, False])
def test_shutdown_unpins_every_slot_once_no_transfer_uses_it(
        dev: FakeDevice, transports: list[Transport], wait: bool) -> None:
    state = device_state(dev)
    sender = new(transports, chunk_bytes=CHUNK, device_host_bytes=4 * CHUNK)
    receiver = new(transports, chunk_bytes=CHUNK)
    sender.send_checkpoint([1], 7, state, T)
    same(receiver.recv_checkpoint(0, sender.metadata(), 7, T), state)
    assert dev.pinned_bytes > 0  # both sides' slots are page-locked and kept between steps
    pinned = dev.pinned_bytes

    receiver.shutdown(wait)
    with pytest.raises(HealError, match="shut down"):
        receiver.recv_checkpoint(0, sender.metadata(), 7, T)
    sender.shutdown(wait)
    deadline = time.monotonic() + 10
    while dev.pinned_bytes and time.monotonic() < deadline:  # wait=False unpins behind
        time.sleep(0.01)
    assert dev.pinned_bytes == 0, f"{dev.pinned_bytes} of {pinned} bytes still page-locked"
    with pytest.raises(HealError, match="shut down"):
        sender.send_checkpoint([1], 8, state, T)


def test_shutdown_waits_for_a_receive_in_progress_before_unpinning(
        dev: FakeDevice, transports: list[Transport]) -> None:
    g = torch.Generator().manual_seed(2)
    state = {"model": {f"w{i}": torch.rand(512, 512, generator=g) for i in range(4)}}
    sender = new(transports, chunk_bytes=CHUNK)  # a host state: only the receiver's copies
    model = zeros_on(dev, state["model"])
    receiver = new(transports, chunk_bytes=CHUNK, destinations=lambda: {"model": model})
    sender.send_checkpoint([1], 7, state, T)
    dev.pause()  # the receive's copies (in-place checks, then copies up) wait until resumed
    got: list[Any] = []
    worker = threading.Thread(target=lambda: got.append(
        receiver.recv_checkpoint(0, sender.metadata(), 7, T)))
    worker.start()
    deadline = time.monotonic() + 10
    while not dev.pending_copies() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert dev.pending_copies()
    receiver.shutdown(wait=False)
    time.sleep(0.2)
    assert dev.pinned_bytes > 0  # a copy through a slot is still in flight: kept pinned
    dev.resume()
    worker.join(10)
    same(got[0], state)
    deadline = time.monotonic() + 10
    while dev.pinned_bytes and time.monotonic() < deadline:
        time.sleep(0.01)
    sender.shutdown()
    assert dev.pinned_bytes == 0
