"""Random S3 faults at a given rate, in front of moto's backend or of a real S3 server.

Built on the fault-injection helpers of tests/ckptstore/stores/test_s3.py (`FaultPlan`,
`FaultMiddleware`, `Rule`), which it imports rather than copies:

* `ChaosPlan` is a FaultPlan that, besides its explicit rules, draws a fault for each request
  with probability `rate` (seeded RNG): 503 SlowDown, 500 InternalError, 500 after the request
  landed (a lost reply), a connection dropped before the request is processed or after it
  landed, and, for GETs, a body cut off half-way. Independently, with probability `rate`, the
  request is delayed by 5-50 ms. While `down` is set (an outage), every request's connection
  is dropped before it is processed.
* `ChaosMiddleware` is a FaultMiddleware that also knows the actions `FaultMiddleware` lacks
  ("500", "drop", "drop-after") and hands the others to it.
* `ForwardApp` is a WSGI app that forwards each request byte for byte (headers, raw path and
  query, body) to an upstream S3 server, so the same faults can sit in front of SeaweedFS. The
  client signs for the proxy's host:port and the Host header is forwarded unchanged, so the
  upstream's signature check passes.
"""

from __future__ import annotations

import http.client
import random
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from tests.ckptstore.stores.test_s3 import FaultMiddleware, FaultPlan, Rule, _xml_error

# fault kinds and their weights when a request is picked for a fault
KINDS: dict[str, int] = {"503": 30, "500": 15, "lost-reply": 15, "drop": 10, "drop-after": 10,
                         "truncate": 20}
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
              "proxy-connection", "expect"}


class ChaosPlan(FaultPlan):
    """A FaultPlan that also injects random faults at `rate` (see the module docstring)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.rate = 0.0
        self._rng = random.Random(seed)
        self.injected: Counter[str] = Counter()
        self.request_count = 0
        #: an outage: while True every request's connection is dropped (counted in `refused`)
        self.down = False
        self.refused = 0

    def configure(self, rate: float, seed: int) -> None:
        with self.lock:
            self.rate = rate
            self._rng = random.Random(seed)
            self.injected.clear()
            self.request_count = 0
            self.seen.clear()

    def take(self, env: dict[str, Any]) -> Rule | None:
        rule = super().take(env)  # explicit rules first; records the request in `seen`
        with self.lock:
            self.request_count += 1
            if self.down:
                self.refused += 1
                return Rule(lambda _env: True, "drop")
            if rule is not None:
                return rule
            pause = self._rng.uniform(0.005, 0.05) if self._rng.random() < self.rate else 0.0
            action = None
            if self._rng.random() < self.rate:
                kinds = [k for k in KINDS if k != "truncate" or env["REQUEST_METHOD"] == "GET"]
                action = self._rng.choices(kinds, [KINDS[k] for k in kinds])[0]
                self.injected[action] += 1
            if pause:
                self.injected["delay"] += 1
        if pause:
            time.sleep(pause)  # latency, outside the lock
        return Rule(lambda _env: True, action) if action else None


class _Given:
    """The one rule a FaultMiddleware should apply to this request."""

    def __init__(self, rule: Rule) -> None:
        self.rule = rule

    def take(self, env: dict[str, Any]) -> Rule | None:
        return self.rule


class ChaosMiddleware(FaultMiddleware):
    """FaultMiddleware plus the actions "500", "drop" and "drop-after"."""

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        rule = self.plan.take(environ)
        if rule is None:
            return self.app(environ, start_response)
        if rule.action == "500":
            environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
            body = _xml_error("InternalError", "We encountered an internal error.")
            start_response("500 Internal Server Error", [
                ("Content-Type", "application/xml"), ("Content-Length", str(len(body)))])
            return [body]
        if rule.action in ("drop", "drop-after"):
            if rule.action == "drop-after":
                self._forward(environ)  # the request lands; its reply never leaves
            sock = environ["werkzeug.socket"]
            start_response("500 Internal Server Error", [("Content-Length", "0")])

            def dropped() -> Iterator[bytes]:
                sock.shutdown(socket.SHUT_RDWR)  # no status line ever reaches the client
                return
                yield b""  # pragma: no cover - makes this a generator

            return dropped()
        return FaultMiddleware(self.app, _Given(rule))(environ, start_response)  # type: ignore[arg-type]


class ForwardApp:
    """WSGI app forwarding every request unchanged to http://host:port (one connection per
    request). Hop-by-hop headers are dropped; the body is sent with its exact length."""

    def __init__(self, host: str, port: int, timeout: float = 120.0) -> None:
        self.host, self.port, self.timeout = host, port, timeout

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]
                 ) -> Iterable[bytes]:
        method = environ["REQUEST_METHOD"]
        target = environ.get("REQUEST_URI") or environ.get("RAW_URI")
        if not target:
            query = environ.get("QUERY_STRING", "")
            target = environ.get("PATH_INFO", "/") + (f"?{query}" if query else "")
        length = environ.get("CONTENT_LENGTH")
        body = (environ["wsgi.input"].read(int(length)) if length
                else environ["wsgi.input"].read() if environ.get("wsgi.input_terminated")
                else b"")
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            conn.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
            for key, value in environ.items():
                if key.startswith("HTTP_"):
                    name = key[5:].replace("_", "-")
                    if name.lower() not in HOP_BY_HOP:
                        conn.putheader(name, value)
            if environ.get("CONTENT_TYPE"):
                conn.putheader("Content-Type", environ["CONTENT_TYPE"])
            if body or method in ("PUT", "POST"):
                conn.putheader("Content-Length", str(len(body)))
            conn.endheaders(body)
            resp = conn.getresponse()
            data = resp.read()
            headers = [(k, v) for k, v in resp.getheaders() if k.lower() not in HOP_BY_HOP]
            if method != "HEAD" and not any(k.lower() == "content-length" for k, _ in headers):
                headers.append(("Content-Length", str(len(data))))
            start_response(f"{resp.status} {resp.reason}", headers)
            return [data]
        finally:
            conn.close()


class ChaosServer:
    """A threaded HTTP server on 127.0.0.1 serving `app` behind ChaosMiddleware."""

    def __init__(self, app: Any, seed: int = 0) -> None:
        from werkzeug.serving import make_server

        self.plan = ChaosPlan(seed)
        self._server = make_server("127.0.0.1", 0, ChaosMiddleware(app, self.plan),
                                   threaded=True)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="s3-chaos")
        self._thread.start()
        host, port = self._server.server_address[:2]
        self.endpoint = f"http://{host!s}:{port}"

    def close(self) -> None:
        self._server.shutdown()
        self._thread.join()
        self._server.server_close()


def moto_app() -> Any:
    """moto's S3 as a WSGI app, sharing this process's moto backend (the same buckets as
    every moto server started in this process)."""
    from moto.server import (  # type: ignore[attr-defined]
        DomainDispatcherApplication,
        create_backend_app,
    )

    return DomainDispatcherApplication(create_backend_app)
