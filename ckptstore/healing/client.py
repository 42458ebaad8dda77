"""HTTP/1.1 requests to a sender, with one deadline over a whole receive.

A small client of its own rather than http.client: the sockets are blocking, with the
kernel's send and receive timeouts (SO_SNDTIMEO, SO_RCVTIMEO) set to the time left before
each operation, and bodies are read straight into the caller's buffer with MSG_WAITALL in
1 MiB pieces, each hashed while it is in the cache. So one piece costs one system call and
one release of the interpreter lock, where a socket with a Python timeout (non-blocking
underneath) wakes up for every segment that arrives.
"""

from __future__ import annotations

import re
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any

from ..errors import FormatError
from .errors import HealError, HealTimeoutError

PIECE = 1 << 20
#: the receive buffer asked for each connection, before it connects (the kernel caps it at
#: net.core.rmem_max and doubles it). Left to autotuning, a fresh connection starts at
#: tcp_rmem's default (128 KiB) and grows with the transfer: over loopback here a 1 GiB
#: transfer took 0.8-1.1 s that way and 0.3-0.5 s with the buffer set. 8 MiB covers the
#: bandwidth-delay product of 100 Gb/s at 0.6 ms per connection
SOCKET_BUFFER = 8 << 20
MAX_HEAD = 1 << 16
MAX_ERROR_BODY = 1 << 16
_ADDRESS = re.compile(r"http://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]{1,253}):([0-9]{1,5})/"
                      r"([0-9a-f]{32})/\Z")


@dataclass(frozen=True)
class Address:
    host: str
    port: int
    prefix: str  # "/<secret>/"

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}{self.prefix}"


def parse_address(metadata: object) -> Address:
    """The sender's address from its transport metadata; FormatError for anything else."""
    m = _ADDRESS.match(metadata) if isinstance(metadata, str) else None
    if m is None:
        raise FormatError(f"not the metadata of a ckptstore.torchft.Transport: "
                          f"{metadata!r:.120} (expected http://HOST:PORT/<32 hex>/)")
    port = int(m.group(2))
    if not 0 < port < 65536:
        raise FormatError(f"bad port in transport metadata {metadata!r:.120}")
    return Address(m.group(1).strip("[]"), port, f"/{m.group(3)}/")


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def check(self, what: str) -> float:
        """The seconds left; HealTimeoutError naming `what` when none are."""
        left = self.left()
        if left <= 0:
            raise HealTimeoutError(f"timed out after {self.seconds:g} s {what}")
        return left


