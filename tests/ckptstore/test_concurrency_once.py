"""`OnceEach`, `run_concurrently`, `fetches_started`, `results_ahead` and `read_ahead`
(ckptstore/concurrency.py), the pieces a load's prefetch of index segments and parts is
made of: each key computed once however many threads ask, different keys at the same time,
a failure not kept; a prefetch overlaps its calls and drops their errors for the later use
to raise; fetched results are used on the calling thread; results fetched ahead are
claimed once each, errors raised by the claim; a read-ahead keeps its results in
order, fetches a bounded number ahead, raises an error where it is reached and leaves no
fetch running once it stops."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from ckptstore.concurrency import (
    OnceEach,
    fetches_started,
    outcome,
    read_ahead,
    results_ahead,
    run_concurrently,
)
from tests.helpers import wait_until


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


def fetch_all(fetches: dict, use: Callable[[Any, Any], Any], workers: int) -> None:
    with fetches_started(fetches, workers) as deliver:
        deliver(use)


def test_fetches_overlap_and_their_results_are_used_on_the_calling_thread() -> None:
    started: list[float] = []
    used: list[tuple[int, str, str]] = []

    def fetch(k: int) -> str:
        started.append(time.monotonic())
        time.sleep(0.1)
        if k == 3:
            raise ValueError("a fetch's error: left to the later use")
        return f"bytes {k}"

    def use(k: int, got: str) -> None:
        if k == 2:
            raise ValueError("a use's error: left to the later use")
        used.append((k, got, threading.current_thread().name))

    fetch_all({k: functools.partial(fetch, k) for k in range(5)}, use, workers=8)
    assert len(started) == 5 and max(started) - min(started) < 0.09  # side by side
    me = threading.current_thread().name
    assert sorted(used) == [(k, f"bytes {k}", me) for k in (0, 1, 4)]
    fetch_all({0: functools.partial(fetch, 0)}, use, workers=8)  # overlaps the block's work
    assert len(started) == 6 and sorted(used)[:2] == [(0, "bytes 0", me)] * 2
    fetch_all({k: functools.partial(fetch, k) for k in (0, 1)}, use, workers=1)  # no threads
    assert len(started) == 6


class _Fetches:
    """`count` fetches of 20 ms each, recording how many ran at once and which started."""

    def __init__(self, count: int, fail_at: int = -1) -> None:
        self.started: list[int] = []
        self.running = 0
        self.most = 0
        self.threads: set[int] = set()
        self.lock = threading.Lock()
        self.fail_at = fail_at
        self.calls = [functools.partial(self.fetch, i) for i in range(count)]

    def fetch(self, i: int) -> int:
        with self.lock:
            self.started.append(i)
            self.running += 1
            self.most = max(self.most, self.running)
            self.threads.add(threading.get_ident())
        time.sleep(0.02)
        with self.lock:
            self.running -= 1
        if i == self.fail_at:
            raise OSError(f"fetch {i} failed")
        return i * 10


def test_fetches_started_run_while_the_block_works_and_are_used_when_delivered() -> None:
    fetches = _Fetches(6)
    used: list[tuple[int, int]] = []
    with fetches_started(dict(enumerate(fetches.calls)), workers=3) as deliver:
        # the block's own work: the fetches run meanwhile, none delivered yet
        wait_until(lambda: len(fetches.started) == 6, what="every fetch started")
        assert not used
        deliver(lambda k, got: used.append((k, got)))
        deliver(lambda k, got: used.append((k, got)))  # each result is handed out once
    assert sorted(used) == [(i, i * 10) for i in range(6)]
    assert 1 < fetches.most <= 3


def test_fetches_started_and_never_delivered_are_cancelled_on_leaving() -> None:
    fetches = _Fetches(40)
    before = threading.active_count()
    with pytest.raises(KeyError):
        with fetches_started(dict(enumerate(fetches.calls)), workers=2):
            raise KeyError("the block failed before it used the fetches")
    assert fetches.running == 0 and threading.active_count() == before
    assert len(fetches.started) < 40
    single = _Fetches(1)  # one fetch overlaps the block's own work: begun on entering it
    got: list[tuple[int, int]] = []
    with fetches_started(dict(enumerate(single.calls)), workers=4) as deliver:
        wait_until(lambda: single.started == [0], what="the one fetch begun")
        deliver(lambda k, result: got.append((k, result)))
    assert got == [(0, 0)] and threading.get_ident() not in single.threads
    alone = _Fetches(3)  # no threads to run them on: nothing fetched ahead, nothing delivered
    with fetches_started(dict(enumerate(alone.calls)), workers=1) as deliver:
        deliver(lambda k, result: pytest.fail("nothing was fetched ahead"))
    assert alone.started == []


def test_results_ahead_run_while_the_block_works_and_are_claimed_once_each() -> None:
    fetches = _Fetches(6, fail_at=4)
    with results_ahead(dict(enumerate(fetches.calls)), workers=3) as claim:
        # the block's own work: the fetches run meanwhile
        wait_until(lambda: len(fetches.started) == 6, what="every fetch started")
        first = claim(2)
        assert first is not None and first() == 20 and first() == 20
        assert claim(2) is None  # claimed before: the caller fetches it itself
        assert claim(99) is None  # never fetched ahead
        failed = claim(4)
        assert failed is not None
        with pytest.raises(OSError, match="fetch 4 failed"):  # raised by the claim's call
            failed()
    assert 1 < fetches.most <= 3
    assert threading.get_ident() not in fetches.threads


def test_results_ahead_not_claimed_are_cancelled_on_leaving() -> None:
    fetches = _Fetches(40)
    before = threading.active_count()
    with pytest.raises(KeyError):
        with results_ahead(dict(enumerate(fetches.calls)), workers=2):
            raise KeyError("the block failed before it claimed anything")
    assert fetches.running == 0 and threading.active_count() == before
    assert len(fetches.started) < 40
    late = _Fetches(40)  # a result claimed inside, taken after the block cancelled it
    with results_ahead(dict(enumerate(late.calls)), workers=2) as claim:
        last = claim(39)
    assert last is not None and 39 not in late.started
    assert last() == 390 and late.threads >= {threading.get_ident()}  # fetched by the caller
    single = _Fetches(1)  # one fetch overlaps the block's own work: begun on entering it
    with results_ahead(dict(enumerate(single.calls)), workers=4) as claim:
        wait_until(lambda: single.started == [0], what="the one fetch begun")
        only = claim(0)
        assert only is not None and only() == 0
    assert threading.get_ident() not in single.threads
    alone = _Fetches(3)  # no threads to run them on: nothing fetched ahead
    with results_ahead(dict(enumerate(alone.calls)), workers=1) as claim:
        assert claim(0) is None
    assert alone.started == []


def test_read_ahead_keeps_order_overlaps_and_stays_bounded() -> None:
    fetches = _Fetches(30)
    seen = []
    for got in read_ahead(fetches.calls, workers=4):
        with fetches.lock:  # never more than 4 fetched or in flight beyond the one in use
            assert len(fetches.started) <= len(seen) + 1 + 4
        seen.append(got)
        time.sleep(0.005)
    assert seen == [i * 10 for i in range(30)]
    assert 1 < fetches.most <= 4
    assert threading.get_ident() not in fetches.threads


def test_read_ahead_raises_an_error_where_it_is_reached_and_cancels_the_rest() -> None:
    fetches = _Fetches(40, fail_at=5)
    seen = []
    before = threading.active_count()
    with pytest.raises(OSError, match="fetch 5 failed"):
        seen.extend(read_ahead(fetches.calls, workers=3))
    assert seen == [0, 10, 20, 30, 40]  # every result before the failed one was handed out
    assert len(fetches.started) < 40  # the later ones were cancelled
    assert fetches.running == 0 and threading.active_count() == before


def test_read_ahead_stopped_early_leaves_nothing_running() -> None:
    fetches = _Fetches(40)
    before = threading.active_count()
    ahead = read_ahead(fetches.calls, workers=3)
    assert [next(ahead), next(ahead)] == [0, 10]
    ahead.close()
    assert fetches.running == 0 and threading.active_count() == before
    assert len(fetches.started) <= 2 + 3 + 1


def test_read_ahead_of_one_worker_runs_on_the_calling_thread() -> None:
    fetches = _Fetches(3)
    assert list(read_ahead(fetches.calls, workers=1)) == [0, 10, 20]
    assert fetches.threads == {threading.get_ident()} and fetches.most == 1


def test_an_outcome_gives_the_result_or_raises_the_error_when_used() -> None:
    calls: list[int] = []

    def fine() -> int:
        calls.append(1)
        return 7

    def broken() -> int:
        calls.append(2)
        raise OSError("no such object")

    ok, bad = outcome(fine), outcome(broken)
    assert calls == [1, 2]  # both ran at once
    assert ok() == 7 and ok() == 7
    with pytest.raises(OSError, match="no such object"):
        bad()
    assert calls == [1, 2]  # neither ran again
