"""Saving state that lives on a device, through the device seam (ckptstore/pipeline/device.py)
and its asynchronous test double, FakeDevice: the production save path, with CPU tensors the
fake device adopted standing for CUDA tensors. Copies complete later on the device's threads;
the destination of a copy is garbage (0xA5) until its event completes; the spies below make
every hash and every write of the save check that the bytes they read have no copy pending,
and the device records a buffer copied into while pending or while being hashed or written.

What is checked (each fails when its ordering is broken: docs in the report of the change):
* no host buffer is hashed, written or reused before its copy's event (all save modes);
* the page-locked pool stays within max_host_bytes and is pinned once, not per save;
* a failing copy fails the save with one DeviceCopyError naming the tensor; nothing commits;
* an optimizer guard makes step() wait for exactly the tensors not yet copied;
* tensors that cannot be read (meta, a lost device) are refused naming their key path.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch

from ckptstore import CheckpointManager, CheckpointStore, RNGState, SourceChangedError
from ckptstore.errors import UnsupportedTypeError
from ckptstore.format.hashing import XXH3_128, HashAlgorithm
from ckptstore.pipeline import staging
from ckptstore.pipeline.device import DeviceCopyError, FakeDevice
from ckptstore.pipeline.options import MAX_OVERLAP_THREADS
from ckptstore.stores.memory import MemoryStore
from tests.helpers import assert_same

CHUNK = 64 << 10


@pytest.fixture
def dev():
    with FakeDevice(latency=0.001) as device:
        yield device
    assert not device.violations, device.violations


class WatchedStore(MemoryStore):
    """A memory store whose writes check, with the device, that the bytes they read are not
    waiting for a copy (and mark them busy meanwhile); `delay` widens that window."""

    def __init__(self, dev: FakeDevice, delay: float = 0.0) -> None:
        super().__init__()
        self.dev = dev
        self.delay = delay
        self.reads_during_copies = 0

    def put(self, key: str, data: Any) -> None:
        with self.dev.using(data, "write"):
            if self.delay:
                time.sleep(self.delay)
            super().put(key, data)

    def read_into_digest(self, key: str, start: int, out: memoryview) -> str:
        if self.dev.pending_copies("to_device"):
            self.reads_during_copies += 1
        return super().read_into_digest(key, start, out)


def watched_repo(dev: FakeDevice, store: Any = None, **options: Any) -> CheckpointStore:
    """A repository whose saves hash through the device's check (as WatchedStore writes)."""
    options.setdefault("async_writer", "thread")
    repo = CheckpointStore(store if store is not None else WatchedStore(dev),
                           chunk_bytes=CHUNK, **options)

    def digest(data: Any) -> str:
        with dev.using(data, "hash"):
            return XXH3_128.digest(data)

    repo.save_options = replace(repo.save_options,
                                hash=HashAlgorithm(XXH3_128.name, digest, False))
    return repo


