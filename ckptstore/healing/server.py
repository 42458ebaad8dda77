"""The sender's HTTP server: serves the published step's index and blobs (ranged GETs by
digest) from the state's memory, on a small thread pool (one thread per connection). A blob
of device tensors is copied into a page-locked slot for each request, and sent once that
copy completed (snapshot.DeviceBlob); a failed copy is a 500 naming the device error.

Paths, under a random secret prefix that only the transport's metadata string names:

    GET  /<secret>/v1/<step>/index                     the sealed manifest of that step
    GET  /<secret>/v1/<step>/<snapshot>/blob/<digest>  a blob, or `Range: bytes=a-b` of it
    POST /<secret>/v1/<step>/<snapshot>/done           the receiver has everything

Errors are JSON bodies `{"error": "...", "retry": bool}` on a kept-alive connection: 503 with
retry for a step not published yet, 410 for a step or snapshot no longer served (the sender
moved on), 404 for anything else unknown.

Phases: idle (nothing served) -> serving (after `publish`) -> draining (`withdraw` called:
no new transfer starts; the transfers that fetched this step's index may finish) -> idle.
`withdraw` returns once no request reads the state any more and none will: every transfer
finished or its connection closed, or, after the timeout, their connections were shut down.
A transfer lives until the receiver posts `done` or every connection that carried it (the
one that fetched its index, those that fetched its blobs) is closed, so a receiver that dies
ends its transfer with its sockets.

Why one module: the phases, the transfer bookkeeping and the request handler guard one
state under one lock; `withdraw`'s promise holds only if all three read it the same way.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from ..errors import DeviceCopyError
from .client import SOCKET_BUFFER, set_timeouts
from .snapshot import Snapshot

log = logging.getLogger("ckptstore.healing")

#: called for every blob body about to be sent: (blob digest, offset in the blob, the bytes);
#: may sleep, and may return other bytes of the same length to send instead (tests inject
#: corruption and slow senders with it)
ServeHook = Callable[[str, int, memoryview], "bytes | memoryview | None"]

_PATH = re.compile(r"/(?P<secret>[0-9a-f]{32})/v1/(?P<step>-?[0-9]{1,19})/"
                   r"(?:(?P<index>index)|(?P<snap>[0-9a-f]{32})/"
                   r"(?:blob/(?P<digest>[0-9a-f]{32})|(?P<done>done)))\Z")
_RANGE = re.compile(r"bytes=([0-9]{1,19})-([0-9]{1,19})\Z")
#: at most this many bytes per system call: a whole chunk (16 MiB by default) goes out in one,
#: and a pack's small members in one scatter-gather send. Each call releases and retakes the
#: interpreter lock; while the trainer runs Python, retaking it can wait up to the switch
#: interval (5 ms), so fewer, larger calls serve faster beside training
SEND_PIECE = 16 << 20
IOV_MAX = 512


class _Refused(Exception):
    def __init__(self, status: int, message: str, retry: bool = False) -> None:
        super().__init__(message)
        self.status, self.message, self.retry = status, message, retry


class ServeState:
    """What is served and who reads it (thread-safe; no HTTP in here)."""

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.snapshot: Snapshot | None = None
        self.phase = "idle"
        self.last_step: int | None = None  # the newest step published
        self.failed: dict[int, str] = {}  # step -> why it could not be published
        #: transfer id -> ids of the open connections it has used (it ends when the receiver
        #: posts done or when all of them are closed)
        self.transfers: dict[int, set[int]] = {}
        self.inflight = 0  # requests reading the state's memory now
        self.conns: dict[int, socket.socket] = {}
        self.bytes_sent = 0  # blob and index bytes, since the server started
        self.requests = 0
        self._next_id = 0

    def new_id(self) -> int:
        with self.cv:
            self._next_id += 1
            return self._next_id

    def join_transfer(self, transfer: int | None, conn: int) -> bool:
        """Note that connection `conn` carries `transfer`; False if no such transfer runs."""
        with self.cv:
            conns = self.transfers.get(transfer) if transfer is not None else None
            if conns is None:
                return False
            conns.add(conn)
            return True

    def leave(self, transfers: set[int], conn: int) -> None:
        """Connection `conn` closed: a transfer none of whose connections is open ends."""
        with self.cv:
            for t in transfers:
                conns = self.transfers.get(t)
                if conns is not None:
                    conns.discard(conn)
                    if not conns:
                        del self.transfers[t]
            self.cv.notify_all()

    def index_for(self, step: int, transfer: int, conn: int = 0,
                  hold: float = 0.0) -> Snapshot:
        """The snapshot to serve an index request for `step` from, registering `transfer`.
        A step not published yet is waited for up to `hold` seconds (a long poll: the
        receiver usually asks before the sender has hashed its state)."""
        end = time.monotonic() + hold
        with self.cv:
            while True:
                try:
                    return self._index_for(step, transfer, conn)
                except _Refused as exc:
                    left = end - time.monotonic()
                    if not exc.retry or left <= 0:
                        raise
                    self.cv.wait(left)

    def _index_for(self, step: int, transfer: int, conn: int) -> Snapshot:
        with self.cv:
            why = self.failed.get(step)
            if why is not None:
                raise _Refused(500, f"the sender could not serve step {step}: {why}")
            snap = self.snapshot
            if self.phase == "serving" and snap is not None and snap.step == step:
                self.transfers[transfer] = {conn}
                return snap
            newest = self.last_step
            if newest is not None and newest > step:
                raise _Refused(410, f"step {step} is not served: the sender has moved on to "
                                    f"step {newest}")
            if newest == step and self.phase != "serving":
                raise _Refused(410, f"step {step} is no longer served: the sender stopped "
                                    "serving it (disallow_checkpoint: it has moved on)")
            doing = ("nothing yet" if newest is None else
                     f"step {newest}" if self.phase == "serving" else
                     f"nothing (its last step was {newest})")
            raise _Refused(503, f"step {step} is not served yet: the sender serves {doing}",
                           retry=True)

    @contextmanager
    def reading(self, step: int, token: str, transfer: int | None,
                conn: int) -> Iterator[Snapshot]:
        """Count a request that reads the snapshot's memory while it does."""
        self.join_transfer(transfer, conn)
        with self.cv:
            snap = self.snapshot
            if snap is None or snap.step != step or snap.token != token or not (
                    self.phase == "serving"
                    or (self.phase == "draining" and transfer in self.transfers)):
                raise _Refused(410, f"the snapshot of step {step} is no longer served: the "
                                    "sender stopped serving it (disallow_checkpoint) or "
                                    f"moved on (its newest step is {self.last_step})")
            self.inflight += 1
        try:
            yield snap
        finally:
            with self.cv:
                self.inflight -= 1
                self.cv.notify_all()

    def end_transfer(self, transfer: int | None) -> None:
        if transfer is None:
            return
        with self.cv:
            if self.transfers.pop(transfer, None) is not None:
                self.cv.notify_all()

    def publish(self, snapshot: Snapshot) -> None:
        with self.cv:
            assert self.phase == "idle", "withdraw the previous step first"
            self.snapshot, self.phase, self.last_step = snapshot, "serving", snapshot.step
            self.failed.pop(snapshot.step, None)
            self.cv.notify_all()

    def publish_failure(self, step: int, why: str) -> None:
        with self.cv:
            self.failed = {step: why}
            self.last_step = step if self.last_step is None else max(self.last_step, step)
            self.cv.notify_all()

    def withdraw(self, timeout: float) -> None:
        """Stop serving; return once nothing reads the state (module docstring)."""
        with self.cv:
            if self.phase == "idle":
                return
            self.phase = "draining"
            self.cv.notify_all()
            done = self.cv.wait_for(lambda: not self.transfers and not self.inflight,
                                    timeout=max(0.0, timeout))
            if not done:
                log.warning("live heal: %d transfer(s) of step %s still running after %.1f s; "
                            "closing their connections", len(self.transfers),
                            self.last_step, timeout)
                for sock in list(self.conns.values()):
                    try:
                        sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                self.transfers.clear()
                self.cv.wait_for(lambda: not self.inflight)
            self.snapshot, self.phase = None, "idle"
            self.cv.notify_all()


