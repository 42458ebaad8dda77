"""The store contract (ckptstore.stores.testing.StoreTests) run against every backend: memory,
a local folder, and S3 on moto's server; each with raw accessors that bypass the store."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest

from ckptstore.stores import LocalStore, MemoryStore, Store, open_store
from ckptstore.stores.s3 import S3Store
from ckptstore.stores.testing import S3StoreTests, StoreTests


class TestMemoryStore(StoreTests):
    @pytest.fixture
    def store(self) -> MemoryStore:
        return MemoryStore()

    def raw_get(self, store: MemoryStore, key: str) -> bytes:
        return bytes(store._objects[key][0])

    def raw_put(self, store: MemoryStore, key: str, data: bytes) -> None:
        store._objects[key] = (data, time.time())


class TestLocalStore(StoreTests):
    @pytest.fixture
    def store(self, tmp_path: Path) -> LocalStore:
        return LocalStore(tmp_path / "store")

    def raw_get(self, store: LocalStore, key: str) -> bytes:
        return Path(store.root, key).read_bytes()

    def raw_put(self, store: LocalStore, key: str, data: bytes) -> None:
        path = Path(store.root, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


class TestS3StoreOnMoto(S3StoreTests):
    @pytest.fixture
    def store(self, moto_endpoint: str) -> Iterator[S3Store]:
        bucket = f"contract-{uuid.uuid4().hex[:12]}"
        boto3.client("s3", endpoint_url=moto_endpoint).create_bucket(Bucket=bucket)
        s = open_store(f"s3://{bucket}/prefix", endpoint_url=moto_endpoint)
        assert isinstance(s, S3Store)
        yield s
        s.close()


class TestDirectLocalStore(TestLocalStore):
    """The writer process's store: large page-aligned bodies go out with O_DIRECT."""

    @pytest.fixture
    def store(self, tmp_path: Path) -> LocalStore:
        from ckptstore.stores.direct_io import DirectLocalStore

        return DirectLocalStore(tmp_path / "store")


class TestFarTier(StoreTests):
    """A later tier as a tiered repository sees it (tiers/far.py), over a local folder."""

    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[Store]:
        from ckptstore.tiers.far import FarTier

        far = FarTier("far://contract", lambda: LocalStore(tmp_path / "far"), lambda s: None)
        assert far.open_now()
        yield far
        far.close()

    def raw_get(self, store: Store, key: str) -> bytes:
        return Path(store._store.root, key).read_bytes()  # type: ignore[attr-defined]

    def raw_put(self, store: Store, key: str, data: bytes) -> None:
        path = Path(store._store.root, key)  # type: ignore[attr-defined]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


class TestReceivedBlobs(StoreTests):
    """Blobs received from a peer, held in memory (training/peers.py): written once by the
    fetch, then read-only, so the contract's deletes and overwrites do not apply."""

    @pytest.fixture
    def store(self) -> Store:
        from ckptstore.training.peers import ReceivedBlobs

        return ReceivedBlobs("peer://contract")

    def raw_get(self, store: Store, key: str) -> bytes:
        return bytes(store.view(key))  # type: ignore[attr-defined]

    def raw_put(self, store: Store, key: str, data: bytes) -> None:
        store.put(key, data)
