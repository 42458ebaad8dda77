"""A byte budget shared by pipeline workers: bounds the extra memory a save or restore holds."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class ByteBudget:
    """Counting semaphore in bytes. A request larger than the whole budget is admitted alone
    (when nothing else is held), so an oversized chunk cannot deadlock the pipeline; a request
    of 0 bytes never waits (a holder may hold more than the capacity, alone)."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError("memory budget must be positive")
        self.capacity = capacity
        self._held = 0
        self._peak = 0
        self._cond = threading.Condition()

    @contextmanager
    def hold(self, nbytes: int) -> Iterator[None]:
        with self._cond:
            while nbytes and self._held and self._held + nbytes > self.capacity:
                self._cond.wait()
            self._held += nbytes
            self._peak = max(self._peak, self._held)
        try:
            yield
        finally:
            with self._cond:
                self._held -= nbytes
                self._cond.notify_all()

    @property
    def peak(self) -> int:
        """Most bytes held at once so far."""
        return self._peak
