"""The store contract (ckptstore.stores.testing.StoreTests) on a real S3 server: SeaweedFS,
started on 127.0.0.1 by the `seaweedfs` fixture (skipped where `weed` cannot run)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import boto3
import pytest

from ckptstore.stores import open_store
from ckptstore.stores.s3 import S3Store
from ckptstore.stores.testing import S3StoreTests


class TestS3StoreOnSeaweedFS(S3StoreTests):
    @pytest.fixture
    def store(self, seaweed_env: str) -> Iterator[S3Store]:
        bucket = f"contract-{uuid.uuid4().hex[:12]}"
        boto3.client("s3", endpoint_url=seaweed_env, region_name="us-east-1").create_bucket(
            Bucket=bucket)
        s = open_store(f"s3://{bucket}/prefix", endpoint_url=seaweed_env)
        assert isinstance(s, S3Store)
        yield s
        s.close()
