"""StreamingLoader: batches from a StreamingDataset, prefetched by threads, exactly resumable.

Workers are threads (I/O, xxh3 and numpy release the GIL): `num_workers` request threads plus
two window-assembly threads and one producer thread that cuts batches ahead of the consumer
into a queue of `prefetch_batches`. The rank's item order does not depend on `num_workers`, so
neither does the state. `num_workers=0` runs everything in the consumer's thread.

State semantics: `state_dict()` describes the position after the batches already *returned*
to the caller. Loading it and iterating continues with exactly the next item. One rank's
state is enough for every rank (ranks run in lockstep: same batch size, same number of steps):
it names the next epoch only once rank 0, whose share is the largest, is done too.

Epochs: a pass is complete once it has returned all its items, whether or not the consumer
then drew StopIteration (Lightning stops after `len(loader)` batches). A new `iter()` after a
complete pass moves to the next epoch (and reshuffles); after an unfinished one it restarts
the pass from its starting point (like torch's DataLoader; after `load_state_dict` that is the
loaded position). One pass at a time: `close()`, `load_state_dict` or a newer `iter()` stops a
running pass as interrupted, never complete (its iterator then ends; after a newer `iter()`
drawing from it raises RuntimeError). `len()` is the number of batches of a whole epoch, also
after `load_state_dict` mid-epoch (the resumed pass is shorter and ends with StopIteration),
because Lightning takes `len()` once as the length of every epoch.
`set_epoch` is optional; the loader has no `sampler`, so Lightning never calls it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import closing
from typing import Any

from ..format.validate import check_int
from ..read.metrics import Metrics
from ..read.prefetch import BackgroundIterator, dataset_windows, iter_batches, timed_batches
from ..read.views import Batch, batch_len
from .collate import Collate, resolve
from .dataset import Pass, StreamingDataset


class StreamingLoader:
    """Iterate batches (dicts of numpy arrays / lists, or torch tensors with collate='torch').

    The words mean the same in StreamingLoader and MixedLoader: `batch_size` is the number of
    items in each batch returned; `num_workers` the request threads reading a dataset (0:
    everything in the consumer's thread); `prefetch_bytes` bounds the decoded bytes of windows
    loaded ahead of the one in use, for each dataset read. (A dataset's own `io_threads` and
    `prefetch_bytes` apply only when it is iterated directly.)
    """

    def __init__(
        self,
        dataset: StreamingDataset,
        batch_size: int = 1,
        *,
        num_workers: int = 4,
        prefetch_bytes: int = 256 << 20,
        prefetch_batches: int = 4,
        drop_last: bool = False,
        collate: Collate = "numpy",
    ) -> None:
        if not isinstance(dataset, StreamingDataset):
            raise TypeError(
                "StreamingLoader takes a StreamingDataset (or TokenDataset), got"
                f" {type(dataset).__name__}: open the data with StreamingDataset(uri) first"
            )
        if dataset.torch_workers > 1:
            raise ValueError(
                "this dataset was made for torch's DataLoader worker processes (torch_workers="
                f"{dataset.torch_workers}); StreamingLoader has its own threads: create the"
                " dataset without torch_workers"
            )
        self.dataset = dataset
        self.batch_size = check_int(batch_size, "batch_size", 1, None, ValueError)
        self.num_workers = check_int(num_workers, "num_workers", 0, None, ValueError)
        self.prefetch_bytes = check_int(prefetch_bytes, "prefetch_bytes", 0, None, ValueError)
        self.prefetch_batches = check_int(prefetch_batches, "prefetch_batches", 1, None,
                                          ValueError)
        self.drop_last = bool(drop_last)
        self._collate = resolve(collate)
        self.metrics: Metrics = dataset.metrics
        self._pass: Pass | None = None  # the current (or last) pass
        self._active: tuple[Pass, Any] | None = None  # the running pass and its source

    # -- epochs ------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Make the next pass read `epoch` (optional: a complete pass advances by itself).
        `dataset.set_epoch(epoch)` does the same."""
        self.dataset.set_epoch(epoch)

    @property
    def epoch(self) -> int:
        return self.dataset.epoch

    def _current(self) -> Pass | None:
        """The loader's last pass, if the dataset still follows it (no set_epoch or state
        loaded since, on the loader or on the dataset)."""
        return self._pass if self.dataset.is_last_pass(self._pass) else None

    def __len__(self) -> int:
        """Batches of a whole epoch (the current one, or the next after a complete pass)."""
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    # -- iteration ---------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        """One pass. A pass still running when a new one starts is stopped first (as by
        close(), so the new one restarts at its start point); drawing from the stopped
        iterator then raises RuntimeError, since the rest of its items will not come."""
        ds = self.dataset
        self._stop("iter")
        progress = ds.pass_start()
        order, pieces, left = ds.pieces(progress)
        this = Pass(progress, left - left % self.batch_size if self.drop_last else left)
        ds.track_pass(this)
        self._pass = this
        nw, budget = self.num_workers, self.prefetch_bytes

        def produce(stop: threading.Event | None) -> Iterator[Batch]:
            with closing(dataset_windows(ds, order, pieces, nw, budget, stop)) as views:
                yield from iter_batches(views, self.batch_size, self.drop_last)

        source: Any = (
            BackgroundIterator(produce, self.prefetch_batches) if nw > 0 else produce(None)
        )
        self._active = (this, source)
        try:
            for batch in timed_batches(source, self.metrics, batch_len):
                # counted before the yield: returning the last batch completes the pass
                this.count += batch_len(batch)
                yield self._collate(ds.finish_batch(batch))
            if this.stopped is None:
                this.ended = True
            elif this.stopped == "iter" and not this.complete:
                raise RuntimeError(
                    "this StreamingLoader pass was stopped by a newer iter() of the same loader"
                    " (one pass at a time: finish or close an iterator before making another)"
                )
        finally:
            if hasattr(source, "close"):
                source.close()
            if self._active is not None and self._active[1] is source:
                self._active = None

    def close(self) -> None:
        """Stop a pass in progress (its threads are stopped and joined). The pass counts as
        interrupted, as after `break`: the state is the position after the batches returned,
        the next iter() restarts the pass from its start point, and the stopped iterator
        ends (StopIteration)."""
        self._stop("close")

    def _stop(self, why: str) -> None:
        active, self._active = self._active, None
        if active is not None:
            this, source = active
            this.stopped = this.stopped or why
            if hasattr(source, "close"):
                source.close()

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Small JSON-able state: the position after the batches returned so far (the next
        epoch's start once every rank has returned all its batches of the epoch, so any
        rank's state will do)."""
        ds = self.dataset
        p = self._current()
        if p is None:
            progress = ds.settled(ds.peek_progress(), 0)
        else:
            progress = ds.settled(p.progress, p.count, self.batch_size if self.drop_last else 1)
        return ds.make_state(progress, kind="loader", batch_size=self.batch_size)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from `state` (refused with StateMismatchError if it is another dataset's).
        A pass in progress is stopped (as by close())."""
        progress = self.dataset.check_state(state)
        self.close()
        self.dataset.resume(progress)

    def stats(self) -> dict[str, Any]:
        """Metrics snapshot: samples/s, bytes/s, consumer wait on I/O, requests, cache hits."""
        return self.metrics.snapshot()
