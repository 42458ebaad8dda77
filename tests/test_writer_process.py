"""async_writer="process": overlapped saves written by a writer process from shared staging
slots (issue 13). Real processes, killed with SIGKILL; the writer is found through /proc."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from ckptstore import CheckpointManager, CheckpointStore, StoreError

from .helpers import assert_same

MiB = 1 << 20
MARK = "ckptstore.pipeline.writer_process"


def writer_pids(parent: int) -> list[int]:
    """Writer processes whose parent is `parent` (zombies excluded)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == parent and fields[0] != "Z" and MARK.encode() in cmdline:
            found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_gone(pid: int, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_round_trip_through_the_writer_process(tmp_path):
    repo = CheckpointStore(tmp_path / "r", chunk_bytes=256 * 1024, async_writer="process")
    torch.manual_seed(0)
    w = torch.randn(1024, 512)  # 2 MiB: 8 chunks, staged in shared slots
    state = {"w": w, "tied": w, "t": w.t(), "bf": torch.randn(300, 700).to(torch.bfloat16),
             "small": torch.arange(10), "bias": torch.randn(7),  # packed: sent inline
             "row": torch.randn(2, 200_000),  # one row is larger than a slot: sent inline
             "np": np.arange(12.0).reshape(3, 4), "step": 3}
    expected = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}
    info = repo.save_async("a", state, staging="overlap", max_host_bytes=MiB).wait()
    assert info.staging == "overlap" and info.peak_extra_bytes <= 2 * MiB
    [writer] = writer_pids(os.getpid())
    loaded = repo.load("a")
    assert_same(loaded, expected)
    assert loaded["w"].data_ptr() == loaded["tied"].data_ptr()
    state["w"].add_(1.0)
    repo.save_async("b", state, staging="overlap", max_host_bytes=MiB).wait()
    assert writer_pids(os.getpid()) == [writer]  # one writer serves every save
    assert torch.equal(repo.load("b")["w"], expected["w"] + 1.0)
    assert repo.verify("a").ok and repo.verify("b").ok
    # saves staged by copy and synchronous saves write in this process, as before
    repo.save("c", {"x": torch.ones(3)})
    assert repo.save_async("d", {"x": torch.ones(3)}).wait().staging == "copy"
    repo.close()
    assert wait_gone(writer)


def test_process_writer_needs_a_local_folder():
    with pytest.raises(ValueError, match="local folders only"):
        CheckpointStore(f"memory://{os.getpid()}-proc", async_writer="process")
    with pytest.raises(ValueError, match="async_writer"):
        CheckpointStore(f"memory://{os.getpid()}-proc2", async_writer="fork")


def test_writer_killed_mid_save_fails_it_and_the_next_save_starts_another(tmp_path):
    repo = CheckpointStore(tmp_path / "r", chunk_bytes=MiB, async_writer="process")
    repo.save_async("warm", {"x": torch.ones(4)}, staging="overlap").wait()
    [writer] = writer_pids(os.getpid())
    os.kill(writer, signal.SIGSTOP)  # frozen: the next save is surely in flight below
    state = {f"w{i}": torch.rand(512, 1024) for i in range(8)}  # 16 MiB
    handle = repo.save_async("big", state, staging="overlap", max_host_bytes=4 * MiB)
    time.sleep(0.2)
    assert not handle.done()
    os.kill(writer, signal.SIGKILL)
    with pytest.raises(StoreError, match="writer process ended"):
        handle.wait()
    assert not repo.exists("big") and [c.name for c in repo.list()] == ["warm"]
    info = repo.save_async("again", state, staging="overlap", max_host_bytes=4 * MiB).wait()
    assert info.logical_bytes == 16 * MiB
    assert_same(repo.load("again"), state)
    assert writer_pids(os.getpid()) and writer not in writer_pids(os.getpid())
    repo.close()


def test_write_errors_in_the_writer_surface_from_wait(tmp_path):
    root = tmp_path / "r"
    repo = CheckpointStore(root, chunk_bytes=64 * 1024, async_writer="process")
    repo.save_async("warm", {"x": torch.ones(4)}, staging="overlap").wait()
    (root / "blobs").rename(root / "blobs-gone")
    (root / "blobs").write_bytes(b"a file where the blob folder should be")
    with pytest.raises(StoreError, match="writer process"):
        repo.save_async("a", {"w": torch.randn(512, 256)}, staging="overlap",
                        max_host_bytes=256 * 1024).wait()
    assert not repo.exists("a")
    repo.close()


