"""What makes a live heal's transfer fast, each checked for what it promises: new tensors
backed ahead of the transfer (same bytes, no page faults left for the receiving threads),
huge pages asked for only where the range holds them, chunks hashed piece by piece as they
arrive (the same digest as the whole), connections with a receive buffer set before they
connect, and receives that use all of it still bit-exact."""

from __future__ import annotations

import os
import resource
import socket
import sys
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
import torch

from ckptstore.format.hashing import SHA256_128, XXH3_128, StreamingDigest
from ckptstore.healing import memory, receive
from ckptstore.healing.client import SOCKET_BUFFER, Address, Connection, Deadline
from ckptstore.torchft import Transport

T = timedelta(seconds=20)
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux madvise")


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


# ------------------------------------------------------------------ memory.py
def test_huge_range_is_whole_aligned_pages_inside_the_buffer() -> None:
    H = memory.HUGE_PAGE
    assert memory.huge_range(10 * H, 8 * H) == (10 * H, 8 * H)
    start, length = memory.huge_range(10 * H + 4096, 8 * H) or (0, 0)
    assert start == 11 * H and length == 7 * H  # the partial pages at both ends left out
    assert memory.huge_range(10 * H + 1, memory.MIN_HUGE - 1) is None  # too small
    assert memory.huge_range(0, 0) is None


@linux
def test_populate_backs_memory_and_keeps_its_bytes() -> None:
    n = 64 << 20
    held = np.arange(n // 8, dtype=np.int64)  # backed, with content
    before = held.copy()
    if not memory.populate(held.view(np.uint8)):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    assert np.array_equal(held, before)

    # mapped, not backed (torch's allocator, unlike numpy's, asks for no huge pages)
    fresh = torch.empty(n, dtype=torch.uint8).numpy()
    f0 = _minor_faults()
    fresh.fill(1)
    unbacked = _minor_faults() - f0
    again = torch.empty(n, dtype=torch.uint8).numpy()
    assert memory.populate(again)
    f0 = _minor_faults()
    again.fill(1)
    backed = _minor_faults() - f0
    assert unbacked > 1000, unbacked  # 16384 small pages, fewer with huge ones
    assert backed < unbacked // 10, (backed, unbacked)


@linux
def test_advise_huge_leaves_the_bytes_and_refuses_small_buffers() -> None:
    small = np.ones(memory.MIN_HUGE // 2, np.uint8)
    assert not memory.advise_huge(small)
    big = np.arange((32 << 20) // 8, dtype=np.int64)
    before = big.copy()
    thp = "/sys/kernel/mm/transparent_hugepage/enabled"
    # a kernel built with transparent huge pages takes the advice (in any mode)
    assert memory.advise_huge(big.view(np.uint8)) == os.path.exists(thp)
    assert np.array_equal(big, before)


# ------------------------------------------------------------------ client.py, receive.py
@pytest.mark.parametrize("algorithm", [XXH3_128, SHA256_128], ids=lambda a: a.name)
def test_a_chunk_hashed_piece_by_piece_has_its_digest(algorithm: Any) -> None:
    data = os.urandom((3 << 20) + 17)
    h = StreamingDigest(algorithm)
    for a in range(0, len(data), 1 << 20):
        h.update(memoryview(data)[a : a + (1 << 20)])
    assert h.digest() == algorithm.digest(data)
    flipped = bytearray(data)
    flipped[-1] ^= 1
    h = StreamingDigest(algorithm)
    h.update(memoryview(bytes(flipped)))
    assert h.digest() != algorithm.digest(data)


@linux
def test_connections_set_their_receive_buffer_before_connecting() -> None:
    with open("/proc/sys/net/core/rmem_max") as f:
        cap = int(f.read())
    server = socket.create_server(("127.0.0.1", 0))
    try:
        default = socket.socket()
        untouched = default.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        default.close()
        conn = Connection(Address("127.0.0.1", server.getsockname()[1], "/x/"), Deadline(5))
        sock = conn._arm("connecting")
        got = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        conn.close()
    finally:
        server.close()
    # Linux doubles what was asked for (its bookkeeping), capped at rmem_max
    assert got == 2 * min(SOCKET_BUFFER, cap), (got, cap)
    assert got > untouched


def test_new_tensors_are_backed_ahead_in_fetch_order_and_arrive_exactly(
        transports: list[Transport], monkeypatch: pytest.MonkeyPatch) -> None:
    backed: list[int] = []
    real = receive.populate

    def spy(buf: np.ndarray) -> bool:
        backed.append(int(buf.nbytes))
        return real(buf)

    monkeypatch.setattr(receive, "populate", spy)
    monkeypatch.setattr(receive, "_spare_core", lambda: True)
    state = {"w": torch.rand(1 << 20), "m": [torch.rand(3 << 20), torch.rand(2 << 20)],
             "b": torch.rand(10)}
    sender = Transport(T)
    transports.append(sender)
    sender.send_checkpoint([1], 3, state, T)
    w = torch.zeros(1 << 20)
    receiver = Transport(T, destinations=lambda: {"w": w, "b": torch.zeros(10)})
    transports.append(receiver)
    got = receiver.recv_checkpoint(0, sender.metadata(), 3, T)
    for a, b in zip(got["m"], state["m"]):
        assert torch.equal(a, b)
    assert got["w"] is w and torch.equal(w, state["w"])
    # the two new tensors' chunks (16 MiB blocks: 12 MiB, 8 MiB), largest first; not the
    # destination's (it is the caller's memory, already backed) nor the packed bias
    assert backed == [12 << 20, 8 << 20], backed


@pytest.mark.parametrize("huge", [False, True], ids=["small-pages", "huge-pages"])
def test_a_receive_creating_most_of_the_state_is_exact(
        transports: list[Transport], huge: bool) -> None:
    moments = {i: {"exp_avg": torch.rand(2048, 1024), "exp_avg_sq": torch.rand(2048, 1024),
                   "step": torch.tensor(3.0)} for i in range(3)}
    state = {"model": {f"l{i}": torch.rand(2048, 1024) for i in range(3)},
             "optim": {"state": moments, "param_groups": [{"lr": 0.1, "params": [0, 1, 2]}]}}
    sender = Transport(T)
    transports.append(sender)
    sender.send_checkpoint([1], 9, state, T)
    model = {f"l{i}": torch.zeros(2048, 1024) for i in range(3)}
    dest = {"model": model, "optim": {"state": {}, "param_groups": []}}
    receiver = Transport(T, destinations=lambda: dest, huge_pages=huge)
    transports.append(receiver)
    got = receiver.recv_checkpoint(0, sender.metadata(), 9, T)
    for i in range(3):
        assert got["model"][f"l{i}"] is model[f"l{i}"]
        assert torch.equal(model[f"l{i}"], state["model"][f"l{i}"])
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(got["optim"]["state"][i][k], moments[i][k])
    info = receiver.last_receive
    assert info is not None and info.network_bytes >= info.logical_bytes
