"""Small shared tools: timing, page-cache dropping, byte views of tensors, fsync, peak RSS."""

from __future__ import annotations

import os
import resource
import shutil
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

MiB = 1 << 20
GiB = 1 << 30
GB = 1e9


# ---------------------------------------------------------------------------- page cache
def drop_caches() -> bool:
    """Write back dirty pages and drop the page cache (root only). True if it worked."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike[str]) -> None:
    """fsync a file written by a library that does not (fsync on any fd flushes the inode)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rmtree(path: str | os.PathLike[str]) -> None:
    shutil.rmtree(path, ignore_errors=True)


def fresh_dir(root: Path, name: str) -> Path:
    d = root / name
    rmtree(d)
    d.mkdir(parents=True)
    return d


# ---------------------------------------------------------------------------- bytes
def byte_view(t: Any) -> np.ndarray:
    """Flat writable uint8 numpy view of a contiguous CPU tensor (any dtype, bf16 included)."""
    import torch

    assert t.is_contiguous()
    if t.numel() == 0:
        return np.empty(0, np.uint8)
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.int16)
    return t.detach().numpy().reshape(-1).view(np.uint8)


IOV_MAX = 1024


def write_all(fd: int, views: list[memoryview]) -> None:
    """writev every buffer completely (batches of IOV_MAX, partial writes resumed)."""
    i = 0
    while i < len(views):
        batch = views[i : i + IOV_MAX]
        n = os.writev(fd, batch)
        total = sum(len(v) for v in batch)
        if n == total:
            i += len(batch)
            continue
        # partial write: finish the batch buffer by buffer
        for v in batch:
            if n >= len(v):
                n -= len(v)
                continue
            rest = v[n:]
            n = 0
            while len(rest):
                k = os.write(fd, rest)
                rest = rest[k:]
        i += len(batch)


def read_all(fd: int, views: list[memoryview], offset: int = 0) -> None:
    """preadv into every buffer completely."""
    pos = offset
    i = 0
    while i < len(views):
        batch = views[i : i + IOV_MAX]
        n = os.preadv(fd, batch, pos)
        total = sum(len(v) for v in batch)
        if n == total:
            pos += n
            i += len(batch)
            continue
        if n == 0:
            raise OSError("unexpected end of file")
        pos += n
        for v in batch:  # finish the batch buffer by buffer
            if n >= len(v):
                n -= len(v)
                continue
            rest = v[n:]
            n = 0
            while len(rest):
                k = os.preadv(fd, [rest], pos)
                if k == 0:
                    raise OSError("unexpected end of file")
                rest = rest[k:]
                pos += k
        i += len(batch)


# ---------------------------------------------------------------------------- time
_CPU_LOG: list[float] = []  # CPU seconds (user+system, all threads) of each timed() call


def _cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Wall seconds of fn() and its result; the CPU seconds it used go to the CPU log."""
    c0 = _cpu()
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    _CPU_LOG.append(_cpu() - c0)
    return dt, out


def summary(seconds: list[float], nbytes: int, cpu: bool = True) -> dict[str, Any]:
    """best (min), median and all runs; throughput from the best run in GB/s (1e9 B/s).
    `cpu`: the runs were the last len(seconds) timed() calls, so their CPU seconds are known
    (CPU time is what a 2-core machine shared with other work really limits)."""
    best = min(seconds)
    out = {
        "runs": [round(s, 4) for s in seconds],
        "best_s": best,
        "median_s": statistics.median(seconds),
        "bytes": nbytes,
        "gbps": nbytes / best / GB if best > 0 else None,
    }
    if cpu and len(_CPU_LOG) >= len(seconds):
        cpus = _CPU_LOG[-len(seconds) :]
        out["cpu_s"] = [round(c, 4) for c in cpus]
        out["cpu_s_per_GB"] = min(cpus) / (nbytes / GB) if nbytes else None
    return out


# ---------------------------------------------------------------------------- memory
def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def rss() -> int:
    return _status("VmRSS")


def hwm() -> int:
    return _status("VmHWM")


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: write 5 to /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return hwm() <= rss() + 4 * MiB


class PeakMeter:
    """Peak RSS above the RSS at entry, for one operation. Uses the kernel's high-water mark
    after resetting it (exact); falls back to sampling VmRSS every 2 ms in a thread."""

    def __init__(self) -> None:
        self.baseline = 0
        self.peak = 0
        self.method = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def extra(self) -> int:
        return max(0, self.peak - self.baseline)

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss())

    def __enter__(self) -> PeakMeter:
        self.baseline = rss()
        if reset_peak():
            self.method = "VmHWM after clear_refs"
        else:
            self.method = "VmRSS sampled every 2 ms"
            self.peak = self.baseline
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, rss())
        else:
            self.peak = hwm()


@contextmanager
def peak_meter() -> Iterator[PeakMeter]:
    m = PeakMeter()
    with m:
        yield m
