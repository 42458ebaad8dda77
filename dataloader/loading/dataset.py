"""StreamingDataset: a dataset in a store, read window by window in a deterministic order.

Use it through `StreamingLoader` (threads, batches, exact resume), or iterate it directly /
under torch's DataLoader (IterableDataset protocol: one sample dict at a time). Under torch's
DataLoader with worker processes, give the dataset the DataLoader's `num_workers` and
`batch_size` as `torch_workers` and `torch_batch_size`: each worker then reads only the windows
it serves, and the order torch's round-robin delivers is fixed by those two numbers
(order/lanes.py), so states stay exact. (`num_workers` and `batch_size`, their old names here,
are still accepted, with a DeprecationWarning: they mean something else for the loaders.)

Epochs: a pass that delivered all its items is complete, whether or not the consumer drew
StopIteration (Lightning and torch's DataLoader stop after `len()` batches); the next pass
then reads the next epoch. `len()` is always the length of a whole epoch for this rank, also
after a resume mid-epoch (the resumed pass is shorter and ends with StopIteration). Under
torch's DataLoader *with worker processes* the passes run in copies of the dataset, so the
object in the main process cannot see them end: call `set_epoch(epoch)` before each epoch
there (persistent workers, which would keep serving a stale copy, are refused).

Why one module of ~630 lines: one class, whose order, progress, state and iteration protocol
share its fields; the parts that stand alone (order arithmetic, block reads, views, state
checks) live in order/, read/ and state.py.
"""

from __future__ import annotations

import inspect
import math
import operator
import os
import sys
import threading
import warnings
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from typing import Any

import numpy as np

from ckptstore.errors import ObjectNotFoundError
from ckptstore.stores import Store, open_store

from ..errors import DatasetNotFoundError
from ..format.fields import FieldInfo
from ..format.index import check_zarr_metadata, load_index
from ..format.spec import INDEX_KEY
from ..format.validate import INT64_MAX, check_int
from ..order.epoch import (
    BALANCE,
    MAX_WORLD_SIZE,
    EpochOrder,
    Piece,
    advance,
    as_intervals,
    merge_intervals,
    rank_plan,
)
from ..order.full import FullOrder
from ..order.lanes import delivered, remaining, schedule, worker_pieces
from ..read.block_lru import BlockLRU
from ..read.blocks import BlockReader, InlineExecutor
from ..read.cache import ChunkCache
from ..read.metrics import Metrics
from ..read.prefetch import dataset_windows
from ..read.views import GatheredView, PlainView, merge_parts
from .state import Progress, fresh, from_state, to_state

_DEFAULT_WINDOW_BYTES = 32 << 20
SHUFFLE_MODES = ("window", "full")
_RANDOM_BLOCKS = 4  # decoded blocks kept for random access (ds[i])


def detect_topology() -> tuple[int, int]:
    """(rank, world_size) from torch.distributed when it is initialized, else (0, 1).
    torch is only consulted if the program imported it already."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank()), int(dist.get_world_size())
    return 0, 1


def register_with_torch() -> bool:
    """Make torch's DataLoader treat StreamingDataset as an IterableDataset (a virtual
    subclass, so this module never imports torch). Done automatically when a dataset is created
    after torch was imported; call it yourself otherwise. Returns True if torch was found."""
    data = sys.modules.get("torch.utils.data")
    if data is None:
        return False
    if not issubclass(StreamingDataset, data.IterableDataset):
        data.IterableDataset.register(StreamingDataset)
    return True


def describe_field(f: FieldInfo) -> str:
    """`f`'s item type in words: 'int64 scalar', 'uint8 fixed (2, 3)', 'float32 ragged
    ndim 2', 'bytes', 'str'."""
    if f.kind in ("bytes", "str"):
        return f.kind
    dtype = np.dtype(f.dtype).name
    if f.kind == "fixed":
        return f"{dtype} fixed {tuple(f.shape or ())}"
    return f"{dtype} ragged ndim {f.ndim}" if f.kind == "ragged" else f"{dtype} {f.kind}"


