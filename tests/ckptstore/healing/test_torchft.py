"""ckptstore.torchft.Transport: torchft's own transport contract test, a real torchft Manager
with a Lighthouse on 127.0.0.1 and two replica groups (one SIGKILLed and replaced mid
training, healed through the transport with a chunk corrupted on the way), a sender SIGKILLed
mid-transfer, and the transport's own rules: only what differs travels, every chunk is
verified before it lands, `disallow_checkpoint` is honoured, one step is never mixed with
another, bad input gets one clear error."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import unittest
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torchft._torchft import LighthouseServer
from torchft.checkpointing.transport_test import run_multi_recovery_test

import ckptstore
from ckptstore.errors import FormatError, IntegrityError, KeyMismatchError, UnsupportedTypeError
from ckptstore.torchft import HealError, HealTimeoutError, Transport

ROOT = Path(__file__).resolve().parents[3]
# the workers import ckptstore from where this process does, and the tests package from here
WORKER_ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(
    [str(Path(ckptstore.__file__).resolve().parents[1]), str(ROOT)]))
T = timedelta(seconds=10)


def same(a: Any, b: Any, path: str = "") -> None:
    """Equal structure, types and bits (tensors: dtype, shape and every element)."""
    assert type(a) is type(b), (path, type(a), type(b))
    if isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}.{i}")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), path
    else:
        assert a == b, (path, a, b)


def new(made: list[Transport], **kw: Any) -> Transport:
    t = Transport(kw.pop("timeout", T), **kw)
    made.append(t)
    return t


def frozen_state(seed: int, trainable_seed: int) -> dict[str, Any]:
    """A LoRA-like state: a frozen base (seeded by `seed`), trainable adapters and their Adam
    moments (seeded by `trainable_seed`), a step counter and plain values."""
    g = torch.Generator().manual_seed(seed)
    base = {f"layer{i}.weight": torch.rand(512, 1024, generator=g) for i in range(4)}
    h = torch.Generator().manual_seed(trainable_seed)
    lora = {f"layer{i}.lora": torch.rand(1024, 8, generator=h) for i in range(4)}
    moments = {i: {"exp_avg": torch.rand(1024, 8, generator=h), "step": torch.tensor(7.0)}
               for i in range(4)}
    return {"model": {**base, **lora},
            "optim": {"state": moments, "param_groups": [{"lr": 1e-3, "params": [0, 1, 2, 3],
                                                          "betas": (0.9, 0.99)}]},
            "torchft": {"step": 7, "batches_committed": 14}}


# ------------------------------------------------------------------ torchft's contract
class TorchftContract(unittest.TestCase):
    def test_multi_recovery_cpu(self) -> None:
        made: list[Transport] = []

        def init(rank: int, world_size: int) -> Transport:
            t = Transport(timeout=timedelta(seconds=10))
            made.append(t)
            return t

        try:
            run_multi_recovery_test(self, init, device=torch.device("cpu"))
        finally:
            for t in made:
                t.shutdown(wait=False)


# ------------------------------------------------------------------ a real Manager
def _start_replica(replica: int, lighthouse: str, out: Path, seed: int, steps: int,
                   corrupt: bool = False, start_when: Path | None = None
                   ) -> subprocess.Popen[str]:
    spec = {"replica": replica, "lighthouse": lighthouse, "steps": steps, "seed": seed,
            "out": str(out), "corrupt_once": corrupt,
            "start_when": None if start_when is None else str(start_when)}
    with open(out.with_suffix(".log"), "w") as log:
        return subprocess.Popen([sys.executable, "-m", "tests.torchft_replica",
                                 json.dumps(spec)], cwd=ROOT, env=WORKER_ENV,
                                stdout=subprocess.PIPE, stderr=log, text=True)


def _log_tail(out: Path) -> str:
    lines = out.with_suffix(".log").read_text(errors="replace").splitlines()
    return "\n".join(line for line in lines if "[INFO]" not in line)[-3000:]


def _follow(proc: subprocess.Popen[str], lines: list[str], seen: threading.Event,
            wanted: str) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line.strip())
        if line.strip() == wanted:
            seen.set()


def test_manager_heals_a_killed_replica_bit_exactly(tmp_path: Path) -> None:
    """Two replica groups under a real Manager and Lighthouse; group 1 is SIGKILLed after
    step 2 and replaced by a process whose model starts from other weights. The replacement
    heals from group 0 through our transport (one chunk corrupted on the way: detected and
    fetched again) and both end bit-identical."""
    steps = 6
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=100,
                                  quorum_tick_ms=20, heartbeat_timeout_ms=1000)
    procs: list[subprocess.Popen[str]] = []
    try:
        addr = lighthouse.address()
        a = _start_replica(0, addr, tmp_path / "a.json", seed=42, steps=steps, corrupt=True)
        b = _start_replica(1, addr, tmp_path / "b.json", seed=42, steps=steps)
        # the replacement: imported and built now, joins once group 1 is dead
        go = tmp_path / "replace-now"
        c = _start_replica(1, addr, tmp_path / "c.json", seed=7, steps=steps, start_when=go)
        procs += [a, b, c]
        a_lines: list[str] = []
        b_lines: list[str] = []
        b_at_2 = threading.Event()
        threading.Thread(target=_follow, args=(a, a_lines, threading.Event(), ""),
                         daemon=True).start()
        threading.Thread(target=_follow, args=(b, b_lines, b_at_2, "STEP 2"),
                         daemon=True).start()
        assert b_at_2.wait(60), f"group 1 never reached step 2: {b_lines[-5:]}"
        os.kill(b.pid, signal.SIGKILL)
        assert b.wait(10) == -signal.SIGKILL
        go.touch()
        c_lines: list[str] = []
        threading.Thread(target=_follow, args=(c, c_lines, threading.Event(), ""),
                         daemon=True).start()
        for p, name in ((a, "a"), (c, "c")):
            assert p.wait(90) == 0, (f"replica {name} failed: a={a_lines[-5:]} "
                                     f"c={c_lines[-5:]}\n{_log_tail(tmp_path / f'{name}.json')}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            if p.stdout is not None:
                p.stdout.close()
        lighthouse.shutdown()
    ra = json.loads((tmp_path / "a.json").read_text())
    rc = json.loads((tmp_path / "c.json").read_text())
    assert ra["step"] == rc["step"] == steps
    assert rc["initial"] != ra["initial"]  # the replacement started from other weights
    late = [h for h in rc["heals"] if h["step"] > 0]
    assert len(late) == 1, rc["heals"]
    heal = late[0]
    assert 2 <= heal["step"] < steps  # healed mid-training, then trained on with group 0
    assert heal["network_bytes"] > heal["logical_bytes"] * 0.9  # other weights: all sent
    assert ra["flipped"] and heal["refetched_chunks"] == 1  # the flipped chunk: fetched again
    assert ra["served"] >= heal["network_bytes"]
    assert rc["state"] == ra["state"]  # bit-exact: every tensor's digest, every value


# ------------------------------------------------------------------ sender death / timeout
def test_sender_killed_mid_transfer_fails_once_and_quickly(transports: list[Transport]) -> None:
    spec = {"mib": 48, "delay": 0.2, "step": 5}
    proc = subprocess.Popen([sys.executable, "-m", "tests.torchft_sender", json.dumps(spec)],
                            cwd=ROOT, env=WORKER_ENV, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        assert line.startswith("READY "), line
        metadata = line.split(" ", 1)[1]
        receiver = new(transports)
        outcome: list[BaseException | None] = []

        def receive() -> None:
            try:
                receiver.recv_checkpoint(0, metadata, 5, timedelta(seconds=30))
                outcome.append(None)
            except BaseException as exc:  # noqa: BLE001
                outcome.append(exc)

        t = threading.Thread(target=receive)
        t.start()
        time.sleep(0.8)  # 12 chunks of 4 MiB at 0.2 s each over 2 connections: ~1.2 s
        assert not outcome, "the transfer ended before the sender was killed"
        os.kill(proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        t.join(10)
        assert not t.is_alive()
        assert time.monotonic() - killed < 5  # well within the 30 s timeout
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    err = outcome[0]
    assert isinstance(err, HealError) and not isinstance(err, HealTimeoutError), err
    assert "stopped answering mid-transfer" in str(err) and "step 5" in str(err)
    assert receiver.last_receive is None


def test_stalled_sender_times_out_within_the_timeout(transports: list[Transport]) -> None:
    release = threading.Event()
    sender = new(transports, serve_hook=lambda d, o, v: release.wait(20) and None)
    sender.send_checkpoint([1], 3, {"w": torch.rand(1 << 20)}, T)
    receiver = new(transports)
    t0 = time.monotonic()
    with pytest.raises(HealTimeoutError, match="timed out"):
        receiver.recv_checkpoint(0, sender.metadata(), 3, timedelta(seconds=1))
    assert time.monotonic() - t0 < 3
    release.set()


# ------------------------------------------------------------------ only what differs
def test_only_what_differs_travels(transports: list[Transport], tmp_path: Path) -> None:
    state = frozen_state(seed=1, trainable_seed=2)
    sender = new(transports)
    sender.send_checkpoint([1], 7, state, T)
    base_bytes = sum(v.nbytes for k, v in state["model"].items() if "lora" not in k)

    # the replacement built the frozen base itself; adapters start elsewhere; no moments yet
    mine = frozen_state(seed=1, trainable_seed=99)
    dest = {"model": mine["model"], "optim": {"state": {}, "param_groups": []}}
    receiver = new(transports, destinations=lambda: dest)
    got = receiver.recv_checkpoint(0, sender.metadata(), 7, T)
    same(got, state)
    for k, v in mine["model"].items():  # filled in place: the same objects come back
        assert got["model"][k] is v
    info = receiver.last_receive
    assert info is not None and info.in_place_bytes == base_bytes
    assert info.network_bytes < 0.2 * info.logical_bytes  # adapters, moments and the index
    assert info.network_bytes >= info.logical_bytes - base_bytes

    # or from the local repository's last checkpoint (the previous step: base unchanged)
    repo = ckptstore.CheckpointStore(tmp_path / "near")
    repo.save("step-6", frozen_state(seed=1, trainable_seed=5))
    repo.close()
    from_disk = new(transports, local=tmp_path / "near")
    got = from_disk.recv_checkpoint(0, sender.metadata(), 7, T)
    same(got, state)
    info = from_disk.last_receive
    assert info is not None and info.local_bytes == base_bytes and info.in_place_bytes == 0
    assert info.network_bytes < 0.2 * info.logical_bytes


def test_every_storable_value_round_trips(transports: list[Transport]) -> None:
    """The checkpoint encoding over the wire: containers, scalars, dtypes, tied and strided
    tensors, numpy, bytes."""
    from collections import OrderedDict

    import numpy as np

    tied = torch.rand(300, 200)
    sd: OrderedDict[str, Any] = OrderedDict(w=tied, again=tied, t=tied.t(), row=tied[7])
    sd._metadata = OrderedDict({"": {"version": 2}})  # type: ignore[attr-defined]
    state = {"model": sd, "bf": torch.rand(70000).to(torch.bfloat16),
             "mask": torch.rand(5) > 0.5, "np": np.arange(12, dtype=np.int16).reshape(3, 4),
             "raw": b"\x00\x01payload", "f": float("nan"), "none": None,
             "groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0, 1]}], 3: "int key"}
    sender = new(transports)
    sender.send_checkpoint([1], 9, state, T)
    got = new(transports).recv_checkpoint(0, sender.metadata(), 9, T)
    m = got["model"]
    assert type(m) is OrderedDict and m._metadata == {"": {"version": 2}}
    assert m["w"] is m["again"] and torch.equal(m["w"], tied)
    assert m["t"].untyped_storage().data_ptr() == m["w"].untyped_storage().data_ptr()
    assert torch.equal(m["t"], tied.t()) and torch.equal(m["row"], tied[7])
    assert got["bf"].dtype == torch.bfloat16 and torch.equal(got["bf"], state["bf"])
    assert torch.equal(got["mask"], state["mask"])
    assert got["np"].dtype == np.int16 and (got["np"] == state["np"]).all()
    assert got["raw"] == state["raw"] and got["f"] != got["f"] and got["none"] is None
    assert got["groups"] == state["groups"] and got[3] == "int key"


# ------------------------------------------------------------------ verification
def _flip_all(digest: str, offset: int, data: memoryview) -> bytes:
    bad = bytearray(data)
    bad[0] ^= 1
    return bytes(bad)


def test_corrupt_chunks_never_land(transports: list[Transport]) -> None:
    sender = new(transports, serve_hook=_flip_all)
    sender.send_checkpoint([1], 2, {"w": torch.rand(1 << 20), "b": torch.rand(10)}, T)
    w, b = torch.zeros(1 << 20), torch.zeros(10)
    receiver = new(transports, destinations=lambda: {"w": w, "b": b}, retries=2)
    with pytest.raises(IntegrityError, match="failed its digest 3 time"):
        receiver.recv_checkpoint(0, sender.metadata(), 2, T)
    assert not w.any() and not b.any()  # nothing unverified reached the destinations


def test_a_corrupt_chunk_is_fetched_again(transports: list[Transport]) -> None:
    once = threading.Lock()
    flipped: list[str] = []

    def flip_once(digest: str, offset: int, data: memoryview) -> bytes | None:
        with once:
            if flipped:
                return None
            flipped.append(digest)
        return _flip_all(digest, offset, data)

    state = {"w": torch.rand(3 << 20), "v": torch.arange(100)}
    sender = new(transports, serve_hook=flip_once)
    sender.send_checkpoint([1], 2, state, T)
    receiver = new(transports)
    same(receiver.recv_checkpoint(0, sender.metadata(), 2, T), state)
    assert flipped and receiver.last_receive is not None
    assert receiver.last_receive.refetched_chunks == 1


# ------------------------------------------------------------------ steps and disallow
def test_disallow_waits_for_the_transfer_and_then_nothing_is_read(
        transports: list[Transport]) -> None:
    reads: list[float] = []

    def slow(digest: str, offset: int, data: memoryview) -> None:
        reads.append(time.monotonic())
        time.sleep(0.05)

    state = {"w": [torch.rand(1 << 20) for _ in range(6)]}  # 6 chunks of 4 MiB
    sender = new(transports, serve_hook=slow)
    sender.send_checkpoint([1], 4, state, T)
    receiver = new(transports)
    result: list[Any] = []
    t = threading.Thread(target=lambda: result.append(
        receiver.recv_checkpoint(0, sender.metadata(), 4, T)))
    t.start()
    while not reads:
        time.sleep(0.005)
    sender.disallow_checkpoint()  # the transfer started: it is allowed to finish
    returned = time.monotonic()
    t.join(10)
    same(result[0], state)
    assert max(reads) < returned  # nothing read after disallow returned
    with pytest.raises(HealError, match="no longer served"):
        new(transports).recv_checkpoint(0, sender.metadata(), 4, T)


def test_a_stuck_receiver_is_cut_off_at_the_timeout(transports: list[Transport]) -> None:
    sender = new(transports, timeout=timedelta(seconds=1))
    sender.send_checkpoint([1], 4, {"w": torch.rand(8 << 20)}, T)  # one 32 MiB tensor
    url = sender.metadata()
    host, port = url.split("//")[1].split("/")[0].split(":")
    prefix = "/" + url.split("/")[3] + "/"
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"GET {prefix}v1/4/index HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(1 << 16)
    headers = head.decode("latin-1")
    token = headers.split("X-Ckpt-Snapshot: ")[1].split("\r\n")[0]
    transfer = headers.split("X-Ckpt-Transfer: ")[1].split("\r\n")[0]
    digest = json.loads(_index_of(sender))["tensors"][0]["attributes"]["ckptstore"][
        "chunks"][0]["blob"]
    sock.sendall(f"GET {prefix}v1/4/{token}/blob/{digest}?t={transfer} HTTP/1.1\r\n"
                 "Host: x\r\n\r\n".encode())  # and never read the 16 MiB answer
    time.sleep(0.2)
    t0 = time.monotonic()
    sender.disallow_checkpoint()
    took = time.monotonic() - t0
    assert 0.7 < took < 5, took
    sock.close()


def _index_of(sender: Transport) -> str:
    snap = sender._server.state.snapshot
    assert snap is not None
    return snap.index.decode()


def test_one_step_only(transports: list[Transport]) -> None:
    sender = new(transports)
    sender.send_checkpoint([1], 6, {"w": torch.rand(10)}, T)
    receiver = new(transports)
    t0 = time.monotonic()
    with pytest.raises(HealError, match="moved on to step 6"):
        receiver.recv_checkpoint(0, sender.metadata(), 5, T)
    assert time.monotonic() - t0 < 1
    with pytest.raises(HealTimeoutError, match="timed out after 0.3 s waiting for step 7"):
        receiver.recv_checkpoint(0, sender.metadata(), 7, timedelta(seconds=0.3))


# ------------------------------------------------------------------ bad input
def test_bad_input_gets_one_clear_error(transports: list[Transport]) -> None:
    sender = new(transports)
    with pytest.raises(UnsupportedTypeError, match="user.opt: cannot store a value of type"):
        sender.send_checkpoint([1], 1, {"user": {"opt": object()}}, T)
    receiver = new(transports)
    t0 = time.monotonic()
    with pytest.raises(HealError, match="could not serve step 1: UnsupportedTypeError"):
        receiver.recv_checkpoint(0, sender.metadata(), 1, T)
    assert time.monotonic() - t0 < 1
    with pytest.raises(FormatError, match="not the metadata of a ckptstore"):
        receiver.recv_checkpoint(0, "http://127.0.0.1:1/checkpoint/", 1, T)
    sender.send_checkpoint([1], 2, {"w": torch.rand(4, 4), "v": torch.rand(3)}, T)
    wrong = new(transports, destinations=lambda: {"w": torch.rand(4, 5), "x": torch.rand(2)})
    with pytest.raises(KeyMismatchError, match=r"not in the state sent: \['x'\].*w: "
                                               "destination shape"):
        wrong.recv_checkpoint(0, sender.metadata(), 2, T)
    with pytest.raises(TypeError, match="timedelta"):
        Transport(10)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="destinations must be a callable"):
        Transport(T, destinations={"w": torch.rand(1)})  # type: ignore[arg-type]


# ------------------------------------------------------------------ DTensors in place
def test_dtensor_destination_is_filled_in_place(transports: list[Transport]) -> None:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", rank=0, world_size=1,
                            store=dist.HashStore())  # type: ignore[attr-defined]
    try:
        mesh = DeviceMesh("cpu", [0])
        sent = distribute_tensor(torch.rand(8, 4), mesh, [Shard(0)])
        sender = new(transports)
        sender.send_checkpoint([1], 1, {"p": sent, "n": 3}, T)
        dest = distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)])
        receiver = new(transports, destinations=lambda: {"p": dest})
        got = receiver.recv_checkpoint(0, sender.metadata(), 1, T)
        assert got["p"] is dest and got["n"] == 3
        assert torch.equal(dest.to_local(), sent.to_local())
        other = distribute_tensor(torch.zeros(8, 4), mesh, [Shard(1)])
        wrong = new(transports, destinations=lambda: {"p": other})
        with pytest.raises(KeyMismatchError, match="placements"):
            wrong.recv_checkpoint(0, sender.metadata(), 1, T)
    finally:
        dist.destroy_process_group()
