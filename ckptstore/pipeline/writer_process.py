"""A writer process for overlapped background saves (`async_writer="process"`).

The training process copies each block into a staging slot that lives in shared memory (an
anonymous `memfd`, mapped in both processes); the writer process writes it to the store
(`LocalStore.put`: temp file, fsync, rename) and answers. The store's Python work and the
write syscalls then run under the writer's own interpreter lock, not the trainer's.

Protocol, over a Unix socket pair (no pickle: JSON lines and raw bytes):

* parent -> writer, one JSON object per line:
  - `{"op": "map", "slot": i, "nbytes": n}`, with the slot's memfd passed beside it
    (SCM_RIGHTS): the writer maps it; the parent keeps its own mapping.
  - `{"op": "put", "id": k, "key": key, "slot": i, "offset": o, "nbytes": n}`: write bytes
    [o, o + n) of slot i as object `key`; or `{"op": "put", "id": k, "key": key,
    "inline": n}` followed by n raw bytes (data that is not in a slot: packs of small
    arrays, compressed chunks). Large blobs in a slot are written with O_DIRECT from the
    slot itself (stores/direct_io.py: no page-cache copy; buffered where refused).
  - `{"op": "sync", "id": k, "keys": [...]}`: make every object written so far durable
    (`store.sync()`), and the folders of `keys` too: the objects put since the last sync
    through any writer, so that those a writer that has since ended renamed into place are
    made durable by its successor (`LocalStore.note_written`).
* writer -> parent: `{"id": k}` when request k is done, or `{"id": k, "error": {"type":
  ..., "message": ..., "errno": ...}}`.

Lifetime: one writer per staging pool, started at its first request. The writer exits when
the socket closes (the parent closed it or died) and, in case another process inherited the
parent's end, when its parent process changes (polled every 0.1 s). A writer killed mid-way
fails the requests in flight (StoreError): the save fails and nothing is committed, since
only the parent ever creates manifests; the next request starts a new writer. A writer that
ended while idle (between two puts of one save) loses nothing either: the parent remembers
every object put since the last sync, whoever wrote it, and the next sync makes all their
folders durable. A parent killed
mid-way commits nothing either; the writer finishes at most the object in hand (an
unreferenced blob, later reclaimed by gc) and exits.

Why one module: the two ends of one protocol (the parent's requests and the writer's loop)
and the shared slots they map; keeping them together keeps the message format in one place.
"""

from __future__ import annotations

import array
import concurrent.futures as cf
import functools
import itertools
import json
import mmap
import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..errors import DurabilityError, StoreAccessError, StoreError
from ..stores.base import Buffer
from ..stores.direct_io import DirectLocalStore
from ..stores.local import LocalStore

_ERRORS: dict[str, type[StoreError]] = {
    "DurabilityError": DurabilityError, "StoreAccessError": StoreAccessError}
_RECV = 1 << 16
_FDS_SPACE = socket.CMSG_SPACE(16 * array.array("i").itemsize)
PARENT_POLL = 0.1  # seconds between the writer's checks that its parent is alive
_CHILD_MAIN = "from ckptstore.pipeline.writer_process import main; main()"


def writer_process_available() -> bool:
    """Whether this platform can run a writer process (anonymous shared memory that can be
    passed to another process, and a Python executable to start it with)."""
    return hasattr(os, "memfd_create") and hasattr(socket, "send_fds") and bool(sys.executable)