def device_state(dev: FakeDevice, seed: int = 0) -> dict[str, Any]:
    """Every kind of tensor a training state has, on the device, beside host values."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(512, 256, generator=g)  # 8 chunks
    model = {
        "w": w, "tied": w[100:200],  # a view of w: stored once, restored sharing storage
        "bf16": torch.randn(300, 200, generator=g).to(torch.bfloat16),
        "i8": torch.randint(-128, 127, (70000,), dtype=torch.int8, generator=g),
        "mask": torch.rand(5000, generator=g) > 0.5,  # small: packed
        "t": torch.randn(40, 3000, generator=g).t(),  # not contiguous
        "scalar": torch.tensor(2.5), "empty": torch.empty(0, 7),
        "f8": torch.randn(1000, generator=g).to(torch.float8_e4m3fn),
        "c": torch.randn(100, 10, dtype=torch.complex64, generator=g),
        "bias": torch.randn(256, generator=g),
        "param": torch.nn.Parameter(torch.randn(64, 64, generator=g)),
    }
    dev.adopt(model)
    return {"model": model, "host": {"cpu": torch.arange(1000.0), "np": np.arange(10)}}


def save(repo: CheckpointStore, name: str, state: Any, mode: str, **kw: Any) -> Any:
    if mode == "save":
        return repo.save(name, state)
    if mode == "copy":
        return repo.save_async(name, state, staging="copy").wait()
    return repo.save_async(name, state, staging="overlap", max_host_bytes=4 * CHUNK,
                           **kw).wait()


# ------------------------------------------------------------------------------ ordering
@pytest.mark.parametrize("mode", ["save", "copy", "overlap", "writer-process"])
def test_device_state_round_trips_and_no_buffer_is_used_before_its_copy(dev, tmp_path, mode):
    dev.latency = 0.003  # copies complete well after they were issued
    if mode == "writer-process":  # overlapped into a folder: shared slots, pinned once
        repo = watched_repo(dev, tmp_path / "repo", async_writer="process")
    else:
        repo = watched_repo(dev, WatchedStore(dev, delay=0.001))
    state = device_state(dev)
    info = save(repo, "a", state, "overlap" if mode == "writer-process" else mode)
    assert info.tensors == 14 and info.chunks_written > 10
    assert_same(repo.load("a"), state)  # bit-exact: every hash and write saw the copied bytes
    assert dev.unpinned == 0  # every copy went into page-locked memory
    assert dev.sync_reads == 0  # and none was a synchronous fallback
    assert dev.issued and all(kind == "to_host" for kind, _p, _n in dev.issued)
    repo.close()


def test_slots_come_back_only_after_their_bytes_are_written(dev):
    """Two slots, a slow device and slow writes: each slot is written out and reused many
    times; a slot given back before its write ended would be copied into while the write
    reads it (a violation), and its blob would hold another block (the load would fail)."""
    dev.latency = 0.002
    repo = watched_repo(dev, WatchedStore(dev, delay=0.004), max_inflight_bytes=2 * CHUNK)
    w = torch.randn(24 * CHUNK // 4)
    dev.adopt(w)
    repo.save_async("o", {"w": w}, staging="overlap", max_host_bytes=2 * CHUNK).wait()
    w.add_(1)
    repo.save("s", {"w": w})
    back_o, back_s = repo.load("o")["w"], repo.load("s")["w"]
    assert torch.equal(back_s, w) and torch.equal(back_o + 1, w)
    repo.close()


def test_pool_stays_within_max_host_bytes_and_is_pinned_once(dev):
    dev.latency = 0.002
    repo = watched_repo(dev, max_inflight_bytes=3 * CHUNK)
    budget = 4 * CHUNK
    w = torch.randn(40 * CHUNK // 4)
    small = [torch.randn(100) for _ in range(50)]  # packs: staged into the same pool
    dev.adopt(w, small)
    pins = []
    for i in range(3):
        w.add_(1)  # new bytes every save: every chunk is copied, hashed and written
        info = repo.save_async(f"o{i}", {"w": w, "small": small}, staging="overlap",
                               max_host_bytes=budget).wait()
        assert 0 < info.peak_extra_bytes <= budget
        pins.append(dev.pins)
    assert pins[0] == pins[1] == pins[2] > 0, pins  # no pinning per save: the pool is kept
    assert dev.pinned_bytes <= budget
    assert dev.max_pending_bytes <= budget
    # saves that are not overlapped: the store's pool, within max_inflight_bytes
    before = dev.pinned_bytes
    for i in range(2):
        w.add_(1)
        info = repo.save(f"s{i}", {"w": w, "small": small})
        assert 0 < info.peak_extra_bytes <= 3 * CHUNK
        pins.append(dev.pins)
    assert pins[3] == pins[4] > pins[2]
    assert dev.pinned_bytes - before <= 3 * CHUNK
    assert torch.equal(repo.load("s1")["w"], w)
    repo.close()


def test_copy_staging_holds_the_values_of_the_call(dev):
    """staging="copy" returns once every byte is in the arena: changing the device tensors
    right after the call cannot reach the checkpoint; the bounce slots are pinned once."""
    dev.latency = 0.002
    repo = watched_repo(dev)
    state = device_state(dev)
    for i in range(2):
        expected = {k: v.detach().clone() for k, v in state["model"].items()}
        handle = repo.save_async(f"c{i}", state, staging="copy")
        with torch.no_grad():
            for v in state["model"].values():
                if v.dtype.is_floating_point and v.dtype.itemsize >= 2:
                    v.add_(1)  # at once, before the background write has started
        handle.wait()
        back = repo.load(f"c{i}")["model"]
        for k, v in expected.items():
            assert_same(back[k].detach(), v, k)
    assert dev.pins <= staging.BOUNCE_SLOTS and dev.unpinned == 0
    repo.close()


# ------------------------------------------------------------------------------ failures
@pytest.mark.parametrize("mode", ["save", "copy", "overlap"])
@pytest.mark.parametrize("sticky", [False, True])
def test_a_failing_copy_fails_the_save_and_commits_nothing(dev, mode, sticky):
    repo = watched_repo(dev, max_inflight_bytes=4 * CHUNK)
    state = device_state(dev)
    dev.fail("to_host", after=3, sticky=sticky)
    with pytest.raises(DeviceCopyError, match=r"model\.\w+: the copy from fake:0 to host "
                                              r"memory failed: FakeDeviceError: injected"):
        save(repo, "bad", state, mode)
    assert repo.list() == [] and repo.latest() is None
    assert not repo.store.exists("checkpoints/bad.json")
    # nothing is left held: the next save uses the same pools and commits
    dev.heal()
    save(repo, "good", state, mode)
    assert_same(repo.load("good"), state)
    repo.close()


def small_device_state(dev: FakeDevice, n: int = 96) -> dict[str, Any]:
    """Only small tensors (1 KiB each): every one of them is a pack member."""
    g = torch.Generator().manual_seed(1)
    state = {f"p{i}": torch.randn(256, generator=g) for i in range(n)}
    dev.adopt(state)
    return state


@pytest.mark.parametrize("mode", ["save", "copy", "overlap"])
def test_a_failing_copy_of_a_pack_member_fails_the_save_and_commits_nothing(dev, mode):
    repo = watched_repo(dev)
    state = small_device_state(dev)
    dev.fail("to_host", after=5)
    with pytest.raises(DeviceCopyError, match=r"p\d+: the copy from fake:0 to host memory "
                                              r"failed: FakeDeviceError: injected"):
        save(repo, "bad", state, mode)
    assert repo.list() == [] and not repo.store.exists("checkpoints/bad.json")
    dev.heal()
    save(repo, "good", state, mode)
    assert_same(repo.load("good"), state)
    repo.close()


def test_pack_slots_come_back_only_after_the_pack_is_written(dev):
    """Small device tensors in packs, two slots but a budget for more pack jobs, slow copies
    and a slow hash: a slot given back before its pack was hashed and written would be
    copied into by the next pack job while this one still reads it (a violation; the blob
    would hold the wrong members)."""
    dev.latency = 0.002
    repo = watched_repo(dev, WatchedStore(dev, delay=0.002), max_inflight_bytes=8 * CHUNK)
    slow = repo.save_options.hash.digest

    def slow_digest(data: Any) -> str:
        time.sleep(0.001)
        return slow(data)

    repo.save_options = replace(repo.save_options, hash=replace(repo.save_options.hash,
                                                                digest=slow_digest))
    state = small_device_state(dev, n=640)
    saved = {}
    for name in ("o1", "o2", "o3"):
        repo.save_async(name, state, staging="overlap", max_host_bytes=2 * CHUNK).wait()
        saved[name] = {k: v.clone() for k, v in state.items()}
        for t in state.values():
            t.add_(1)  # every member new: each save packs them all again
        assert not dev.violations, dev.violations
    repo.save("s", state)
    saved["s"] = state
    for name, want in saved.items():
        assert_same(repo.load(name), want)
    repo.close()


def test_unreadable_tensors_are_refused_naming_their_key(dev):
    repo = watched_repo(dev)
    with pytest.raises(UnsupportedTypeError, match=r"^model\.w: a tensor on the meta device"):
        repo.save("m", {"model": {"w": torch.empty(3, 3, device="meta")}})
    lost = torch.randn(10)
    dev.adopt(lost)
    dev.lost = True
    with pytest.raises(UnsupportedTypeError,
                       match=r"^opt\.state\.0: tensor on fake:0 cannot be read: the fake "
                             r"device was lost"):
        repo.save("l", {"opt": {"state": [lost]}})
    with pytest.raises(UnsupportedTypeError, match=r"opt\.state\.0"):
        repo.save_async("l", {"opt": {"state": [lost]}}, staging="overlap")
    assert repo.list() == [] and dev.issued == []
    repo.close()


# ------------------------------------------------------------------------------ guards
def _trained(dev: FakeDevice, width: int = 64) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(width, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(8, width)).sum().backward()
    opt.step()  # momentum buffers exist now
    dev.adopt(model, opt)
    return model, opt


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(8, model.in_features)).sum().backward()
    opt.step()


@pytest.mark.parametrize("width", [64, 1024])  # weight packed with the small tensors; chunks
def test_a_guarded_step_waits_for_its_tensors_not_yet_copied(dev, width):
    model, opt = _trained(dev, width)
    ema = torch.randn(8 * CHUNK // 4)
    dev.adopt(ema)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    repo = watched_repo(dev)
    dev.hold(model.weight)  # the copy of the weight (and its pack) stays pending
    handle = repo.save_async("g", {"model": model.state_dict(), "optim": opt.state_dict(),
                                   "ema": ema}, staging="overlap", guard=[opt])
    stepper = threading.Thread(target=_step, args=(model, opt))
    stepper.start()
    stepper.join(0.3)
    assert stepper.is_alive()  # step() waits for the weight's copy
    assert torch.equal(model.weight.detach(), before["weight"])
    dev.release(model.weight)
    stepper.join(10)
    assert not stepper.is_alive()
    info = handle.wait()
    assert info.guard_wait_seconds >= 0.25
    saved = repo.load("g")["model"]
    assert all(torch.equal(saved[k], v) for k, v in before.items())
    repo.close()


def test_a_guarded_step_does_not_wait_for_other_tensors(dev):
    model, opt = _trained(dev)
    ema = torch.randn(8 * CHUNK // 4)
    dev.adopt(ema)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    repo = watched_repo(dev)
    dev.hold(ema)  # only what the optimizer does not change is pending
    handle = repo.save_async("g", {"model": model.state_dict(), "optim": opt.state_dict(),
                                   "ema": ema}, staging="overlap", guard=[opt])
    stepper = threading.Thread(target=_step, args=(model, opt))
    stepper.start()
    stepper.join(10)
    assert not stepper.is_alive()  # the step ran while the save still waits for ema
    assert dev.pending_copies("to_host") > 0 and not handle.done()
    assert not torch.equal(model.weight.detach(), before["weight"])
    dev.release(ema)
    handle.wait()
    saved = repo.load("g")["model"]
    assert all(torch.equal(saved[k], v) for k, v in before.items())  # the values of the call
    repo.close()


class GatedStore(WatchedStore):
    """Blob writes wait until `gate` is set."""

    def __init__(self, dev: FakeDevice) -> None:
        super().__init__(dev)
        self.gate = threading.Event()
        self.blobs_written = 0

    def put(self, key: str, data: Any) -> None:
        if key.startswith("blobs/"):
            self.gate.wait()
            self.blobs_written += 1
        super().put(key, data)


def test_copies_run_ahead_of_writes_by_the_budget_not_by_a_thread_cap(dev):
    """A budget of more blocks than MAX_OVERLAP_THREADS: with no write finished, every block
    is copied, so a guarded step runs although nothing reached the store yet."""
    blocks = MAX_OVERLAP_THREADS + 32
    store = GatedStore(dev)
    repo = watched_repo(dev, store)
    w = torch.nn.Parameter(torch.randn(blocks * CHUNK // 4))
    w.grad = torch.ones_like(w)
    opt = torch.optim.SGD([w], lr=0.5)
    dev.adopt(w)
    before = w.detach().clone()
    handle = repo.save_async("r", {"w": w}, staging="overlap",
                             max_host_bytes=(blocks + 8) * CHUNK, guard=[opt])
    stepper = threading.Thread(target=opt.step)
    stepper.start()
    stepper.join(10)
    stepped, written = not stepper.is_alive(), store.blobs_written
    copies = sum(kind == "to_host" for kind, _p, _n in dev.issued)
    store.gate.set()  # (before asserting: a failed test must not leave the save waiting)
    handle.wait()
    stepper.join(10)
    assert stepped and written == 0 and copies == blocks, (stepped, written, copies)
    assert torch.equal(repo.load("r")["w"], before)
    repo.close()


def test_an_unguarded_device_tensor_changed_before_its_copy_fails_the_save(dev):
    repo = watched_repo(dev)
    w = torch.randn(4 * CHUNK // 4)
    dev.adopt(w)
    dev.hold(w)
    handle = repo.save_async("u", {"w": w}, staging="overlap")
    w.add_(1)  # too early: its copy has not run
    dev.release(w)
    with pytest.raises(SourceChangedError, match="^w: tensor changed in place"):
        handle.wait()
    assert repo.list() == []
    repo.close()


# ------------------------------------------------------------------------------ manager
def test_manager_saves_a_device_model_beside_training_and_restores_it(dev, tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.BatchNorm1d(64),
                                torch.nn.Linear(64, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def train() -> None:
        model(torch.randn(16, 32)).sum().backward()
        opt.step()
        opt.zero_grad()

    train()
    dev.adopt(model, opt)
    mgr = CheckpointManager(tmp_path / "m", async_save=True, staging="overlap",
                            max_host_bytes=4 * CHUNK, chunk_bytes=CHUNK)
    state = {"model": model, "optim": opt, "rng": RNGState()}
    expected_model = {k: v.clone() for k, v in model.state_dict().items()}
    expected_opt = {i: {k: v.clone() for k, v in s.items()}
                    for i, s in enumerate(opt.state.values())}
    mgr.save(1, state)
    train()  # guarded: waits for the copies of what it changes; BN buffers copied at call
    train()
    info = mgr.wait()
    assert info is not None and info.staging == "overlap"
    mgr.close()

    torch.manual_seed(1)
    model2 = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.BatchNorm1d(64),
                                 torch.nn.Linear(64, 8))
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-2)
    dev.adopt(model2)
    mgr = CheckpointManager(tmp_path / "m")
    assert mgr.restore({"model": model2, "optim": opt2, "rng": RNGState()},
                       map_location=dev) == 1
    for k, v in model2.state_dict().items():
        assert torch.equal(v, expected_model[k]), k
        assert dev.owns(v) or not v.numel()  # restored in place, on the device
    for i, s in enumerate(opt2.state.values()):
        for k, v in s.items():
            assert torch.equal(v, expected_opt[i][k]), k
            assert dev.owns(v), k  # map_location: created on the device
    with pytest.raises(UnsupportedTypeError, match="device must be"):
        mgr.restore({"model": model2}, map_location={"cuda:0": "cpu"})
    mgr.close()


# ------------------------------------------------------------------------------ DTensor
@pytest.fixture
def one_rank_mesh(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0,
                            world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_dtensors_on_the_device_save_and_restore(dev, one_rank_mesh):
    from torch.distributed.tensor import DTensor, Replicate, Shard

    g = torch.Generator().manual_seed(3)
    a = DTensor.from_local(torch.randn(96, 80, generator=g), one_rank_mesh, [Shard(0)])
    b = DTensor.from_local(torch.randn(40, generator=g).to(torch.bfloat16), one_rank_mesh,
                           [Replicate()])
    dev.adopt(a, b)
    repo = watched_repo(dev)
    repo.save("s", {"a": a, "b": b})
    repo.save_async("o", {"a": a, "b": b}, staging="overlap").wait()
    for name in ("s", "o"):
        za = DTensor.from_local(torch.zeros(96, 80), one_rank_mesh, [Shard(0)])
        zb = DTensor.from_local(torch.zeros(40, dtype=torch.bfloat16), one_rank_mesh,
                                [Replicate()])
        dev.adopt(za, zb)
        repo.load(name, into={"a": za, "b": zb})
        assert torch.equal(za.to_local(), a.to_local())
        assert torch.equal(zb.to_local().view(torch.int16), b.to_local().view(torch.int16))
    assert dev.unpinned == 0 and dev.sync_reads == 0
    repo.close()


def test_copy_keys_on_a_device_are_copied_at_call_time(dev):
    """`copy_keys=` names tensors the caller changes right after the call (EMA weights): on a
    device they are copied to the host before save_async returns, so the change is not seen
    and the save commits the values of the call."""
    repo = watched_repo(dev)
    ema = torch.arange(50_000, dtype=torch.float32)
    dev.adopt(ema)
    state = {"ema": ema, "w": torch.randn(20_000)}
    dev.adopt(state["w"])
    handle = repo.save_async("s", state, staging="overlap", copy_keys=["ema"])
    ema.mul_(0)  # untracked, but copied at the call
    handle.wait()
    out = repo.load("s")
    assert torch.equal(out["ema"], torch.arange(50_000, dtype=torch.float32))
    assert torch.equal(out["w"], state["w"])
    repo.close()


def test_device_leaves_without_a_source_are_still_tracked(dev):
    """An Overlap given no source for a leaf (None) takes it from the leaf's DeviceArray, so
    a change before the copy still fails the save instead of committing mixed values."""
    from ckptstore.format.tree import TreeEncoder
    from ckptstore.pipeline.overlap import Overlap, StagingPool

    w = torch.randn(1000)
    dev.adopt(w)
    encoder = TreeEncoder()
    encoder.encode_state({"w": w})
    overlap = Overlap(encoder.leaves, [None], StagingPool(CHUNK))
    assert overlap.sources[0] is w and set(overlap.marks) == {"fake:0"}
    overlap.check(0)
    w.add_(1)
    with pytest.raises(SourceChangedError, match="^w: tensor changed in place"):
        overlap.check(0)
