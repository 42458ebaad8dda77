"""Loader metrics: throughput, bytes read, and how long the consumer waited on I/O."""

from __future__ import annotations

import threading
import time
from typing import Any


class Metrics:
    """Counters updated by the reader (I/O threads) and the loader (consumer thread).

    `wait_s` is the time the consumer spent blocked waiting for the next batch: the share of
    its time the training loop lost to data loading. Thread-safe; `snapshot()` is a plain dict.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.started = time.perf_counter()
            self.samples = 0
            self.batches = 0
            self.bytes_read = 0
            self.requests = 0
            self.cache_hits = 0
            self.cache_bytes = 0
            self.wait_s = 0.0
            self.first_batch_s: float | None = None

    def add_read(self, nbytes: int, requests: int = 1) -> None:
        with self._lock:
            self.bytes_read += nbytes
            self.requests += requests

    def add_cache_hit(self, nbytes: int) -> None:
        with self._lock:
            self.cache_hits += 1
            self.cache_bytes += nbytes

    def add_batch(self, samples: int, waited: float) -> None:
        with self._lock:
            self.samples += samples
            self.batches += 1
            self.wait_s += waited
            if self.first_batch_s is None:
                self.first_batch_s = time.perf_counter() - self.started

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            elapsed = max(time.perf_counter() - self.started, 1e-9)
            return {
                "elapsed_s": elapsed,
                "samples": self.samples,
                "batches": self.batches,
                "samples_per_s": self.samples / elapsed,
                "bytes_read": self.bytes_read,
                "bytes_per_s": self.bytes_read / elapsed,
                "requests": self.requests,
                "cache_hits": self.cache_hits,
                "cache_bytes": self.cache_bytes,
                "wait_s": self.wait_s,
                "wait_fraction": self.wait_s / elapsed,
                "time_to_first_batch_s": self.first_batch_s,
            }
