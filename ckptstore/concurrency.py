"""Rules for work on a thread pool: `completed` (results as they complete, and on the first
error every job not yet started is cancelled before the error propagates), `Turns` (how
many threads of a save beside training may use a core at once), `run_concurrently` (calls
whose errors their later users raise), `fetches_started` (the same for fetches whose
results the calling thread uses, begun before that use), `results_ahead` (fetches begun
before a later pass takes their results one by one),
`read_ahead` (results used in order while the next ones are fetched; `outcome` keeps a
fetch's error for its use) and `OnceEach` (a value computed once per key, keys
concurrently)."""

from __future__ import annotations

import concurrent.futures as cf
import functools
import itertools
import threading
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Generic, TypeVar

T = TypeVar("T")
K = TypeVar("K")
V = TypeVar("V")

#: While the caller waits for a background save (a guarded `optimizer.step()` or
#: `SaveHandle.wait()`), its core is free: the save may use this many more working threads
#: and writes in flight (`Turns.lent_to_waiter`). A pool that may be boosted needs
#: `BOOST_THREADS` threads beyond its usual ones.
BOOST_WORKERS = 1
BOOST_IO = 4
BOOST_THREADS = BOOST_WORKERS + BOOST_IO


def completed(futures: Iterable[cf.Future[T]]) -> Iterator[cf.Future[T]]:
    """Yield each future once it is done, its result available; if one raised (or the
    consumer stops with an exception), cancel those not started and re-raise. Jobs already
    running finish on their own: the pool's shutdown waits for them."""
    pending = list(futures)
    try:
        for fut in cf.as_completed(pending):
            fut.result()  # raises the job's error here, before the consumer sees the future
            yield fut
    except BaseException:
        for fut in pending:
            fut.cancel()
        raise


class Turns:
    """Lets at most `n` threads of a pool work at once, however many it runs, and up to `io`
    more wait in blocking writes: a save beside training then takes about `n` cores from it.

    A thread works inside `copy()` (staging a block: a guarded `optimizer.step()` waits for
    copies, so a copy goes before any write that waits) or `write()` (hashing, compressing,
    writing). Inside either, `io()` hands the turn back for a blocking write (a file's fsync
    mostly waits for the disk) if an io slot is free, so that another thread works
    meanwhile. `boosted()` lends more turns and io slots for a while: while the trainer
    waits for the save (a guard), its core is free. Each release wakes one waiter, not every
    thread of the pool: each wake-up takes the interpreter lock, which the training thread
    needs too."""

    def __init__(self, n: int, io: int = 0) -> None:
        if n < 1 or io < 0:
            raise ValueError("turns must be positive and io slots non-negative")
        self.n = n
        self.io_slots = io
        self._extra = 0  # turns lent by boosted()
        self._extra_io = 0
        self._busy = 0
        self._io_busy = 0
        self._copies_waiting = 0
        lock = threading.Lock()
        self._copy_turn = threading.Condition(lock)
        self._write_turn = threading.Condition(lock)
        self._holding = threading.local()  # this thread holds a turn

    def _full(self) -> bool:
        return self._busy >= self.n + self._extra

    @contextmanager
    def copy(self) -> Iterator[None]:
        with self._copy_turn:
            self._copies_waiting += 1
            while self._full():
                self._copy_turn.wait()
            self._copies_waiting -= 1
            self._busy += 1
        yield from self._held()

    @contextmanager
    def write(self) -> Iterator[None]:
        with self._write_turn:
            while self._full() or self._copies_waiting:
                self._write_turn.wait()
            self._busy += 1
        yield from self._held()

    def _held(self) -> Iterator[None]:
        self._holding.turn = True
        try:
            yield
        finally:
            if self._holding.turn:
                self._holding.turn = False
                self._release()

    @contextmanager
    def io(self) -> Iterator[None]:
        """A blocking write: if an io slot is free, the turn this thread holds is given back
        for its duration; otherwise the write keeps the turn."""
        with self._copy_turn:
            slot = self._io_busy < self.io_slots + self._extra_io
            if slot:
                self._io_busy += 1
        if not slot:
            yield
            return
        if getattr(self._holding, "turn", False):
            self._holding.turn = False
            self._release()
        try:
            yield
        finally:
            with self._copy_turn:
                self._io_busy -= 1

    @contextmanager
    def boosted(self, workers: int, io: int) -> Iterator[None]:
        """Lend `workers` more turns and `io` more io slots until the block ends."""
        with self._copy_turn:
            self._extra += workers
            self._extra_io += io
            self._copy_turn.notify_all()
            self._write_turn.notify_all()
        try:
            yield
        finally:
            with self._copy_turn:
                self._extra -= workers
                self._extra_io -= io

    def lent_to_waiter(self) -> AbstractContextManager[None]:
        """`boosted` by the caller's core while the caller blocks on this save."""
        return self.boosted(BOOST_WORKERS, BOOST_IO)

    def _release(self) -> None:
        with self._copy_turn:
            self._busy -= 1
            if self._copies_waiting:
                self._copy_turn.notify()
            else:
                self._write_turn.notify()


def run_concurrently(calls: list[Callable[[], Any]], workers: int) -> None:
    """A prefetch: run `calls` on up to `workers` threads and wait for them, when that can
    overlap anything (two calls or more, two workers or more; else nothing is run). Their
    errors are dropped: the caller's later use of each result makes the call again (a
    OnceEach keeps only what succeeded) and raises them there."""
    if len(calls) <= 1 or workers <= 1:
        return
    with cf.ThreadPoolExecutor(min(workers, len(calls)),
                               thread_name_prefix="ckpt-prefetch") as pool:
        for future in [pool.submit(call) for call in calls]:
            future.exception()


