"""`OnceEach` and `run_concurrently` (ckptstore/concurrency.py), the pieces a load's prefetch
of index segments and parts is made of: each key computed once however many threads ask,
different keys at the same time, a failure not kept; a prefetch overlaps its calls and
drops their errors for the later use to raise."""

from __future__ import annotations

import threading
import time

import pytest

from ckptstore.concurrency import OnceEach, run_concurrently


def test_each_key_is_computed_once_and_different_keys_at_the_same_time() -> None:
    calls: list[int] = []
    running = 0
    most = 0
    guard = threading.Lock()

    def make(key: int) -> str:
        nonlocal running, most
        with guard:
            calls.append(key)
            running += 1
            most = max(most, running)
        time.sleep(0.05)
        with guard:
            running -= 1
        return f"v{key}"

    once: OnceEach[int, str] = OnceEach(make)
    threads = [threading.Thread(target=once.get, args=(k % 3,)) for k in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(calls) == [0, 1, 2]  # twelve asks, three keys, three computations
    assert most >= 2  # the keys did not wait for one another
    assert once.get(1) == "v1" and once.done == {0: "v0", 1: "v1", 2: "v2"}


def test_a_failed_computation_is_not_kept() -> None:
    attempts: list[int] = []

    def make(key: int) -> int:
        attempts.append(key)
        if len(attempts) == 1:
            raise OSError("store down")
        return key * 10

    once: OnceEach[int, int] = OnceEach(make)
    with pytest.raises(OSError):
        once.get(4)
    assert once.get(4) == 40 and attempts == [4, 4]


def test_a_prefetch_overlaps_its_calls_and_drops_their_errors() -> None:
    started: list[float] = []

    def slow() -> None:
        started.append(time.monotonic())
        time.sleep(0.1)

    def failing() -> None:
        raise ValueError("left to the later use")

    t0 = time.monotonic()
    run_concurrently([slow, slow, slow, slow, failing], workers=4)
    assert len(started) == 4
    assert max(started) - min(started) < 0.09  # all four began before the first ended
    assert time.monotonic() - t0 < 5  # (a guard against a hang, not a benchmark)
    ran: list[int] = []
    run_concurrently([lambda: ran.append(1)], workers=8)  # one call: nothing to overlap
    run_concurrently([lambda: ran.append(2), lambda: ran.append(3)], workers=1)
    assert ran == []
