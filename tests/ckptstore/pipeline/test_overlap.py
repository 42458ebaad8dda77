"""save_async(staging="overlap"): background copies within a host-memory budget, optimizer
guards, detection of tensors changed too early, crash safety (issue 13)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch

from ckptstore import CheckpointManager, CheckpointStore, MemoryStore, SourceChangedError
from tests.helpers import assert_same, reap, wait_until

MiB = 1 << 20


def _equal(loaded, expected, path=""):
    """Same keys and bit-identical tensors (container types may differ)."""
    assert set(loaded) == set(expected), path
    for k, v in expected.items():
        if isinstance(v, dict):
            _equal(loaded[k], v, f"{path}.{k}")
        else:
            assert_same(loaded[k], v, f"{path}.{k}")


def _clone(state):
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def test_overlap_round_trip_returns_before_copying(tmp_path):
    repo = CheckpointStore(tmp_path / "r", chunk_bytes=256 * 1024)
    w = torch.randn(1024, 512)  # 2 MiB: 8 chunks
    state = {"w": w, "tied": w, "t": w.t(), "bf": torch.randn(300, 700).to(torch.bfloat16),
             "small": torch.arange(10), "np": np.arange(12.0).reshape(3, 4), "b": b"xyz",
             "step": 3}
    expected = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}
    handle = repo.save_async("a", state, staging="overlap", max_host_bytes=MiB)
    state["np"][0, 0] = -1.0  # numpy arrays are copied at call time: safe to change
    info = handle.wait()
    assert info.staging == "overlap" and info.copied_at_call_bytes == 12 * 8
    assert info.peak_extra_bytes <= MiB
    loaded = repo.load("a")
    expected["np"] = np.arange(12.0).reshape(3, 4)
    assert_same(loaded, expected)
    assert loaded["w"].data_ptr() == loaded["tied"].data_ptr()  # tied weights still tied
    repo.close()


def test_a_load_into_the_tensors_of_an_overlapped_save_waits_until_they_are_copied(tmp_path):
    # a load writes its destinations through raw memory (no version counter moves): the
    # overlapped save in flight committed a mix of the call's values and the loaded ones
    repo = CheckpointStore(tmp_path / "r", chunk_bytes=256 * 1024)
    repo.save("old", {"w": torch.zeros(16 << 20)})
    w = torch.ones(16 << 20)  # 64 MiB: 256 chunks through a 1 MiB staging pool
    handle = repo.save_async("new", {"w": w}, staging="overlap", max_host_bytes=MiB)
    repo.load("old", into={"w": w})  # a rollback while the save runs
    handle.wait()
    assert not w.any()  # the load's values
    assert bool((repo.load("new")["w"] == 1).all())  # the call's values, whole
    repo.close()


def test_store_and_manager_defaults():
    repo = CheckpointStore(f"memory://{os.getpid()}-defaults", staging="overlap",
                           max_host_bytes=8 * MiB)
    info = repo.save_async("a", {"w": torch.randn(64, 64)}).wait()
    assert info.staging == "overlap"
    assert repo.save_async("b", {"w": torch.randn(64, 64)}, staging="copy").wait().staging \
        == "copy"
    with pytest.raises(ValueError):
        repo.save_async("c", {}, staging="lazy")
    with pytest.raises(ValueError):
        CheckpointManager(repo, async_save=True, staging="overlap", max_host_bytes=0)
    repo.close()


class _GatedStore(MemoryStore):
    """A memory store whose blob writes wait until `gate` is set: the save stays at its
    first block (one staging slot) until the test has made its changes."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.gate = threading.Event()

    def put(self, key, data):
        if key.startswith("blobs/"):
            assert self.gate.wait(30)
        return super().put(key, data)


