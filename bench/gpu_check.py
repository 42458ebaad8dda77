#!/usr/bin/env python
"""Device saves and restores on a real GPU (ckptstore/pipeline/device.py): correctness, then
speed beside torch.distributed.checkpoint (DCP) async_save with its DefaultStager (pinned
memory, non-blocking copies on a staging stream).

    python bench/gpu_check.py          # no arguments; at most 8 minutes; the last line is JSON

Without a GPU (torch.cuda.is_available() False) the last line says so ("gpu": false) and the
exit code is 0; what runs then is the CPU fallback: the same correctness cases through
FakeDevice (the seam's test double), the disk's read speed and the sizing plan.

On a GPU:

1. correctness, bit-exact, on cuda:0: fp32 (several chunks), bf16, int8, bool, a
   non-contiguous view, tied views of one storage, a 0-d tensor, an empty one, CPU tensors
   and numpy beside them (mixed state), values written by a kernel issued just before the
   save call (the copies must wait for it); saved by `save`, `save_async(staging="copy")`,
   `save_async(staging="overlap")` written by the writer process and by threads with an
   optimizer guard stepping meanwhile, and by CheckpointManager (overlap, guarded Adam,
   BatchNorm buffers); each restored into CUDA tensors (`into=`) and as new CUDA tensors
   (`device="cuda:0"`, `map_location=` for the manager), tied storage kept; a DTensor on a
   1-GPU mesh (Shard(0), Replicate) saved and restored into DTensors.
2. speed, for a state of at least 8 GiB on the GPU (sized down to fit the GPU, host memory,
   disk and about 25 s per save): a training loop (matmuls, then SGD over the state's
   tensors) checkpointed by ckptstore (staging="overlap", guard on the optimizer) and by DCP
   (async_save, staging waited for before the next optimizer step). Per save: the loop's
   stall (the call plus what the next steps waited for), the extra time per step while the
   save runs, the time until durable, the peak extra host memory (RSS of the trainer and
   its writer process, less the shared slots counted once) and the pinned bytes. Restore
   into the CUDA tensors (page cache dropped with fadvise first) in GB/s for both, against
   the raw limits: pinned host-to-device bandwidth and the disk's parallel read speed.
   Targets: stall <= DCP's; extra host memory <= max_host_bytes + 64 MiB; restore >= 1.5x
   DCP and >= 0.8x the slower raw limit.

GPU_CHECK_DIR sets where checkpoints are written (default: a folder under the current one).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import ckptstore  # noqa: E402
from ckptstore.pipeline.device import FakeDevice  # noqa: E402

GiB = 1 << 30
MiB = 1 << 20
DEADLINE = time.monotonic() + 7.5 * 60  # the whole run, with margin under 8 minutes
TARGET_STATE = 8 * GiB
MAX_HOST_BYTES = 512 * MiB
SECONDS_PER_SAVE = 20.0  # the state is sized so that one save takes about this at most
CKPT_OPTIONS = {"background_workers": 2, "background_io": 4}  # a GPU job leaves cores idle
DEVICE = "cuda:0"  # where the speed run's state lives
DCP_STAGING = {"use_pinned_memory": True, "use_shared_memory": False,
               "use_async_staging": True, "use_non_blocking_copy": True}


def left() -> float:
    return DEADLINE - time.monotonic()


# ------------------------------------------------------------------------------ helpers
def same(a: Any, b: Any) -> bool:
    """Bit-exact equality of tensors (any device, any layout) or numpy arrays."""
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
        return False
    x = a.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    y = b.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return bool(torch.equal(x, y))


class Place:
    """Where the correctness cases put their tensors: cuda:0, or FakeDevice on the CPU."""

    def __init__(self, device: Any) -> None:
        self.device = device  # "cuda:0" or a FakeDevice
        self.fake = device if isinstance(device, FakeDevice) else None

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if self.fake is not None:
            self.fake.adopt(t)
            return t
        return t.to(self.device)

    def module(self, m: torch.nn.Module) -> torch.nn.Module:
        if self.fake is not None:
            self.fake.adopt(m)
            return m
        return m.to(self.device)

    def adopt(self, *objs: Any) -> None:  # optimizer states made after a step
        if self.fake is not None:
            self.fake.adopt(*objs)

    def owns(self, t: torch.Tensor) -> bool:
        if self.fake is not None:
            return not t.numel() or self.fake.owns(t)
        return t.device.type == "cuda"

    def sync(self) -> None:
        if self.fake is None:
            torch.cuda.synchronize()


def case_state(place: Place) -> tuple[dict[str, Any], dict[str, Any]]:
    """(state on the device, its expected values on the host)."""
    g = torch.Generator().manual_seed(7)
    host = {
        "fp32": torch.randn(1024, 1536, generator=g),  # 6 MiB: several 1 MiB chunks
        "bf16": torch.randn(700, 300, generator=g).to(torch.bfloat16),
        "int8": torch.randint(-128, 127, (300000,), dtype=torch.int8, generator=g),
        "bool": torch.rand(100000, generator=g) > 0.5,
        "base": torch.randn(800, 600, generator=g),
        "scalar": torch.tensor(1.5), "empty": torch.empty(0, 3),
        "small": torch.randn(33, generator=g),
    }
    dev = {k: place(v.clone()) for k, v in host.items()}
    state: dict[str, Any] = {
        "model": {**{k: dev[k] for k in ("fp32", "bf16", "int8", "bool", "scalar", "empty",
                                         "small")},
                  "nc": dev["base"].t(), "tied": dev["fp32"][100:300]},
        "host": {"cpu": torch.arange(5000.0), "np": np.arange(12, dtype=np.int16)},
    }
    expected = {"model": {**{k: host[k] for k in ("fp32", "bf16", "int8", "bool", "scalar",
                                                  "empty", "small")},
                          "nc": host["base"].t(), "tied": host["fp32"][100:300]},
                "host": {"cpu": torch.arange(5000.0), "np": np.arange(12, dtype=np.int16)}}
    return state, expected


def kernel_write(state: dict[str, Any], expected: dict[str, Any]) -> None:
    """Values written on the device right before the save call (no synchronize): the save's
    copies must wait for this work (its call-time mark)."""
    with torch.no_grad():
        state["model"]["fp32"].mul_(2.0)
    expected["model"]["fp32"].mul_(2.0)  # x2 is exact: the same bits on both sides


def check_tree(got: Any, want: Any, path: str, place: Place | None, problems: list[str]
               ) -> None:
    if isinstance(want, dict):
        for k, v in want.items():
            if not isinstance(got, dict) or k not in got:
                problems.append(f"{path}.{k}: missing")
                continue
            check_tree(got[k], v, f"{path}.{k}", place, problems)
        return
    if not same(got, want):
        problems.append(f"{path}: values differ")
    elif place is not None and isinstance(got, torch.Tensor) and not place.owns(got):
        problems.append(f"{path}: not on the device")


def zeros_like_tree(tree: Any, place: Place) -> Any:
    if isinstance(tree, dict):
        return {k: zeros_like_tree(v, place) for k, v in tree.items()}
    if isinstance(tree, torch.Tensor):
        return place(torch.zeros(tree.shape, dtype=tree.dtype))
    return np.zeros_like(tree)


def correctness(place: Place, root: Path) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []

    def record(name: str, fn: Callable[[], list[str]]) -> None:
        t0 = time.perf_counter()
        try:
            problems = fn()
            results.append({"case": name, "ok": not problems, "problems": problems[:5],
                            "seconds": round(time.perf_counter() - t0, 2)})
        except Exception as exc:
            results.append({"case": name, "ok": False,
                            "error": f"{type(exc).__name__}: {exc}"[:400],
                            "where": traceback.format_exc(limit=-3)[-600:]})

    def mode_case(mode: str) -> list[str]:
        folder = root / f"c-{mode}"
        writer = "process" if mode == "overlap-process" else "thread"
        repo = ckptstore.CheckpointStore(folder, chunk_bytes=1 * MiB, async_writer=writer,
                                         max_inflight_bytes=8 * MiB)
        state, expected = case_state(place)
        kernel_write(state, expected)
        if mode == "save":
            repo.save("a", state)
        elif mode == "copy":
            repo.save_async("a", state, staging="copy").wait()
        elif mode == "overlap-process":
            repo.save_async("a", state, staging="overlap", max_host_bytes=4 * MiB).wait()
        else:  # overlap by threads, an optimizer stepping meanwhile over other tensors
            w = place(torch.randn(2048, 1024))
            w.grad = place(torch.ones(2048, 1024))
            opt = torch.optim.SGD([w], lr=0.5)
            state["model"]["w"] = w
            expected["model"]["w"] = w.detach().cpu().clone()
            handle = repo.save_async("a", state, staging="overlap", max_host_bytes=4 * MiB,
                                     guard=[opt])
            opt.step()  # waits for w's copies, then changes w: the checkpoint has the old w
            handle.wait()
        problems: list[str] = []
        place.sync()
        check_tree(repo.load("a"), expected, "load", None, problems)
        into = zeros_like_tree(expected, place)
        repo.load("a", into=into)
        check_tree(into, expected, "into", None, problems)
        new = repo.load("a", device=place.device)
        check_tree(new["model"], expected["model"], "device", place, problems)
        if new["model"]["tied"].untyped_storage().data_ptr() != \
                new["model"]["fp32"].untyped_storage().data_ptr():
            problems.append("device: tied tensors do not share storage")
        repo.close()
        return problems

    def manager_case() -> list[str]:
        torch.manual_seed(0)

        def net() -> torch.nn.Module:
            return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.BatchNorm1d(512),
                                       torch.nn.Linear(512, 64))

        model = place.module(net())
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)

        def train() -> None:
            x = place(torch.randn(32, 256))
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()

        train()
        place.adopt(opt)
        mgr = ckptstore.CheckpointManager(root / "c-manager", async_save=True,
                                          staging="overlap", max_host_bytes=4 * MiB,
                                          chunk_bytes=1 * MiB)
        want_model = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        want_opt = [{k: v.detach().cpu().clone() for k, v in s.items()}
                    for s in opt.state.values()]
        mgr.save(1, {"model": model, "optim": opt, "rng": ckptstore.RNGState()})
        train()
        train()
        mgr.close()
        model2 = place.module(net())
        opt2 = torch.optim.Adam(model2.parameters(), lr=1e-2)
        mgr = ckptstore.CheckpointManager(root / "c-manager")
        problems: list[str] = []
        if mgr.restore({"model": model2, "optim": opt2, "rng": ckptstore.RNGState()},
                       map_location=place.device) != 1:
            problems.append("restore did not find step 1")
        check_tree(dict(model2.state_dict()), want_model, "model", place, problems)
        for i, s in enumerate(opt2.state.values()):
            for k, v in s.items():
                if not same(v, want_opt[i][k]):
                    problems.append(f"optim.{i}.{k}: values differ")
        mgr.close()
        return problems

    def dtensor_case() -> list[str]:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Replicate, Shard

        backend = "gloo" if place.fake is not None else "cpu:gloo,cuda:nccl"
        dist.init_process_group(backend, init_method=f"file://{root / 'pg'}", rank=0,
                                world_size=1)
        try:
            mesh = init_device_mesh("cpu" if place.fake is not None else "cuda", (1,))
            g = torch.Generator().manual_seed(1)
            a_host = torch.randn(1500, 700, generator=g)
            b_host = torch.randn(333, generator=g).to(torch.bfloat16)
            a = DTensor.from_local(place(a_host.clone()), mesh, [Shard(0)])
            b = DTensor.from_local(place(b_host.clone()), mesh, [Replicate()])
            repo = ckptstore.CheckpointStore(root / "c-dtensor", chunk_bytes=1 * MiB)
            repo.save("s", {"a": a, "b": b})
            repo.save_async("o", {"a": a, "b": b}, staging="overlap",
                            max_host_bytes=4 * MiB).wait()
            problems: list[str] = []
            for name in ("s", "o"):
                za = DTensor.from_local(place(torch.zeros(1500, 700)), mesh, [Shard(0)])
                zb = DTensor.from_local(place(torch.zeros(333, dtype=torch.bfloat16)), mesh,
                                        [Replicate()])
                repo.load(name, into={"a": za, "b": zb})
                if not (same(za.to_local(), a_host) and same(zb.to_local(), b_host)):
                    problems.append(f"{name}: DTensor values differ")
            repo.close()
            return problems
        finally:
            dist.destroy_process_group()

    for mode in ("save", "copy", "overlap-process", "overlap-guarded"):
        record(mode, lambda mode=mode: mode_case(mode))
    record("manager", manager_case)
    record("dtensor-1-device-mesh", dtensor_case)
    return results


# ------------------------------------------------------------------------------ measuring
def host_bytes(pids: list[int]) -> int:
    """Resident bytes of the trainer plus its children's private resident bytes (the shared
    slots a writer process maps are counted once, in the trainer)."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for i, pid in enumerate(pids):
        try:
            fields = Path(f"/proc/{pid}/statm").read_text().split()
        except OSError:
            continue
        resident, shared = int(fields[1]), int(fields[2])
        total += (resident if i == 0 else resident - shared) * page
    return total


