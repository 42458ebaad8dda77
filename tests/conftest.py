"""Shared fixtures: stores of every kind, including S3 on a real moto server over HTTP."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

# Tests talk only to the moto server on 127.0.0.1; these dummy credentials feed the standard
# boto3 chain (environment variables) so no real credentials are ever read.
os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
os.environ.pop("AWS_PROFILE", None)


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """A moto S3 server in this process's threads, bound to 127.0.0.1 on a free port."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture
def s3_uri(moto_endpoint: str) -> str:
    """A fresh bucket on the moto server; returns s3://bucket/prefix."""
    import boto3

    bucket = f"test-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=moto_endpoint).create_bucket(Bucket=bucket)
    return f"s3://{bucket}/repo"


@pytest.fixture(params=["memory", "local", "s3"])
def store_uri(request: pytest.FixtureRequest, tmp_path) -> str:
    """One URI per backend; tests using it run against all three."""
    kind = request.param
    if kind == "memory":
        return f"memory://{uuid.uuid4().hex}"
    if kind == "local":
        return str(tmp_path / "store")
    return request.getfixturevalue("s3_uri")


@pytest.fixture
def store_options(store_uri: str, request: pytest.FixtureRequest) -> dict:
    if store_uri.startswith("s3://"):
        return {"endpoint_url": request.getfixturevalue("moto_endpoint")}
    return {}


@pytest.fixture
def store(store_uri: str, store_options: dict):
    from ckptstore import open_store

    s = open_store(store_uri, **store_options)
    yield s
    s.close()
