"""Assertions and runners shared by tests."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Exact equality of nested states: types, key types, dtypes, shapes and bits."""
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), f"{path}: keys differ"
        for k in a:
            assert type(k) is type(list(b.keys())[list(a.keys()).index(k)])
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}.{i}")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{path}: {a.dtype}{a.shape} != {b.dtype}{b.shape}")
        assert a.requires_grad == b.requires_grad, f"{path}: requires_grad differs"
        x, y = a.detach().contiguous(), b.detach().contiguous()
        if x.numel():
            same = torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
            assert same, path
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{a.shape}"
        assert a.tobytes() == b.tobytes(), path
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), path
    elif isinstance(a, float):
        assert a.hex() == b.hex(), path
    else:
        assert a == b, path


def json_paths(doc: Any, prefix: tuple = ()) -> Iterator[tuple]:
    """Every path (tuple of keys and indexes) in a JSON document, the root () first."""
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from json_paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from json_paths(v, (*prefix, i))


def sealed_manifest(doc: dict) -> bytes:
    """Manifest bytes for a (possibly tampered) manifest document, with a correct seal: lets
    tests reach the parser's structural checks behind the self-digest check."""
    from ckptstore.format.canonical import SEAL_FIELD, canonical_json, seal

    body = {k: v for k, v in doc.items() if k != SEAL_FIELD}
    try:
        raw = canonical_json(body)
    except ValueError:  # NaN and the like: no canonical form, sent as they are
        return json.dumps(doc).encode()
    return raw if body.get("version") == 1 else seal(raw)


#: What the ranks' server process imports once (multiprocessing's forkserver): each rank
#: then starts as a fork of it instead of a fresh interpreter importing torch (1-3 s of CPU
#: per rank, hundreds of ranks over the suite).
RANK_PRELOAD = ["torch", "torch.distributed", "numpy", "ckptstore", "tests.dist_worker"]


def _rank_start_method() -> str:
    """"forkserver", with RANK_PRELOAD imported by the server (set before it first starts;
    later calls change nothing). The test process itself is never forked: the server is a
    fresh interpreter, so a rank inherits no thread or lock of the test process."""
    import multiprocessing

    multiprocessing.set_forkserver_preload(RANK_PRELOAD)
    return "forkserver"


def _rank_entry(rank: int, fn: Callable[..., None], environ: dict[str, str],
                *args: Any) -> None:
    """A rank: the test process's environment as it is now (a forked rank has the server's,
    from when the server started), then `fn(rank, *args)`."""
    os.environ.clear()
    os.environ.update(environ)
    fn(rank, *args)


def spawn_ranks(fn: Callable[..., None], world: int, tmp_path: Path, tag: str,
                args: Callable[[str, str], tuple[Any, ...]],
                report: Callable[[int], str], ok: str = "ok") -> list[str]:
    """The one spawn-and-collect helper of the multi-rank tests: start `world` processes
    (forkserver: `_rank_start_method`, with this process's environment) running
    `fn(rank, *args(init_file, out_dir))` on one gloo group (file init), wait for all, then
    read each rank's report file `out_dir/report(rank)`; a rank whose report does not start
    with `ok` (or that wrote none) fails the test with its text (the worker writes its
    traceback there). Returns the reports, in rank order.

    A rank that aborts (SIGABRT) after every rank reported success is not a failure: the
    ranks wrote their reports after their last collective and left the group, and gloo can
    still abort a process while its transport threads wind down at exit ("terminate called
    without an active exception"), more often on a loaded machine."""
    import pytest
    import torch.multiprocessing as mp

    init = tmp_path / f"pg-{tag}"
    out = tmp_path / f"out-{tag}"
    out.mkdir()
    try:
        mp.start_processes(_rank_entry, args=(fn, dict(os.environ), *args(str(init), str(out))),
                           nprocs=world, join=True, start_method=_rank_start_method())
    except mp.ProcessExitedException as exc:
        done = all((out / report(r)).exists()
                   and (out / report(r)).read_text().startswith(ok) for r in range(world))
        if not (done and exc.signal_name == "SIGABRT"):
            raise
    finally:
        reports = [(out / report(r)).read_text() if (out / report(r)).exists() else ""
                   for r in range(world)]
        for rank, text in enumerate(reports):
            if not text.startswith(ok):
                pytest.fail(f"rank {rank} failed in {tag}:\n{text or '(no report)'}")
    return reports


