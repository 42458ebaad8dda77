"""Plumbing shared by every part: fresh subprocesses (wall time and peak RSS of each, from
os.wait4), workers (a function of a part module run in a fresh interpreter, its result a JSON
file), timing, tracemalloc and cProfile (summed over every thread of the process)."""

from __future__ import annotations

import contextlib
import cProfile
import gc
import importlib
import json
import os
import pstats
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent  # bench/scale
BENCH = HERE.parent
REPO = BENCH.parent
SCRIPT = BENCH / "scale_bench.py"
MiB = 1 << 20


@dataclass
class Ctx:
    """What every part gets: the scratch root, the run's settings, and a progress callback."""

    root: Path
    reps: int
    quick: bool
    profile: bool
    timeout: float = 1800.0
    note: Callable[[str], None] = print
    #: PYTHONSAFEPATH: `python -c` / `-m` children must not put their working directory (this
    #: checkout) before PYTHONPATH, or `--source` would not be what they import
    env: dict[str, str] = field(default_factory=lambda: dict(
        os.environ, PYTHONPATH=str(REPO), PYTHONDONTWRITEBYTECODE="1", PYTHONSAFEPATH="1"))

    def folder(self, name: str) -> Path:
        """A fresh, empty folder under the scratch root."""
        path = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self.root))
        return path


@dataclass(frozen=True)
class Child:
    """A finished subprocess: exit code, output, wall seconds, peak RSS in bytes."""

    rc: int
    stdout: str
    stderr: str
    wall_s: float
    maxrss: int

    def check(self, what: str) -> Child:
        if self.rc != 0:
            raise RuntimeError(f"{what} failed (exit {self.rc}):\n{self.stderr[-4000:]}")
        return self

    def last_json(self) -> Any:
        return json.loads(self.stdout.strip().splitlines()[-1])


def run_child(argv: list[str], ctx: Ctx, timeout: float | None = None) -> Child:
    """Run argv to completion in a fresh process; its own peak RSS comes from wait4."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=out, stderr=err, env=ctx.env, cwd=REPO)
        timer = threading.Timer(timeout or ctx.timeout, proc.kill)
        timer.start()
        try:
            _pid, status, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        return Child(proc.returncode, out.read().decode(errors="replace"),
                     err.read().decode(errors="replace"), wall, usage.ru_maxrss * 1024)


def imported_from(ctx: Ctx) -> str:
    """Where a child of this context imports ckptstore from (checks --source)."""
    child = run_child([sys.executable, "-c", "import ckptstore; print(ckptstore.__file__)"],
                      ctx).check("import check")
    return child.stdout.strip()


def run_script(ctx: Ctx, source: str, *args: str) -> Child:
    """`python -c source args...` in a fresh process (checked)."""
    return run_child([sys.executable, "-c", source, *args], ctx).check("child script")


def run_worker(ctx: Ctx, target: str, **kwargs: Any) -> dict[str, Any]:
    """Run `scale.<module>.<function>(**kwargs)` (target "module.function") in a fresh
    interpreter; returns its result dict plus `_wall_s` and `_maxrss` of that process."""
    with tempfile.NamedTemporaryFile(suffix=".json", dir=ctx.root, delete=False) as f:
        result = Path(f.name)
    job = {"target": target, "kwargs": kwargs, "result": str(result)}
    child = run_child([sys.executable, str(SCRIPT), "--worker", json.dumps(job)], ctx)
    child.check(f"worker {target}")
    out: dict[str, Any] = json.loads(result.read_text())
    result.unlink()
    out["_wall_s"] = child.wall_s
    out["_maxrss"] = child.maxrss
    return out


def worker_main(job_json: str) -> None:
    """Entry of a worker process (scale_bench.py --worker JOB)."""
    job = json.loads(job_json)
    module_name, function = job["target"].rsplit(".", 1)
    module = importlib.import_module(f"scale.{module_name}")
    result = getattr(module, function)(**job["kwargs"])
    Path(job["result"]).write_text(json.dumps(result))


# ----------------------------------------------------------------------------- timing
def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """(seconds, result) of one call, with Python's collector settled first."""
    gc.collect()
    t0 = time.perf_counter()
    value = fn()
    return time.perf_counter() - t0, value


def best(reps: int, fn: Callable[[], Any]) -> dict[str, Any]:
    """Every time of `reps` calls and the minimum (the figure reported)."""
    times = []
    for _ in range(max(1, reps)):
        seconds, value = timed(fn)
        del value
        times.append(seconds)
    return {"best_s": min(times), "times_s": times}


