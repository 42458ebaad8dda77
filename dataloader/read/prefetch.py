"""The prefetching machinery: windows loaded ahead within a byte budget, batches assembled in a
background thread, a bounded queue to the consumer, and clean shutdown.

Contract (after torchdata.nodes): the producer runs in one daemon thread and hands items to the
consumer through a bounded queue; a stop event ends it promptly (every blocking wait polls the
event); an exception in any I/O thread or in the producer is passed to the consumer and raised
there with its original traceback; closing the iterator (explicitly, by `break`, or by garbage
collection) stops the producer, cancels queued loads and joins the thread. Nothing here knows
about ranks or states: it delivers the pieces it is given, in order.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any, Generic, Protocol, TypeVar

from ..order.epoch import Piece
from .blocks import InlineExecutor
from .metrics import Metrics
from .views import Batch, merge_parts

T = TypeVar("T")
_POLL = 0.05


class Stopped(Exception):
    """Raised inside the producer when the consumer went away."""


def wait_result(fut: Future[T], stop: threading.Event | None) -> T:
    while True:
        try:
            return fut.result(timeout=_POLL)
        except TimeoutError:
            if stop is not None and stop.is_set():
                fut.cancel()
                raise Stopped from None


class Executors:
    """The thread pools of one pass: `io` for requests, `windows` for window assembly.
    With num_workers == 0 both run inline in the calling thread."""

    def __init__(self, num_workers: int) -> None:
        if num_workers < 0:
            raise ValueError("num_workers must be >= 0")
        self.inline = num_workers == 0
        if self.inline:
            self.io: Executor = InlineExecutor()
            self.windows: Executor = InlineExecutor()
        else:
            self.io = ThreadPoolExecutor(num_workers, thread_name_prefix="dataloader-io")
            self.windows = ThreadPoolExecutor(2, thread_name_prefix="dataloader-window")

    def shutdown(self) -> None:
        self.windows.shutdown(wait=False, cancel_futures=True)
        self.io.shutdown(wait=False, cancel_futures=True)


def iter_windows(
    pieces: Sequence[Piece],
    load: Callable[[int], Any],
    nbytes: Callable[[int], int],
    executors: Executors,
    prefetch_bytes: int,
    stop: threading.Event | None = None,
) -> Iterator[tuple[Piece, Any]]:
    """Yield (piece, view) in order. The window needed now is loaded first; once it is there,
    the following windows are loaded ahead (on executors.windows) while the consumer works,
    as long as the windows ahead stay within `prefetch_bytes` (at least one when threaded)."""
    groups: list[tuple[int, list[Piece]]] = []
    for p in pieces:
        if groups and groups[-1][0] == p.window:
            groups[-1][1].append(p)
        else:
            groups.append((p.window, [p]))
    futures: dict[int, Future[Any]] = {}
    nxt, ahead = 0, 0

    def submit() -> None:
        nonlocal nxt
        futures[nxt] = executors.windows.submit(load, groups[nxt][0])
        nxt += 1

    try:
        for gi, (w, ps) in enumerate(groups):
            if gi < nxt:
                ahead -= nbytes(w)
            else:
                submit()  # the window needed now goes first
            view = wait_result(futures.pop(gi), stop)
            # then read ahead while the consumer works on this window
            while (
                not executors.inline
                and nxt < len(groups)
                and (nxt == gi + 1 or ahead + nbytes(groups[nxt][0]) <= prefetch_bytes)
            ):
                ahead += nbytes(groups[nxt][0])
                submit()
            for p in ps:
                yield p, view
            del view
    finally:
        for fut in futures.values():
            fut.cancel()


class WindowSource(Protocol):
    """A dataset read window by window (StreamingDataset)."""

    def load_window(self, order: Any, w: int, io: Any) -> Any: ...

    def window_nbytes(self, order: Any, w: int) -> int: ...


def dataset_windows(source: WindowSource, order: Any, pieces: Sequence[Piece], threads: int,
                    prefetch_bytes: int, stop: threading.Event | None = None
                    ) -> Generator[tuple[Piece, Any], None, None]:
    """One pass over `pieces` of `source` in `order`: `iter_windows` with this pass's own
    executors (`threads` I/O threads), shut down when the pass ends, however it ends."""
    executors = Executors(threads)
    try:
        yield from iter_windows(pieces, lambda w: source.load_window(order, w, executors.io),
                                lambda w: source.window_nbytes(order, w), executors,
                                prefetch_bytes, stop)
    finally:
        executors.shutdown()


def iter_batches(
    views: Iterator[tuple[Piece, Any]], batch_size: int, drop_last: bool
) -> Iterator[Batch]:
    """Cut consecutive items of the pieces into batches of `batch_size` (the last may be
    shorter unless drop_last)."""
    parts: list[Batch] = []
    have = 0
    for piece, view in views:
        i = piece.start
        while i < piece.stop:
            take = min(piece.stop - i, batch_size - have)
            parts.append(view.gather(i, i + take))
            have += take
            i += take
            if have == batch_size:
                yield merge_parts(parts)
                parts, have = [], 0
    if parts and not drop_last:
        yield merge_parts(parts)


class BackgroundIterator(Generic[T]):
    """Runs `make(stop_event)` (a generator) in a daemon thread; items come through a bounded
    queue. `wait_s` in `metrics` accumulates the time the consumer blocked in __next__."""

    _END = object()

    def __init__(self, make: Callable[[threading.Event], Iterator[T]], max_queue: int = 4) -> None:
        self._stop = threading.Event()
        self._q: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=max(1, max_queue))
        self._make = make
        self._done = False
        self.last_wait = 0.0
        self._thread = threading.Thread(target=self._run, name="dataloader-producer", daemon=True)
        self._thread.start()

    def _put(self, item: tuple[str, Any]) -> bool:
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=_POLL)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        gen = None
        try:
            gen = self._make(self._stop)
            for item in gen:
                if not self._put(("item", item)):
                    return
            self._put(("end", None))
        except Stopped:
            return
        except BaseException as exc:  # handed to the consumer
            self._put(("error", exc))
        finally:
            if gen is not None and hasattr(gen, "close"):
                try:
                    gen.close()
                except Exception:
                    pass

    def __iter__(self) -> BackgroundIterator[T]:
        return self

    def __next__(self) -> T:
        if self._done:
            raise StopIteration
        t0 = time.perf_counter()
        while True:
            try:
                kind, value = self._q.get(timeout=_POLL)
                break
            except queue.Empty:
                if self._stop.is_set():  # closed from another thread while we waited
                    self._done = True
                    raise StopIteration from None
                if not self._thread.is_alive() and self._q.empty():
                    self._done = True
                    raise RuntimeError("dataloader producer thread died without a result") from None
        self.last_wait = time.perf_counter() - t0
        if kind == "item":
            item: T = value
            return item
        self._done = True
        self.close()
        if kind == "error":
            raise value
        raise StopIteration

    def close(self, timeout: float = 10.0) -> None:
        """Stop the producer and join it (idempotent)."""
        self._done = True
        self._stop.set()
        while True:  # unblock a producer waiting on a full queue
            try:
                self._q.get_nowait()
            except queue.Empty:
                break
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def __del__(self) -> None:
        try:
            self._stop.set()
        except Exception:
            pass


def timed_batches(source: Iterator[T], metrics: Metrics, count: Callable[[T], int]) -> Iterator[T]:
    """Yield from `source`, recording batch counts and the consumer's wait in `metrics`."""
    while True:
        t0 = time.perf_counter()
        try:
            item = next(source)
        except StopIteration:
            return
        waited = getattr(source, "last_wait", None)
        metrics.add_batch(count(item), waited if waited is not None else time.perf_counter() - t0)
        yield item