def wait_until(condition: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    """Synchronise on a condition instead of sleeping a guessed time: poll `condition` until
    it holds (AssertionError naming `what` after `timeout` seconds)."""
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or condition}")
        time.sleep(0.001)


def reap(proc: subprocess.Popen, timeout: float) -> str:
    """Wait for `proc` (killed or finishing), close its pipes and return the tail of its
    stderr (empty if it was not piped): killed children leave no unclosed-file warnings."""
    try:
        proc.wait(timeout=timeout)
        err = proc.stderr.read() if proc.stderr is not None else ""
    finally:
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()
    if isinstance(err, bytes):
        err = err.decode(errors="replace")
    return err[-3000:]


def encoded_from_columns(entries: Any, algorithm: Any) -> Any:
    """`segment_encoding.encode_columns` of `entries`' chunks given as a collective save's
    builder has them (columns: raw blob and chunk digests, offset, size, nbytes)."""
    from ckptstore.format.segment_encoding import encode_columns

    chunks = [c for e in entries for c in e.chunks]

    def raw(hexes: list[str]) -> np.ndarray:
        return np.frombuffer(bytes.fromhex("".join(hexes)), np.uint8).reshape(-1, 16)

    return encode_columns(entries, raw([c.blob for c in chunks]),
                          np.array([c.offset for c in chunks], np.uint64),
                          np.array([c.size for c in chunks], np.uint64),
                          np.array([c.nbytes for c in chunks], np.uint64),
                          raw([c.digest for c in chunks]), algorithm)


def valid_entry(key: str, shape: tuple[int, ...], rows: int,
                grid: tuple[int, ...] | None = None, codec: Any = None, seed: int = 0) -> Any:
    """A float32 TensorEntry obeying every rule, with distinct digests per `seed`; raw chunks
    share blobs ten to a blob (packs), compressed ones are whole blobs."""
    import math

    from ckptstore.format.dtypes import DTYPES
    from ckptstore.format.manifest import (
        ChunkRef,
        TensorEntry,
        chunk_region,
        entry_problem,
        expected_chunk_count,
    )

    f32 = DTYPES["float32"]
    count = expected_chunk_count(shape, rows, f32.itemsize, grid)
    block = grid if grid is not None else (rows, *shape[1:])
    chunks = []
    for i in range(count):
        nbytes = math.prod(b - a for a, b in chunk_region(shape, block, i)) * f32.itemsize
        digest = f"{seed * 1_000_003 + i:032x}"
        if codec is None:
            blob = f"{seed * 7_919 + i // 10 + (1 << 100):032x}"
            offset, size = (i % 10) * 64, nbytes
        else:
            blob, offset, size = digest, 0, max(1, nbytes // 2)
        chunks.append(ChunkRef(blob, offset, size, nbytes, digest))
    e = TensorEntry(key, "torch", f32, shape, rows, codec, tuple(chunks), chunk_shape=grid)
    assert entry_problem(e) is None, entry_problem(e)
    return e


class InFlight:
    """Calls counted while they run: how many at once (`now`, `most`) and the keys they were
    for, in the order they started (`keys`). For stores that stand in for a remote one:
    `with flight.call(key, 0.01): ...` waits that long first, as a round trip would."""

    def __init__(self) -> None:
        self.now = 0
        self.most = 0
        self.keys: list[str] = []
        self._lock = threading.Lock()

    @contextmanager
    def call(self, key: str, seconds: float) -> Iterator[None]:
        with self._lock:
            self.now += 1
            self.most = max(self.most, self.now)
            self.keys.append(key)
        try:
            time.sleep(seconds)
            yield
        finally:
            with self._lock:
                self.now -= 1

    def reset(self) -> None:
        with self._lock:
            self.most = self.now
            self.keys = []