def test_unguarded_change_right_after_the_call_fails_cleanly_or_keeps_old_values():
    store = _GatedStore(f"gated-{os.getpid()}")
    repo = CheckpointStore(store, chunk_bytes=128 * 1024)
    torch.manual_seed(0)
    gate = torch.zeros(128 * 1024 // 4)  # first in the state, never changed: one block
    state = {"gate": gate, **{f"w{i}": torch.randn(256, 512) for i in range(6)}}  # 4 blocks each
    store.gate.set()
    repo.save("base", state)
    for attempt in range(3):
        store.gate.clear()
        name = f"s{attempt}"
        handle = repo.save_async(name, state, staging="overlap", max_host_bytes=128 * 1024)
        for key, t in state.items():  # the trainer moves on without a guard
            if key != "gate":
                t.add_(1.0)
        store.gate.set()  # only now can the save copy past its first block
        with pytest.raises(SourceChangedError) as err:
            handle.wait()
        assert err.value.key in state and "nothing was committed" in str(err.value)
        assert not repo.exists(name)
    # a change after the save ended never reaches it (staged, written and committed)
    old = _clone(state)
    repo.save_async("after", state, staging="overlap", max_host_bytes=128 * 1024).wait()
    for t in state.values():
        t.add_(1.0)
    assert_same(repo.load("after"), old)
    assert repo.latest() == "after" and repo.verify("base").ok
    repo.close()


def test_change_after_wait_and_guard_hold_call_time_values(tmp_path):
    repo = CheckpointStore(tmp_path / "r", chunk_bytes=64 * 1024)
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 256))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    x = torch.randn(32, 256)
    for _ in range(2):
        model(x).square().mean().backward()
        opt.step()
    expected = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                "optim": {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}}
    model(x).square().mean().backward()  # gradients of the next step, ready at once
    handle = repo.save_async("a", {"model": model.state_dict(),
                                   "optim": opt.state_dict()["state"][0]},
                             staging="overlap", max_host_bytes=256 * 1024)
    handle.guard(opt)
    assert len(opt._optimizer_step_pre_hooks) == 1
    opt.step()  # waits for the copies of the parameters and moments, then changes them
    info = handle.wait()
    assert not opt._optimizer_step_pre_hooks  # removed once the save ended
    assert info.guard_wait_seconds >= 0.0
    loaded = repo.load("a")
    _equal(loaded["model"], expected["model"])
    _equal(loaded["optim"], expected["optim"])
    assert not torch.equal(model[0].weight, expected["model"]["0.weight"])  # the step ran
    handle.guard(opt)  # after the save: nothing to guard
    assert not opt._optimizer_step_pre_hooks
    repo.close()