def _torch_worker_info() -> Any:
    """torch's WorkerInfo in a DataLoader worker process, else None."""
    data = sys.modules.get("torch.utils.data")
    return data.get_worker_info() if data is not None else None


class Pass:
    """One pass run in this process (the dataset iterated directly, or by StreamingLoader):
    where it started, how many items it delivers in all (`left`), how many it has delivered
    (`count`), whether it ran to its end (`ended`) and whether it was stopped early
    (`stopped`: by close() or a newer iter(); such a pass is interrupted, never complete
    unless it had delivered everything)."""

    def __init__(self, progress: Progress, left: int) -> None:
        self.progress, self.left, self.count = progress, left, 0
        self.ended = False
        self.stopped: str | None = None

    @property
    def complete(self) -> bool:
        return self.ended or self.count >= self.left


def _renamed(obj: object, old: str, old_value: int | None, new: str, value: int,
             default: int) -> int:
    """`value`, or what the caller gave under the parameter's deprecated name `old` (with a
    DeprecationWarning attributed to the code that creates `obj`)."""
    if old_value is None:
        return value
    if value != default:
        raise TypeError(f"give {new} or its deprecated name {old}, not both")
    level, frame = 2, inspect.currentframe()
    frame = frame.f_back if frame is not None else None  # the __init__ that called this
    while frame is not None and frame.f_code.co_name == "__init__" and (
            frame.f_locals.get("self") is obj):
        frame, level = frame.f_back, level + 1
    warnings.warn(
        f"{type(obj).__name__}({old}=...) is deprecated: call it {new} (for the loaders,"
        f" {old} means something else)", DeprecationWarning, stacklevel=level)
    return old_value