class SharedSlot:
    """`nbytes` of shared memory (a memfd) mapped here. Its fd stays open while the slot
    lives, so that a restarted writer can map it too."""

    def __init__(self, index: int, nbytes: int) -> None:
        if not hasattr(os, "memfd_create"):
            raise StoreError('async_writer="process" needs Linux (os.memfd_create)')
        self.index = index
        self.nbytes = nbytes
        self.fd = os.memfd_create(f"ckptstore-slot-{index}", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, nbytes)
        self._map = mmap.mmap(self.fd, nbytes)
        self.array = np.frombuffer(self._map, np.uint8)
        self.address = int(self.array.ctypes.data)

    def close(self) -> None:
        """Close the fd; the mapping goes when the last array viewing it does."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _address(data: Buffer) -> tuple[int, int]:
    """(first byte's address, length) of a contiguous buffer."""
    view = np.frombuffer(data, np.uint8)
    return int(view.ctypes.data), view.nbytes


class WriterHandle(Protocol):
    """What the parent needs of a started writer (a `subprocess.Popen`)."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def kill(self) -> None: ...


class _Connection:
    """One started writer: its process, the parent's end of the socket, and the requests
    sent to it that it has not answered yet."""

    def __init__(self, sock: socket.socket, proc: WriterHandle) -> None:
        self.sock = sock
        self.proc = proc
        self.pending: dict[int, cf.Future[None]] = {}

    def alive(self) -> bool:
        return self.proc.poll() is None


def _read_replies(conn: _Connection, lock: threading.Lock,
                  box: list[_Connection | None]) -> None:
    """Resolve `conn`'s requests as its writer answers; when its stream ends, fail what is
    left (requests to a writer started since are not touched)."""
    reader = conn.sock.makefile("rb")
    try:
        for line in reader:
            reply = json.loads(line)
            with lock:
                fut = conn.pending.pop(reply["id"], None)
            if fut is None:
                continue
            err = reply.get("error")
            if err is None:
                fut.set_result(None)
            else:
                cls = _ERRORS.get(err["type"], StoreError)
                exc = cls(f"writer process: {err['message']}")
                exc.errno = err.get("errno")
                fut.set_exception(exc)
    except (OSError, ValueError):
        pass
    with lock:
        pending, conn.pending = conn.pending, {}
        if box[0] is conn:
            box[0] = None
    try:
        code = conn.proc.wait(timeout=1.0)
    except subprocess.TimeoutExpired:
        code = None
    for fut in pending.values():
        fut.set_exception(StoreError(f"the writer process ended (exit status {code}) "
                                     "before it finished writing; nothing was committed"))
    reader.close()
    conn.sock.close()


def _stop(box: list[_Connection | None]) -> None:
    """Tell the live writer to finish (its WriterProcess was dropped or the program ends)."""
    conn = box[0]
    if conn is not None:
        try:
            conn.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def spawn_writer(fd: int, root: Path, threads: int, direct: bool) -> WriterHandle:
    """Start a writer process serving socket `fd` (which the caller closes afterwards).
    The one place a writer is started: tests replace it to run `serve` where their power
    loss model sees its disk operations (tests/reliability/powerloss.py)."""
    package_root = str(Path(__file__).resolve().parents[2])
    path = os.environ.get("PYTHONPATH")
    env = dict(os.environ, PYTHONPATH=package_root + (os.pathsep + path if path else ""))
    return subprocess.Popen(
        [sys.executable, "-c", _CHILD_MAIN, str(fd), str(root), str(threads),
         "direct" if direct else "buffered"],
        pass_fds=[fd], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=env)


class WriterProcess:
    """The parent's end: `put()` and `sync()` run in the writer process; thread-safe (many
    requests may be in flight). Shared slots are registered with `add_slot()`."""

    def __init__(self, root: Path, threads: int = 1, direct: bool = True) -> None:
        self.root = root
        self.threads = threads
        #: write large slot blobs with O_DIRECT (stores/direct_io.py); False: all buffered
        self.direct = direct
        self._lock = threading.Lock()  # the connection, its pending requests, the slots
        self._ids = itertools.count()
        self._slots: list[SharedSlot] = []
        #: keys put since the last sync, by any writer (see the module docstring)
        self._unsynced: set[str] = set()
        # the live connection, in a box the reply reader and the finalizer share: neither
        # keeps this object alive, and when it goes, its writer is told to stop
        self._box: list[_Connection | None] = [None]
        self._closed = False
        weakref.finalize(self, _stop, self._box)

    @property
    def _conn(self) -> _Connection | None:
        return self._box[0]

    @_conn.setter
    def _conn(self, conn: _Connection | None) -> None:
        self._box[0] = conn

    # ---------------------------------------------------------------- the process
    def _started(self) -> _Connection:
        """A live writer, started (and given every slot) if need be. Called with the lock
        held."""
        if self._closed:
            raise StoreError("the writer process was closed")
        if self._conn is not None and self._conn.alive():
            return self._conn
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            proc = spawn_writer(theirs.fileno(), self.root, self.threads, self.direct)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        conn = self._conn = _Connection(ours, proc)
        threading.Thread(target=_read_replies, args=(conn, self._lock, self._box),
                         name="ckpt-writer-replies", daemon=True).start()
        for slot in self._slots:  # a restarted writer maps every slot again
            self._send_map(conn, slot)
        return conn

    @staticmethod
    def _send_map(conn: _Connection, slot: SharedSlot) -> None:
        line = json.dumps({"op": "map", "slot": slot.index, "nbytes": slot.nbytes}) + "\n"
        try:
            socket.send_fds(conn.sock, [line.encode()], [slot.fd])
        except OSError:
            pass  # the writer died: its requests fail (see _read_replies)

    # ---------------------------------------------------------------- requests
    def add_slot(self, slot: SharedSlot) -> None:
        """Register a shared slot and give it to the writer (started if need be)."""
        with self._lock:
            conn = self._started()
            self._slots.append(slot)
            self._send_map(conn, slot)

    def _request(self, message: dict[str, Any], payload: Buffer | None = None) -> None:
        """Send one request and wait for its answer. A writer found dead while sending (it
        ended while idle, before its reply reader noticed: `Popen.poll` cannot tell while
        that thread waits on the process) never received the request whole, so it is sent
        once more to a new writer; a writer that dies after receiving it fails it."""
        for attempt in (1, 2):
            fut: cf.Future[None] = cf.Future()
            with self._lock:
                conn = self._started()
                message["id"] = rid = next(self._ids)
                conn.pending[rid] = fut
                try:
                    conn.sock.sendall((json.dumps(message) + "\n").encode())
                    if payload is not None:
                        conn.sock.sendall(payload)
                except OSError:
                    conn.pending.pop(rid, None)
                    if self._conn is conn:
                        self._conn = None  # dead: the next request starts another writer
                    if attempt == 1:
                        continue
                    raise StoreError("the writer process could not be reached; nothing was "
                                     "committed") from None
            fut.result()
            return

    def put(self, key: str, data: Buffer) -> None:
        """Write `data` as `key` in the writer process (like Store.put); returns when written."""
        address, nbytes = _address(data)
        with self._lock:
            slot = next((s for s in self._slots
                         if s.address <= address and address + nbytes <= s.address + s.nbytes),
                        None)
        if slot is not None:
            self._request({"op": "put", "key": key, "slot": slot.index,
                           "offset": address - slot.address, "nbytes": nbytes})
        else:
            self._request({"op": "put", "key": key, "inline": nbytes}, data)
        with self._lock:
            self._unsynced.add(key)

    def sync(self) -> None:
        """Make every object put since the last sync durable, whichever writer wrote it
        (LocalStore.sync in the writer, told the keys of its predecessors too)."""
        with self._lock:
            keys = sorted(self._unsynced)
        self._request({"op": "sync", "keys": keys})
        with self._lock:
            self._unsynced.difference_update(keys)

    @property
    def pid(self) -> int | None:
        """The writer's process id while one runs."""
        conn = self._conn
        return conn.proc.pid if conn is not None and conn.alive() else None

    def close(self) -> None:
        """Stop the writer (it finishes the request in hand) and wait for it."""
        with self._lock:
            self._closed = True
            conn = self._conn
        if conn is not None:
            try:
                conn.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            try:
                conn.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                conn.proc.kill()
                conn.proc.wait()
        for slot in self._slots:
            slot.close()


