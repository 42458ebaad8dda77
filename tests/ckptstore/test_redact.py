"""Secrets in URIs (user info, presigned-URL queries, fragments) never reach a message, repr or
the `ckpt` output: every entry point shows URIs through `ckptstore.redact`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ckptstore
from ckptstore.cli import main
from ckptstore.errors import InvalidNameError, StoreError
from ckptstore.redact import redact_text, redact_uri
from ckptstore.stores import LocalStore, open_store

ROOT = Path(__file__).resolve().parents[2]
# every secret below contains this marker (upper case), so one check finds any part of them
SECRET = "SECRET"


def _texts(exc: BaseException) -> Iterator[str]:
    """str and repr of an error and of every error it chains to."""
    seen: set[int] = set()
    node: BaseException | None = exc
    while node is not None and id(node) not in seen:
        seen.add(id(node))
        yield str(node)
        yield repr(node)
        node = node.__cause__ or node.__context__


def _assert_clean(*texts: str) -> None:
    for text in texts:
        assert SECRET not in text, text


# ------------------------------------------------------------------------- the rule
@pytest.mark.parametrize("uri, shown", [
    ("s3://AKIASECRET:SECRETPW@bucket/x", "s3://***@bucket/x"),
    ("https://user:SECRETPW@host:8443/path?X-Amz-Signature=SIGSECRET&a=b",
     "https://***@host:8443/path?<redacted>"),
    ("http://host/p#token=SIGSECRET", "http://host/p#<redacted>"),
    ("s3://AKIASECRET:SECRET/PW@bucket/p", "s3://***@bucket/p"),  # a '/' in the password
    ("AKIASECRET:SECRETPW@bucket://x", "***://x"),  # not a scheme before '://'
    ("memory://name", "memory://name"),
    ("/data/runs/a@b?c", "/data/runs/a@b?c"),  # a path, not a URL: shown as is
    (b"s3://AKIASECRET:SECRETPW@b/x", "<bytes>"),
])
def test_redact_uri(uri: Any, shown: str) -> None:
    assert redact_uri(uri) == shown
    assert redact_uri(shown) == shown and redact_text(shown) == shown  # idempotent


def test_redact_text_finds_urls_inside_messages() -> None:
    text = ('Could not connect to the endpoint URL: "http://u:SECRETPW@127.0.0.1:1/b?x=SIGSECRET"'
            "; Custom endpoint `https://h/p?X-Amz-Signature=SIGSECRET` was not a valid URI")
    out = redact_text(text)
    _assert_clean(out)
    assert '"http://***@127.0.0.1:1/b?<redacted>"' in out
    assert "`https://h/p?<redacted>`" in out


# ------------------------------------------------------------------------- library
BAD_URIS = [
    "https://user:SECRETPW@host/path?X-Amz-Signature=SIGSECRET",
    "s3://AKIASECRET:SECRETPW@bucket/x",
    "s3://AKIASECRET:SECRET/PW@bucket/x",
    "s3://bucket/x?X-Amz-Signature=SIGSECRET",
    "file://user:SECRETPW@host/x?sig=SIGSECRET",
    "file://{tmp}/x?X-Amz-Signature=SIGSECRET",  # a local path given as a URL
    "AKIASECRET:SECRETPW@bucket://x",
    "s3://bucket/AKIASECRET:SECRETPW@host/x",  # user info in the path: an invalid prefix
    "s3://bucket/run/AKIASECRET:SECRETPW@host",
]


@pytest.mark.parametrize("uri", BAD_URIS)
@pytest.mark.parametrize("entry", ["open_store", "CheckpointStore", "CheckpointStore-nocreate"])
def test_bad_uris_are_refused_without_echoing_secrets(uri: str, entry: str, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    uri = uri.replace("{tmp}", str(tmp_path))
    opts: dict[str, Any] = {"endpoint_url": "http://127.0.0.1:1", "max_attempts": 1,
                            "connect_timeout": 1} if uri.startswith("s3://") else {}
    with pytest.raises((InvalidNameError, StoreError)) as info:
        if entry == "open_store":
            open_store(uri, **opts)
        else:
            ckptstore.CheckpointStore(uri, create=entry == "CheckpointStore", **opts)
    _assert_clean(*_texts(info.value))
    assert list(tmp_path.iterdir()) == []  # no folder made, named after the query or not


def test_a_tier_listed_twice_is_named_redacted(tmp_path: Path) -> None:
    uri = "memory://AKIASECRET:SECRETPW@host/x"
    with pytest.raises(InvalidNameError, match="listed twice") as info:
        ckptstore.CheckpointStore([str(tmp_path / "near"), uri, uri])
    _assert_clean(*_texts(info.value))


def test_local_store_refuses_a_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidNameError, match="not a URL") as info:
        LocalStore("https://user:SECRETPW@host/x?X-Amz-Signature=SIGSECRET")
    _assert_clean(*_texts(info.value))
    assert list(tmp_path.iterdir()) == []


def test_store_and_repository_uri_and_repr_are_redacted() -> None:
    uri = "memory://user:SECRETPW@redaction-test?tok=SIGSECRET"
    store = open_store(uri)
    repo = ckptstore.CheckpointStore(store)
    assert store.uri == repo.uri == "memory://***@redaction-test?<redacted>"
    _assert_clean(repr(store), repr(repo), str(vars(store)), store.uri)
    store.put("k", b"1")
    assert open_store(uri).get("k") == b"1"  # the real name still selects the shared store
    with pytest.raises(StoreError) as info:
        store.get("missing")
    _assert_clean(*_texts(info.value))


# ------------------------------------------------------------------------- S3
@pytest.mark.parametrize("endpoint", [
    "http://user:SECRETPW@127.0.0.1:1",
    "http://user:SECRETPW@127.0.0.1:1/?X-Amz-Signature=SIGSECRET",
    "http://127.0.0.1:1/?X-Amz-Signature=SIGSECRET",
    "http://127.0.0.1:1/path#SIGSECRET",
    "http://127.0.0.1:notaport?x=SIGSECRET",
])
def test_s3_endpoint_with_secrets_is_refused_without_echo(endpoint: str, s3_uri: str) -> None:
    with pytest.raises(InvalidNameError) as info:
        open_store(s3_uri, endpoint_url=endpoint, max_attempts=1, connect_timeout=1)
    _assert_clean(*_texts(info.value))
    assert "127.0.0.1" in str(info.value)  # still says which endpoint


def test_s3_endpoint_from_the_environment_is_checked_too(
        s3_uri: str, moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # botocore reads $AWS_ENDPOINT_URL itself; its own error quotes the whole URL
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"{moto_endpoint}/?X-Amz-Signature=SIGSECRET")
    with pytest.raises(InvalidNameError) as info:
        open_store(s3_uri, max_attempts=1)
    _assert_clean(*_texts(info.value))


class _Body:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def stream(self, **_: Any) -> Iterator[bytes]:
        yield self.data


def test_botocore_texts_are_redacted_in_store_errors_and_their_causes(
        s3_uri: str, moto_endpoint: str) -> None:
    from botocore.awsrequest import AWSResponse
    from botocore.exceptions import HTTPClientError

    url = "https://user:SECRETPW@proxy:3128/x?X-Amz-Signature=SIGSECRET"
    store = open_store(s3_uri, endpoint_url=moto_endpoint, max_attempts=1)
    store.put("k", b"1")

    def client_error(request: Any, **_: Any) -> AWSResponse:
        body = (f"<?xml version='1.0'?><Error><Code>InvalidArgument</Code>"
                f"<Message>bad request, see {url}</Message></Error>").encode()
        return AWSResponse(request.url, 400, {"Content-Type": "application/xml"}, _Body(body))

    def http_error(request: Any, **_: Any) -> None:
        raise HTTPClientError(error=f"proxy refused {url}")

    events = store.client.meta.events  # type: ignore[attr-defined]
    events.register("before-send.s3.HeadObject", client_error)
    events.register("before-send.s3.GetObject", http_error)
    for call, expect in ((lambda: store.stat("k"), "https://***@proxy:3128/x?<redacted>"),
                         (lambda: store.get("k"), "https://***@proxy:3128/x?<redacted>")):
        with pytest.raises(StoreError) as info:
            call()
        assert expect in str(info.value)
        _assert_clean(*_texts(info.value))
    store.close()


# ------------------------------------------------------------------------- ckpt CLI
def _ckpt_command() -> list[str]:
    candidate = Path(sysconfig.get_path("scripts")) / "ckpt"
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return [str(candidate)]
    return [sys.executable, "-m", "ckptstore.cli"]


def _run(*args: str, debug: bool = False, extra_env: dict[str, str] | None = None
         ) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.pop("CKPT_DEBUG", None)
    env.pop("AWS_PROFILE", None)
    env.update({"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"})
    if debug:
        env["CKPT_DEBUG"] = "1"
    env.update(extra_env or {})
    return subprocess.run([*_ckpt_command(), *args], capture_output=True, text=True, timeout=120,
                          env=env)


CLI_CASES = [
    ("ls", "https://user:SECRETPW@host/path?X-Amz-Signature=SIGSECRET"),
    ("ls", "s3://AKIASECRET:SECRETPW@bucket/x", "--endpoint-url", "http://127.0.0.1:1"),
    ("du", "s3://bucket/x?X-Amz-Signature=SIGSECRET", "--endpoint-url", "http://127.0.0.1:1"),
    ("ls", "s3://no-such-bucket-here/x", "--max-attempts", "1",
     "--endpoint-url", "http://user:SECRETPW@127.0.0.1:1/?X-Amz-Signature=SIGSECRET"),
    ("verify", "file:///tmp/x?X-Amz-Signature=SIGSECRET"),
    ("cp", "s3://bucket-a/x", "/tmp/ckpt-redaction-never", "a", "--max-attempts", "1",
     "--src-endpoint-url", "http://127.0.0.1:1/?X-Amz-Signature=SIGSECRET"),
    ("show", "memory://user:SECRETPW@nothing?t=SIGSECRET", "latest", "--table"),
]


@pytest.mark.parametrize("debug", [False, True], ids=["plain", "CKPT_DEBUG"])
@pytest.mark.parametrize("args", CLI_CASES, ids=[c[0] + str(i) for i, c in enumerate(CLI_CASES)])
def test_cli_never_prints_secrets(args: tuple[str, ...], debug: bool) -> None:
    r = _run(*args, debug=debug)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    _assert_clean(r.stdout, r.stderr)
    assert r.stderr.strip().splitlines()[-1].startswith("ckpt: error: ")
    assert ("Traceback" in r.stderr) == debug


def test_cli_unreachable_endpoint_from_the_environment() -> None:
    # the closed port 1 on 127.0.0.1: refused at once; the query is refused before connecting
    r = _run("ls", "s3://some-bucket/x", "--max-attempts", "1",
             extra_env={"AWS_ENDPOINT_URL": "http://127.0.0.1:1/?X-Amz-Signature=SIGSECRET"})
    assert r.returncode == 2
    _assert_clean(r.stdout, r.stderr)
    assert "127.0.0.1:1" in r.stderr


@pytest.mark.parametrize("fmt", ["--json", "--table"])
def test_cli_output_shows_the_uri_redacted(fmt: str, capsys: pytest.CaptureFixture[str]) -> None:
    uri = f"memory://user:SECRETPW@cli-out{fmt}?tok=SIGSECRET"
    with ckptstore.CheckpointStore(uri) as repo:
        repo.save("one", {"w": np.arange(4, dtype=np.float32)})
    for command in (["ls", uri, fmt], ["show", uri, "one", fmt], ["du", uri, fmt],
                    ["verify", uri, fmt], ["diff", uri, "one", "one", fmt]):
        assert main(command) == 0
        out, err = capsys.readouterr()
        _assert_clean(out, err)
        if fmt == "--json":
            doc = json.loads(out)
            shown = doc["a"]["uri"] if "a" in doc else doc["uri"]
            assert shown == f"memory://***@cli-out{fmt}?<redacted>"
