"""S3-specific behaviour and faults, against moto's server over real HTTP.

Faults come from two places, both outside the store under test:
* a second HTTP server in this process that serves the same moto backend through a small WSGI
  middleware (`FaultPlan`): 503 SlowDown, a lost reply after the write landed, a GET body cut
  off mid-way (the socket is shut down), an empty 200 listing;
* botocore `before-send` event handlers on the store's own client (a part upload that fails).
"""

from __future__ import annotations

import array
import concurrent.futures as cf
import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError, ConnectionClosedError

from ckptstore.errors import InvalidNameError, ObjectExistsError, ObjectNotFoundError, StoreError
from ckptstore.format.hashing import digest
from ckptstore.maintenance import checks
from ckptstore.stores import open_store
from ckptstore.stores import s3 as s3_module
from ckptstore.stores.s3 import MiB, S3Store

# -- a fault-injecting front for the moto backend -------------------------------------------


@dataclass
class Rule:
    """Apply `action` to the next `times` requests that `match`."""

    match: Callable[[dict[str, Any]], bool]
    action: str  # "503" | "lost-reply" | "no-such-upload" | "truncate" | "empty-200"
    times: int = 1
    hits: int = 0


@dataclass
class FaultPlan:
    rules: list[Rule] = field(default_factory=list)
    seen: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, action: str, method: str, key: str = "", *, query: str = "",
            times: int = 1) -> Rule:
        def match(env: dict[str, Any]) -> bool:
            return (
                env["REQUEST_METHOD"] == method
                and env["PATH_INFO"].endswith(key)
                and query in env.get("QUERY_STRING", "")
            )

        rule = Rule(match, action, times)
        with self.lock:
            self.rules.append(rule)
        return rule

    def take(self, env: dict[str, Any]) -> Rule | None:
        with self.lock:
            self.seen.append({
                "method": env["REQUEST_METHOD"],
                "path": env["PATH_INFO"],
                "query": env.get("QUERY_STRING", ""),
                "range": env.get("HTTP_RANGE"),
                "if_match": env.get("HTTP_IF_MATCH"),
            })
            for rule in self.rules:
                if rule.hits < rule.times and rule.match(env):
                    rule.hits += 1
                    return rule
        return None

    def requests(self, method: str, key: str = "") -> list[dict[str, Any]]:
        with self.lock:
            return [r for r in self.seen if r["method"] == method and r["path"].endswith(key)]

    def reset(self) -> None:
        with self.lock:
            self.rules.clear()
            self.seen.clear()


def _xml_error(code: str, message: str) -> bytes:
    return (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
            f"<Message>{message}</Message></Error>").encode()