def set_timeouts(sock: socket.socket, seconds: float) -> None:
    """The kernel's send and receive timeouts of a blocking socket (at least 1 ms)."""
    seconds = max(0.001, seconds)
    tv = struct.pack("@ll", int(seconds), int((seconds % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


class Broken(Exception):
    """The connection failed (refused, reset, closed early): the caller decides whether to
    retry on a new connection."""


class Refused(Exception):
    """The sender answered with an error document."""

    def __init__(self, status: int, message: str, retry: bool) -> None:
        super().__init__(message)
        self.status, self.message, self.retry = status, message, retry


@dataclass(frozen=True)
class Response:
    status: int
    headers: dict[str, str]  # lower-case names
    length: int

    def header(self, name: str) -> str | None:
        return self.headers.get(name.lower())


class Connection:
    """One kept-alive connection to the sender (opened on first use)."""

    def __init__(self, address: Address, deadline: Deadline) -> None:
        self.address = address
        self.deadline = deadline
        self._sock: socket.socket | None = None
        self._pending = b""  # body bytes read with the head

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None
                self._pending = b""

    def _arm(self, what: str) -> socket.socket:
        left = self.deadline.check(what)
        if self._sock is None:
            try:
                sock = _connect(self.address.host, self.address.port, left)
            except TimeoutError:
                self.deadline.check(what)
                raise HealTimeoutError(f"timed out {what}: no connection") from None
            except OSError as exc:
                raise Broken(f"cannot connect: {type(exc).__name__}: {exc}") from None
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock = sock
        set_timeouts(self._sock, self.deadline.left())
        return self._sock

    def _failed(self, exc: BaseException, what: str) -> BaseException:
        """The error to raise for a socket error `exc` (the connection is closed)."""
        self.close()
        if isinstance(exc, (TimeoutError, BlockingIOError)):
            self.deadline.check(what)
            return HealTimeoutError(f"timed out {what}: the sender stopped answering")
        if isinstance(exc, (Broken, HealError)):
            return exc
        return Broken(f"{type(exc).__name__}: {exc}")

    def request(self, method: str, path: str, what: str,
                headers: dict[str, str] | None = None) -> Response:
        """Send a request and read the response head. Refused for an error document (its
        body read), Broken for a failed connection, HealTimeoutError past the deadline."""
        lines = [f"{method} {self.address.prefix}{path} HTTP/1.1",
                 f"Host: {self.address.host}:{self.address.port}", "Content-Length: 0"]
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        data = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        try:
            sock = self._arm(what)
            sock.sendall(data)
            head = self._pending
            while b"\r\n\r\n" not in head:
                if len(head) > MAX_HEAD:
                    raise Broken("response head too large")
                self._arm(what)
                more = sock.recv(MAX_HEAD)
                if not more:
                    raise Broken("the sender closed the connection")
                head += more
        except (OSError, Broken) as exc:
            raise self._failed(exc, what) from None
        raw, _, self._pending = head.partition(b"\r\n\r\n")
        resp = _parse_head(raw)
        if resp is None:
            self.close()
            raise Broken("malformed response head")
        if resp.status >= 300:
            message, retry = self._error_body(resp, what)
            raise Refused(resp.status, message, retry)
        return resp

    def _error_body(self, resp: Response, what: str) -> tuple[str, bool]:
        import json

        if resp.length > MAX_ERROR_BODY:
            self.close()
            return f"HTTP {resp.status}", False
        body = bytearray(resp.length)
        try:
            self.read_into(resp, memoryview(body), what)
            doc: Any = json.loads(body.decode("utf-8", "replace")) if body else {}
        except (Broken, HealError, ValueError):
            self.close()
            return f"HTTP {resp.status}", False
        if isinstance(doc, dict) and isinstance(doc.get("error"), str):
            return doc["error"], bool(doc.get("retry"))
        return f"HTTP {resp.status}", False

    def read_into(self, resp: Response, out: memoryview, what: str,
                  hasher: Any = None) -> None:
        """Read the whole body (exactly len(out) bytes) into `out`, feeding `hasher` piece by
        piece. Broken if the sender closes early, HealTimeoutError past the deadline."""
        n = len(out)
        if resp.length != n:
            self.close()
            raise Broken(f"the sender sent {resp.length} bytes where {n} were asked for")
        pos = min(n, len(self._pending))
        out[:pos] = self._pending[:pos]
        self._pending = self._pending[pos:]
        hashed = 0
        try:
            while pos < n:
                sock = self._arm(what)
                end = min(n, pos + PIECE)
                while pos < end:
                    k = sock.recv_into(out[pos:end], end - pos, socket.MSG_WAITALL)
                    if not k:
                        raise Broken(f"the sender closed the connection after {pos} of {n} "
                                     "bytes of a response")
                    pos += k
                if hasher is not None:
                    hasher.update(out[hashed:pos])
                    hashed = pos
        except (OSError, Broken) as exc:
            raise self._failed(exc, what) from None
        if hasher is not None and hashed < n:
            hasher.update(out[hashed:n])

    def read_all(self, resp: Response, limit: int, what: str) -> bytes:
        if not 0 <= resp.length <= limit:
            self.close()
            raise HealError(f"{what}: the sender announced {resp.length} bytes (limit {limit})")
        buf = bytearray(resp.length)
        self.read_into(resp, memoryview(buf), what)
        return bytes(buf)


def _connect(host: str, port: int, timeout: float) -> socket.socket:
    """A connected socket to host:port whose receive buffer was set before it connected (the
    window it advertises depends on it)."""
    error: OSError | None = None
    for family, kind, proto, _name, addr in socket.getaddrinfo(host, port, 0,
                                                                socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
            sock.settimeout(timeout)
            sock.connect(addr)
            return sock
        except OSError as exc:
            sock.close()
            error = exc
    raise error if error is not None else OSError(f"cannot resolve {host!r}")


def _parse_head(raw: bytes) -> Response | None:
    try:
        text = raw.decode("latin-1")
        status_line, *header_lines = text.split("\r\n")
        version, code, *_ = status_line.split(" ", 2)
        if not version.startswith("HTTP/1."):
            return None
        headers = {}
        for line in header_lines:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length", "0"))
        return Response(int(code), headers, length) if length >= 0 else None
    except ValueError:
        return None