class StreamingDataset:
    """A dataset written by `write_dataset`, streamed from any ckptstore store.

    Order: with `shuffle`, blocks are permuted per epoch and items permuted within windows of
    about `shuffle_window` samples (default: ~32 MiB of data); the order depends only on
    (seed, epoch, dataset). `shuffle_mode="full"`: a pseudo-random permutation of all the
    epoch's samples instead (reads amplified, see docs/dataloader.md; decoded blocks are kept
    across windows up to `block_cache_bytes`). Ranks: `rank`/`world_size` default to
    torch.distributed's (else 0/1); each rank gets a contiguous, near-equal share of the
    epoch; `balance` 'drop' or 'pad' makes the shares exactly equal. Reading: `fields`
    selects columns; `cache_dir` (with `cache_limit_bytes`) keeps verified chunks locally;
    `io_threads` and `prefetch_bytes` apply when the dataset is iterated directly: they are
    what `num_workers` and `prefetch_bytes` are to StreamingLoader and MixedLoader, which take
    their own. Under torch's DataLoader with worker processes: `torch_workers` and
    `torch_batch_size` are the DataLoader's `num_workers` and `batch_size` (see the module doc).
    """

    kind = "dataset"
    full_shuffle_supported = True

    def __init__(
        self,
        uri: str | Store,
        *,
        shuffle: bool = False,
        seed: int = 0,
        shuffle_window: int | None = None,
        shuffle_mode: str = "window",
        block_cache_bytes: int = 256 << 20,
        rank: int | None = None,
        world_size: int | None = None,
        balance: str = "none",
        fields: Sequence[str] | None = None,
        cache_dir: str | None = None,
        cache_limit_bytes: int = 16 << 30,
        io_threads: int = 4,
        prefetch_bytes: int = 128 << 20,
        merge_gap: int = 1 << 20,
        max_request: int = 16 << 20,
        torch_workers: int = 0,
        torch_batch_size: int = 1,
        store_options: Mapping[str, Any] | None = None,
        num_workers: int | None = None,
        batch_size: int | None = None,
    ) -> None:
        """`num_workers` and `batch_size` are the deprecated names of `torch_workers` and
        `torch_batch_size` (DeprecationWarning)."""
        torch_workers = _renamed(self, "num_workers", num_workers, "torch_workers",
                                 torch_workers, 0)
        torch_batch_size = _renamed(self, "batch_size", batch_size, "torch_batch_size",
                                    torch_batch_size, 1)
        seed = check_int(seed, "seed", 0, None, ValueError)
        io_threads = check_int(io_threads, "io_threads", 0, None, ValueError)
        prefetch_bytes = check_int(prefetch_bytes, "prefetch_bytes", 0, None, ValueError)
        if shuffle_mode not in SHUFFLE_MODES:
            raise ValueError(f"shuffle_mode must be one of {SHUFFLE_MODES}, got {shuffle_mode!r}")
        if shuffle_mode == "full" and not self.full_shuffle_supported:
            raise ValueError(f"{type(self).__name__} supports shuffle_mode='window' only")
        if balance not in BALANCE:
            raise ValueError(f"balance must be one of {BALANCE}, got {balance!r}")
        if (rank is None) != (world_size is None):
            raise ValueError("give both rank and world_size, or neither")
        if world_size is not None:
            world_size = check_int(world_size, "world_size", 1, MAX_WORLD_SIZE, ValueError)
            rank = check_int(rank, "rank", 0, world_size - 1, ValueError)
        self.store = open_store(uri, **dict(store_options or {}))
        self.uri = self.store.uri  # redacted: safe to show
        try:
            self.index = load_index(self.store)
        except ObjectNotFoundError:
            raise DatasetNotFoundError(
                f"{self.store.uri}: no dataset here ({INDEX_KEY} is missing;"
                " was the write finished?)"
            ) from None
        self.fields: tuple[FieldInfo, ...] = self._select_fields(fields)
        if not self.index.partitions:  # a partition's arrays are checked on its first read
            with ThreadPoolExecutor(8, thread_name_prefix="dataloader-open") as pool:
                check_zarr_metadata(
                    self.store, self.index, self.index.array_paths(self.fields), executor=pool
                )
        self.shuffle, self.seed = bool(shuffle), seed
        self.full_shuffle = self.shuffle and shuffle_mode == "full"
        self._blocks = BlockLRU(check_int(block_cache_bytes, "block_cache_bytes", 0, None,
                                           ValueError))
        self.balance = balance
        self._rank, self._world = rank, world_size
        rows = self.index.rows_per_chunk
        if shuffle_window is None:
            nb = self.index.block_nbytes(self.fields)
            per_block = float(nb.mean()) if len(nb) else 1.0
            k = max(1, round(_DEFAULT_WINDOW_BYTES / max(per_block, 1.0)))
        else:
            if shuffle_window < 1:
                raise ValueError("shuffle_window must be >= 1 sample")
            k = max(1, math.ceil(shuffle_window / rows))
        self.window_blocks = int(min(k, max(1, self.index.num_blocks)))
        self.metrics = Metrics()
        self.cache = ChunkCache(cache_dir, cache_limit_bytes) if cache_dir else None
        self.reader = BlockReader(
            self.store,
            self.index,
            cache=self.cache,
            merge_gap=merge_gap,
            max_request=max_request,
            metrics=self.metrics,
            fields=[f.name for f in self.fields],
        )
        self._block_nbytes = self.index.block_nbytes(self.fields)
        self._block_starts = self.index.block_starts()
        self._block_rows = self.index.block_rows()
        self.io_threads, self.prefetch_bytes = io_threads, prefetch_bytes
        # torch DataLoader's batch size and worker processes (0 or 1: none): with worker
        # processes they fix the delivery order (order/lanes.py)
        self.torch_batch_size = max(1, int(torch_batch_size))
        self.torch_workers = check_int(torch_workers, "torch_workers", 0, 4096, ValueError)
        self._epoch = 0
        self._resume: Progress | None = None
        self._orders: dict[int, Any] = {}
        self._last: Pass | None = None  # the last pass run in this process (direct or loader)
        self._worker_pid: int | None = None  # the torch worker process that iterated this copy
        self._random_blocks: dict[int, Any] = {}  # ds[i]: a few decoded blocks, LRU
        self._random_lock = threading.Lock()
        register_with_torch()

    @property
    def num_workers(self) -> int:
        """Deprecated name of `torch_workers`."""
        warnings.warn("StreamingDataset.num_workers is deprecated: use torch_workers",
                      DeprecationWarning, stacklevel=2)
        return self.torch_workers

    @property
    def batch_size(self) -> int:
        """Deprecated name of `torch_batch_size`."""
        warnings.warn("StreamingDataset.batch_size is deprecated: use torch_batch_size",
                      DeprecationWarning, stacklevel=2)
        return self.torch_batch_size

    def _select_fields(self, names: Sequence[str] | None) -> tuple[FieldInfo, ...]:
        if names is None:
            return self.index.fields
        return tuple(self.index.field(n) for n in names)

    def _array_paths(self) -> set[str]:
        """The arrays the selected fields read (the only ones ever fetched)."""
        return set(self.index.array_paths(self.fields))

    def item_fields(self) -> dict[str, str]:
        """Each field of an item, as `dtype kind [shape]` (sources mixed together must agree)."""
        return {f.name: describe_field(f) for f in self.fields}

    # -- identity and order --------------------------------------------------------------
    @property
    def fingerprint(self) -> str:
        return self.index.fingerprint

    @property
    def num_samples(self) -> int:
        return self.index.num_samples

    @property
    def epoch(self) -> int:
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next pass reads (a loaded state for another epoch is dropped).
        Optional where the passes run in this object (iterated directly, by StreamingLoader or
        by a DataLoader without worker processes): a complete pass moves to the next epoch by
        itself. Required before each epoch under a DataLoader with worker processes."""
        self._epoch = check_int(epoch, "epoch", 0, INT64_MAX, ValueError)
        last, self._last = self._last, None  # an explicit epoch wins over "the pass after a
        # complete one"; a loaded state's position holds until its epoch is left or read out
        if self._resume is not None and (
                self._resume.epoch != epoch or (last is not None and last.complete)):
            self._resume = None

    def _next_epoch(self) -> int:
        """The epoch the next pass reads: the next one after a complete pass."""
        d = self._last
        return self._epoch + 1 if d is not None and d.complete else self._epoch

    def pass_start(self) -> Progress:
        """Move to the epoch the next pass reads (the next one after a complete pass, unless
        `set_epoch` or `load_state_dict` chose since) and return where that pass starts: a
        loaded state's position in its epoch (also when an interrupted pass is run again),
        else the epoch's start."""
        if self._next_epoch() != self._epoch:
            self.set_epoch(self._next_epoch())
        return self.begin(self._epoch)

    def track_pass(self, p: Pass) -> None:
        """Make `p` the pass that `len()`, `state_dict()` and the next pass follow."""
        self._last = p

    def is_last_pass(self, p: Pass | None) -> bool:
        """Whether `p` is still the pass this dataset follows (no set_epoch or state since)."""
        return p is not None and self._last is p

    def epoch_items(self, epoch: int) -> int:
        """Items this rank delivers in a whole pass of `epoch` (what `len()` reports)."""
        rank, world = self.topology()
        total = self.epoch_order(epoch).total
        return rank_plan(total, np.zeros((0, 2), np.int64), world, rank, self.balance).total

    def topology(self) -> tuple[int, int]:
        if self._world is not None:
            return int(self._rank or 0), int(self._world)
        return detect_topology()

    def order_options(self) -> dict[str, Any]:
        """What the global order depends on besides the dataset (kept in states)."""
        options = {
            "mode": "samples",
            "seed": self.seed,
            "shuffle": self.shuffle,
            "window_blocks": self.window_blocks,
        }
        if self.full_shuffle:  # absent for window shuffle: older states stay valid
            options["shuffle_mode"] = "full"
        if self.torch_workers > 1:  # the order torch's worker processes deliver (lanes.py)
            options["torch_workers"] = [self.torch_workers, self.torch_batch_size]
        return options

    def epoch_order(self, epoch: int) -> Any:
        """The epoch's order: an EpochOrder (window shuffle, or none) or a FullOrder."""
        order = self._orders.get(epoch)
        if order is None and self.full_shuffle:
            rows = int(self.index.rows_per_chunk) * self.window_blocks
            order = FullOrder(self.seed, epoch, self.index.num_samples, rows)
            self._keep_order(epoch, order)
        if order is None:
            order = EpochOrder.build(
                self.index.block_rows(),
                seed=self.seed,
                epoch=epoch,
                shuffle=self.shuffle,
                window_blocks=self.window_blocks,
                items_per_window=self._items_fn(),
            )
            self._keep_order(epoch, order)
        return order

    def _keep_order(self, epoch: int, order: Any) -> None:
        """Cache the two most recent epochs' orders (a pass's and the next one's, which
        `len()` asks for after a complete pass), no more: each can be large."""
        self._orders[epoch] = order
        while len(self._orders) > 2:
            self._orders.pop(next(iter(self._orders)))

    def _items_fn(self) -> Any:
        """Items per window, given the windows' block ids (None: one item per sample)."""
        return None

    # -- windows ---------------------------------------------------------------------------
    def window_nbytes(self, order: Any, w: int) -> int:
        if isinstance(order, FullOrder):  # the window's samples, at the average sample size
            per = float(self._block_nbytes.sum()) / max(1, self.index.num_samples)
            return int(per * int(order.window_items[w]))
        return int(self._block_nbytes[order.window_blocks_of(w)].sum())

    def load_window(self, order: Any, w: int, io: Any) -> Any:
        """Fetch and decode window `w` of `order` (requests on executor `io`); return its view."""
        if isinstance(order, FullOrder):
            return self._load_full_window(order, w, io)
        blocks = [int(b) for b in order.window_blocks_of(w)]
        data = self.reader.load_blocks(blocks, io)
        return self.make_view(order, w, blocks, data)

    def _load_full_window(self, order: FullOrder, w: int, io: Any) -> GatheredView:
        """The samples of a full-permutation window: their blocks are read `window_blocks` at
        a time (through the block LRU), and only the window's rows are kept."""
        samples = order.window_samples(w)
        blocks_of = np.searchsorted(self._block_starts, samples, side="right") - 1
        needed = np.unique(blocks_of)
        parts, where = [], []
        for g in range(0, len(needed), self.window_blocks):
            group = [int(b) for b in needed[g : g + self.window_blocks]]
            data = self._blocks.load(group, lambda bs: self.reader.load_blocks(bs, io))
            sel = np.flatnonzero(np.isin(blocks_of, group))
            starts = np.concatenate([[0], np.cumsum([self._block_rows[b] for b in group])])
            slot = np.searchsorted(group, blocks_of[sel])
            local = starts[slot] + (samples[sel] - self._block_starts[blocks_of[sel]])
            view = PlainView(self.fields, group, data, self._block_starts, local.astype(np.int64))
            parts.append(view.gather(0, len(sel)))
            where.append(sel)
        perm = np.empty(len(samples), dtype=np.int64)
        perm[np.concatenate(where)] = np.arange(len(samples), dtype=np.int64)
        return GatheredView(merge_parts(parts), perm)

    def make_view(self, order: EpochOrder, w: int, blocks: list[int], data: list[Any]) -> Any:
        n = int(self.index.block_rows()[blocks].sum())
        return PlainView(
            self.fields, blocks, data, self._block_starts, order.sample_perm(w, n)
        )

    def finish_batch(self, batch: dict[str, Any]) -> dict[str, Any]:
        return batch

    # -- progress and state ----------------------------------------------------------------
    def begin(self, epoch: int) -> Progress:
        """The starting position of a pass over `epoch`: a loaded state's position in that
        epoch, else its start. The loaded state is kept (a pass run again restarts there)
        until `set_epoch` leaves its epoch or a complete pass of it is followed by another."""
        rank, world = self.topology()
        r = self._resume
        if r is None or r.epoch != epoch:
            return fresh(epoch, world, self.balance)
        if r.world_size == world and r.balance == self.balance:
            return r
        return Progress(epoch, self._fold(r), world, self.balance, 0)

    def pieces(self, progress: Progress) -> tuple[EpochOrder, list[Piece], int]:
        """(order, pieces still to deliver, their item count) for this rank."""
        rank, world = self.topology()
        order = self.epoch_order(progress.epoch)
        plan = rank_plan(order.total, progress.base, world, rank, progress.balance)
        segs = plan.after(progress.consumed)
        return order, order.pieces(segs), sum(b - a for a, b in segs)

    def peek_progress(self) -> Progress:
        """Where the next pass would start (without consuming a loaded state)."""
        rank, world = self.topology()
        if self._next_epoch() != self._epoch:
            return fresh(self._next_epoch(), world, self.balance)
        r = self._resume
        if r is not None and r.epoch == self._epoch:
            if r.world_size == world and r.balance == self.balance:
                return r
            return Progress(r.epoch, self._fold(r), world, self.balance, 0)
        return fresh(self._epoch, world, self.balance)

    def _fold(self, r: Progress) -> Any:
        """The items delivered by every rank of `r`'s topology, joined to its base."""
        order = self.epoch_order(r.epoch)
        if self.torch_workers <= 1:
            return advance(order.total, r.base, r.world_size, r.balance, r.consumed)
        done = [r.base]
        for rank in range(r.world_size):  # each rank's delivered items: a schedule prefix
            plan = rank_plan(order.total, r.base, r.world_size, rank, r.balance)
            runs = schedule(order.pieces(plan.after(0)), self.torch_workers, self.torch_batch_size)
            done.append(delivered(runs, r.consumed, order.item_starts))
        return merge_intervals(np.concatenate([as_intervals(d) for d in done]))

    def _lane_pieces(self, progress: Progress, wid: int, nw: int) -> tuple[Any, list[Piece]]:
        """This worker's pieces in the torch-workers order (all of them when nw == 1)."""
        rank, world = self.topology()
        order = self.epoch_order(progress.epoch)
        plan = rank_plan(order.total, progress.base, world, rank, progress.balance)
        runs = schedule(order.pieces(plan.after(0)), self.torch_workers, self.torch_batch_size)
        runs = remaining(runs, progress.consumed)
        if nw > 1:
            return order, worker_pieces(runs, wid, nw)
        return order, [p for _, ps in runs for p in ps]

    def make_state(
        self, progress: Progress, kind: str | None = None, **extra: Any
    ) -> dict[str, Any]:
        return to_state(
            kind or self.kind,
            self.fingerprint,
            self.order_options(),
            progress,
            self.topology()[0],
            **extra,
        )

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """State after the consumer has seen `consumed` items of the current pass (default:
        the number this object yielded itself when iterated directly). A position at the end
        of the epoch (every rank's items consumed) is the start of the next epoch."""
        d = self._last
        if d is not None:
            return self.make_state(self.settled(d.progress, d.count if consumed is None
                                                else consumed))
        return self.make_state(self.settled(self.peek_progress(), consumed or 0))

    def settled(self, start: Progress, count: int, multiple: int = 1) -> Progress:
        """The position `count` items after `start` (every rank in lockstep), or the next
        epoch's start once every rank has delivered all the items of its pass: a resume then
        reads the next epoch, not an empty pass. Rank 0 has the largest share, so its pass
        decides, whichever rank asks (a pass delivers whole `multiple`s of items: a loader's
        batch size with drop_last)."""
        total = self.epoch_order(start.epoch).total
        share = rank_plan(total, start.base, start.world_size, 0, start.balance).total
        left = max(0, share - start.consumed)
        if count >= left - left % multiple:
            return fresh(start.epoch + 1, start.world_size, start.balance)
        return start.with_consumed(start.consumed + count)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from a state of this dataset (any rank's; ranks run in lockstep). Raises
        StateMismatchError for another dataset's state, other ordering options or any
        malformed field; a refused state changes nothing."""
        self.resume(self.check_state(state))

    def check_state(self, state: Mapping[str, Any]) -> Progress:
        """Validate `state` against this dataset and return the position it describes,
        without changing anything (StateMismatchError naming the bad field)."""
        return from_state(
            state,
            ("dataset", "loader"),
            self.fingerprint,
            self.order_options(),
            lambda epoch: self.epoch_order(epoch).total,
        )

    def resume(self, progress: Progress) -> None:
        """Make the next pass start at `progress` (from `check_state`)."""
        self._resume = progress
        self._epoch = progress.epoch
        self._last = None

    # -- IterableDataset protocol ----------------------------------------------------------
    def __len__(self) -> int:
        """Items this rank delivers in a whole epoch (all of the epoch's items on one rank):
        the epoch in progress, or the next after a complete pass. A pass resumed mid-epoch
        delivers fewer (`remaining()`); `len()` stays the epoch's length, which Lightning and
        torch's DataLoader take as the length of every epoch."""
        return self.epoch_items(self._next_epoch())

    def remaining(self) -> int:
        """Items this rank delivers in the next pass (fewer than `len()` after a resume)."""
        return self.pieces(self.peek_progress())[2]

    def __getitem__(self, i: int) -> dict[str, Any]:
        """Sample `i` of the stored dataset (0 <= i < num_samples, negative counts from the
        end), in the selected fields, with ``_index`` = i; independent of shuffle, rank and
        state. Reads (and verifies) the sample's block; the last few blocks read are kept."""
        n = self.index.num_samples
        k = operator.index(i)
        if k < 0:
            k += n
        if not 0 <= k < n:
            raise IndexError(f"sample {i} is out of range (the dataset has {n} samples)")
        b = int(np.searchsorted(self._block_starts, k, side="right")) - 1
        with self._random_lock:
            block = self._random_blocks.pop(b, None)
        if block is None:
            block = self.reader.load_blocks([b], InlineExecutor())[0]
        with self._random_lock:
            self._random_blocks[b] = block  # most recently used last
            while len(self._random_blocks) > _RANDOM_BLOCKS:
                self._random_blocks.pop(next(iter(self._random_blocks)))
        local = np.asarray([k - int(self._block_starts[b])], dtype=np.int64)
        return PlainView(self.fields, [b], [block], self._block_starts, local).sample(0)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """One pass, sample by sample: the epoch after a complete pass, else the current one
        (from a loaded state, if any). In torch worker processes, this worker's share."""
        info = _torch_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        if info is not None:
            if self._worker_pid == os.getpid():
                raise ValueError(
                    "this dataset is iterated again in the same torch DataLoader worker process"
                    " (persistent_workers=True): the main process's set_epoch and"
                    " load_state_dict cannot reach a persistent worker's copy, so its epochs"
                    " would go wrong; use persistent_workers=False"
                )
            self._worker_pid = os.getpid()
        if nw > 1 and nw != self.torch_workers:
            raise ValueError(
                f"this dataset runs in torch DataLoader worker processes (the DataLoader's"
                f" num_workers={nw}): create it with torch_workers={nw} and"
                " torch_batch_size=<the DataLoader's batch_size>, so that its states describe"
                " the order the workers deliver"
            )
        progress = self.pass_start()
        if self.torch_workers > 1:
            order, pieces = self._lane_pieces(progress, wid, nw)
        else:
            order, pieces, _ = self.pieces(progress)
        # counted before each yield: the pass is complete when its last item is handed out
        this = Pass(progress, sum(p.stop - p.start for p in pieces))
        self.track_pass(this)
        windows = dataset_windows(self, order, pieces, self.io_threads, self.prefetch_bytes)
        with closing(windows) as views:
            for piece, view in views:
                for i in range(piece.start, piece.stop):
                    sample = view.sample(i)
                    this.count += 1
                    yield sample