class _FailingStore(MemoryStore):
    """A memory store whose blob writes fail after the first few (a full disk)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.puts = 0

    def put(self, key, data):
        if key.startswith("blobs/"):
            self.puts += 1
            if self.puts > 3:
                raise OSError(28, "No space left on device")
        return super().put(key, data)


def test_background_write_error_surfaces_from_wait():
    store = _FailingStore(f"fail-{os.getpid()}")
    repo = CheckpointStore(store, chunk_bytes=64 * 1024)
    handle = repo.save_async("a", {"w": torch.randn(512, 256)}, staging="overlap",
                             max_host_bytes=256 * 1024)
    with pytest.raises(OSError, match="No space left"):
        handle.wait()
    assert repo.list() == []
    # an error nobody waited for is raised by the next save
    repo.save_async("b", {"w": torch.randn(512, 256)}, staging="overlap")
    with pytest.raises(OSError, match="No space left"):
        repo.save_async("c", {"w": torch.randn(4)}, staging="overlap")
    assert repo.list() == []
    repo.close()


def test_manager_guards_optimizer_over_many_steps(tmp_path):
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(128, 768), torch.nn.BatchNorm1d(768),
                                torch.nn.ReLU(), torch.nn.Linear(768, 512),
                                torch.nn.Linear(512, 10))  # 1.6-1.5 MiB layers: guarded
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mgr = CheckpointManager(tmp_path / "run", async_save=True, staging="overlap",
                            max_host_bytes=512 * 1024, chunk_bytes=128 * 1024, workers=2)
    state = {"model": model, "optim": opt, "extra": {"ema": torch.zeros(300, 1000)}}
    snapshots = {}
    gen = torch.Generator().manual_seed(3)
    handles = []
    for step in range(1, 25):
        x = torch.randn(64, 128, generator=gen)
        loss = model(x).logsumexp(1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        state["extra"]["ema"].mul_(0.5).add_(step)  # plain entry: copied at call time
        if step % 3 == 0:
            snapshots[step] = _snapshot(model, opt, state["extra"])
            handles.append(mgr.save(step, state))
    mgr.wait()
    waited = [h.wait().guard_wait_seconds for h in handles]
    assert all(w >= 0 for w in waited)
    assert not opt._optimizer_step_pre_hooks
    for step, snap in snapshots.items():
        loaded = mgr.repo.load(mgr.name_of(step))
        _equal(loaded["model"], snap["model"])
        _equal(loaded["optim"]["state"], snap["optim"])
        _equal(loaded["extra"], snap["extra"])
    mgr.close()


def test_manager_guards_accelerates_wrapped_optimizer_and_commits_what_it_acknowledged(
        tmp_path):
    """accelerate's AcceleratedOptimizer subclasses torch's Optimizer without its hooks: the
    save used to raise AttributeError from `guard` while its background write went on and
    committed. It is now guarded through the optimizer it wraps, from the start."""
    from accelerate import Accelerator

    torch.manual_seed(5)
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.Linear(1024, 300))
    model, opt = accelerator.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-2))
    assert type(opt).__name__ == "AcceleratedOptimizer"
    mgr = CheckpointManager(tmp_path / "run", async_save=True, staging="overlap",
                            max_host_bytes=256 * 1024, chunk_bytes=128 * 1024)
    state = {"model": model, "optim": opt}
    snapshots = {}
    for step in range(1, 7):
        loss = model(torch.randn(16, 64)).square().mean()
        opt.zero_grad()
        accelerator.backward(loss)
        opt.step()  # waits for the copies of the save before it (the inner optimizer's hook)
        if step % 2 == 0:
            snapshots[step] = _snapshot(model, opt.optimizer, {})
            mgr.save(step, state)
    mgr.wait()
    assert not opt.optimizer._optimizer_step_pre_hooks
    for step, snap in snapshots.items():
        loaded = mgr.repo.load(mgr.name_of(step))
        _equal(loaded["model"], snap["model"])
        _equal(loaded["optim"]["state"], snap["optim"])
    mgr.close()


def test_an_optimizer_that_cannot_be_guarded_is_copied_at_call_and_a_failed_guard_commits_nothing(
        tmp_path):
    class Hookless(torch.optim.SGD):  # an Optimizer without torch's hook registry
        def __init__(self, params):
            super().__init__(params, lr=0.1)
            del self._optimizer_step_pre_hooks

    model = torch.nn.Linear(256, 256)
    opt = Hookless(model.parameters())
    mgr = CheckpointManager(tmp_path / "run", async_save=True, staging="overlap")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    mgr.save(1, {"model": model, "optim": opt}).wait()  # its tensors are copied at the call
    _equal(mgr.repo.load("step-1")["model"], before)
    repo = mgr.repo
    with pytest.raises(TypeError, match="cannot guard Hookless"):
        repo.save_async("direct", {"w": model.weight}, staging="overlap", guard=[opt])
    repo.wait()
    assert not repo.exists("direct") and repo.names() == ["step-1"]
    mgr.close()


def _snapshot(model, opt, extra):
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "optim": {i: {k: v.clone() for k, v in s.items()}
                      for i, s in opt.state_dict()["state"].items()},
            "extra": {k: v.clone() for k, v in extra.items()}}


_RSS_CHILD = textwrap.dedent("""
    import json, resource, sys, torch
    from ckptstore import CheckpointStore
    torch.manual_seed(0)
    state = {f"w{i}": torch.rand(4096, 4096) for i in range(8)}   # 8 x 64 MiB = 512 MiB
    repo = CheckpointStore(sys.argv[1], chunk_bytes=8 << 20, workers=4)
    repo.save_async("warm", {"x": torch.ones(4)}, staging="overlap").wait()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    info = repo.save_async("big", state, staging="overlap", max_host_bytes=64 << 20).wait()
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"growth": (after - before) * 1024, "peak": info.peak_extra_bytes,
                      "bytes": info.logical_bytes}))
""")


def test_peak_rss_stays_within_the_budget(tmp_path):
    out = subprocess.run([sys.executable, "-c", _RSS_CHILD, str(tmp_path / "r")],
                         capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(out.stdout)
    assert result["bytes"] == 512 * MiB
    assert result["peak"] <= 64 * MiB
    assert result["growth"] <= 64 * MiB + 96 * MiB, result


_KILL_CHILD = textwrap.dedent("""
    import sys, torch
    from ckptstore import CheckpointStore
    repo = CheckpointStore(sys.argv[1], chunk_bytes=1 << 20, workers=2)
    state = {f"w{i}": torch.rand(1024, 1024) for i in range(48)}   # 192 MiB
    repo.save("base", {"w": torch.ones(8)})
    handle = repo.save_async("big", state, staging="overlap", max_host_bytes=4 << 20)
    print("started", flush=True)
    handle.wait()
    print("done", flush=True)
