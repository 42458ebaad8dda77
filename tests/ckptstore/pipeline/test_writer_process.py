"""async_writer="process": overlapped saves written by a writer process from shared staging
slots (issue 13). Real processes, killed with SIGKILL; the writer is found through /proc."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from ckptstore import CheckpointManager, CheckpointStore, StoreError
from tests.helpers import assert_same, reap

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


def test_a_writer_killed_between_two_blobs_is_replaced_and_its_folders_are_synced(
        tmp_path, monkeypatch):
    """SIGKILL of the writer while it is idle between two blob writes of one save: the next
    put starts another writer, the save commits, and the sync before the commit names every
    blob put since the last sync, the dead writer's included (its successor fsyncs their
    folders: the power-loss campaign checks what survives)."""
    from ckptstore.pipeline.writer_process import WriterProcess

    repo = CheckpointStore(tmp_path / "r", chunk_bytes=MiB, async_writer="process")
    repo.save_async("warm", {"x": torch.ones(4)}, staging="overlap").wait()
    put, request = WriterProcess.put, WriterProcess._request
    killed: list[int] = []
    dead_writer_keys: list[str] = []
    syncs: list[list[str]] = []
    one_at_a_time = threading.Lock()

    def put_then_kill(self, key, data):
        with one_at_a_time:  # no request in flight at the kill: the writer is idle
            put(self, key, data)
            if not killed:
                dead_writer_keys.append(key)
                conn = self._conn
                killed.append(conn.proc.pid)
                os.kill(conn.proc.pid, signal.SIGKILL)
                # reaped (not just a zombie leader whose threads are still going down)
                # before the next put: the writer died while idle
                assert conn.proc.wait(10) == -signal.SIGKILL

    def recording(self, message, payload=None):
        if message["op"] == "sync":
            syncs.append(list(message["keys"]))
        request(self, message, payload)

    monkeypatch.setattr(WriterProcess, "put", put_then_kill)
    monkeypatch.setattr(WriterProcess, "_request", recording)
    state = {f"w{i}": torch.rand(256, 1024) for i in range(4)}  # 4 blobs of 1 MiB
    repo.save_async("big", state, staging="overlap", max_host_bytes=2 * MiB).wait()
    assert killed and writer_pids(os.getpid()) and killed[0] not in writer_pids(os.getpid())
    assert_same(repo.load("big"), state)
    assert repo.verify("big").ok
    assert dead_writer_keys[0] in syncs[-1]  # handed to the writer that replaced it
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


@pytest.mark.parametrize("writer_state", ["frozen mid-save", "writing", "idle"])
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
        elif writer_state == "writing":  # its O_DIRECT writes of 1 MiB blobs in flight
            proc.stdin.write("go\n")
            proc.stdin.flush()
            assert proc.stdout.readline().strip() == "started"
            time.sleep(0.03)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        os.kill(writer, signal.SIGCONT)
        assert wait_gone(writer), "the writer outlived its trainer"
    finally:
        if proc.poll() is None:
            proc.kill()
        reap(proc, 30)
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


# ---------------------------------------------------------------- O_DIRECT writes
def _aligned(nbytes: int) -> memoryview:
    """`nbytes` of random bytes in a page-aligned anonymous mapping (as a shared slot is)."""
    import mmap

    buf = mmap.mmap(-1, max(nbytes, 1))
    view = memoryview(buf)[:nbytes]
    view[:] = np.random.default_rng(nbytes).integers(0, 256, nbytes, np.uint8).tobytes()
    return view


def _cached_pages(path: Path) -> int:
    """How many of the file's pages are in the page cache (mincore(2) of a mapping)."""
    import ctypes
    import mmap

    size = path.stat().st_size
    libc = ctypes.CDLL(None, use_errno=True)
    with path.open("rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as m:
        pages = -(-size // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * pages)()
        address = np.frombuffer(m, np.uint8).ctypes.data
        assert libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vec) == 0
        return sum(v & 1 for v in vec)


def _skip_unless_direct_bypasses_the_cache(folder: Path) -> None:
    """Skip where O_DIRECT writes land in the page cache anyway (tmpfs: its pages are the
    cache), or where the file system refuses O_DIRECT: the page-cache checks below would
    not tell direct from buffered writes there."""
    import fcntl

    folder.mkdir(parents=True, exist_ok=True)
    probe = folder / "probe"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
        os.write(fd, _aligned(64 * 1024))
    except OSError as exc:
        pytest.skip(f"O_DIRECT refused here: {exc}")
    finally:
        os.close(fd)
    cached = _cached_pages(probe)
    probe.unlink()
    if cached:
        pytest.skip("this file system keeps O_DIRECT writes in the page cache")


@pytest.mark.parametrize("nbytes", [4 * MiB, 4 * MiB + 123, MiB + 4095, 300_000])
def test_direct_store_writes_bodies_bit_exact_whatever_their_size(tmp_path, nbytes):
    from ckptstore.stores.direct_io import DIRECT_MIN_BYTES, DirectLocalStore

    store = DirectLocalStore(tmp_path / "s")
    data = _aligned(nbytes)
    store.put("blobs/x", data)
    path = tmp_path / "s" / "blobs" / "x"
    assert path.read_bytes() == data.tobytes()
    assert store.direct_writes == (1 if nbytes >= DIRECT_MIN_BYTES else 0)
    assert store.refused is None
    store.sync()
    assert not list(store.temp_files())


def test_direct_writes_leave_the_page_cache_alone(tmp_path):
    """O_DIRECT is really in effect: the buffered store's file is cached, the direct one's
    is not (but for its buffered tail)."""
    from ckptstore.stores.direct_io import DirectLocalStore
    from ckptstore.stores.local import LocalStore

    _skip_unless_direct_bypasses_the_cache(tmp_path / "probe")
    data = _aligned(8 * MiB + 100)
    LocalStore(tmp_path / "b").put("x", data)
    DirectLocalStore(tmp_path / "d").put("x", data)
    assert _cached_pages(tmp_path / "b" / "x") >= 2048
    assert _cached_pages(tmp_path / "d" / "x") <= 1
    assert (tmp_path / "d" / "x").read_bytes() == data.tobytes()


def test_the_kernel_refusing_a_direct_write_falls_back_to_buffered(tmp_path, monkeypatch):
    """O_DIRECT from a buffer that is not block-aligned: a real file system refuses it
    (EINVAL); the body is written buffered, bit-exact, and the store stops trying."""
    from ckptstore.stores import direct_io

    base = _aligned(3 * MiB + 1)
    unaligned = base[1:]  # one byte past a page boundary
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        reason = direct_io.write_direct(fd, unaligned)
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == unaligned.tobytes()
    if reason is None:
        pytest.skip("this file system takes unaligned O_DIRECT writes (tmpfs)")
    assert "O_DIRECT refused" in reason

    store = direct_io.DirectLocalStore(tmp_path / "s")
    monkeypatch.setattr(direct_io, "direct_eligible", lambda view: True)  # force the try
    store.put("a", unaligned)
    assert store.refused is not None and store.direct_writes == 0
    store.put("b", _aligned(2 * MiB))  # no more tries: buffered, though it is aligned
    assert store.direct_writes == 0
    assert (tmp_path / "s" / "a").read_bytes() == unaligned.tobytes()
    assert (tmp_path / "s" / "b").read_bytes() == _aligned(2 * MiB).tobytes()


def test_a_file_system_without_o_direct_gets_buffered_writes(tmp_path, monkeypatch):
    """Simulated: setting O_DIRECT on the descriptor fails with EINVAL, as on a file system
    without direct IO. Every put still lands bit-exact through the store's protocol."""
    import errno

    from ckptstore.stores import direct_io

    def refuse(fd: int, on: bool) -> None:
        if on:
            raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(direct_io, "_set_direct", refuse)
    store = direct_io.DirectLocalStore(tmp_path / "s")
    for i, n in enumerate([4 * MiB, 2 * MiB + 7]):
        data = _aligned(n)
        store.put(f"blobs/{i}", data)
        assert (tmp_path / "s" / "blobs" / str(i)).read_bytes() == data.tobytes()
    assert store.refused is not None and "Invalid argument" in store.refused
    assert store.direct_writes == 0
    store.sync()
    assert not list(store.temp_files())


def test_overlapped_saves_with_direct_blobs_load_and_verify(tmp_path):
    """Chunks of 1 MiB and more (written direct from the shared slots), with odd-sized
    chunks, a packed small array and arrays sent inline."""
    _skip_unless_direct_bypasses_the_cache(tmp_path / "probe")
    repo = CheckpointStore(tmp_path / "r", chunk_bytes=2 * MiB, async_writer="process")
    torch.manual_seed(5)
    state = {"w": torch.randn(1301, 1031), "h": torch.randn(3, 1 << 20).half(),
             "b": torch.randn(5), "n": np.arange(7.0)}
    expected = {k: v.clone() if isinstance(v, torch.Tensor) else v.copy()
                for k, v in state.items()}
    repo.save_async("a", state, staging="overlap", max_host_bytes=8 * MiB).wait()
    blobs = [p for p in (tmp_path / "r" / "blobs").rglob("*") if p.is_file()]
    big = [p for p in blobs if p.stat().st_size >= MiB]
    assert len(big) >= 4 and any(p.stat().st_size % 4096 for p in big)
    # written direct: not in the page cache (but for a buffered tail) until read
    assert all(_cached_pages(p) <= 1 for p in big)
    assert_same(repo.load("a"), expected)
    assert repo.verify("a").ok
    repo.close()


@pytest.mark.parametrize("direct", [True, False])
def test_the_writer_process_writes_slots_direct_unless_told_not_to(tmp_path, direct):
    from ckptstore.pipeline.writer_process import SharedSlot, WriterProcess
    from ckptstore.stores.local import LocalStore

    _skip_unless_direct_bypasses_the_cache(tmp_path / "probe")
    LocalStore(tmp_path / "r")
    writer = WriterProcess(tmp_path / "r", 1, direct=direct)
    slot = SharedSlot(0, 4 * MiB)
    writer.add_slot(slot)
    data = _aligned(3 * MiB + 5)
    slot.array[: data.nbytes] = np.frombuffer(data, np.uint8)
    writer.put("x", slot.array[: data.nbytes])
    writer.sync()
    writer.close()
    path = tmp_path / "r" / "x"
    cached = _cached_pages(path)
    assert (cached <= 1) if direct else (cached >= 768)
    assert path.read_bytes() == data.tobytes()
