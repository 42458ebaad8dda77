"""Simulated power loss for LocalStore, in the style of LevelDB's FaultInjectionTestEnv.

`PowerLossHarness` replaces the `os` module (and `Path`) that `ckptstore.stores.local` sees
with proxies. Every call goes through the real `os`, but the harness

* numbers the calls that change the disk (create, write, fsync, rename/replace, link, unlink,
  mkdir, rmdir, truncate) and, at the chosen crash point N, makes the N-th of them fail with
  `PowerCut` and every later intercepted call too: the process is "dead", nothing it does
  after the crash point reaches the disk;
* records what a power cut would leave, under the POSIX model: a file's data is durable once
  the file was fsynced (its content at that fsync); a directory's entries (names created,
  renamed in or out, removed, with the file they name) are durable once that directory was
  fsynced; a directory created but never fsynced holds nothing durable.

`power_cut()` then rewrites the folder to what survives: every directory holds its entries as
of its last fsync, every file its content as of its last fsync (empty if never fsynced).
Mode "eager-names" keeps instead every name change made up to the crash (a file system that
journals metadata eagerly) while still dropping unsynced data: a rename is then durable before
the data it points to, the case that makes `fsync` before `rename` necessary.

The real fsync is not called (the model, not the device, decides what survives; skipping it
makes a crash point cost milliseconds instead of tens of them).

Identity of files: each file or directory seen is pinned by an open descriptor for the whole
run, so the kernel cannot reuse its inode number, and an inode number names one file.

Limits (see docs/reliability.md): unsynced data is dropped whole (no torn sector, no garbage,
no partial prefix); between the two modes no mixed subset of unsynced name changes is tried;
only what `ckptstore.stores.local` and `direct_io` call is intercepted, in this process and
in the async writer processes, which run here as threads (`ThreadWriter`).
"""

from __future__ import annotations

import itertools
import os as real_os
import pathlib
import shutil
import socket
import stat
import subprocess
import threading
import types
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest

import ckptstore.pipeline.writer_process as writer_process_module
import ckptstore.stores.direct_io as direct_io_module
import ckptstore.stores.local as local_module

MODES = ("strict", "eager-names")
T = TypeVar("T")
Listing = dict[str, tuple[str, int]]  # name -> ("d" | "f", inode)


class PowerCut(BaseException):
    """Raised by every intercepted call from the crash point on. A BaseException, so no
    `except Exception` (or `except OSError`) in the code under test can carry on after it."""