def traced(fn: Callable[[], Any], top: int = 0) -> dict[str, Any]:
    """tracemalloc around one call: bytes still held by its result (`current`), the peak
    during it, and optionally the `top` allocation sites of what it holds."""
    gc.collect()
    tracemalloc.start(1)
    try:
        value = fn()
        current, peak = tracemalloc.get_traced_memory()
        sites = top_sites(tracemalloc.take_snapshot(), top) if top else []
    finally:
        tracemalloc.stop()
    del value
    return {"current_bytes": current, "peak_bytes": peak, "sites": sites}


def top_sites(snapshot: tracemalloc.Snapshot, top: int = 12) -> list[dict[str, Any]]:
    """The `top` allocation sites (file:line) of a tracemalloc snapshot, by bytes held."""
    stats = snapshot.statistics("lineno")
    return [{"site": f"{s.traceback[0].filename.split('site-packages/')[-1]}:"
                     f"{s.traceback[0].lineno}", "bytes": s.size, "blocks": s.count}
            for s in stats[:top]]


@contextlib.contextmanager
def thread_profiles() -> Iterator[list[cProfile.Profile]]:
    """Profile every thread started inside the block (cProfile sees one thread only)."""
    collected: list[cProfile.Profile] = []
    real_run = threading.Thread.run

    def run(self: threading.Thread) -> None:
        prof = cProfile.Profile()
        prof.enable()
        try:
            real_run(self)
        finally:
            prof.disable()
            collected.append(prof)

    threading.Thread.run = run  # type: ignore[method-assign]
    try:
        yield collected
    finally:
        threading.Thread.run = real_run  # type: ignore[method-assign]


def profiled(fn: Callable[[], Any], top: int = 14) -> dict[str, Any]:
    """cProfile of one call, summed over the calling thread and every thread it starts:
    the top functions by own time and by cumulative time (seconds summed over threads)."""
    main = cProfile.Profile()
    gc.collect()
    with thread_profiles() as others:
        t0 = time.perf_counter()
        main.enable()
        try:
            fn()
        finally:
            main.disable()
        wall = time.perf_counter() - t0
    stats = pstats.Stats(main)
    for prof in others:
        stats.add(prof)
    return {"wall_s": wall, "threads": 1 + len(others),
            "by_tottime": _rows(stats, "tottime", top), "by_cumtime": _rows(stats, "cumtime", top)}


def _rows(stats: pstats.Stats, key: str, top: int) -> list[dict[str, Any]]:
    table = stats.stats  # type: ignore[attr-defined]
    order = 2 if key == "tottime" else 3
    ranked = sorted(((_where(func), v) for func, v in table.items()),
                    key=lambda item: -item[1][order])
    return [{"function": where, "calls": v[1], "tottime_s": round(v[2], 4),
             "cumtime_s": round(v[3], 4)}
            for where, v in ranked if not where.startswith(("bench/", "<"))][:top]


def _where(func: tuple[str, int, str]) -> str:
    filename, line, name = func
    if filename == "~":
        return name
    short = filename.split("site-packages/")[-1].replace(str(REPO) + "/", "")
    return f"{short}:{line}({name})"


# ----------------------------------------------------------------------------- machine
def load_snapshot() -> dict[str, Any]:
    """Load averages and CPU pressure (PSI "some" avg60, %) now."""
    snap: dict[str, Any] = {"time": time.strftime("%H:%M:%S"), "loadavg": os.getloadavg()}
    with contextlib.suppress(OSError, IndexError, ValueError):
        with open("/proc/pressure/cpu") as f:
            snap["cpu_pressure_avg60"] = float(f.readline().split()[2].split("=")[1])
    return snap


def rss_bytes() -> int:
    """This process's resident set size now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def machine_facts(root: Path) -> dict[str, Any]:
    import platform

    import torch

    facts: dict[str, Any] = {"cpus": os.cpu_count(), "python": platform.python_version(),
                             "torch": torch.__version__, "scratch": str(root)}
    with open("/proc/meminfo") as f:
        facts["mem_total_GiB"] = round(int(f.readline().split()[1]) / 2**20, 1)
    git = ["git", "-C", str(REPO)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True)
    dirty = subprocess.run([*git, "status", "--porcelain", "ckptstore"], capture_output=True,
                           text=True)
    facts["git"] = head.stdout.strip()
    facts["ckptstore_dirty_files"] = [line[3:] for line in dirty.stdout.splitlines()]
    return facts


def index_blobs(manifest: Any) -> list[Any]:
    """A manifest's index blobs (version 3: segments and tree), also for a measured tree of
    an earlier commit (segments only, or nothing)."""
    for name in ("index_blobs", "segment_refs"):
        method = getattr(manifest, name, None)
        if method is not None:
            return list(method())
    return []


def fsync_path(path: Path) -> None:
    """fsync a file or a folder by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