@contextmanager
def _begun(fetches: dict[K, Callable[[], T]], workers: int, name: str
           ) -> Iterator[dict[K, cf.Future[T]]]:
    """The futures of `fetches`, run on up to `workers` threads from entering the block;
    leaving it cancels those not started and waits for those running. {} where there are no
    threads to run them on (`workers` <= 1): nothing is run. One fetch runs too: it overlaps
    the block's own work."""
    if not fetches or workers <= 1:
        yield {}
        return
    pool = cf.ThreadPoolExecutor(min(workers, len(fetches)), thread_name_prefix=name)
    try:
        yield {key: pool.submit(fetch) for key, fetch in fetches.items()}
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


@contextmanager
def fetches_started(fetches: dict[K, Callable[[], T]], workers: int
                    ) -> Iterator[Callable[[Callable[[K, T], Any]], None]]:
    """A prefetch whose results need Python work: run `fetches` on up to `workers` threads,
    begun on entering the block so that the block's own work (other reads) overlaps them.
    The block calls what this yields, `deliver(use)`, to hand each result to `use(key,
    result)` on the calling thread as it arrives, once (work that holds the interpreter would
    only take turns on threads, each slowing the others). Errors of both are dropped, for the
    caller's later use to raise. Nothing is run where `workers` <= 1. Leaving the block
    cancels the fetches not started and waits for those running, delivered or not."""
    with _begun(fetches, workers, "ckpt-prefetch") as futures:
        keys = {future: key for key, future in futures.items()}

        def deliver(use: Callable[[K, T], Any]) -> None:
            for future in cf.as_completed(keys):
                if future.exception() is not None:
                    continue
                try:
                    use(keys[future], future.result())
                except Exception:  # noqa: BLE001 - raised again by the access that needs it
                    pass
            keys.clear()

        yield deliver


@contextmanager
def results_ahead(fetches: dict[K, Callable[[], T]], workers: int
                  ) -> Iterator[Callable[[K], Callable[[], T] | None]]:
    """Fetches begun long before their results are used: run `fetches` on up to `workers`
    threads from entering the block, so the block's own work (encoding a state) overlaps
    them. The block's `claim(key)` gives, once per key, a call that waits for that result
    and returns it or raises its error (a fetch the block's end cancelled before it began
    runs on the caller's thread then); None for a key not fetched ahead or claimed before
    (the caller then fetches it itself). Thread-safe. Leaving the block cancels the fetches
    not started and waits for those running; results not claimed are dropped. Nothing runs
    ahead where `workers` <= 1."""
    lock = threading.Lock()
    with _begun(fetches, workers, "ckpt-ahead") as futures:

        def claim(key: K) -> Callable[[], T] | None:
            with lock:
                future = futures.pop(key, None)
            return None if future is None else functools.partial(
                _result_or_fetch, future, fetches[key])

        yield claim


def _result_or_fetch(future: cf.Future[T], fetch: Callable[[], T]) -> T:
    """`future`'s result; `fetch()` where it was cancelled before it began."""
    try:
        return future.result()
    except cf.CancelledError:
        return fetch()


def read_ahead(fetches: Sequence[Callable[[], T]], workers: int) -> Generator[T, None, None]:
    """The results of `fetches`, in order, fetched on up to `workers` threads while the
    caller uses the earlier ones: at most `workers` results are fetched or in flight beyond
    the one in use, so memory stays bounded however many there are. A fetch's error is
    raised where its result is reached; the fetches not yet started are then cancelled (and
    those running end) before it propagates, as when the caller stops early. With one
    fetch or `workers` <= 1: each in turn, on the calling thread."""
    if len(fetches) <= 1 or workers <= 1:
        for fetch in fetches:
            yield fetch()
        return
    pool = cf.ThreadPoolExecutor(min(workers, len(fetches)), thread_name_prefix="ckpt-ahead")
    try:
        following = iter(fetches)
        pending: deque[cf.Future[T]] = deque(
            pool.submit(fetch) for fetch in itertools.islice(following, workers))
        while pending:
            result = pending.popleft().result()
            after = next(following, None)
            if after is not None:
                pending.append(pool.submit(after))
            yield result
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def outcome(call: Callable[[], T]) -> Callable[[], T]:
    """Run `call` now, and return a call that gives what it gave or raises what it raised:
    for a read-ahead whose failures belong to the access that needs the result, not to the
    whole pass (`read_ahead` itself stops at the first error)."""
    try:
        result = call()
    except Exception as exc:  # noqa: BLE001 - raised by the caller's access
        return functools.partial(_raise, exc)
    return functools.partial(_given, result)


def _given(result: T) -> T:
    return result


def _raise(exc: Exception) -> Any:
    raise exc


class OnceEach(Generic[K, V]):
    """`get(key)` computes `make(key)` once per key and keeps it; different keys compute
    concurrently, callers of one key wait for the first. A failed `make` is not kept (the
    next `get` tries again). `done`: the values kept so far."""

    def __init__(self, make: Callable[[K], V]) -> None:
        self._make = make
        self.done: dict[K, V] = {}
        self._locks: dict[K, threading.Lock] = {}
        self._guard = threading.Lock()

    def get(self, key: K) -> V:
        got = self.done.get(key)
        if got is not None:
            return got
        with self._guard:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            got = self.done.get(key)
            if got is None:
                got = self.done[key] = self._make(key)
            return got
