"""The S3 servers the tests start on 127.0.0.1: one way to run moto and to make a bucket
(tests/conftest.py and tests/reliability/conftest.py both use these)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def running_moto() -> Iterator[str]:
    """A moto S3 server in this process's threads, bound to 127.0.0.1 on a free port; its
    endpoint URL."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def new_bucket(endpoint: str, prefix: str = "test") -> str:
    """Create a fresh bucket at `endpoint` (credentials from the environment); its name."""
    import boto3

    bucket = f"{prefix}-{uuid.uuid4().hex[:12]}"
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    try:
        client.create_bucket(Bucket=bucket)
    finally:
        client.close()
    return bucket
