"""The store contract (ckptstore.stores.testing.StoreTests) on a real S3 server: SeaweedFS,
started on 127.0.0.1 by the `seaweedfs` fixture (skipped where `weed` cannot run)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import boto3
import pytest

from ckptstore.stores import open_store
from ckptstore.stores.s3 import S3Store
from ckptstore.stores.testing import StoreTests


class TestS3StoreOnSeaweedFS(StoreTests):
    @pytest.fixture
    def store(self, seaweed_env: str) -> Iterator[S3Store]:
        bucket = f"contract-{uuid.uuid4().hex[:12]}"
        boto3.client("s3", endpoint_url=seaweed_env, region_name="us-east-1").create_bucket(
            Bucket=bucket)
        s = open_store(f"s3://{bucket}/prefix", endpoint_url=seaweed_env)
        assert isinstance(s, S3Store)
        yield s
        s.close()

    def raw_get(self, store: S3Store, key: str) -> bytes:
        reply = store.client.get_object(Bucket=store.bucket, Key=store._key(key))
        return bytes(reply["Body"].read())

    def raw_put(self, store: S3Store, key: str, data: bytes) -> None:
        store.client.put_object(Bucket=store.bucket, Key=store._key(key), Body=data)