def children() -> list[int]:
    try:
        text = Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


class Peak:
    """Samples host_bytes every 20 ms in the background; `peak` since start."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, host_bytes([os.getpid(), *children()]))
            self._stop.wait(0.02)

    def __enter__(self) -> Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def drop_cache(folder: Path) -> None:
    """Evict a checkpoint's files from the page cache (they are fsynced: clean pages)."""
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def disk_read_gbps(folder: Path, threads: int = 8) -> float:
    """Parallel buffered reads of every file under `folder`, from the device (cache dropped)."""
    files = [p for p in folder.rglob("*") if p.is_file()]
    drop_cache(folder)
    total = sum(p.stat().st_size for p in files)

    def read(path: Path) -> None:
        view = memoryview(bytearray(16 * MiB))
        with open(path, "rb", buffering=0) as f:
            while f.readinto(view):
                pass

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(threads) as pool:
        list(pool.map(read, files))
    return total / (time.perf_counter() - t0) / 1e9


def disk_write_gbps(folder: Path, nbytes: int) -> float:
    """One file of `nbytes` written in 16 MiB pieces and fsynced."""
    path = folder / "write-probe"
    block = np.random.default_rng(0).integers(0, 255, 16 * MiB, dtype=np.uint8).tobytes()
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for _ in range(max(1, nbytes // len(block))):
            f.write(block)
        os.fsync(f.fileno())
    seconds = time.perf_counter() - t0
    path.unlink()
    return max(1, nbytes // len(block)) * len(block) / seconds / 1e9


def meminfo_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def plan_size(root: Path, gpu_free: int | None) -> dict[str, Any]:
    """The state's size: TARGET_STATE, or less to fit the GPU, host memory (DCP pins a full
    host copy), the disk (two checkpoints) and about SECONDS_PER_SAVE per save."""
    write = disk_write_gbps(root, 512 * MiB)
    limits = {"target": TARGET_STATE,
              "host": int((meminfo_available() - 4 * GiB) / 1.5),
              "disk": int(shutil.disk_usage(root).free / 3.5),  # 2 + 1 checkpoints, margin
              "time": int(SECONDS_PER_SAVE * write * 1e9)}
    if gpu_free is not None:
        limits["gpu"] = int(gpu_free * 0.4)
    size = max(256 * MiB, min(limits.values()) // (256 * MiB) * 256 * MiB)
    bound = min(limits, key=lambda k: limits[k])
    return {"state_bytes": size, "bound_by": bound, "limits": limits,
            "disk_write_gbps": round(write, 2)}


# ------------------------------------------------------------------------------ speed
class Loop:
    """A training step on the GPU: matmuls on activations, then SGD over the state's
    tensors (what a checkpoint must hold still while it copies them)."""

    def __init__(self, nbytes: int, n: int = 8192) -> None:
        per = n * n // 2 * 4  # 128 MiB fp32 tensors
        count = max(1, nbytes // per)
        self.module = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.randn(n // 2, n, device=DEVICE)) for _ in range(count)])
        self.params = list(self.module.parameters())
        for p in self.params:
            p.grad = torch.full_like(p, 1e-3)
        self.opt = torch.optim.SGD(self.params, lr=1e-3, foreach=True)
        self.x = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
        self.w = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
        self.nbytes = sum(p.numel() * 4 for p in self.params)
        self.before_step: Callable[[], None] | None = None

    def tensors(self) -> dict[str, Any]:
        """The state as plain tensors (DCP's state dict)."""
        return {"model": dict(self.module.state_dict())}

    def step(self) -> float:
        """One step; returns its wall time (synchronized)."""
        t0 = time.perf_counter()
        y = self.x
        for _ in range(24):
            y = torch.mm(y, self.w)
        if self.before_step is not None:
            self.before_step()
        self.opt.step()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def checksum(self) -> list[int]:
        return [int(p.detach().view(torch.int32).sum(dtype=torch.int64)) for p in self.params]


def baseline(loop: Loop, steps: int = 12) -> float:
    times = [loop.step() for _ in range(steps)]
    return statistics.median(times[2:])


def ckpt_saves(loop: Loop, folder: Path, saves: int, max_host_bytes: int
               ) -> tuple[dict[str, Any], list[int], int]:
    """CheckpointManager (async, overlap, keep_last=1) beside the loop: the optimizer is
    guarded, the parameters are never copied at call time."""
    mgr = ckptstore.CheckpointManager(folder, keep_last=1, async_save=True,
                                      staging="overlap", max_host_bytes=max_host_bytes,
                                      **CKPT_OPTIONS)
    base_step = baseline(loop)
    base_mem = host_bytes([os.getpid(), *children()])
    rows = []
    want: list[int] = []
    with Peak() as peak:
        for s in range(saves):
            want = loop.checksum()  # the values this save must hold (synchronizes first)
            t0 = time.perf_counter()
            handle = mgr.save(s, {"model": loop.module, "optim": loop.opt})
            call = time.perf_counter() - t0
            assert isinstance(handle, ckptstore.SaveHandle)
            steps = []
            while not handle.done() and left() > 30:
                steps.append(loop.step())
            info = handle.wait()
            durable = time.perf_counter() - t0
            rows.append({"stall_s": call + info.guard_wait_seconds, "call_s": call,
                         "guard_wait_s": info.guard_wait_seconds, "durable_s": durable,
                         "steps": len(steps),
                         "extra_per_step_s": (statistics.mean(steps) - base_step
                                              if steps else None)})
    pool = getattr(mgr.repo, "_pool", None)
    pinned = pool.pins.bytes if pool is not None else 0
    out = summarize(rows, base_step, peak.peak - base_mem, pinned)
    out["max_host_bytes"] = max_host_bytes
    mgr.close()
    return out, want, saves - 1


def dcp_saves(loop: Loop, root: Path, saves: int) -> tuple[dict[str, Any], str, list[int]]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    stager = DefaultStager(StagingOptions(**DCP_STAGING))
    base_step = baseline(loop)
    base_mem = host_bytes([os.getpid(), *children()])
    rows = []
    folder = ""
    want: list[int] = []
    with Peak() as peak:
        for s in range(saves):
            previous, folder = folder, str(root / f"dcp-{s}")
            want = loop.checksum()
            t0 = time.perf_counter()
            response = dcp.async_save(loop.tensors(), async_stager=stager, no_dist=True,
                                      storage_writer=FileSystemWriter(folder, thread_count=8,
                                                                      sync_files=True))
            call = time.perf_counter() - t0
            waited = [0.0]

            def wait_staging(response: Any = response, waited: list[float] = waited) -> None:
                w0 = time.perf_counter()
                response.staging_completion.result()  # DCP: the step may change the state
                waited[0] += time.perf_counter() - w0

            loop.before_step = wait_staging
            steps = []
            while not response.upload_completion.done() and left() > 30:
                steps.append(loop.step())
            response.upload_completion.result()
            loop.before_step = None
            durable = time.perf_counter() - t0
            rows.append({"stall_s": call + waited[0], "call_s": call,
                         "guard_wait_s": waited[0], "durable_s": durable, "steps": len(steps),
                         "extra_per_step_s": (statistics.mean(steps) - base_step
                                              if steps else None)})
            if previous:
                shutil.rmtree(previous, ignore_errors=True)  # as keep_last=1
    stager.close()
    # DefaultStager pins a host copy of the whole state (kept for the next save)
    return summarize(rows, base_step, peak.peak - base_mem, loop.nbytes), folder, want


def summarize(rows: list[dict[str, Any]], base_step: float, extra_host: int,
              pinned: int) -> dict[str, Any]:
    measured = rows[1:] or rows  # the first save is the warm-up (pinning, writer start)
    extras = [r["extra_per_step_s"] for r in measured if r["extra_per_step_s"] is not None]
    return {"saves": rows, "base_step_s": base_step,
            "stall_s": statistics.median(r["stall_s"] for r in measured),
            "extra_per_step_s": statistics.median(extras) if extras else None,
            "durable_s": statistics.median(r["durable_s"] for r in measured),
            "peak_extra_host_bytes": extra_host, "pinned_bytes": pinned}


def restore_ckpt(loop: Loop, folder: Path, step: int, want: list[int]) -> dict[str, Any]:
    mgr = ckptstore.CheckpointManager(folder)
    for p in loop.params:
        p.detach().zero_()
    drop_cache(folder)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    got = mgr.restore({"model": loop.module, "optim": loop.opt})
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    ok = got == step and loop.checksum() == want
    drop_cache(folder)
    t0 = time.perf_counter()
    new = mgr.repo.load(mgr.name_of(step), device=DEVICE)
    torch.cuda.synchronize()
    new_seconds = time.perf_counter() - t0
    del new
    mgr.close()
    return {"into_gbps": loop.nbytes / seconds / 1e9, "new_tensors_gbps":
            loop.nbytes / new_seconds / 1e9, "checksum_ok": ok}


def restore_dcp(loop: Loop, folder: str, want: list[int]) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    for p in loop.params:
        p.detach().zero_()
    drop_cache(Path(folder))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    dcp.load(loop.tensors(), checkpoint_id=folder, no_dist=True)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return {"into_gbps": loop.nbytes / seconds / 1e9, "checksum_ok": loop.checksum() == want}


def h2d_gbps(nbytes: int = 1 * GiB) -> float:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(4):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    return 4 * nbytes / (time.perf_counter() - t0) / 1e9


def speed(root: Path) -> dict[str, Any]:
    free, _total = torch.cuda.mem_get_info()
    plan = plan_size(root, free)
    loop = Loop(plan["state_bytes"])
    matched = -(-loop.nbytes // (16 * MiB)) * 16 * MiB  # the host memory DCP pins
    out: dict[str, Any] = {"plan": plan, "state_bytes": loop.nbytes,
                           "ckptstore_options": CKPT_OPTIONS}
    for _ in range(3):
        loop.step()  # warm-up (kernels, allocator)
    # "matched": as much host memory as DCP's staging (the state's size); "bounded": 512 MiB
    out["ckptstore"] = {}
    out["ckptstore"]["matched"], _want, _step = ckpt_saves(loop, root / "matched", 3, matched)
    shutil.rmtree(root / "matched", ignore_errors=True)
    gc_collect()
    out["ckptstore"]["bounded"], want, step = ckpt_saves(loop, root / "ckpt", 2,
                                                         MAX_HOST_BYTES)
    gc_collect()
    out["dcp"], dcp_folder, dcp_want = dcp_saves(loop, root, 3 if left() > 150 else 2)
    gc_collect()
    out["restore_ckptstore"] = restore_ckpt(loop, root / "ckpt", step, want)
    out["restore_dcp"] = restore_dcp(loop, dcp_folder, dcp_want)
    out["raw"] = {"h2d_pinned_gbps": h2d_gbps(), "disk_read_gbps": disk_read_gbps(root / "ckpt")}
    return out


def gc_collect() -> None:
    import gc

    gc.collect()
    torch.cuda.empty_cache()


def targets(speed_out: dict[str, Any]) -> dict[str, Any]:
    configs, dc = speed_out["ckptstore"], speed_out["dcp"]
    raw = speed_out["raw"]
    slower = min(raw["h2d_pinned_gbps"], raw["disk_read_gbps"])
    rc, rd = speed_out["restore_ckptstore"]["into_gbps"], speed_out["restore_dcp"]["into_gbps"]
    return {
        # with the host memory DCP uses (its staging pins a copy of the whole state)
        "stall_le_dcp": configs["matched"]["stall_s"] <= dc["stall_s"],
        "stall_bounded_over_dcp": configs["bounded"]["stall_s"] / max(dc["stall_s"], 1e-9),
        "extra_host_le_max_host_plus_64MiB": all(
            c["peak_extra_host_bytes"] <= c["max_host_bytes"] + 64 * MiB
            for c in configs.values()),
        "restore_ge_1.5x_dcp": rc >= 1.5 * rd,
        "restore_ge_0.8x_slower_raw_limit": rc >= 0.8 * slower,
        "restore_ratio_dcp": rc / rd if rd else None,
        "restore_ratio_raw": rc / slower if slower else None,
    }


# ------------------------------------------------------------------------------ main
@contextlib.contextmanager
def workdir() -> Iterator[Path]:
    base = Path(os.environ.get("GPU_CHECK_DIR", os.getcwd()))
    base.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="gpu-check-", dir=base))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def cpu_fallback(root: Path) -> dict[str, Any]:
    """What runs without a GPU: the correctness cases through FakeDevice, the disk's read
    speed over those checkpoints, and the sizing plan a GPU run would start from."""
    with FakeDevice(latency=0.0005) as dev:
        cases = correctness(Place(dev), root)
        violations = list(dev.violations)
    return {"correctness": cases, "correct": all(c["ok"] for c in cases),
            "fake_device_violations": violations,
            "disk_read_gbps": round(disk_read_gbps(root), 2),
            "plan": plan_size(root, None)}


def raise_fd_limit() -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < 65536:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 65536), hard))


def main() -> int:
    t0 = time.monotonic()
    result: dict[str, Any] = {"check": "gpu_check", "torch": torch.__version__}
    with workdir() as root:
        if not torch.cuda.is_available():
            result["gpu"] = False
            result["reason"] = ("no GPU: torch.cuda.is_available() is False; only the CPU "
                                "fallback ran (correctness through FakeDevice), no GPU "
                                "figure was measured")
            result["cpu_fallback"] = cpu_fallback(root)
            result["ok"] = result["cpu_fallback"]["correct"]
        else:
            result["gpu"] = True
            result["device"] = torch.cuda.get_device_name(0)
            raise_fd_limit()  # a pool as large as the state: a shared-memory slot per chunk
            cases = correctness(Place("cuda:0"), root)
            result["correctness"] = cases
            result["correct"] = all(c["ok"] for c in cases)
            try:
                result["speed"] = speed(root)
                result["targets"] = targets(result["speed"])
            except Exception as exc:
                result["speed_error"] = f"{type(exc).__name__}: {exc}"[:600]
                result["speed_where"] = traceback.format_exc(limit=-4)[-900:]
            met = result.get("targets", {})
            result["ok"] = result["correct"] and bool(met) and all(
                v for k, v in met.items() if isinstance(v, bool))
    result["seconds"] = round(time.monotonic() - t0, 1)
    print(json.dumps(result, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