# -------------------------------------------------------------------- the writer's side
class _Channel:
    """Reads JSON lines, raw payloads and passed fds from the socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.fds: deque[int] = deque()

    def _more(self) -> bool:
        data, ancdata, _flags, _addr = self.sock.recvmsg(_RECV, _FDS_SPACE)
        for level, kind, cdata in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(cdata[: len(cdata) - len(cdata) % fds.itemsize])
                self.fds.extend(fds)
        self.buf += data
        return bool(data)

    def line(self) -> dict[str, Any] | None:
        while b"\n" not in self.buf:
            if not self._more():
                return None
        end = self.buf.index(b"\n")
        message: dict[str, Any] = json.loads(self.buf[:end])
        del self.buf[: end + 1]
        return message

    def payload(self, n: int) -> bytearray:
        while len(self.buf) < n:
            if not self._more():
                raise EOFError("the parent closed the channel mid-message")
        data = self.buf[:n]
        del self.buf[:n]
        return data


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(PARENT_POLL)
    os._exit(0)


def serve(fd: int, root: str, threads: int, direct: bool = True,
          watch_parent: bool = True) -> None:
    """The writer's main loop (module docstring); `direct`: O_DIRECT for large blobs;
    `watch_parent`: exit when the parent process changes (off where the writer runs as a
    thread of its parent: tests)."""
    if watch_parent:
        threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    sock = socket.socket(fileno=fd)
    try:
        store: LocalStore = (DirectLocalStore(root, create=False) if direct
                             else LocalStore(root, create=False))
    except BaseException:
        sock.close()
        raise
    channel = _Channel(sock)
    maps: dict[int, memoryview] = {}
    send_lock = threading.Lock()
    in_flight: list[cf.Future[None]] = []

    def answer(rid: int, exc: BaseException | None) -> None:
        reply: dict[str, Any] = {"id": rid}
        if exc is not None:
            reply["error"] = {"type": type(exc).__name__, "message": str(exc),
                              "errno": getattr(exc, "errno", None)}
        with send_lock:
            sock.sendall((json.dumps(reply) + "\n").encode())

    def sync(keys: list[str]) -> None:
        store.note_written(keys)  # what a writer before this one put since the last sync
        store.sync()

    def run(rid: int, work: Any) -> None:
        try:
            work()
        except Exception as exc:  # reported to the parent, which raises it
            answer(rid, exc)
        except BaseException:  # the writer is going down: end the channel, so that the
            sock.shutdown(socket.SHUT_RDWR)  # parent fails this request instead of waiting
            raise
        else:
            answer(rid, None)

    with sock, store, cf.ThreadPoolExecutor(threads, thread_name_prefix="ckpt-writer") as pool:
        while (msg := channel.line()) is not None:
            op = msg["op"]
            if op == "map":
                slot_fd = channel.fds.popleft()
                maps[msg["slot"]] = memoryview(mmap.mmap(slot_fd, msg["nbytes"]))
                os.close(slot_fd)
            elif op == "put":
                if "inline" in msg:
                    data: Buffer = channel.payload(msg["inline"])
                else:
                    data = maps[msg["slot"]][msg["offset"] : msg["offset"] + msg["nbytes"]]
                in_flight.append(pool.submit(run, msg["id"], lambda k=msg["key"], d=data:
                                             store.put(k, d)))
            elif op == "sync":
                cf.wait(in_flight)
                in_flight.clear()
                run(msg["id"], functools.partial(sync, msg.get("keys", [])))
            in_flight[:] = [f for f in in_flight if not f.done()]


def main() -> None:
    """Entry point of the writer process: argv = socket fd, store folder, threads,
    "direct" or "buffered"."""
    fd, root, threads = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    serve(fd, root, threads, direct=sys.argv[4:5] != ["buffered"])