class FaultMiddleware:
    def __init__(self, app: Any, plan: FaultPlan) -> None:
        self.app = app
        self.plan = plan

    def _forward(self, environ: dict[str, Any]) -> tuple[str, list[tuple[str, str]], bytes]:
        captured: dict[str, Any] = {}

        def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None):
            captured["status"], captured["headers"] = status, headers

        result = self.app(environ, start_response)
        try:
            body = b"".join(result)
        finally:
            getattr(result, "close", lambda: None)()
        return captured["status"], captured["headers"], body

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]):
        rule = self.plan.take(environ)
        if rule is None:
            return self.app(environ, start_response)
        if rule.action == "503":
            length = int(environ.get("CONTENT_LENGTH") or 0)
            environ["wsgi.input"].read(length)  # drain the request body
            body = _xml_error("SlowDown", "Please reduce your request rate.")
            start_response("503 Service Unavailable", [
                ("Content-Type", "application/xml"), ("Content-Length", str(len(body)))])
            return [body]
        if rule.action == "no-such-upload":  # what MinIO answers a repeated Complete
            environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
            body = _xml_error("NoSuchUpload", "The specified multipart upload does not exist.")
            start_response("404 Not Found", [
                ("Content-Type", "application/xml"), ("Content-Length", str(len(body)))])
            return [body]
        if rule.action == "lost-reply":
            self._forward(environ)  # the write lands in moto ...
            body = _xml_error("InternalError", "We encountered an internal error.")
            start_response("500 Internal Server Error", [  # ... and the client never hears so
                ("Content-Type", "application/xml"), ("Content-Length", str(len(body)))])
            return [body]
        if rule.action == "empty-200":
            self._forward(environ)
            start_response("200 OK", [("Content-Type", "application/xml"),
                                      ("Content-Length", "0")])
            return [b""]
        if rule.action == "truncate":
            status, headers, body = self._forward(environ)
            start_response(status, headers)  # promises the full Content-Length
            sock = environ["werkzeug.socket"]

            def cut() -> Iterator[bytes]:
                yield body[: len(body) // 2]
                sock.shutdown(socket.SHUT_RDWR)  # ... and the connection dies half-way

            return cut()
        raise AssertionError(f"unknown fault action {rule.action}")


@pytest.fixture(scope="session")
def fault_server(moto_endpoint: str) -> Iterator[tuple[str, FaultPlan]]:
    """Same moto backend as `moto_endpoint` (moto's state is per process), behind FaultPlan."""
    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    plan = FaultPlan()
    app = FaultMiddleware(DomainDispatcherApplication(create_backend_app), plan)
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    host, port = str(server.server_address[0]), server.server_address[1]
    try:
        yield f"http://{host}:{port}", plan
    finally:
        server.shutdown()
        thread.join()


@pytest.fixture
def faults(fault_server: tuple[str, FaultPlan]) -> Iterator[FaultPlan]:
    _, plan = fault_server
    plan.reset()
    yield plan
    plan.reset()


@pytest.fixture
def faulty_store(s3_uri: str, fault_server: tuple[str, FaultPlan], faults: FaultPlan):
    store = S3Store.from_uri(s3_uri, endpoint_url=fault_server[0], max_attempts=4,
                             read_retries=3)
    yield store
    store.close()


@pytest.fixture
def raw(moto_endpoint: str):
    client = boto3.client("s3", endpoint_url=moto_endpoint)
    yield client
    client.close()


def _bucket(uri: str) -> str:
    return uri[len("s3://"):].split("/", 1)[0]


def _pending_uploads(raw: Any, bucket: str) -> list[dict[str, Any]]:
    return raw.list_multipart_uploads(Bucket=bucket).get("Uploads", [])


PATTERN = bytes(range(251))  # a prime length, so shifted ranges never line up by accident


def _data(n: int) -> bytes:
    return (PATTERN * (n // len(PATTERN) + 1))[:n]


# -- opening -------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["ab", "Upper-case", "under_score", "-start", "end-",
                                 "a..b", "192.168.1.1", "x" * 64, ""])
def test_invalid_bucket_names(bad: str) -> None:
    with pytest.raises(InvalidNameError, match="bucket"):
        S3Store.from_uri(f"s3://{bad}/p", endpoint_url="http://127.0.0.1:1")


@pytest.mark.parametrize("bad", ["s3://bucket/../x", "s3://bucket/a//b", "s3://bucket/a b",
                                 "s3://bucket/p?x=1", "gs://bucket/p"])
def test_invalid_uris(bad: str) -> None:
    with pytest.raises(InvalidNameError):
        S3Store.from_uri(bad, endpoint_url="http://127.0.0.1:1")


def test_credentials_in_uri_or_endpoint_are_refused_without_echo() -> None:
    with pytest.raises(InvalidNameError) as info:
        S3Store.from_uri("s3://AKIAEXAMPLE:sup3rs3cret@bucket/p")
    assert "sup3rs3cret" not in str(info.value) and "AKIAEXAMPLE" not in str(info.value)
    with pytest.raises(InvalidNameError) as info:
        S3Store.from_uri("s3://bucket/p", endpoint_url="http://user:sup3rs3cret@127.0.0.1:1")
    assert "sup3rs3cret" not in str(info.value)


def test_uri_prefix_and_key_mapping(s3_uri: str, moto_endpoint: str, raw: Any) -> None:
    bucket = _bucket(s3_uri)
    with open_store(f"s3://{bucket}/runs/exp1/", endpoint_url=moto_endpoint) as a, \
            open_store(f"s3://{bucket}/runs/exp10", endpoint_url=moto_endpoint) as b, \
            open_store(f"s3://{bucket}", endpoint_url=moto_endpoint) as root:
        assert a.uri == f"s3://{bucket}/runs/exp1" and root.uri == f"s3://{bucket}"
        assert repr(a).startswith("S3Store('s3://")
        a.put("k/1", b"a")
        b.put("k/1", b"b")
        keys = sorted(o["Key"] for o in raw.list_objects_v2(Bucket=bucket)["Contents"])
        assert keys == ["runs/exp1/k/1", "runs/exp10/k/1"]
        assert [i.key for i in a.list()] == ["k/1"]  # exp10 is not under exp1/
        assert a.get("k/1") == b"a" and b.get("k/1") == b"b"
        assert sorted(i.key for i in root.list("runs/")) == keys
        info = a.stat("k/1")
        assert info.size == 1 and abs(info.mtime - time.time()) < 120


def test_list_pages_and_skips_foreign_keys(s3_uri: str, moto_endpoint: str, raw: Any) -> None:
    store = S3Store.from_uri(s3_uri, endpoint_url=moto_endpoint)
    store._list_page_size = 3
    for i in range(8):
        store.put(f"p/{i}", bytes(i))
    raw.put_object(Bucket=_bucket(s3_uri), Key="repo/p/folder/", Body=b"")  # console "folder"
    pages: list[int] = []
    store.client.meta.events.register(
        "before-send.s3.ListObjectsV2", lambda request, **kw: pages.append(1))
    assert {i.key: i.size for i in store.list("p/")} == {f"p/{i}": i for i in range(8)}
    assert len(pages) == 3
    store.close()


def test_missing_bucket_is_a_clear_store_error(moto_endpoint: str, raw: Any) -> None:
    name = f"missing-{uuid.uuid4().hex[:10]}"
    with pytest.raises(StoreError, match=name) as info:
        S3Store.from_uri(f"s3://{name}/p", endpoint_url=moto_endpoint)  # the default
    assert "does not exist" in str(info.value)
    # only create=True makes the bucket (a typo must not create one in your account)
    store = S3Store.from_uri(f"s3://{name}/p", endpoint_url=moto_endpoint, create=True)
    store.put("x", b"1")
    # a bucket that vanishes later: every call names it, and a GET is not "no such object"
    raw.delete_object(Bucket=name, Key="p/x")
    raw.delete_bucket(Bucket=name)
    for call in (lambda: store.get("x"), lambda: store.put("y", b"2"),
                 lambda: list(store.list()), lambda: store.delete("x"),
                 lambda: store.create("z", b"3")):
        with pytest.raises(StoreError, match=f"bucket '{name}' does not exist") as info:
            call()
        assert not isinstance(info.value, ObjectNotFoundError)
    store.close()


def test_unreachable_endpoint_fails_fast_with_one_clear_line() -> None:
    t0 = time.monotonic()
    with pytest.raises(StoreError) as info:
        S3Store.from_uri("s3://some-bucket/p", endpoint_url="http://127.0.0.1:1", max_attempts=2)
    assert time.monotonic() - t0 < 10
    message = str(info.value)
    assert "cannot reach S3 endpoint http://127.0.0.1:1" in message
    assert "\n" not in message


def test_missing_credentials_is_a_clear_store_error(
    moto_endpoint: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                "AWS_WEB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(StoreError, match="no usable AWS credentials") as info:
        S3Store.from_uri("s3://some-bucket/p", endpoint_url=moto_endpoint)
    assert "\n" not in str(info.value)


def test_credentials_never_appear_in_errors_reprs_or_logs(
    s3_uri: str, moto_endpoint: str, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    key_id, secret = "AKIASENTINEL1234XYZW", "s3cr3t-SENTINEL-value-do-not-print"
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    caplog.set_level(logging.DEBUG, logger="ckptstore")
    texts: list[str] = []

    def collect(exc: BaseException) -> None:
        while exc is not None:
            texts.extend([str(exc), repr(exc)])
            exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]

    store = S3Store.from_uri(s3_uri, endpoint_url=moto_endpoint, max_attempts=1)
    texts += [repr(store), store.uri, str(vars(store))]
    for call in (lambda: store.get("nope"), lambda: store.get_range("nope", 0, 3),
                 lambda: store.stat("nope"), lambda: store.read_into("nope", 0, memoryview(
                     bytearray(1))),
                 lambda: S3Store.from_uri("s3://no-such-bkt-here/p", endpoint_url=moto_endpoint,
                                          create=False),
                 lambda: S3Store.from_uri("s3://bkt-x/p", endpoint_url="http://127.0.0.1:1",
                                          max_attempts=1)):
        with pytest.raises(StoreError) as info:
            call()
        collect(info.value)
    store.put("x", b"1")
    with pytest.raises(ObjectExistsError) as info:
        store.create("x", b"2")
    collect(info.value)
    store.close()
    texts += [r.getMessage() for r in caplog.records]
    for text in texts:
        assert secret not in text and key_id not in text


# -- writes ----------------------------------------------------------------------------------


def test_put_accepts_buffers_without_bytes(s3_uri: str, moto_endpoint: str) -> None:
    with S3Store.from_uri(s3_uri, endpoint_url=moto_endpoint) as store:
        typed = array.array("I", range(1000))
        store.put("typed", memoryview(typed))  # format "I", itemsize 4
        assert store.get("typed") == typed.tobytes()
        strided = memoryview(bytes(range(200)))[::3]  # not contiguous
        store.put("strided", strided)
        assert store.get("strided") == bytes(range(200))[::3]
        middle = memoryview(bytearray(_data(5000)))[1000:4000]
        store.put("middle", middle)
        assert store.get("middle") == _data(5000)[1000:4000]
        store.create("created", memoryview(_data(300))[7:77])
        store.create("created", memoryview(_data(300))[7:77])  # identical: success
        assert store.get("created") == _data(300)[7:77]


def test_multipart_upload_in_parallel(s3_uri: str, moto_endpoint: str, raw: Any) -> None:
    store = S3Store.from_uri(s3_uri, endpoint_url=moto_endpoint, multipart_threshold=6 * MiB,
                             multipart_chunksize=5 * MiB, multipart_concurrency=3)
    parts: list[str] = []
    threads: set[str] = set()

    def count(request: Any, **kwargs: Any) -> None:
        parts.append(request.url)
        threads.add(threading.current_thread().name)

    store.client.meta.events.register("before-send.s3.UploadPart", count)
    data = _data(12 * MiB + 12345)
    store.put("big/obj", memoryview(data))
    assert len(parts) == 3 and len(threads) > 1
    head = raw.head_object(Bucket=_bucket(s3_uri), Key="repo/big/obj")
    assert head["ETag"].endswith('-3"') and head["ContentLength"] == len(data)
    assert store.get("big/obj") == data
    across = 5 * MiB - 100
    assert store.get_range("big/obj", across, 300) == data[across : across + 300]
    out = bytearray(2 * MiB + 7)
    store.read_into("big/obj", 4 * MiB, memoryview(out))  # several read steps
    assert out == data[4 * MiB : 6 * MiB + 7]
    # below the threshold: one PutObject
    parts.clear()
    store.put("small", data[: 6 * MiB - 1])
    assert parts == []
    # a create-only large object goes through a conditional CompleteMultipartUpload
    store.create("big/created", data)
    store.create("big/created", data)  # identical re-create is success
    with pytest.raises(ObjectExistsError):
        store.create("big/created", data[:-1] + b"!")
    assert store.get("big/created") == data
    assert _pending_uploads(raw, _bucket(s3_uri)) == []
    store.close()


def test_failed_multipart_is_aborted_and_leaves_nothing(
    s3_uri: str, moto_endpoint: str, raw: Any
) -> None:
    store = S3Store.from_uri(s3_uri, endpoint_url=moto_endpoint, multipart_threshold=6 * MiB,
                             multipart_chunksize=5 * MiB, max_attempts=2)
    bucket = _bucket(s3_uri)
    calls: list[str] = []

    def fail_part_2(request: Any, **kwargs: Any) -> None:
        calls.append(request.url)
        if "partNumber=2" in request.url:
            raise ConnectionClosedError(endpoint_url=request.url)

    store.client.meta.events.register("before-send.s3.UploadPart", fail_part_2)
    data = _data(11 * MiB)  # parts of 5, 5 and 1 MiB
    with pytest.raises(StoreError) as info:
        store.put("big/fail", data)
    assert "\n" not in str(info.value)
    assert sum("partNumber=2" in c for c in calls) == 2  # standard mode retried it once
    assert not store.exists("big/fail")
    assert _pending_uploads(raw, bucket) == []
    # a failed replace leaves the old object whole
    store.client.meta.events.unregister("before-send.s3.UploadPart", fail_part_2)
    store.put("big/keep", b"old")
    store.client.meta.events.register("before-send.s3.UploadPart", fail_part_2)
    with pytest.raises(StoreError):
        store.put("big/keep", data)
    with pytest.raises(StoreError):
        store.create("big/new", data)
    assert store.get("big/keep") == b"old"
    assert not store.exists("big/new")
    assert _pending_uploads(raw, bucket) == []

    # any exception, not only botocore's, aborts the upload
    def explode(request: Any, **kwargs: Any) -> None:
        if "partNumber=3" in request.url:
            raise RuntimeError("injected")

    store.client.meta.events.unregister("before-send.s3.UploadPart", fail_part_2)
    store.client.meta.events.register("before-send.s3.UploadPart", explode)
    with pytest.raises(RuntimeError, match="injected"):
        store.put("big/boom", data)
    assert _pending_uploads(raw, bucket) == []
    assert not store.exists("big/boom")
    store.close()


def test_failed_abort_is_logged_and_the_first_error_kept(
    s3_uri: str, moto_endpoint: str, raw: Any, caplog: pytest.LogCaptureFixture
) -> None:
    store = S3Store.from_uri(s3_uri, endpoint_url=moto_endpoint, multipart_threshold=5 * MiB,
                             multipart_chunksize=5 * MiB, max_attempts=1)

    def fail(request: Any, **kwargs: Any) -> None:
        raise ConnectionClosedError(endpoint_url=request.url)

    store.client.meta.events.register("before-send.s3.CompleteMultipartUpload", fail)
    store.client.meta.events.register("before-send.s3.AbortMultipartUpload", fail)
    with caplog.at_level(logging.WARNING, logger="ckptstore"):
        with pytest.raises(StoreError, match="write .*ConnectionClosedError"):
            store.put("big/x", _data(6 * MiB))
    assert any("could not abort" in r.getMessage() for r in caplog.records)
    (upload,) = _pending_uploads(raw, _bucket(s3_uri))  # what a lifecycle rule must clean up
    raw.abort_multipart_upload(Bucket=_bucket(s3_uri), Key=upload["Key"],
                               UploadId=upload["UploadId"])
    store.close()


def test_transient_503_is_retried_on_put_and_get(faulty_store: S3Store, faults: FaultPlan):
    faults.add("503", "PUT", "/repo/t/obj")
    faults.add("503", "GET", "/repo/t/obj")
    faulty_store.put("t/obj", memoryview(b"-payload")[1:])  # a reader botocore must rewind
    assert faulty_store.get("t/obj") == b"payload"
    assert len(faults.requests("PUT", "/repo/t/obj")) == 2
    assert len(faults.requests("GET", "/repo/t/obj")) == 2


def test_persistent_503_gives_up_after_bounded_attempts(
    s3_uri: str, fault_server: tuple[str, FaultPlan], faults: FaultPlan
) -> None:
    with S3Store.from_uri(s3_uri, endpoint_url=fault_server[0], max_attempts=2) as store:
        store.put("t/obj", b"payload")
        faults.add("503", "GET", "/repo/t/obj", times=100)
        with pytest.raises(StoreError, match="SlowDown") as info:
            store.get("t/obj")
    assert "\n" not in str(info.value)
    assert len(faults.requests("GET", "/repo/t/obj")) == 2  # max_attempts counts every call


def test_truncated_body_is_retried_and_resumed(faulty_store: S3Store, faults: FaultPlan):
    data = _data(3 * MiB + 11)
    faulty_store.put("t/big", data)
    # get(): the whole object again
    faults.add("truncate", "GET", "/repo/t/big", times=2)
    assert faulty_store.get("t/big") == data
    assert len(faults.requests("GET", "/repo/t/big")) == 3
    # get_range(): the same range again
    faults.reset()
    faults.add("truncate", "GET", "/repo/t/big")
    assert faulty_store.get_range("t/big", 1000, 2 * MiB) == data[1000 : 1000 + 2 * MiB]
    assert [r["range"] for r in faults.requests("GET", "/repo/t/big")] == [
        f"bytes=1000-{1000 + 2 * MiB - 1}"] * 2
    # read_into(): resumes after the bytes that did arrive, pinned to the same ETag
    faults.reset()
    faults.add("truncate", "GET", "/repo/t/big")
    out = bytearray(3 * MiB)
    faulty_store.read_into("t/big", 11, memoryview(out))
    assert out == data[11:]
    first, second = faults.requests("GET", "/repo/t/big")
    assert first["range"] == f"bytes=11-{len(data) - 1}" and first["if_match"] is None
    resumed_at = int(second["range"].split("=")[1].split("-")[0])
    assert 11 < resumed_at <= 11 + 3 * MiB // 2 + 1
    assert second["if_match"] is not None
    # read_into_digest(): resumed the same way, and hashes exactly the bytes delivered
    faults.reset()
    faults.add("truncate", "GET", "/repo/t/big")
    out = bytearray(3 * MiB)
    assert faulty_store.read_into_digest("t/big", 11, memoryview(out)) == digest(data[11:])
    assert out == data[11:]
    assert len(faults.requests("GET", "/repo/t/big")) == 2


def test_truncated_body_gives_up_after_bounded_retries(faulty_store: S3Store,
                                                       faults: FaultPlan) -> None:
    faulty_store.put("t/obj", _data(100_000))
    faults.add("truncate", "GET", "/repo/t/obj", times=100)
    with pytest.raises(StoreError, match="broke off"):
        faulty_store.get_range("t/obj", 0, 100_000)
    assert len(faults.requests("GET", "/repo/t/obj")) == 4  # read_retries=3


def test_replaced_object_is_never_read_as_a_mix(faulty_store: S3Store, faults: FaultPlan,
                                                moto_endpoint: str) -> None:
    old, new = _data(1 * MiB), bytes(reversed(_data(1 * MiB)))
    faulty_store.put("t/obj", old)
    out = bytearray(len(old))

    def replace_then_cut(env: dict[str, Any]) -> bool:
        if env["REQUEST_METHOD"] == "GET" and env["PATH_INFO"].endswith("/repo/t/obj"):
            if not getattr(replace_then_cut, "done", False):
                replace_then_cut.done = True  # type: ignore[attr-defined]
                return True
        return False

    faults.rules.append(Rule(replace_then_cut, "truncate"))
    # the first GET is cut; replace the object before the store resumes
    original = faulty_store.client.get_object

    def replace_before_resume(value: bytes) -> None:
        def get_object(**kwargs: Any) -> Any:
            if "IfMatch" in kwargs:
                with S3Store.from_uri(faulty_store.uri, endpoint_url=moto_endpoint) as other:
                    other.put("t/obj", value)
            return original(**kwargs)

        faulty_store._client.get_object = get_object  # type: ignore[method-assign]

    replace_before_resume(new)
    faulty_store.read_into("t/obj", 0, memoryview(out))
    assert bytes(out) == new  # started over on the new version, no mix of old and new
    # the digest computed while reading starts over with the bytes
    replace_then_cut.done = False  # type: ignore[attr-defined]
    faults.rules.append(Rule(replace_then_cut, "truncate"))
    out[:] = bytes(len(out))
    replace_before_resume(old)
    assert faulty_store.read_into_digest("t/obj", 0, memoryview(out)) == digest(old)
    assert bytes(out) == old


def test_create_lost_reply_then_retry_is_success(faulty_store: S3Store, faults: FaultPlan,
                                                 raw: Any, s3_uri: str) -> None:
    faults.add("lost-reply", "PUT", "/repo/m/step-1.json")
    faulty_store.create("m/step-1.json", memoryview(b'#{"step": 1}')[1:])
    puts = faults.requests("PUT", "/repo/m/step-1.json")
    assert len(puts) == 2  # the first landed, its reply was lost; the retry answered 412
    assert faulty_store.get("m/step-1.json") == b'{"step": 1}'


def test_an_upload_a_retried_create_left_behind_is_aborted_by_gc_once_abandoned(
        faults: FaultPlan, raw: Any, s3_uri: str, fault_server: tuple[str, FaultPlan],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """CreateMultipartUpload lands, its reply is lost, botocore retries it: the put goes on
    with the second upload and the first, never known to the store, stays (billed parts
    nothing removes). gc aborts incomplete uploads once ABANDONED_UPLOAD_AGE old."""
    store = S3Store.from_uri(s3_uri, endpoint_url=fault_server[0], multipart_threshold=5 * MiB,
                             multipart_chunksize=5 * MiB)
    data = _data(7 * MiB)
    faults.add("lost-reply", "POST", "/repo/blobs/ab/big", query="uploads")
    store.put("blobs/ab/big", data)
    assert store.get("blobs/ab/big") == data
    (orphan,) = _pending_uploads(raw, _bucket(s3_uri))
    monkeypatch.setattr(s3_module, "ABANDONED_UPLOAD_AGE", 1e12)  # (moto dates each 2010)
    assert list(store.temp_files()) == []  # young: a live writer's upload may look the same
    monkeypatch.setattr(s3_module, "ABANDONED_UPLOAD_AGE", 0.0)
    (listed,) = store.temp_files()
    assert listed.key == f"blobs/ab/big#upload={orphan['UploadId']}"
    report = checks.gc(store, lambda: {"big"}, grace_seconds=0, now=time.time() + 7200)
    assert report.deleted_temp_files == 1 and report.deleted_blobs == 0
    assert _pending_uploads(raw, _bucket(s3_uri)) == []
    assert store.get("blobs/ab/big") == data
    with pytest.raises(StoreError, match="not an upload"):
        store.delete_temp("blobs/ab/big")
    store.close()


@pytest.mark.parametrize("method", ["put", "create"])
def test_multipart_complete_lost_reply(faults: FaultPlan, raw: Any, s3_uri: str,
                                       fault_server: tuple[str, FaultPlan], method: str) -> None:
    """Complete lands, its reply is lost, and the retried Complete answers NoSuchUpload (as
    MinIO does; moto would answer 200 again): the store checks the object's multipart ETag."""
    store = S3Store.from_uri(s3_uri, endpoint_url=fault_server[0], multipart_threshold=5 * MiB,
                             multipart_chunksize=5 * MiB)
    data = _data(7 * MiB)
    faults.add("lost-reply", "POST", "/repo/m/big", query="uploadId=")
    faults.add("no-such-upload", "POST", "/repo/m/big", query="uploadId=")
    getattr(store, method)("m/big", data)
    assert len(faults.requests("POST", "/repo/m/big")) == 3  # create, complete, complete
    assert store.get("m/big") == data
    # NoSuchUpload while the object did *not* land: the upload is aborted; put fails, create
    # (whose caller cannot tell what happened) starts over with a new upload
    faults.add("no-such-upload", "POST", "/repo/m/other", query="uploadId=")
    if method == "put":
        with pytest.raises(StoreError, match="NoSuchUpload"):
            store.put("m/other", data)
        assert not store.exists("m/other")
    else:
        store.create("m/other", data)
        assert store.get("m/other") == data
        assert len(faults.requests("POST", "/repo/m/other")) == 4  # two uploads, two completes
    assert _pending_uploads(raw, _bucket(s3_uri)) == []
    store.close()


def test_create_over_other_content_raises_and_keeps_the_object(
    s3_uri: str, moto_endpoint: str
) -> None:
    with S3Store.from_uri(s3_uri, endpoint_url=moto_endpoint) as store:
        store.create("m/a.json", b"first")
        with pytest.raises(ObjectExistsError, match="m/a.json"):
            store.create("m/a.json", b"other")  # same size, other bytes
        with pytest.raises(ObjectExistsError):
            store.create("m/a.json", b"longer content")
        assert store.get("m/a.json") == b"first"
        # a lost reply is not a loophole: a retried create of other bytes still fails
        store.put("m/b.json", b"theirs")
        with pytest.raises(FileExistsError):
            store.create("m/b.json", b"mine!!")
        assert store.get("m/b.json") == b"theirs"


def test_empty_listing_reply_is_not_trusted(faulty_store: S3Store, faults: FaultPlan) -> None:
    faulty_store.put("l/1", b"1")
    faults.add("empty-200", "GET", "", query="list-type=2")
    with pytest.raises(StoreError, match="malformed listing"):
        list(faulty_store.list("l/"))
    assert [i.key for i in faulty_store.list("l/")] == ["l/1"]


# -- reads -----------------------------------------------------------------------------------


def test_ranges(s3_uri: str, moto_endpoint: str) -> None:
    with S3Store.from_uri(s3_uri, endpoint_url=moto_endpoint) as store:
        store.put("r", b"0123456789")
        gets: list[str] = []
        store.client.meta.events.register(
            "before-send.s3.GetObject", lambda request, **kw: gets.append(request.url))
        # zero-length: no impossible 'bytes=10-9' request, but the key must exist
        assert store.get_range("r", 10, 0) == b""
        store.read_into("r", 3, memoryview(bytearray()))
        assert gets == []
        with pytest.raises(ObjectNotFoundError):
            store.get_range("missing", 0, 0)
        with pytest.raises(StoreError):
            store.get_range("r", 11, 0)
        # past the end: an error naming the object size, never a short result
        with pytest.raises(StoreError, match="size 10"):
            store.get_range("r", 10, 1)
        with pytest.raises(StoreError, match="short read"):
            store.get_range("r", 8, 5)
        store.put("empty", b"")
        assert store.get("empty") == b""
        with pytest.raises(StoreError):
            store.get_range("empty", 0, 1)
        # read_into accepts typed buffers (numpy-like element sizes)
        out = array.array("H", [0, 0])
        store.read_into("r", 2, memoryview(out))
        assert out.tobytes() == b"2345"


def test_checksum_settings_are_configurable(s3_uri: str, moto_endpoint: str) -> None:
    with S3Store.from_uri(s3_uri, endpoint_url=moto_endpoint,
                          request_checksum_calculation="when_required",
                          response_checksum_validation="when_required",
                          max_pool_connections=8) as store:
        config = store.client.meta.config
        assert config.request_checksum_calculation == "when_required"
        assert config.response_checksum_validation == "when_required"
        assert config.retries == {"mode": "standard", "total_max_attempts": 5}
        assert config.max_pool_connections == 8
        store.put("x", b"abc")
        assert store.get("x") == b"abc"


def test_protocol_errors_that_escape_botocore_are_retried_then_mapped(
        s3_uri: str, moto_endpoint: str) -> None:
    """An error reply whose body is cut makes urllib3 raise ProtocolError past botocore's
    retries: the store retries such a request itself, then reports a StoreError (never a raw
    urllib3 exception)."""
    import urllib3

    store = S3Store.from_uri(s3_uri, endpoint_url=moto_endpoint, max_attempts=2)
    store.put("k", b"v")
    failures = {"left": 1}

    def cut_reply(request: Any, **kwargs: Any) -> None:
        if failures["left"]:
            failures["left"] -= 1
            raise urllib3.exceptions.ProtocolError("Connection broken: IncompleteRead")

    for event in ("HeadObject", "PutObject", "GetObject", "DeleteObject"):
        store.client.meta.events.register(f"before-send.s3.{event}", cut_reply)
    for op in (lambda: store.exists("k"), lambda: store.put("k", b"w"),
               lambda: store.get("k"), lambda: store.create("new", b"n"),
               lambda: store.delete("new")):
        failures["left"] = 1
        op()  # one broken reply: retried, succeeds
    assert store.get("k") == b"w"
    failures["left"] = 100
    with pytest.raises(StoreError, match="ProtocolError"):
        store.stat("k")
    failures["left"] = 100
    with pytest.raises(StoreError, match="ProtocolError"):
        store.get("k")


def test_delete_many_sends_many_keys_per_request(s3_any_uri: str, s3_endpoint: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # S3 takes 1,000 keys per DeleteObjects (s3.DELETE_BATCH); 100 here keeps the test short
    monkeypatch.setattr(s3_module, "DELETE_BATCH", 100)
    store = S3Store.from_uri(s3_any_uri, endpoint_url=s3_endpoint)
    keys = [f"blobs/{i % 16:02x}/{i:06d}" for i in range(260)]
    with cf.ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda k: store.put(k, b"x"), keys))
    batches: list[int] = []
    singles: list[int] = []
    store.client.meta.events.register(
        "before-send.s3.DeleteObjects", lambda request, **kw: batches.append(1))
    store.client.meta.events.register(
        "before-send.s3.DeleteObject", lambda request, **kw: singles.append(1))
    store.delete_many([*keys[:250], "blobs/none/k"])
    assert sorted(i.key for i in store.list("blobs/")) == sorted(keys[250:])
    assert len(batches) == 3 and not singles
    store.close()


def test_delete_many_falls_back_to_single_deletes_where_the_server_refuses_batches(
        s3_uri: str, moto_endpoint: str, caplog: pytest.LogCaptureFixture) -> None:
    store = S3Store.from_uri(s3_uri, endpoint_url=moto_endpoint)
    keys = [f"k/{i}" for i in range(30)]
    for key in keys:
        store.put(key, b"x")
    tried: list[int] = []

    def refuse(**kwargs: Any) -> Any:
        tried.append(1)
        raise ClientError({"Error": {"Code": "NotImplemented", "Message": "no batches"},
                           "ResponseMetadata": {"HTTPStatusCode": 501}}, "DeleteObjects")

    store._client.delete_objects = refuse  # type: ignore[method-assign]
    with caplog.at_level(logging.INFO, logger="ckptstore"):
        store.delete_many(keys[:20])
    assert sorted(i.key for i in store.list("k/")) == sorted(keys[20:])
    assert "DeleteObjects refused (NotImplemented)" in caplog.text
    store.delete_many(keys[20:])  # not asked again
    assert tried == [1] and list(store.list("k/")) == []
    store.close()


def test_delete_many_names_an_object_the_server_would_not_delete(
        s3_uri: str, moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    store = S3Store.from_uri(s3_uri, endpoint_url=moto_endpoint)
    monkeypatch.setattr(s3_module, "DELETE_BATCH", 100)
    keys = [f"k/{i:04d}" for i in range(150)]
    real = store._client.delete_objects
    calls: list[int] = []

    def partly(**kwargs: Any) -> Any:
        calls.append(len(kwargs["Delete"]["Objects"]))
        reply = real(**kwargs)
        if len(calls) == 1:  # the first request: one object refused, as S3 reports it
            refused = kwargs["Delete"]["Objects"][7]["Key"]
            reply["Errors"] = [{"Key": refused, "Code": "AccessDenied", "Message": "Denied"}]
        return reply

    store._client.delete_objects = partly  # type: ignore[method-assign]
    with pytest.raises(StoreError, match=r"k/0007: S3 error AccessDenied .*1 of 100 objects"):
        store.delete_many(keys)
    assert calls == [100, 50]  # the other request was still made
    store.close()
