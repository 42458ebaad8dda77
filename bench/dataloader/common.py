"""Shared by the runner scripts (stdlib + numpy only: also runs in the mosaic venv).

A runner is called as ``python run_X.py PHASE CONFIG_JSON`` with PHASE 'write' or 'read' and
prints one line ``RESULT {json}``. The read phase: build dataset + loader, time the first
batch, read one full epoch (throughput includes the first batch), take the loader's state at
50% of the epoch, then build a *new* dataset + loader from that state and time its first batch.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any


def config() -> tuple[str, dict[str, Any]]:
    return sys.argv[1], json.loads(sys.argv[2])


def emit(result: dict[str, Any]) -> None:
    print("RESULT " + json.dumps(result), flush=True)


def list_collate(samples: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Variable-size byte samples cannot be stacked: keep them as a list of bytes per field
    (litdata hands out memoryviews, which cannot cross a worker-process queue)."""
    return {
        k: [bytes(s[k]) if isinstance(s[k], memoryview) else s[k] for s in samples]
        for k in samples[0]
    }


def batch_size_of(batch: Any) -> int:
    if isinstance(batch, dict):
        v = next(iter(v for k, v in batch.items() if not k.startswith("_")))
    else:
        v = batch
    return len(v)


def read_phase(
    make: Callable[[Any], tuple[Any, Any]],
    state_of: Callable[[Any], Any],
    total: int,
    close: Callable[[Any], None] = lambda loader: None,
    first_ids: Callable[[Any], list[int]] | None = None,
) -> dict[str, Any]:
    """`make(state_or_None)` -> (loader, iterator). Returns the measurements."""
    t0 = time.perf_counter()
    loader, it = make(None)
    first = next(it)
    ttfb = time.perf_counter() - t0
    n = batch_size_of(first)
    state = None
    half_ids = None
    want_ids = False
    for batch in it:
        if want_ids:
            half_ids = first_ids(batch) if first_ids else None
            want_ids = False
        n += batch_size_of(batch)
        if state is None and n >= total // 2:
            state = state_of(loader)  # position after this batch
            want_ids = True
    elapsed = time.perf_counter() - t0
    close(loader)
    del it, loader
    t1 = time.perf_counter()
    loader2, it2 = make(state)
    batch = next(it2)
    resume = time.perf_counter() - t1
    resumed_ok = None
    if first_ids is not None and half_ids is not None:
        resumed_ok = first_ids(batch) == half_ids
    close(loader2)
    return {
        "samples": n,
        "expected": total,
        "epoch_s": elapsed,
        "samples_per_s": n / elapsed,
        "ttfb_s": ttfb,
        "resume_s": resume,
        "resume_exact": resumed_ok,
        "state_json_bytes": len(json.dumps(state, default=str)) if state is not None else None,
    }