_PARENT = textwrap.dedent("""
    import os, sys, torch
    from ckptstore import CheckpointStore
    repo = CheckpointStore(sys.argv[1], chunk_bytes=1 << 20, async_writer="process")
    repo.save("base", {"w": torch.ones(8)})
    repo.save_async("warm", {"x": torch.ones(4)}, staging="overlap").wait()
    print("ready", flush=True)
    sys.stdin.readline()  # the test freezes the writer meanwhile
    state = {f"w{i}": torch.rand(1024, 1024) for i in range(16)}   # 64 MiB
    handle = repo.save_async("big", state, staging="overlap", max_host_bytes=4 << 20)
    print("started", flush=True)
    handle.wait()
    print("done", flush=True)
""")


@pytest.mark.parametrize("writer_state", ["frozen mid-save", "idle"])
def test_sigkill_of_the_trainer_leaves_no_checkpoint_and_the_writer_exits(tmp_path,
                                                                         writer_state):
    path = tmp_path / "r"
    proc = subprocess.Popen([sys.executable, "-c", _PARENT, str(path)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdin is not None
    try:
        assert proc.stdout.readline().strip() == "ready"
        [writer] = writer_pids(proc.pid)
        if writer_state == "frozen mid-save":
            os.kill(writer, signal.SIGSTOP)
            proc.stdin.write("go\n")
            proc.stdin.flush()
            assert proc.stdout.readline().strip() == "started"
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        os.kill(writer, signal.SIGCONT)
        assert wait_gone(writer), "the writer outlived its trainer"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    repo = CheckpointStore(path)
    assert [c.name for c in repo.list()] == ["base", "warm"]
    assert not repo.exists("big") and repo.verify("base").ok
    repo.close()


def test_manager_with_the_writer_process_keeps_every_steps_values(tmp_path):
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(128, 768), torch.nn.ReLU(),
                                torch.nn.Linear(768, 512))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mgr = CheckpointManager(tmp_path / "run", async_save=True, staging="overlap",
                            max_host_bytes=512 * 1024, chunk_bytes=128 * 1024,
                            async_writer="process")
    gen = torch.Generator().manual_seed(3)
    snapshots = {}
    for step in range(1, 13):
        loss = model(torch.randn(32, 128, generator=gen)).logsumexp(1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 3 == 0:
            snapshots[step] = {k: v.clone() for k, v in model.state_dict().items()}
            mgr.save(step, {"model": model, "optim": opt})
    mgr.wait()
    for step, snap in snapshots.items():
        loaded = mgr.repo.load(mgr.name_of(step), keys=["model"])["model"]
        for k, v in snap.items():
            assert torch.equal(loaded[k], v), (step, k)
    mgr.close()


def test_auto_writes_overlapped_saves_to_local_folders_with_a_writer_process(tmp_path):
    state = {"w": torch.randn(256, 256)}
    before = set(writer_pids(os.getpid()))
    threads = CheckpointStore(tmp_path / "t", async_writer="thread")
    threads.save_async("a", state, staging="overlap").wait()
    memory = CheckpointStore(f"memory://{os.getpid()}-auto")  # "auto": threads
    memory.save_async("a", state, staging="overlap").wait()
    assert set(writer_pids(os.getpid())) == before
    local = CheckpointStore(tmp_path / "l")  # "auto": a writer process
    local.save_async("a", state, staging="overlap").wait()
    [writer] = set(writer_pids(os.getpid())) - before
    for repo in (threads, memory, local):
        assert_same(repo.load("a"), state)
        repo.close()
    assert wait_gone(writer)


def test_a_dropped_store_stops_its_writer(tmp_path):
    import gc

    repo = CheckpointStore(tmp_path / "r")
    repo.save_async("a", {"w": torch.randn(64, 64)}, staging="overlap").wait()
    [writer] = writer_pids(os.getpid())
    del repo  # never closed
    gc.collect()
    assert wait_gone(writer)
