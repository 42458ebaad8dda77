"""Options and results of saves and restores: the one place each knob is defined and checked.

    SaveOptions     tuning of one save (chunking, codec, threads, memory, writer)
    Staging         how an async save gets the state off the caller's memory, and its bound
    SaveInfo        what a save did
    LoadOptions     tuning of one restore

Every option is validated once, when its object is made; the layers below take the object
and never check again. Thread counts: `SaveOptions.workers` for a save the caller waits for,
`SaveOptions.pool_threads()` for one beside training (its Turns decide how many work at
once); `METADATA_THREADS` for the small requests of listings and existence checks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from ..concurrency import BOOST_THREADS
from ..format.codecs import Codec
from ..format.hashing import XXH3_128, HashAlgorithm

MiB = 1 << 20
STAGING_MODES = ("copy", "overlap")
ASYNC_WRITERS = ("auto", "thread", "process")
#: An overlapped save's writer runs up to this many threads: `background_workers` of them
#: work at once and `background_io` wait in writes (concurrency.Turns), the others hold a
#: staged block and wait for their turn to write it. A thread holds one block, so this also
#: caps how far copies run ahead of writes: 128 blocks, 2 GiB at the default chunk size
#: (threads that wait cost no CPU and little memory)
MAX_OVERLAP_THREADS = 128
#: threads for metadata requests (listings, existence checks, manifest heads): small
#: requests that mostly wait on the store
METADATA_THREADS = 8


@dataclass(frozen=True)
class SaveOptions:
    """Tuning of one save. `chunk_bytes`: target raw size of a row block and of a pack;
    arrays of at most `pack_threshold` bytes are packed together; `max_inflight_bytes` bounds
    the extra memory the pipeline allocates; `workers` is the thread-pool size of a save the
    caller waits for.

    A save that runs beside training (`background`: `save_async`) has a pool of
    `pool_threads()` threads, of which `background_workers` work at once (each takes a core
    from the training step) and up to `background_io` more wait in blocking writes
    (concurrency.Turns); the others wait for a turn."""

    chunk_bytes: int = 16 * MiB
    pack_threshold: int = 256 * 1024
    compression: Codec | None = None
    workers: int = 8
    max_inflight_bytes: int = 512 * MiB
    hash: HashAlgorithm = XXH3_128  # the repository's: names every chunk
    background_workers: int = 1
    background_io: int = 0
    #: who writes the blobs of an overlapped save: "thread" (threads of this process),
    #: "process" (a writer process sharing the staging slots: pipeline/writer_process.py)
    #: or "auto" (a writer process for a local folder, else threads)
    async_writer: str = "auto"
    background: bool = False
    #: the pool of a background save (None: `pool_threads()` picks it)
    background_threads: int | None = None

    def __post_init__(self) -> None:
        if self.chunk_bytes < 1 or self.pack_threshold < 0 or self.workers < 1 \
                or self.background_workers < 1 or self.background_io < 0:
            raise ValueError("chunk_bytes and workers must be positive, pack_threshold and "
                             "background_io >= 0")
        if self.pack_threshold > self.chunk_bytes:
            raise ValueError("pack_threshold cannot exceed chunk_bytes")
        if self.max_inflight_bytes < 1:
            raise ValueError("max_inflight_bytes must be positive")
        if self.async_writer not in ASYNC_WRITERS:
            raise ValueError(f"async_writer must be one of {ASYNC_WRITERS}, got "
                             f"{self.async_writer!r}")

    def threads(self) -> int:
        """The size of this save's thread pool."""
        if not self.background:
            return self.workers
        if self.background_threads is not None:
            return self.background_threads
        return self.background_workers + self.background_io + BOOST_THREADS

    def for_background(self) -> SaveOptions:
        """A save written beside training, staged at call time: threads for its turns, and
        for those lent while the caller waits for it (concurrency.Turns)."""
        return replace(self, background=True, background_threads=None)

    def overlapped(self, staging: Staging) -> SaveOptions:
        """An overlapped save (staging="overlap"): its staging bound (`max_host_bytes`,
        default `max_inflight_bytes`) bounds the pipeline's memory, and the pool gets a
        thread per staging slot besides its working threads, so that copies fill every free
        slot at once."""
        budget = staging.max_host_bytes or self.max_inflight_bytes
        slots = budget // min(self.chunk_bytes, budget)
        threads = slots + self.background_workers + self.background_io
        return replace(self, max_inflight_bytes=budget, background=True,
                       background_threads=min(MAX_OVERLAP_THREADS, threads))


@dataclass(frozen=True)
class Staging:
    """How `save_async` takes the state off the caller's memory: "copy" (all of it into a
    reused arena at call time) or "overlap" (in the background, block by block, at most
    `max_host_bytes` at once; None: the save's `max_inflight_bytes`)."""

    mode: str = "copy"
    max_host_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in STAGING_MODES:
            raise ValueError(f"staging must be one of {STAGING_MODES}, got {self.mode!r}")
        if self.max_host_bytes is not None and (type(self.max_host_bytes) is not int
                                                or self.max_host_bytes < 1):
            raise ValueError(f"max_host_bytes must be a positive int, got "
                             f"{self.max_host_bytes!r}")

    def with_overrides(self, mode: str | None, max_host_bytes: int | None) -> Staging:
        """This staging with a call's overrides (None: keep)."""
        if mode is None and max_host_bytes is None:
            return self
        return Staging(self.mode if mode is None else mode,
                       self.max_host_bytes if max_host_bytes is None else max_host_bytes)


@dataclass(frozen=True)
class SaveInfo:
    """What a save did. Bytes are raw (logical) unless named `stored`."""

    name: str
    tensors: int
    logical_bytes: int
    written_bytes: int  # stored bytes sent to the store by this save
    reused_bytes: int  # logical bytes not written because the store had them already
    chunks_written: int
    chunks_reused: int
    seconds: float  # wall time from call to commit
    blocked_seconds: float  # time the caller waited (async saves: staging only)
    # seconds per stage, summed over workers (and so including their waits for the GIL):
    # stage (copies), hash, lookup (digest + dedup lookup of small packed arrays), compress,
    # write, commit
    stage_seconds: dict[str, float] = field(default_factory=dict)
    peak_extra_bytes: int = 0
    staging: str = "copy"  # async saves: "copy" (staged at call) or "overlap" (in background)
    guard_wait_seconds: float = 0.0  # overlap: time optimizer.step() waited (guards)
    copied_at_call_bytes: int = 0  # overlap: bytes copied at call time (numpy, copy_keys)

    @property
    def throughput(self) -> float:
        """Logical bytes per second of wall time."""
        return self.logical_bytes / self.seconds if self.seconds > 0 else float("inf")


def default_load_workers() -> int:
    """Restore threads: twice the cores, 4 to 8. More threads than that only add contention
    on small machines (measured: 4 beat 8 by 5-15% on 2 cores, local and S3)."""
    return min(8, max(4, 2 * (os.cpu_count() or 2)))


@dataclass(frozen=True)
class LoadOptions:
    """Tuning of one restore: `workers` threads, at most `max_inflight_bytes` of chunk
    buffers held at once; every chunk is checked with `hash`."""

    workers: int = field(default_factory=default_load_workers)
    max_inflight_bytes: int = 512 * MiB
    hash: HashAlgorithm = XXH3_128  # the repository's: every chunk is checked with it

    def __post_init__(self) -> None:
        if self.workers < 1 or self.max_inflight_bytes < 1:
            raise ValueError("workers and max_inflight_bytes must be positive")
