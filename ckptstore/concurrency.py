"""One rule for fan-out work on a thread pool: results as they complete, and on the first
error every job not yet started is cancelled before the error propagates."""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


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