class PowerLossHarness:
    """Intercepts the disk operations of LocalStore under `root`; see the module docstring.

    `crash_at`: 1-based index of the mutating operation that never happens (None: never).
    `skip_fsync(path, is_dir)`: sabotage for the harness's own tests; an fsync of a file or
    folder it selects returns without syncing anything (and `skipped` counts them).
    """

    def __init__(self, root: Path, crash_at: int | None = None, mode: str = "strict",
                 skip_fsync: Callable[[str, bool], bool] | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        self.root = Path(root)
        self.crash_at = crash_at
        self.mode = mode
        self.ops: list[str] = []  # the mutating operations performed, in order
        self.dead = False
        self.skip_fsync = skip_fsync
        self.skipped = 0
        # the model decides what survives, not the device: the real fsync only costs time
        self.real_fsync = False
        self._lock = threading.RLock()
        self._pins: dict[int, int] = {}  # inode -> descriptor held open (no inode reuse)
        self._open_fds: set[int] = set()  # descriptors the code under test opened
        self._dirs: dict[int, Listing] = {}  # durable entries, by directory inode
        self._data: dict[int, bytes] = {}  # durable content, by file inode
        self._at_cut: dict[int, Listing] = {}  # live entries at the crash ("eager-names")
        self._root_ino = real_os.stat(self.root).st_ino
        self._snapshot_durable(self.root)

    # -- bookkeeping --------------------------------------------------------------------------
    def _pin_fd(self, fd: int) -> int:
        ino = real_os.fstat(fd).st_ino
        if ino not in self._pins:
            self._pins[ino] = real_os.dup(fd)
        return ino

    def _pin_path(self, path: Any, dir_fd: int | None = None) -> None:
        fd = real_os.open(path, real_os.O_RDONLY | real_os.O_NOFOLLOW, dir_fd=dir_fd)
        try:
            self._pin_fd(fd)
        finally:
            real_os.close(fd)

    def _listing(self, dir_fd: int) -> Listing:
        out: Listing = {}
        for name in real_os.listdir(dir_fd):
            st = real_os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
                raise AssertionError(f"{name}: only files and folders are modelled")
            out[name] = ("d" if stat.S_ISDIR(st.st_mode) else "f", st.st_ino)
            if st.st_ino not in self._pins:
                self._pin_path(name, dir_fd)
        return out

    def _snapshot_durable(self, folder: Path) -> None:
        """Everything present when the harness starts counts as durable."""
        fd = real_os.open(folder, real_os.O_RDONLY | real_os.O_DIRECTORY)
        try:
            ino = self._pin_fd(fd)
            listing = self._listing(fd)
        finally:
            real_os.close(fd)
        self._dirs[ino] = listing
        for name, (kind, child) in listing.items():
            if kind == "d":
                self._snapshot_durable(folder / name)
            else:
                self._data[child] = (folder / name).read_bytes()

    def _live_listings(self) -> dict[int, Listing]:
        out: dict[int, Listing] = {}
        for dirpath, _dirs, _files in real_os.walk(self.root):
            fd = real_os.open(dirpath, real_os.O_RDONLY | real_os.O_DIRECTORY)
            try:
                out[real_os.fstat(fd).st_ino] = self._listing(fd)
            finally:
                real_os.close(fd)
        return out

    def _fsync(self, fd: int, sync: Callable[[int], None]) -> None:
        st = real_os.fstat(fd)
        if self.skip_fsync is not None:
            target = real_os.readlink(f"/proc/self/fd/{fd}")
            if self.skip_fsync(target, stat.S_ISDIR(st.st_mode)):
                self.skipped += 1
                return
        if self.real_fsync:
            sync(fd)
        self._record_fsync(fd)

    def _record_fsync(self, fd: int) -> None:
        st = real_os.fstat(fd)
        ino = self._pin_fd(fd)
        if stat.S_ISDIR(st.st_mode):
            self._dirs[ino] = self._listing(fd)
        else:
            with open(f"/proc/self/fd/{fd}", "rb") as f:  # whatever the descriptor's mode
                self._data[ino] = f.read()

    # -- the gate every intercepted call passes -----------------------------------------------
    def alive(self) -> None:
        if self.dead:
            raise PowerCut("the power is off")

    def mutate(self, what: str, fn: Callable[[], T]) -> T:
        with self._lock:
            self.alive()
            if self.crash_at is not None and len(self.ops) + 1 >= self.crash_at:
                self.dead = True
                if self.mode == "eager-names":
                    self._at_cut = self._live_listings()
                raise PowerCut(f"power cut before operation {len(self.ops) + 1}: {what}")
            self.ops.append(what)
            return fn()

    # -- the power cut ------------------------------------------------------------------------
    def durable_tree(self) -> dict[str, Any]:
        """What a power cut now would leave: {name: bytes | {...}} from the root."""
        if self.mode == "eager-names" and not self._at_cut:
            self._at_cut = self._live_listings()
        listings = self._at_cut if self.mode == "eager-names" else self._dirs

        def build(ino: int, depth: int) -> dict[str, Any]:
            assert depth < 64, "directory cycle in the model"
            return {name: build(child, depth + 1) if kind == "d" else self._data.get(child, b"")
                    for name, (kind, child) in listings.get(ino, {}).items()}

        return build(self._root_ino, 0)

    def power_cut(self) -> dict[str, Any]:
        """Kill the process's access to the disk and rewrite the folder to what survives.
        Returns the surviving tree."""
        with self._lock:
            self.dead = True
            tree = self.durable_tree()
            for fd in list(self._open_fds) + list(self._pins.values()):
                try:
                    real_os.close(fd)
                except OSError:
                    pass
            self._open_fds.clear()
            self._pins.clear()
            for child in list(self.root.iterdir()):
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink()
            _materialize(self.root, tree)
            return tree

    # -- installing the proxies ---------------------------------------------------------------
    @contextmanager
    def installed(self) -> Iterator[PowerLossHarness]:
        """Route the disk calls of every process that writes a save's bytes through this
        harness: `ckptstore.stores.local`'s (and `direct_io`'s) `os` and `Path`, and the
        async writer processes, which run as threads of this process here (`ThreadWriter`)
        so that their calls pass the same proxies."""
        with pytest.MonkeyPatch.context() as mp:
            proxy = _OsProxy(self)
            mp.setattr(local_module, "os", proxy)
            mp.setattr(direct_io_module, "os", proxy)
            mp.setattr(local_module, "Path", _path_class(self))
            mp.setattr(writer_process_module, "spawn_writer", ThreadWriter.spawn)
            yield self


class ThreadWriter:
    """A writer "process" (ckptstore/pipeline/writer_process.py) run as a thread of the test
    process: the same `serve` loop, with its own store object and its own end of the socket
    pair, as a real writer has; only its disk calls now pass the harness. `kill()` is
    SIGKILL's effect on the parent's side: the channel ends at once, and the writer does
    nothing more (its thread is joined)."""

    _pids = itertools.count(1 << 30)

    def __init__(self, fd: int, root: Path, threads: int, direct: bool) -> None:
        self.pid = next(self._pids)  # never a real process's
        self._fd = real_os.dup(fd)  # the caller closes its own descriptor
        self._sock = socket.socket(fileno=real_os.dup(self._fd))
        self._thread = threading.Thread(
            target=self._serve, args=(str(root), threads, direct), daemon=True,
            name="ckpt-thread-writer")
        self._thread.start()

    @classmethod
    def spawn(cls, fd: int, root: Path, threads: int, direct: bool) -> ThreadWriter:
        return cls(fd, root, threads, direct)

    def _serve(self, root: str, threads: int, direct: bool) -> None:
        try:
            writer_process_module.serve(self._fd, root, threads, direct, watch_parent=False)
        except BaseException:  # noqa: BLE001 - a power cut or a kill ends the writer
            pass
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if not self._thread.is_alive() or threading.current_thread() is self._thread:
            self._sock.close()

    def poll(self) -> int | None:
        return None if self._thread.is_alive() else 0

    def wait(self, timeout: float | None = None) -> int:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise subprocess.TimeoutExpired("thread-writer", timeout or 0.0)
        return 0

    def kill(self) -> None:
        self._shutdown()
        self._thread.join()


def _materialize(folder: Path, tree: dict[str, Any]) -> None:
    for name, node in tree.items():
        if isinstance(node, dict):
            (folder / name).mkdir()
            _materialize(folder / name, node)
        else:
            (folder / name).write_bytes(node)


def _is_create(flags: int) -> bool:
    return bool(flags & real_os.O_CREAT)


class _OsProxy(types.ModuleType):
    """`os` as `ckptstore.stores.local` sees it under the harness. Functions not named here
    (constants, path helpers) are the real ones."""

    def __init__(self, harness: PowerLossHarness) -> None:
        super().__init__("os")
        self._h = harness

    def __getattr__(self, name: str) -> Any:
        return getattr(real_os, name)

    # mutating ------------------------------------------------------------------------------
    def open(self, path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        h = self._h

        def do() -> int:
            fd = real_os.open(path, flags, *args, **kwargs)
            h._open_fds.add(fd)
            if _is_create(flags):
                h._pin_fd(fd)
            return fd

        if _is_create(flags) or flags & real_os.O_TRUNC:
            return h.mutate(f"open-create {path}", do)
        h.alive()
        with h._lock:
            return do()

    def write(self, fd: int, data: Any) -> int:
        return self._h.mutate(f"write fd{fd}", lambda: real_os.write(fd, data))

    def pwrite(self, fd: int, data: Any, offset: int) -> int:
        return self._h.mutate(f"pwrite fd{fd}", lambda: real_os.pwrite(fd, data, offset))

    def writev(self, fd: int, buffers: Any) -> int:
        return self._h.mutate(f"writev fd{fd}", lambda: real_os.writev(fd, buffers))

    def fsync(self, fd: Any) -> None:
        n = fd if isinstance(fd, int) else fd.fileno()
        self._h.mutate(f"fsync fd{n}", lambda: self._h._fsync(n, real_os.fsync))

    def fdatasync(self, fd: Any) -> None:
        n = fd if isinstance(fd, int) else fd.fileno()
        self._h.mutate(f"fdatasync fd{n}", lambda: self._h._fsync(n, real_os.fdatasync))

    def replace(self, src: Any, dst: Any, **kwargs: Any) -> None:
        self._h.mutate(f"replace {src} -> {dst}", lambda: real_os.replace(src, dst, **kwargs))

    def rename(self, src: Any, dst: Any, **kwargs: Any) -> None:
        self._h.mutate(f"rename {src} -> {dst}", lambda: real_os.rename(src, dst, **kwargs))

    def link(self, src: Any, dst: Any, **kwargs: Any) -> None:
        self._h.mutate(f"link {src} -> {dst}", lambda: real_os.link(src, dst, **kwargs))

    def unlink(self, path: Any, **kwargs: Any) -> None:
        self._h.mutate(f"unlink {path}", lambda: real_os.unlink(path, **kwargs))

    def remove(self, path: Any, **kwargs: Any) -> None:
        self._h.mutate(f"remove {path}", lambda: real_os.remove(path, **kwargs))

    def rmdir(self, path: Any, **kwargs: Any) -> None:
        self._h.mutate(f"rmdir {path}", lambda: real_os.rmdir(path, **kwargs))

    def mkdir(self, path: Any, mode: int = 0o777, **kwargs: Any) -> None:
        h = self._h

        def do() -> None:
            real_os.mkdir(path, mode, **kwargs)
            h._pin_path(path, kwargs.get("dir_fd"))

        h.mutate(f"mkdir {path}", do)

    def makedirs(self, path: Any, mode: int = 0o777, exist_ok: bool = False) -> None:
        parent = real_os.path.dirname(real_os.fspath(path))
        if parent and not real_os.path.isdir(parent):
            self.makedirs(parent, mode, exist_ok=True)
        try:
            self.mkdir(path, mode)
        except FileExistsError:
            if not exist_ok:
                raise

    def truncate(self, path: Any, length: int) -> None:
        self._h.mutate(f"truncate {path}", lambda: real_os.truncate(path, length))

    def ftruncate(self, fd: int, length: int) -> None:
        self._h.mutate(f"ftruncate fd{fd}", lambda: real_os.ftruncate(fd, length))

    # reading: only refused once the power is off -------------------------------------------
    def close(self, fd: int) -> None:
        self._h.alive()
        self._h._open_fds.discard(fd)
        real_os.close(fd)

    def read(self, fd: int, n: int) -> bytes:
        self._h.alive()
        return real_os.read(fd, n)

    def pread(self, fd: int, n: int, offset: int) -> bytes:
        self._h.alive()
        return real_os.pread(fd, n, offset)

    def preadv(self, fd: int, buffers: Any, offset: int, *args: Any) -> int:
        self._h.alive()
        return real_os.preadv(fd, buffers, offset, *args)

    def readv(self, fd: int, buffers: Any) -> int:
        self._h.alive()
        return real_os.readv(fd, buffers)

    def stat(self, *args: Any, **kwargs: Any) -> real_os.stat_result:
        self._h.alive()
        return real_os.stat(*args, **kwargs)

    def lstat(self, *args: Any, **kwargs: Any) -> real_os.stat_result:
        self._h.alive()
        return real_os.lstat(*args, **kwargs)

    def fstat(self, fd: int) -> real_os.stat_result:
        self._h.alive()
        return real_os.fstat(fd)

    def scandir(self, *args: Any) -> Any:
        self._h.alive()
        return real_os.scandir(*args)

    def listdir(self, *args: Any) -> list[str]:
        self._h.alive()
        return real_os.listdir(*args)

    def walk(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        for item in real_os.walk(*args, **kwargs):
            self._h.alive()
            yield item


def _path_class(harness: PowerLossHarness) -> type[pathlib.PosixPath]:
    """A Path class for `ckptstore.stores.local` whose disk operations pass the harness."""
    h = harness

    class HarnessPath(pathlib.PosixPath):
        def mkdir(self, mode: int = 0o777, parents: bool = False,
                  exist_ok: bool = False) -> None:
            h.alive()
            if parents:
                parent = self.parent
                if parent != self and not parent.is_dir():
                    parent.mkdir(mode, parents=True, exist_ok=True)
            try:
                h.mutate(f"mkdir {self}", lambda: pathlib.PosixPath.mkdir(self, mode))
            except FileExistsError:
                if not exist_ok or not self.is_dir():
                    raise
            else:
                h._pin_path(str(self))

        def unlink(self, missing_ok: bool = False) -> None:
            h.mutate(f"unlink {self}",
                     lambda: pathlib.PosixPath.unlink(self, missing_ok=missing_ok))

        def rmdir(self) -> None:
            h.mutate(f"rmdir {self}", lambda: pathlib.PosixPath.rmdir(self))

        def rename(self, target: Any) -> Any:
            return h.mutate(f"rename {self}", lambda: pathlib.PosixPath.rename(self, target))

        def replace(self, target: Any) -> Any:
            return h.mutate(f"replace {self}", lambda: pathlib.PosixPath.replace(self, target))

        def touch(self, mode: int = 0o666, exist_ok: bool = True) -> None:
            h.mutate(f"touch {self}", lambda: pathlib.PosixPath.touch(self, mode, exist_ok))

        def write_bytes(self, data: Any) -> int:
            raise AssertionError("unbuffered-durability write through Path: not modelled")

        def write_text(self, *args: Any, **kwargs: Any) -> int:
            raise AssertionError("unbuffered-durability write through Path: not modelled")

        def open(self, *args: Any, **kwargs: Any) -> Any:  # read_bytes/read_text use it
            mode = args[0] if args else kwargs.get("mode", "r")
            if any(c in mode for c in "wax+"):
                raise AssertionError("write through Path.open: not modelled by the harness")
            h.alive()
            return pathlib.PosixPath.open(self, *args, **kwargs)

        def stat(self, *, follow_symlinks: bool = True) -> real_os.stat_result:
            h.alive()
            return pathlib.PosixPath.stat(self, follow_symlinks=follow_symlinks)

        def iterdir(self) -> Generator[Any, None, None]:
            h.alive()
            yield from pathlib.PosixPath.iterdir(self)

    return HarnessPath