class HealServer:
    """The threaded HTTP server of one transport, bound to `host:port` (0: any free port)."""

    def __init__(self, host: str, port: int, timeout: float,
                 hook: ServeHook | None = None) -> None:
        self.state = ServeState()
        self.secret = secrets.token_hex(16)
        self.timeout = timeout
        self.hook = hook
        handler = _handler_class(self)
        server_class = _Server6 if ":" in host else _Server
        self._httpd = server_class((host, port), handler)
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={
            "poll_interval": 0.1}, name="ckpt-heal-server", daemon=True)
        self._thread.start()
        self.host = host
        self.port = int(self._httpd.server_address[1])

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/{self.secret}/"

    def close(self, wait: bool = True) -> None:
        """Stop accepting, close every connection; with `wait`, until the server thread ended."""
        def stop() -> None:
            self._httpd.shutdown()
            self._httpd.server_close()

        with self.state.cv:
            for sock in list(self.state.conns.values()):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        if wait:
            stop()
            self._thread.join()
        else:
            threading.Thread(target=stop, name="ckpt-heal-stop", daemon=True).start()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64


class _Server6(_Server):
    address_family = socket.AF_INET6


def _handler_class(server: HealServer) -> type[BaseHTTPRequestHandler]:
    state = server.state

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            super().setup()
            self.conn_id = state.new_id()
            self.used: set[int] = set()  # transfers this connection has carried
            with state.cv:
                state.conns[self.conn_id] = self.connection
            # blocking, with the kernel's timeouts: a body piece goes out in one system
            # call; a receiver silent for the timeout loses its connection
            self.connection.settimeout(None)
            set_timeouts(self.connection, server.timeout)
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # a large send buffer: fewer wake-ups per chunk (client.py, SOCKET_BUFFER)
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)

        def handle(self) -> None:
            try:
                super().handle()
            except OSError as exc:  # reset, timed out, shut down by withdraw: just close
                log.debug("live heal server: connection ended (%s)", exc)
                self.close_connection = True

        def finish(self) -> None:
            try:
                super().finish()
            finally:
                with state.cv:
                    state.conns.pop(self.conn_id, None)
                state.leave(self.used, self.conn_id)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            log.debug("live heal server: " + format, *args)

        def _reply(self, status: int, body: bytes, content_type: str = "application/json",
                   headers: dict[str, str] | None = None) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            if body:
                self.wfile.write(body)

        def _refuse(self, exc: _Refused) -> None:
            body = json.dumps({"error": exc.message, "retry": exc.retry}).encode()
            self._reply(exc.status, body)

        def _route(self) -> re.Match[str] | None:
            path = self.path.split("?", 1)[0]
            m = _PATH.match(path)
            if m is None or not secrets.compare_digest(m.group("secret"), server.secret):
                self._refuse(_Refused(404, f"unknown path {path[:80]!r}"))
                return None
            return m

        def _transfer_arg(self) -> int | None:
            query = self.path.partition("?")[2]
            for part in query.split("&"):
                name, _, value = part.partition("=")
                if name == "t" and value.isdigit() and len(value) < 19:
                    return int(value)
            return None

        def do_GET(self) -> None:  # noqa: N802
            m = self._route()
            if m is None:
                return
            step = int(m.group("step"))
            try:
                if m.group("index"):
                    self._index(step)
                elif m.group("digest"):
                    self._blob(step, m.group("snap"), m.group("digest"))
                else:
                    raise _Refused(404, "unknown request")
            except _Refused as exc:
                self._refuse(exc)

        def do_POST(self) -> None:  # noqa: N802
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(min(length, 1 << 16))
            m = self._route()
            if m is None:
                return
            if not m.group("done"):
                self._refuse(_Refused(404, "unknown request"))
                return
            state.end_transfer(self._transfer_arg())
            self._reply(204, b"")

        def _index(self, step: int) -> None:
            transfer = state.new_id()
            snap = state.index_for(step, transfer, self.conn_id, hold=min(1.0, server.timeout))
            self.used.add(transfer)
            with state.cv:
                state.bytes_sent += len(snap.index)
                state.requests += 1
            self._reply(200, snap.index, "application/json",
                        {"X-Ckpt-Snapshot": snap.token, "X-Ckpt-Transfer": str(transfer)})

        def _blob(self, step: int, token: str, digest: str) -> None:
            transfer = self._transfer_arg()
            if transfer is not None:
                self.used.add(transfer)
            with state.reading(step, token, transfer, self.conn_id) as snap:
                blob = snap.blobs.get(digest)
                if blob is None:
                    raise _Refused(404, f"step {step} has no blob {digest}")
                start, length = 0, blob.size
                rng = self.headers.get("Range")
                if rng is not None:
                    r = _RANGE.match(rng.strip())
                    if r is None or not int(r.group(1)) <= int(r.group(2)) < blob.size:
                        raise _Refused(416, f"bad range {rng[:60]!r} for a blob of "
                                            f"{blob.size} bytes")
                    start, length = int(r.group(1)), int(r.group(2)) - int(r.group(1)) + 1
                # a device blob is copied into a page-locked slot here (staging.py): the
                # copy completed before anything is sent, the slot is given back after
                with ExitStack() as stack:
                    try:
                        views = stack.enter_context(blob.open(start, length))
                    except DeviceCopyError as exc:
                        raise _Refused(500, f"the sender could not read step {step}: {exc}"
                                       ) from None
                    self._send_body(digest, start, length, views, rng is not None)
                with state.cv:
                    state.bytes_sent += length
                    state.requests += 1

        def _send_body(self, digest: str, start: int, length: int, views: list[memoryview],
                       ranged: bool) -> None:
            self.send_response(206 if ranged else 200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(length))
            self.end_headers()
            pieces: list[bytes | memoryview] = []
            pos = start
            for view in views:
                for a in range(0, len(view), SEND_PIECE):
                    piece: bytes | memoryview = view[a : a + SEND_PIECE]
                    if server.hook is not None:
                        replaced = server.hook(digest, pos, view[a : a + SEND_PIECE])
                        if replaced is not None:
                            piece = replaced
                    pieces.append(piece)
                    pos += len(piece)
                    if len(pieces) >= IOV_MAX or len(piece) >= SEND_PIECE:
                        _send_all(self.connection, pieces)
                        pieces = []
            _send_all(self.connection, pieces)

    return Handler


def _send_all(sock: socket.socket, pieces: list[bytes | memoryview]) -> None:
    """Send `pieces` in order, as few system calls as the kernel allows (a blocking socket
    takes a whole scatter-gather list at once unless interrupted)."""
    views = [memoryview(p).cast("B") for p in pieces if len(p)]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if views and sent:
            views[0] = views[0][sent:]
