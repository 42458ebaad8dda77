"""The contract every Store backend keeps, as an importable test suite (zarr's StoreTests
pattern): subclass `StoreTests` in a test module, provide the `store` fixture and the raw
accessors that bypass the store, and pytest runs every contract test against the backend.

    class TestMyStore(StoreTests):
        @pytest.fixture
        def store(self, tmp_path): return MyStore(tmp_path)
        def raw_get(self, store, key): ...   # the stored bytes, read without the store
        def raw_put(self, store, key, data): ...   # an object written without the store

The contract itself is stated in `ckptstore.stores.base`. Needs pytest (a test dependency).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from ..errors import InvalidNameError, ObjectExistsError, ObjectNotFoundError, StoreError
from ..format.hashing import digest
from .base import Store


class StoreTests:
    """Contract tests for one backend; see the module docstring."""

    @pytest.fixture
    def store(self, *args: Any) -> Store:
        raise NotImplementedError("a StoreTests subclass provides the `store` fixture")

    def raw_get(self, store: Store, key: str) -> bytes:
        """The bytes stored under `key`, read without going through `store`."""
        raise NotImplementedError

    def raw_put(self, store: Store, key: str, data: bytes) -> None:
        """Write an object without going through `store` (as another program would)."""
        raise NotImplementedError

    def test_put_writes_exactly_the_bytes(self, store: Store) -> None:
        store.put("raw/a", b"written by the store")
        store.create("raw/b", memoryview(b"xxcreatedxx")[2:-2])
        assert self.raw_get(store, "raw/a") == b"written by the store"
        assert self.raw_get(store, "raw/b") == b"created"

    def test_objects_written_by_others_are_read(self, store: Store) -> None:
        self.raw_put(store, "raw/c/d", b"from elsewhere")
        assert store.get("raw/c/d") == b"from elsewhere"
        assert store.get_range("raw/c/d", 5, 4) == b"else"
        assert [i.key for i in store.list("raw/c/")] == ["raw/c/d"]
        with pytest.raises(ObjectExistsError):
            store.create("raw/c/d", b"other")

    def test_put_get_roundtrip(self, store: Store) -> None:
        store.put("a/b/one", b"hello")
        assert store.get("a/b/one") == b"hello"
        store.put("a/b/one", b"replaced")
        assert store.get("a/b/one") == b"replaced"


    def test_put_accepts_any_buffer(self, store: Store) -> None:
        store.put("buf/bytearray", bytearray(b"xyz"))
        store.put("buf/memoryview", memoryview(b"0123456789")[2:5])
        assert store.get("buf/bytearray") == b"xyz"
        assert store.get("buf/memoryview") == b"234"


    def test_empty_object(self, store: Store) -> None:
        store.put("empty", b"")
        assert store.get("empty") == b""
        assert store.stat("empty").size == 0


    def test_missing_key_raises_not_found(self, store: Store) -> None:
        with pytest.raises(ObjectNotFoundError):
            store.get("nope/missing")
        with pytest.raises(FileNotFoundError):
            store.get_range("nope/missing", 0, 1)
        with pytest.raises(ObjectNotFoundError):
            store.stat("nope/missing")
        assert not store.exists("nope/missing")


    def test_ranged_reads(self, store: Store) -> None:
        data = bytes(range(256)) * 10
        store.put("r/data", data)
        assert store.get_range("r/data", 0, 10) == data[:10]
        assert store.get_range("r/data", 1000, 1560) == data[1000:]
        assert store.get_range("r/data", 5, 0) == b""
        out = bytearray(100)
        store.read_into("r/data", 300, memoryview(out))
        assert bytes(out) == data[300:400]


    def test_read_into_digest_hashes_exactly_the_bytes_read(self, store: Store) -> None:
        # larger than the local store's 1 MiB hashing step, and not a multiple of it
        data = np.random.default_rng(7).integers(0, 256, (3 << 20) + 12345, np.uint8).tobytes()
        store.put("r/big", data)
        for start, length in [(0, len(data)), (17, (1 << 20) + 1), (len(data) - 5, 5), (9, 0)]:
            out = bytearray(length)
            found = store.read_into_digest("r/big", start, memoryview(out))
            assert bytes(out) == data[start : start + length]
            assert found == digest(data[start : start + length])
        with pytest.raises(StoreError):
            store.read_into_digest("r/big", len(data) - 3, memoryview(bytearray(10)))
        with pytest.raises(ObjectNotFoundError):
            store.read_into_digest("r/missing", 0, memoryview(bytearray(1)))


    def test_range_past_end_is_an_error_not_a_short_read(self, store: Store) -> None:
        store.put("r/short", b"0123456789")
        with pytest.raises(StoreError):
            store.get_range("r/short", 5, 10)
        with pytest.raises(StoreError):
            store.read_into("r/short", 8, memoryview(bytearray(5)))


    def test_create_only(self, store: Store) -> None:
        store.create("m/one.json", b"first")
        with pytest.raises(ObjectExistsError):
            store.create("m/one.json", b"second")
        with pytest.raises(FileExistsError):
            store.create("m/one.json", b"third")
        assert store.get("m/one.json") == b"first"
        # an identical re-create (a retried commit whose reply was lost) is success
        store.create("m/one.json", b"first")


    def test_create_race_has_one_winner(self, store: Store) -> None:
        results: list[str] = []

        def attempt(i: int) -> None:
            try:
                store.create("race/key", f"writer-{i}".encode())
                results.append(f"writer-{i}")
            except ObjectExistsError:
                pass

        threads = [threading.Thread(target=attempt, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(results) == 1
        assert store.get("race/key") == results[0].encode()


    def test_exists_stat_list_delete(self, store: Store) -> None:
        store.put("l/x/1", b"1")
        store.put("l/x/22", b"22")
        store.put("l/y/333", b"333")
        store.put("other", b"o")
        assert store.exists("l/x/1")
        assert store.stat("l/y/333").size == 3
        assert store.stat("l/y/333").mtime > 0
        assert sorted(i.key for i in store.list("l/")) == ["l/x/1", "l/x/22", "l/y/333"]
        assert sorted(i.key for i in store.list("l/x/")) == ["l/x/1", "l/x/22"]
        assert sorted(i.key for i in store.list("l/x/2")) == ["l/x/22"]
        assert {i.key: i.size for i in store.list("")} == {
            "l/x/1": 1, "l/x/22": 2, "l/y/333": 3, "other": 1}
        assert list(store.list("nothing/")) == []
        store.delete("l/x/1")
        store.delete("l/x/1")  # deleting a missing key is fine
        assert not store.exists("l/x/1")
        assert sorted(i.key for i in store.list("l/")) == ["l/x/22", "l/y/333"]

    def test_delete_many_deletes_every_key_given_and_no_other(self, store: Store) -> None:
        keys = [f"m/{i % 7}/k{i}" for i in range(40)]
        for key in keys:
            store.put(key, key.encode())
        doomed = keys[::2]
        # a generator, with a missing key and a repeated one among them
        store.delete_many(k for k in [*doomed, "m/none/k0", doomed[0]])
        assert sorted(i.key for i in store.list("m/")) == sorted(keys[1::2])
        assert all(store.get(k) == k.encode() for k in keys[1::2])
        store.delete_many([])
        store.delete_many(keys[1::2])
        assert list(store.list("m/")) == []


    @pytest.mark.parametrize(
        "bad", ["", "/abs", "../escape", "a/../../b", "a//b", "a/./b", "a\\b", "a b", "é"]
    )
    def test_hostile_keys_are_refused(self, store: Store, bad: str) -> None:
        with pytest.raises(InvalidNameError):
            store.put(bad, b"x")
        with pytest.raises(InvalidNameError):
            store.get(bad)


    def test_large_object(self, store: Store) -> None:
        data = bytes(range(256)) * (40 * 1024 * 4 + 3)  # ~40 MiB: multipart on S3
        store.put("big/obj", data)
        assert store.stat("big/obj").size == len(data)
        assert store.get("big/obj") == data
        assert store.get_range("big/obj", len(data) - 7, 7) == data[-7:]
        store.sync()


    def test_concurrent_puts_and_gets(self, store: Store) -> None:
        def work(i: int) -> None:
            payload = bytes([i]) * (1000 + i)
            store.put(f"c/{i}", payload)
            assert store.get(f"c/{i}") == payload

        _in_threads(16, work)
        assert len(list(store.list("c/"))) == 16


    def test_deferred_puts_are_durable_and_visible_after_commit(self, store: Store) -> None:
        store.put("d/replaced", b"old")
        batch = store.deferred()
        batch.put("d/a", b"first")
        batch.put("d/deep/b", memoryview(b"xxsecondxx")[2:-2])
        batch.put("d/replaced", b"new")
        batch.put("d/empty", b"")
        for key, new in [("d/a", b"first"), ("d/replaced", b"new")]:
            # before the commit: absent, the old object or already the new bytes
            assert not store.exists(key) or store.get(key) in (b"old", new)
        batch.commit()
        assert self.raw_get(store, "d/a") == b"first"
        assert self.raw_get(store, "d/deep/b") == b"second"
        assert self.raw_get(store, "d/replaced") == b"new"
        assert store.get("d/empty") == b""
        assert sorted(i.key for i in store.list("d/")) == [
            "d/a", "d/deep/b", "d/empty", "d/replaced"]
        batch.put("d/after", b"reused")  # a committed batch takes more puts
        batch.commit()
        assert store.get("d/after") == b"reused"

    def test_deferred_puts_from_many_threads(self, store: Store) -> None:
        with store.deferred() as batch:
            _in_threads(12, lambda i: batch.put(f"dt/{i}", bytes([i]) * (1000 + i)))
        assert {i.key: i.size for i in store.list("dt/")} == {
            f"dt/{i}": 1000 + i for i in range(12)}
        assert store.get("dt/7") == bytes([7]) * 1007

    def test_abandoned_deferred_puts_leave_nothing_half_written(self, store: Store) -> None:
        store.put("ab/kept", b"old")
        with pytest.raises(KeyError):
            with store.deferred() as batch:
                batch.put("ab/kept", b"new")
                batch.put("ab/other", b"other")
                raise KeyError("the writer failed")
        # each key holds its old object, or (backends whose puts are durable on return) the
        # whole new one; nothing else is listed
        assert store.get("ab/kept") in (b"old", b"new")
        listed = {i.key for i in store.list("ab/")}
        assert listed <= {"ab/kept", "ab/other"}
        if "ab/other" in listed:
            assert store.get("ab/other") == b"other"

    def test_deferred_puts_refuse_hostile_keys(self, store: Store) -> None:
        batch = store.deferred()
        for bad in ["../escape", "/abs", "a//b"]:
            with pytest.raises(InvalidNameError):
                batch.put(bad, b"x")
        batch.commit()


class S3StoreTests(StoreTests):
    """StoreTests for an S3Store: the raw accessors go through the store's own boto3 client
    to the same bucket and key prefix. Subclasses provide only the `store` fixture."""

    def raw_get(self, store: Store, key: str) -> bytes:
        s3 = _s3(store)
        reply = s3.client.get_object(Bucket=s3.bucket, Key=s3._key(key))
        return bytes(reply["Body"].read())

    def raw_put(self, store: Store, key: str, data: bytes) -> None:
        s3 = _s3(store)
        s3.client.put_object(Bucket=s3.bucket, Key=s3._key(key), Body=data)


def _in_threads(n: int, work: Callable[[int], None]) -> None:
    """Run work(0), ..., work(n - 1) in n threads at once; raise the first failure."""
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            work(i)
        except BaseException as exc:  # raised below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def _s3(store: Store) -> Any:
    from .s3 import S3Store  # boto3 is imported only where S3 is used

    assert isinstance(store, S3Store)
    return store
