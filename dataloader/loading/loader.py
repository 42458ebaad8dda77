"""StreamingLoader: batches from a StreamingDataset, prefetched by threads, exactly resumable.

Workers are threads (I/O, xxh3 and numpy release the GIL): `num_workers` request threads plus
two window-assembly threads and one producer thread that cuts batches ahead of the consumer
into a queue of `prefetch_batches`. The rank's item order does not depend on `num_workers`, so
neither does the state. `num_workers=0` runs everything in the consumer's thread.

State semantics: `state_dict()` describes the position after the batches already *returned*
to the caller. Loading it and iterating continues with exactly the next item. One rank's
state is enough for every rank (ranks run in lockstep: same batch size, same number of steps).

Epochs: a pass is complete once it has returned all its items, whether or not the consumer
then drew StopIteration (Lightning stops after `len(loader)` batches). A new `iter()` after a
complete pass moves to the next epoch (and reshuffles); after an unfinished one it restarts
the pass from its starting point (like torch's DataLoader). `len()` is the number of batches
of a whole epoch, also after `load_state_dict` mid-epoch (the resumed pass is shorter and ends
with StopIteration), because Lightning takes `len()` once as the length of every epoch.
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
from .dataset import StreamingDataset
from .state import Progress, fresh


class _Pass:
    """One pass: its start, the items it returns in all (`expected`), those returned so far
    (`count`), and whether it ran to StopIteration (`ended`)."""

    def __init__(self, progress: Progress, expected: int) -> None:
        self.progress, self.expected, self.count, self.ended = progress, expected, 0, False

    @property
    def complete(self) -> bool:
        return self.ended or self.count >= self.expected


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
        if getattr(dataset, "torch_workers", 0) > 1:
            raise ValueError(
                "this dataset was made for torch's DataLoader worker processes (torch_workers="
                f"{dataset.torch_workers}); StreamingLoader has its own threads: create the"
                " dataset without torch_workers"
            )
        self.dataset = dataset
        self.batch_size = check_int(batch_size, "batch_size", 1, None, ValueError)
        self.num_workers = int(num_workers)
        self.prefetch_bytes = int(prefetch_bytes)
        self.prefetch_batches = int(prefetch_batches)
        self.drop_last = bool(drop_last)
        self._collate = resolve(collate)
        self.metrics: Metrics = dataset.metrics
        self._pass: _Pass | None = None  # the current (or last) pass
        self._active: Any = None
        self._lock = threading.Lock()

    # -- epochs ------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Make the next pass read `epoch` (optional: a complete pass advances by itself)."""
        self.dataset.set_epoch(epoch)
        self._pass = None

    @property
    def epoch(self) -> int:
        return self.dataset.epoch

    def _complete(self) -> bool:
        return self._pass is not None and self._pass.complete

    def __len__(self) -> int:
        """Batches of a whole epoch (the current one, or the next after a complete pass)."""
        n = self.dataset.epoch_items(self.epoch + 1 if self._complete() else self.epoch)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    # -- iteration ---------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        ds = self.dataset
        self.close()
        if self._complete():
            ds.set_epoch(ds.epoch + 1)
        progress = ds.begin(ds.epoch)
        order, pieces, left = ds.pieces(progress)
        this = _Pass(progress, left - left % self.batch_size if self.drop_last else left)
        self._pass = this
        nw, budget = self.num_workers, self.prefetch_bytes

        def produce(stop: threading.Event | None) -> Iterator[Batch]:
            with closing(dataset_windows(ds, order, pieces, nw, budget, stop)) as views:
                yield from iter_batches(views, self.batch_size, self.drop_last)

        source: Any = (
            BackgroundIterator(produce, self.prefetch_batches) if nw > 0 else produce(None)
        )
        self._active = source
        try:
            for batch in timed_batches(source, self.metrics, batch_len):
                # counted before the yield: returning the last batch completes the pass
                this.count += batch_len(batch)
                yield self._collate(ds.finish_batch(batch))
            this.ended = True
        finally:
            if hasattr(source, "close"):
                source.close()
            if self._active is source:
                self._active = None

    def close(self) -> None:
        """Stop a pass in progress (its threads are stopped and joined)."""
        active, self._active = self._active, None
        if active is not None and hasattr(active, "close"):
            active.close()

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Small JSON-able state: the position after the batches returned so far."""
        ds = self.dataset
        p = self._pass
        if p is not None and p.complete:
            _, world = ds.topology()
            progress = fresh(ds.epoch + 1, world, ds.balance)
        elif p is not None:
            progress = p.progress.with_consumed(p.progress.consumed + p.count)
        else:
            progress = ds.peek_progress()
        return ds.make_state(progress, kind="loader", batch_size=self.batch_size)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from `state` (refused with StateMismatchError if it is another dataset's)."""
        self.close()
        self.dataset.load_state_dict(state)
        self._pass = None

    def stats(self) -> dict[str, Any]:
        """Metrics snapshot: samples/s, bytes/s, consumer wait on I/O, requests, cache hits."""
        return self.metrics.snapshot()
