"""Overlapped staging for asynchronous saves (`save_async(..., staging="overlap")`).

The save returns before copying anything. The writer's chunk and pack jobs read the caller's
live arrays, copy each block into a slot of a reused staging pool (at most `max_host_bytes`
in use at once, the writer's ByteBudget), hash the copy, write it and give the slot back.

`Overlap` tracks one such save:

* the torch in-place version counter (`Tensor._version`) of every tensor leaf at call time.
  Before and after each block copy the counter is compared; if it moved, the save fails with
  `SourceChangedError` naming the key and commits nothing. A tensor a guard covers is final
  once its last block is copied (its optimizer waits for that: later changes are fine). Any
  other tensor is checked again after all blocks are written and before the commit, and a
  change by then fails the save too: torch bumps the counter after an op's kernel has
  written, so an op running during the copy may show only later (measured: 19 of 300
  unguarded saves of tensors changed right after the call held new values when only the
  copy itself was bracketed).
* one event per leaf, set once all its blocks are copied (or the save ended): what
  `SaveHandle.guard(optimizer)` waits on before letting `optimizer.step()` run.

What the counter cannot see (docs/training.md, "Overlapped async saves"): in-place torch ops,
`t[i] = x` and ops under `torch.no_grad()` bump it, but writes through `t.data`, through numpy
views of a tensor (`t.numpy()[...] = x`), DLPack/ctypes pointers or other processes sharing
the memory do not; numpy arrays have no counter at all (the repository copies them at call
time). For a guarded tensor, an in-place op by anything other than its optimizer that runs
while its last block is copied and bumps the counter after the check is not detected; for an
unguarded one, such an op still unbumped at the commit. Detection is a safety net; a guard
(or `staging="copy"`) is the guarantee.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any, Protocol

import numpy as np

from ..concurrency import BOOST_THREADS, Turns
from ..errors import SourceChangedError, UnsupportedTypeError
from ..format.leaf import ArrayLeaf
from ..stores.base import Store
from ..stores.local import LocalStore
from .device import CopyEvent, Device, Pins, block_of, host_buffer, marks_for, on_device
from .options import SaveOptions
from .writer_process import SharedSlot, WriterProcess, writer_process_available


def _version_source(obj: Any) -> Any:
    """The torch tensor whose `_version` tracks in-place changes of `obj`, or None."""
    data = getattr(obj, "data", None) if type(obj).__name__ == "Shard" else obj
    version = getattr(data, "_version", None)
    return data if isinstance(version, int) else None


class StagingPool:
    """Reusable slots of `slot_bytes` for block copies; slots are allocated lazily and kept.
    How many are in use at once is bounded by the writer's ByteBudget (each holder holds at
    least a slot's bytes), so at most budget // slot_bytes slots ever exist. With a
    `writer` process, slots are shared memory that process writes from (`sink`).

    A slot that receives copies from a device (`buffer(..., devices)`) is page-locked for it
    the first time and stays so while the pool lives (`pins`): the pool is the pinned host
    memory of device saves, kept and reused from save to save."""

    def __init__(self, slot_bytes: int, writer: WriterProcess | None = None) -> None:
        self.slot_bytes = slot_bytes
        self.sink = writer
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()
        self.allocated = 0
        self.pins = Pins()
        self._unpin = weakref.finalize(self, self.pins.release)

    def _new_slot(self, index: int) -> np.ndarray:
        if self.sink is None:
            return host_buffer(self.slot_bytes)  # its own pages: page-lockable
        shared = SharedSlot(index, self.slot_bytes)
        self.sink.add_slot(shared)
        return shared.array

    @contextmanager
    def buffer(self, nbytes: int, devices: Iterable[Device] = ()) -> Iterator[np.ndarray]:
        """A flat uint8 buffer of at least `nbytes` (a pooled slot when it fits), page-locked
        for `devices` (the devices copying into or out of it)."""
        if nbytes > self.slot_bytes:
            # a block larger than a slot (one huge row): not pooled, so not pinned either
            # (device copies into it are synchronous)
            yield np.empty(nbytes, np.uint8)
            return
        with self._lock:
            slot = self._free.pop() if self._free else None
            if slot is None:
                index = self.allocated
                self.allocated += 1
        try:
            if slot is None:
                slot = self._new_slot(index)
            self.pins.ensure(slot, devices)
            yield slot
        finally:
            if slot is not None:
                with self._lock:
                    self._free.append(slot)

    def close(self) -> None:
        """Stop the writer process, if any (the pool's slots stay usable by threads; their
        page locks stay until the pool is dropped)."""
        if self.sink is not None:
            self.sink.close()


def staging_pool(current: StagingPool | None, store: Store, options: SaveOptions
                 ) -> StagingPool:
    """The pool an overlapped save with `options` uses: `current` if it fits, else a new
    one (and `current` is closed)."""
    slot = min(options.chunk_bytes, options.max_inflight_bytes)
    # the writer's threads: one per write that may be in flight (Turns, guards' boosts)
    threads = (options.background_workers + options.background_io + BOOST_THREADS
               if uses_writer_process(options.async_writer, store) else None)
    if current is not None and current.slot_bytes == slot and threads == (
            None if current.sink is None else current.sink.threads):
        return current
    if current is not None:
        current.close()
    writer = None
    if threads is not None:
        check_async_writer(options.async_writer, store)
        assert isinstance(store, LocalStore)
        writer = WriterProcess(store.root, threads)
    return StagingPool(slot, writer)


#: per store: the pool of device blocks for saves that are not overlapped and for restores
#: (overlapped saves have their own pool, the repository's: staging_pool)
_HOST_POOLS: weakref.WeakKeyDictionary[Store, StagingPool] = weakref.WeakKeyDictionary()
_HOST_POOLS_LOCK = threading.Lock()


def host_pool(store: Store, slot_bytes: int) -> StagingPool:
    """The pool of page-locked slots through which saves that are not overlapped, and
    restores, move the bytes of device tensors of `store`: one per store object, kept while
    it lives (each slot pinned once, then reused); replaced only when a caller needs larger
    slots. How many slots exist is bounded by the budgets of the saves and loads using it."""
    with _HOST_POOLS_LOCK:
        pool = _HOST_POOLS.get(store)
        if pool is None or pool.slot_bytes < slot_bytes:
            pool = _HOST_POOLS[store] = StagingPool(max(slot_bytes, 1))
        return pool


def check_async_writer(async_writer: str, store: Store) -> None:
    """ValueError unless `async_writer` (one of ASYNC_WRITERS: SaveOptions checks that) can
    write to `store`."""
    if async_writer == "process" and not isinstance(store, LocalStore):
        raise ValueError('async_writer="process" writes to local folders only; '
                         f"{store.uri} is not one (use \"auto\" or \"thread\")")
    if async_writer == "process" and not writer_process_available():
        raise ValueError('async_writer="process" needs Linux (memfd) and a Python executable')


def uses_writer_process(async_writer: str, store: Store) -> bool:
    """Whether overlapped saves into `store` are written by a writer process: "process",
    or "auto" (the default) for a local folder where a writer process can run."""
    if async_writer == "auto":
        return isinstance(store, LocalStore) and writer_process_available()
    return async_writer == "process"


class Overlap:
    """The state of one overlapped save (module docstring). Thread-safe."""

    def __init__(self, leaves: list[ArrayLeaf], objects: list[Any], pool: StagingPool,
                 turns: Turns | None = None) -> None:
        self.leaves = leaves
        self.pool = pool
        #: where blobs are written when not through the store itself (a writer process)
        self.sink = pool.sink
        #: the save's Turns (the writer's): a guard lends them the trainer's core while the
        #: trainer waits
        self.turns = turns
        # a device tensor's source: the object itself, or (when the repository left it out
        # as already copied, as it did when encoding copied device tensors) its leaf's
        self.sources = [_version_source(o) if o is not None or not on_device(leaf.array)
                        else _version_source(block_of(leaf.array).source)
                        for o, leaf in zip(objects, leaves)]
        #: the values to save are those of the call: device copies wait for these
        self.marks: dict[str, CopyEvent] = marks_for(leaf.array for leaf in leaves)
        self.versions = [None if s is None else int(s._version) for s in self.sources]
        self.events = [threading.Event() for _ in leaves]
        self._remaining = [0] * len(leaves)
        self._lock = threading.Lock()
        self.finished = False
        self.guarded: set[int] = set()  # leaves a guard covers: their step waits for the copy
        self.waited = 0.0  # seconds optimizer.step() waited for this save (guards)

    def mark(self, device: str) -> CopyEvent | None:
        """The call-time mark of a device (see pipeline/device.py)."""
        return self.marks.get(device)

    def expect(self, counts: dict[int, int]) -> None:
        """The writer is about to copy counts[i] blocks of leaf i (no entry: none)."""
        with self._lock:
            for i in range(len(self.leaves)):
                n = counts.get(i, 0)
                self._remaining[i] = n
                if n == 0:
                    self.events[i].set()

    def check(self, i: int) -> None:
        """Raise SourceChangedError if leaf i changed in place since the call."""
        source = self.sources[i]
        if source is not None:
            now = int(source._version)
            before = self.versions[i]
            if now != before:
                assert before is not None
                raise SourceChangedError(self.leaves[i].key, before, now)

    def confirm(self) -> None:
        """Before the commit: raise SourceChangedError if a leaf no guard covers changed since
        the call. Its blocks were checked when copied, but torch bumps the counter after an
        op's kernel: an op in flight during the copy shows only later; a change after the
        copy cannot be told from one during it, so it fails the save too."""
        for i, source in enumerate(self.sources):
            if source is not None and i not in self.guarded:
                self.check(i)

    def copied(self, i: int) -> None:
        """One block of leaf i was copied (and checked after the copy)."""
        with self._lock:
            self._remaining[i] -= 1
            if self._remaining[i] <= 0:
                self.events[i].set()

    def finish(self) -> None:
        """The save ended (committed or failed): release every waiter."""
        self.finished = True
        for e in self.events:
            e.set()

    def events_for(self, tensors: Iterable[Any]) -> list[threading.Event]:
        """Events of the leaves that share storage with any of `tensors`."""
        wanted = set()
        for t in tensors:
            try:
                s = t.untyped_storage()
                wanted.add((s.data_ptr(), s.nbytes()))
            except (AttributeError, RuntimeError):
                continue
        out = []
        for i, (leaf, e) in enumerate(zip(self.leaves, self.events)):
            if leaf.storage_identity is not None and leaf.storage_identity in wanted:
                with self._lock:
                    self.guarded.add(i)
                out.append(e)
        return out

    def add_wait(self, seconds: float) -> None:
        with self._lock:
            self.waited += seconds


def guard_target(optimizer: Any) -> Any | None:
    """The optimizer whose step pre-hooks run at every step that changes `optimizer`'s
    tensors: `optimizer` itself when it keeps torch's hooks, else, for a wrapper
    (accelerate's AcceleratedOptimizer, Lightning's LightningOptimizer, DeepSpeed-style
    wrappers), the optimizer it wraps (`.optimizer`, `._optimizer`), followed until one does.
    None if there is none: such an optimizer cannot be guarded (its tensors must be copied
    at call time)."""
    seen: set[int] = set()
    obj = optimizer
    while obj is not None and id(obj) not in seen:
        seen.add(id(obj))
        if callable(getattr(obj, "register_step_pre_hook", None)) and isinstance(
                getattr(obj, "_optimizer_step_pre_hooks", None), dict):
            return obj
        obj = getattr(obj, "optimizer", None) or getattr(obj, "_optimizer", None)
    return None


class Tracking(Protocol):
    """What the writer's jobs need of an overlapped save (an Overlap, or a Remapped view)."""

    @property
    def pool(self) -> StagingPool: ...

    def mark(self, device: str) -> CopyEvent | None: ...

    def expect(self, counts: dict[int, int]) -> None: ...

    def check(self, i: int) -> None: ...

    def copied(self, i: int) -> None: ...