""")


def test_sigkill_during_overlapped_save_leaves_no_checkpoint(tmp_path):
    path = tmp_path / "r"
    proc = subprocess.Popen([sys.executable, "-c", _KILL_CHILD, str(path)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "started"
    time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    reap(proc, 30)
    assert proc.returncode == -signal.SIGKILL
    repo = CheckpointStore(path)
    assert [c.name for c in repo.list()] == ["base"]
    assert not repo.exists("big") and repo.verify("base").ok
    repo.close()


def test_turns_let_one_thread_work_and_copies_go_first():
    import threading

    from ckptstore.concurrency import Turns

    turns = Turns(1)
    order: list[str] = []
    working = []
    held = threading.Event()
    release = threading.Event()

    def holder():
        with turns.write():
            held.set()
            release.wait(5)

    def job(kind: str, started: threading.Event):
        started.set()
        with getattr(turns, kind)():
            working.append(kind)
            assert len(working) == 1  # never two at once
            order.append(kind)
            working.remove(kind)

    h = threading.Thread(target=holder)
    h.start()
    assert held.wait(5)
    threads = []
    for n, kind in enumerate(("write", "write", "copy")):  # the copy asks last
        started = threading.Event()
        t = threading.Thread(target=job, args=(kind, started))
        t.start()
        assert started.wait(5)
        # it waits for its turn now: on the Condition of its kind (no guessed sleep)
        turn = turns._copy_turn if kind == "copy" else turns._write_turn
        waiting = 1 if kind == "copy" else n + 1
        wait_until(lambda turn=turn, waiting=waiting: len(turn._waiters) == waiting,
                   what=f"{kind} job {n} waiting for its turn")
        threads.append(t)
    release.set()
    for t in [h, *threads]:
        t.join(5)
    assert order == ["copy", "write", "write"]


def test_turns_hand_the_turn_back_for_blocking_writes():
    import threading

    from ckptstore.concurrency import Turns

    turns = Turns(1, io=1)
    in_io = threading.Event()
    leave_io = threading.Event()

    def writer():
        with turns.write(), turns.io():
            in_io.set()
            leave_io.wait(5)

    t = threading.Thread(target=writer)
    t.start()
    assert in_io.wait(5)
    got = threading.Event()
    c = threading.Thread(target=lambda: [got.set() for _ in [turns.copy().__enter__()]])
    c.start()
    assert got.wait(2)  # the writer waits on its write: another thread may work meanwhile
    leave_io.set()
    t.join(5)


def test_turns_boosted_lends_a_turn_while_the_trainer_waits():
    import threading

    from ckptstore.concurrency import Turns

    turns = Turns(1)
    inside = threading.Event()
    leave = threading.Event()

    def holder():
        with turns.write():
            inside.set()
            leave.wait(5)

    t = threading.Thread(target=holder)
    t.start()
    assert inside.wait(5)
    second = threading.Event()
    w = threading.Thread(target=lambda: [second.set() for _ in [turns.write().__enter__()]])
    w.start()
    assert not second.wait(0.2)  # one turn, taken
    with turns.boosted(1, 0):
        assert second.wait(5)  # the lent turn lets it in
    leave.set()
    t.join(5)


class _SlowPutStore(MemoryStore):
    """A memory store whose blob writes take a while and record how many ran at once."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.lock = threading.Lock()
        self.running = 0
        self.most = 0

    def put(self, key, data):
        if not key.startswith("blobs/"):
            return super().put(key, data)
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            time.sleep(0.03)
            return super().put(key, data)
        finally:
            with self.lock:
                self.running -= 1


@pytest.mark.parametrize("staging", ["copy", "overlap"])
def test_a_caller_blocked_in_wait_lends_its_core_to_the_save(staging):
    """A background save works one write at a time beside training; once the caller blocks
    in `wait()` (its core is free), writes run side by side and the save ends sooner."""
    torch.manual_seed(0)
    state = {f"w{i}": torch.randn(64, 1024) for i in range(16)}  # 16 chunks of 256 KiB
    most = {}
    for waits in (False, True):
        store = _SlowPutStore(f"slow-{os.getpid()}-{staging}-{waits}")
        repo = CheckpointStore(store, chunk_bytes=256 * 1024, async_writer="thread")
        handle = repo.save_async("s", state, staging=staging, max_host_bytes=8 << 20)
        if not waits:  # the trainer goes on: poll without blocking in wait()
            while not handle.done():
                time.sleep(0.01)
        handle.wait()
        most[waits] = store.most
        _equal(repo.load("s"), state)
        repo.close()
    assert most[False] == 1, most  # beside training: one write at a time
    assert most[True] > 1, most  # wait() lent the caller's core: writes side by side
