"""Shared fixtures: stores of every kind, including S3 on a moto server over HTTP and on
SeaweedFS, a real object store (both on 127.0.0.1, started here).

SeaweedFS starts once per session (about 10 s) the first time a test asks for it; if it cannot
start, those tests fail: nothing is skipped silently."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from .seaweed import SeaweedFSUnavailable, running_seaweedfs
from .support.servers import new_bucket, running_moto

# Tests talk only to the S3 servers they start on 127.0.0.1; these dummy credentials feed the
# standard boto3 chain (environment variables) so no real credentials are ever read, and both
# moto and the tests' SeaweedFS accept them.
os.environ["AWS_ACCESS_KEY_ID"] = "testing"
os.environ["AWS_SECRET_ACCESS_KEY"] = "testing"
os.environ.pop("AWS_SESSION_TOKEN", None)
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
os.environ.pop("AWS_PROFILE", None)
_ENDPOINTS: dict[str, str] = {}  # s3:// URI handed out -> the endpoint of its server


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """A moto S3 server in this process's threads, bound to 127.0.0.1 on a free port."""
    with running_moto() as endpoint:
        yield endpoint


@pytest.fixture(scope="session")
def seaweedfs_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A SeaweedFS S3 gateway on 127.0.0.1 for the whole session (tests/seaweed.py). Fails,
    never skips, when it cannot start."""
    try:
        with running_seaweedfs(tmp_path_factory.mktemp("seaweedfs")) as endpoint:
            yield endpoint
    except SeaweedFSUnavailable as exc:
        pytest.fail(str(exc), pytrace=False)


def new_bucket_uri(endpoint: str) -> str:
    """A fresh bucket at `endpoint`; returns s3://bucket/repo."""
    uri = f"s3://{new_bucket(endpoint)}/repo"
    _ENDPOINTS[uri] = endpoint
    return uri


@pytest.fixture
def s3_uri(moto_endpoint: str) -> str:
    """A fresh bucket on the moto server; returns s3://bucket/prefix."""
    return new_bucket_uri(moto_endpoint)


@pytest.fixture(params=["moto", "seaweedfs"])
def s3_endpoint(request: pytest.FixtureRequest) -> str:
    """Each S3 server in turn: moto (a mock) and SeaweedFS (a real object store)."""
    return str(request.getfixturevalue(f"{request.param}_endpoint"))


@pytest.fixture
def s3_any_uri(s3_endpoint: str) -> str:
    """A fresh bucket on each S3 server in turn (pair with `s3_endpoint`)."""
    return new_bucket_uri(s3_endpoint)


@pytest.fixture(params=["memory", "local", "s3", "seaweedfs"])
def store_uri(request: pytest.FixtureRequest, tmp_path) -> str:
    """One URI per backend; tests using it run against all four (S3 on moto and SeaweedFS)."""
    kind = request.param
    if kind == "memory":
        return f"memory://{uuid.uuid4().hex}"
    if kind == "local":
        return str(tmp_path / "store")
    if kind == "seaweedfs":
        return new_bucket_uri(request.getfixturevalue("seaweedfs_endpoint"))
    return request.getfixturevalue("s3_uri")


@pytest.fixture
def store_options(store_uri: str) -> dict:
    if store_uri.startswith("s3://"):
        return {"endpoint_url": _ENDPOINTS[store_uri]}
    return {}


@pytest.fixture
def store(store_uri: str, store_options: dict):
    from ckptstore import open_store

    s = open_store(store_uri, **store_options)
    yield s
    s.close()
