"""Wall-time tracing of ckptstore's collective save and restore, from outside.

Wraps the functions the protocol goes through (ckptstore.training.distributed and the writer, reader
and repository methods it calls) with timers, without changing what they do. Every call is
recorded as (label, start relative to the measurement's start, seconds, thread); nested
calls are recorded too (e.g. `store.sync` inside `rank0.commit`).
"""

from __future__ import annotations

import functools
import threading
import time
from collections import defaultdict
from typing import Any


class Tracer:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: list[tuple[str, float, float, str]] = []
        self.t0 = time.perf_counter()

    def reset(self) -> None:
        with self.lock:
            self.events = []
            self.t0 = time.perf_counter()

    def wrap(self, owner: Any, attr: str, label: str) -> None:
        orig = getattr(owner, attr)
        tracer = self

        @functools.wraps(orig)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            s = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                e = time.perf_counter()
                with tracer.lock:
                    tracer.events.append(
                        (label, s - tracer.t0, e - s, threading.current_thread().name)
                    )

        setattr(owner, attr, wrapper)

    def summary(self) -> dict[str, Any]:
        with self.lock:
            events = list(self.events)
        totals: dict[str, dict[str, float]] = defaultdict(lambda: {"seconds": 0.0, "calls": 0})
        for label, _start, dt, _thread in events:
            totals[label]["seconds"] += dt
            totals[label]["calls"] += 1
        return {
            "totals": dict(totals),
            "events": [
                {"label": lb, "start": round(st, 6), "seconds": round(dt, 6), "thread": th}
                for lb, st, dt, th in events
            ],
        }


def install() -> Tracer:
    import ckptstore.training.distributed as cdist
    import ckptstore.pipeline.loading as loading
    import ckptstore.training.manager as manager
    import ckptstore.repository as repository
    import ckptstore.stores.local as local
    from ckptstore.format.manifest import Manifest
    from ckptstore.pipeline.reader import CheckpointReader
    from ckptstore.pipeline.staging import StagingArena
    from ckptstore.stores.local import LocalStore
    from ckptstore.pipeline.writer import CheckpointWriter

    t = Tracer()
    # save
    t.wrap(repository.CheckpointStore, "_prepare", "prepare")  # exists check, tree, parent
    t.wrap(repository.CheckpointStore, "latest", "prepare.latest")  # list + read manifests
    t.wrap(StagingArena, "stage", "async.stage_copy")
    t.wrap(repository.CheckpointStore, "_write", "write+collective")  # all after prepare
    t.wrap(cdist, "all_gather_json", "all_gather_json")  # descs, then statuses
    t.wrap(cdist, "plan_collective", "plan")
    t.wrap(CheckpointWriter, "write_blobs", "write_blobs")
    t.wrap(LocalStore, "sync", "store.sync")
    t.wrap(local, "_fsync", "fsync")  # blob files (in save threads) and folders (in sync)
    t.wrap(LocalStore, "put", "store.put")  # write + fsync + rename of one blob
    t.wrap(cdist, "build_entries", "rank0.build_entries")
    t.wrap(CheckpointWriter, "commit", "rank0.commit")
    t.wrap(Manifest, "to_bytes", "manifest.to_bytes")
    t.wrap(repository, "parse_manifest", "manifest.parse")
    t.wrap(cdist, "broadcast_json", "broadcast_json")
    # restore
    t.wrap(manager.CheckpointManager, "latest_step", "restore.latest_step")
    t.wrap(repository.CheckpointStore, "manifest", "repo.manifest")
    t.wrap(manager, "_holds_shards", "restore.holds_shards")
    t.wrap(repository, "load_state", "load_state")
    t.wrap(loading, "_check_into", "load.check_into")
    t.wrap(CheckpointReader, "read_tensors", "read_tensors")
    return t
