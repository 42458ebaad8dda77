"""One contract suite for every store backend (memory, local folder, S3 on moto's server)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from ckptstore.errors import InvalidNameError, ObjectExistsError, ObjectNotFoundError, StoreError
from ckptstore.format.hashing import digest


def test_put_get_roundtrip(store):
    store.put("a/b/one", b"hello")
    assert store.get("a/b/one") == b"hello"
    store.put("a/b/one", b"replaced")
    assert store.get("a/b/one") == b"replaced"


def test_put_accepts_any_buffer(store):
    store.put("buf/bytearray", bytearray(b"xyz"))
    store.put("buf/memoryview", memoryview(b"0123456789")[2:5])
    assert store.get("buf/bytearray") == b"xyz"
    assert store.get("buf/memoryview") == b"234"


def test_empty_object(store):
    store.put("empty", b"")
    assert store.get("empty") == b""
    assert store.stat("empty").size == 0


def test_missing_key_raises_not_found(store):
    with pytest.raises(ObjectNotFoundError):
        store.get("nope/missing")
    with pytest.raises(FileNotFoundError):
        store.get_range("nope/missing", 0, 1)
    with pytest.raises(ObjectNotFoundError):
        store.stat("nope/missing")
    assert not store.exists("nope/missing")


def test_ranged_reads(store):
    data = bytes(range(256)) * 10
    store.put("r/data", data)
    assert store.get_range("r/data", 0, 10) == data[:10]
    assert store.get_range("r/data", 1000, 1560) == data[1000:]
    assert store.get_range("r/data", 5, 0) == b""
    out = bytearray(100)
    store.read_into("r/data", 300, memoryview(out))
    assert bytes(out) == data[300:400]


def test_read_into_digest_hashes_exactly_the_bytes_read(store):
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


def test_range_past_end_is_an_error_not_a_short_read(store):
    store.put("r/short", b"0123456789")
    with pytest.raises(StoreError):
        store.get_range("r/short", 5, 10)
    with pytest.raises(StoreError):
        store.read_into("r/short", 8, memoryview(bytearray(5)))


def test_create_only(store):
    store.create("m/one.json", b"first")
    with pytest.raises(ObjectExistsError):
        store.create("m/one.json", b"second")
    with pytest.raises(FileExistsError):
        store.create("m/one.json", b"third")
    assert store.get("m/one.json") == b"first"
    # an identical re-create (a retried commit whose reply was lost) is success
    store.create("m/one.json", b"first")


def test_create_race_has_one_winner(store):
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


def test_exists_stat_list_delete(store):
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


@pytest.mark.parametrize(
    "bad", ["", "/abs", "../escape", "a/../../b", "a//b", "a/./b", "a\\b", "a b", "é"]
)
def test_hostile_keys_are_refused(store, bad):
    with pytest.raises(InvalidNameError):
        store.put(bad, b"x")
    with pytest.raises(InvalidNameError):
        store.get(bad)


def test_large_object(store):
    data = bytes(range(256)) * (40 * 1024 * 4 + 3)  # ~40 MiB: multipart on S3
    store.put("big/obj", data)
    assert store.stat("big/obj").size == len(data)
    assert store.get("big/obj") == data
    assert store.get_range("big/obj", len(data) - 7, 7) == data[-7:]
    store.sync()


def test_concurrent_puts_and_gets(store):
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            payload = bytes([i]) * (1000 + i)
            store.put(f"c/{i}", payload)
            assert store.get(f"c/{i}") == payload
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(list(store.list("c/"))) == 16
