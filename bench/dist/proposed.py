"""Proposed fixes to ckptstore's collective save, applied by monkeypatching inside the
benchmark's ranks with `--proposed-fixes` (the library's files are not changed). They measure
what the fixes proposed in docs/performance-distributed.md would gain:

1. (adopted) the balanced plan of replicated chunks is now the library's own
   `plan_collective`; it is no longer patched here.
2. `LocalStore.sync`: fsync the dirty folders in parallel (one depth level at a time, deepest
   first, as before). Every blob lives in its own `blobs/xx/` folder, so a rank's sync is one
   folder fsync (one journal commit) per chunk, one after another; concurrent fsyncs share
   journal commits.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections import defaultdict
from typing import Any


def parallel_sync(self: Any) -> None:
    from ckptstore.stores.local import fsync_dir

    with self._lock:
        dirty, self._dirty = self._dirty, set()
    by_depth: dict[int, list[Any]] = defaultdict(list)
    for folder in dirty:
        by_depth[len(folder.parts)].append(folder)
    if not by_depth:
        return
    with cf.ThreadPoolExecutor(min(16, len(dirty))) as pool:
        for depth in sorted(by_depth, reverse=True):  # a new folder's entry after its contents
            list(pool.map(lambda f: fsync_dir(f) if f.is_dir() else None, by_depth[depth]))


def apply() -> None:
    from ckptstore.stores.local import LocalStore

    LocalStore.sync = parallel_sync  # type: ignore[method-assign]