class Remapped:
    """An Overlap seen through a map from the writer's part index to the state's leaf index
    (a collective save hands the writer one part per chunk it owns)."""

    def __init__(self, overlap: Tracking, leaf_of: Sequence[int]) -> None:
        self._overlap = overlap
        self._leaf_of = leaf_of
        self.pool = overlap.pool

    def mark(self, device: str) -> CopyEvent | None:
        return self._overlap.mark(device)

    def expect(self, counts: dict[int, int]) -> None:
        total: dict[int, int] = {}
        for j, n in counts.items():
            total[self._leaf_of[j]] = total.get(self._leaf_of[j], 0) + n
        self._overlap.expect(total)

    def check(self, j: int) -> None:
        self._overlap.check(self._leaf_of[j])

    def copied(self, j: int) -> None:
        self._overlap.copied(self._leaf_of[j])


def optimizer_tensors(optimizer: Any) -> list[Any]:
    """Every tensor `optimizer.step()` may change: its parameters and their state tensors."""
    out: list[Any] = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            out.append(p)
            for v in optimizer.state.get(p, {}).values():
                if hasattr(v, "untyped_storage"):
                    out.append(v)
    return out


class Guard:
    """A step pre-hook on one optimizer: `step()` waits until the save has copied every tensor
    the optimizer changes. The hook does nothing once the save ended; it is removed by
    `remove()` (called from the training thread: removing a hook while `step()` iterates over
    the hooks would break that iteration)."""

    def __init__(self, overlap: Overlap, optimizer: Any) -> None:
        target = guard_target(optimizer)
        if target is None:
            raise UnsupportedTypeError(
                f"cannot guard {type(optimizer).__name__}: it has no step pre-hooks and wraps "
                "no optimizer that has (copy its state at call time: copy_keys, or "
                "staging='copy')")
        self.overlap = overlap
        events = overlap.events_for(optimizer_tensors(target))

        def hook(_opt: Any, _args: Any, _kwargs: Any) -> None:
            pending = [e for e in events if not e.is_set()]
            if not pending:
                return
            t0 = time.perf_counter()
            turns = overlap.turns
            # the trainer waits: its core is the save's meanwhile
            with turns.lent_to_waiter() if turns is not None else nullcontext():
                for e in pending:
                    e.wait()
            overlap.add_wait(time.perf_counter() - t0)

        self._handle = target.register_step_pre_hook(hook)

    def remove(self) -> None:
        self._handle.remove()
