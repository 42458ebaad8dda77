"""Mixing several datasets with weights, deterministically and resumably.

Item i of the mixed stream comes from source ``choice(i)``, drawn with the given weights from a
generator seeded by (seed, i // 4096): the same on every rank and independent of workers and
timing. Because every rank makes the same choices, each source is consumed in lockstep across
ranks, so each source's own state (see order/epoch.py) stays exact, and the mixture's state is just
its position plus one state per source. Each source keeps its own epochs: with
``stopping='never'`` a source that runs out starts its next epoch; with ``'first_exhausted'``
the pass ends before the first item whose source has run out, and the next pass begins with
that item, from that source's next epoch (decided by the stream position and the sources'
states alone, so a resumed run ends its passes where the uninterrupted run did).

All sources must yield the same fields (names, kinds, dtypes and shapes: checked when the
loader is made, since a batch column holds items of every source); batches get an extra
``_source`` column (int64, which source each item came from).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import closing
from typing import Any

import numpy as np

from ..errors import StateMismatchError
from ..format.validate import INT64_MAX, check_int, is_int, short_repr
from ..order.epoch import rng_for
from ..read.metrics import Metrics
from ..read.prefetch import BackgroundIterator, dataset_windows, iter_batches
from ..read.views import Batch, batch_len, merge_parts, slice_batch
from .collate import Collate, resolve
from .dataset import StreamingDataset
from .state import STATE_FORMAT, STATE_VERSION, Progress, check_header

_TAG_MIX = 0x313C
_CHOICE_BLOCK = 4096


class _Source:
    """One dataset's stream of raw item batches, with a buffer the mixer takes items from."""

    def __init__(
        self, ds: StreamingDataset, num_workers: int, prefetch_bytes: int, chunk: int
    ) -> None:
        self.ds, self.nw, self.budget, self.chunk = ds, num_workers, prefetch_bytes, chunk
        self.progress: Progress | None = None
        self.taken = 0  # items handed to the mixture since `progress`
        self.buffer: list[Batch] = []
        self.offset = 0
        self.it: Any = None
        self.exhausted = False

    def start(self) -> int:
        """Open the source's current pass (a loaded state's position, or where the last pass
        stopped); return the items it has left (0: the source has run out)."""
        ds = self.ds
        self.progress = ds.begin(ds.epoch)
        order, pieces, left = ds.pieces(self.progress)
        self.taken, self.buffer, self.offset, self.exhausted = 0, [], 0, False

        def produce(stop: threading.Event | None) -> Iterator[Batch]:
            with closing(dataset_windows(ds, order, pieces, self.nw, self.budget, stop)) as views:
                yield from iter_batches(views, self.chunk, False)

        self.it = BackgroundIterator(produce, 2) if self.nw > 0 else produce(None)
        return left

    def roll(self) -> None:
        """Start the source's next epoch (ValueError if it has no items for this rank)."""
        self.close()
        self.ds.set_epoch(self.ds.epoch + 1)
        if self.start() == 0:
            raise ValueError(f"dataset {self.ds.uri} has no items for this rank")

    def available(self) -> int:
        return sum(batch_len(b) for b in self.buffer) - self.offset

    def fill(self, need: int) -> int:
        """Buffer at least `need` items if the epoch has them; return how many are available."""
        while self.available() < need and not self.exhausted:
            try:
                self.buffer.append(next(self.it))
            except StopIteration:
                self.exhausted = True
        return self.available()

    def take(self, n: int) -> Batch | None:
        parts: list[Batch] = []
        while n > 0:
            head = self.buffer[0]
            k = min(n, batch_len(head) - self.offset)
            parts.append(slice_batch(head, self.offset, self.offset + k))
            self.offset += k
            n -= k
            self.taken += k
            if self.offset == batch_len(head):
                self.buffer.pop(0)
                self.offset = 0
        return merge_parts(parts) if parts else None

    def state(self) -> dict[str, Any]:
        assert self.progress is not None
        return self.ds.make_state(self.progress.with_consumed(self.progress.consumed + self.taken))

    def close(self) -> None:
        if self.it is not None and hasattr(self.it, "close"):
            self.it.close()
        self.it = None


class MixedLoader:
    """Batches mixing `datasets` with `weights` (normalised). See the module doc.

    `batch_size`, `num_workers` and `prefetch_bytes` mean what they mean for StreamingLoader,
    for each source: every dataset is read by its own `num_workers` request threads within its
    own `prefetch_bytes` of windows loaded ahead.
    """

    def __init__(
        self,
        datasets: Sequence[StreamingDataset],
        weights: Sequence[float],
        batch_size: int,
        *,
        seed: int = 0,
        stopping: str = "first_exhausted",
        num_workers: int = 2,
        prefetch_bytes: int = 128 << 20,
        drop_last: bool = False,
        collate: Collate = "numpy",
    ) -> None:
        if len(datasets) == 0 or len(datasets) != len(weights):
            raise ValueError("give one weight per dataset (at least one dataset)")
        w = np.asarray(weights, dtype=np.float64)
        if np.any(~np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
            raise ValueError(
                f"weights must be non-negative with a positive sum, got {list(weights)}"
            )
        if stopping not in ("first_exhausted", "never"):
            raise ValueError("stopping must be 'first_exhausted' or 'never'")
        _check_same_fields(datasets)
        seed = check_int(seed, "seed", 0, None, ValueError)
        if any(getattr(d, "torch_workers", 0) > 1 for d in datasets):
            raise ValueError(
                "a dataset made for torch's DataLoader worker processes (torch_workers > 1)"
                " cannot be mixed: MixedLoader has its own threads"
            )
        self.datasets = list(datasets)
        self.weights = (w / w.sum()).tolist()
        self.batch_size = check_int(batch_size, "batch_size", 1, None, ValueError)
        self.seed, self.stopping = seed, stopping
        self.drop_last = drop_last
        self._collate = resolve(collate)
        chunk = max(16, min(256, self.batch_size))
        self._sources = [_Source(d, num_workers, prefetch_bytes, chunk) for d in datasets]
        self.position = 0
        self.metrics = Metrics()
        self._choices: tuple[int, np.ndarray] | None = None

    def choices(self, start: int, stop: int) -> np.ndarray:
        """Source of each mixed item in [start, stop) (the same on every rank)."""
        out = np.empty(stop - start, dtype=np.int64)
        i = start
        while i < stop:
            blk = i // _CHOICE_BLOCK
            if self._choices is None or self._choices[0] != blk:
                rng = rng_for(self.seed, _TAG_MIX, blk)
                self._choices = (
                    blk,
                    rng.choice(len(self.weights), size=_CHOICE_BLOCK, p=self.weights),
                )
            j = min(stop, (blk + 1) * _CHOICE_BLOCK)
            out[i - start : j - start] = self._choices[1][
                i - blk * _CHOICE_BLOCK : j - blk * _CHOICE_BLOCK
            ]
            i = j
        return out

    def __iter__(self) -> Iterator[Any]:
        """Continue the mixed stream from the current position (a pass ends when a source
        runs out with stopping='first_exhausted'; with 'never' it does not end)."""
        for s in self._sources:
            if s.progress is not None:  # continue where the last pass stopped
                st = s.state()
                s.close()
                s.ds.load_state_dict(st)
            if s.start() == 0 and self.stopping == "never":
                s.roll()
        first = self.position
        try:
            while True:
                c = self.choices(self.position, self.position + self.batch_size)
                whole = self._whole(c, self.position == first)
                cut = len(c)
                early: dict[int, Batch | None] = {}
                for k, s in enumerate(self._sources):
                    need = int((c == k).sum())
                    if need == 0:
                        continue
                    have = s.fill(need)
                    if have < need and whole:
                        early[k] = s.take(have)  # finish the old epoch inside this batch
                        while have < need:
                            s.roll()
                            got = s.fill(need - have)
                            if got >= need - have:
                                break
                            extra = s.take(got)
                            early[k] = merge_parts([p for p in (early[k], extra) if p is not None])
                            have += got
                    elif have < need:
                        cut = min(cut, int(np.flatnonzero(c == k)[have]))
                c = c[:cut]
                if cut == 0 or (cut < self.batch_size and self.drop_last):
                    return
                parts: dict[int, Batch | None] = {}
                for k, s in enumerate(self._sources):
                    n = int((c == k).sum())
                    pre = early.get(k)
                    rest = s.take(n - (batch_len(pre) if pre is not None else 0))
                    pieces = [p for p in (pre, rest) if p is not None]
                    parts[k] = merge_parts(pieces) if pieces else None
                batch = _interleave(c, parts)
                self.position += cut
                self.metrics.add_batch(cut, 0.0)
                yield self._collate(self.datasets[0].finish_batch(batch))
                if cut < self.batch_size:
                    return
        finally:
            for s in self._sources:
                s.close()

    def _whole(self, c: np.ndarray, first: bool) -> bool:
        """Whether the batch of choices `c` is taken whole, a source that runs out going on
        with its next epoch inside it: always with 'never'; with 'first_exhausted' only the
        first batch of a pass with drop_last. Otherwise a pass ends before the first item
        whose source ran out, and the next pass begins with that item, from the source's
        next epoch. Decided by the position alone, so a resumed run cuts where the
        uninterrupted one did, and no pass is empty."""
        if self.stopping == "never" or (first and self.drop_last):
            return True
        if first:
            head = self._sources[int(c[0])]
            if head.fill(1) == 0:
                head.roll()
        return False

    def state_dict(self) -> dict[str, Any]:
        for s in self._sources:
            if s.progress is None:
                s.progress = s.ds.peek_progress()
        return {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "kind": "mixed",
            "seed": self.seed,
            "weights": list(self.weights),
            "position": self.position,
            "sources": [s.state() for s in self._sources],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from a mixed-loader state. Every field, each source's state included, is
        checked before anything changes (StateMismatchError naming the field)."""
        state = check_header(state, ("mixed",))
        seed = state.get("seed")
        if not is_int(seed) or seed != self.seed:
            raise StateMismatchError(
                f"mixed-loader state was made with another seed ({short_repr(seed)})"
            )
        self._check_weights(state.get("weights"))
        position = check_int(
            state.get("position"),
            "mixed-loader state: 'position'",
            0,
            INT64_MAX,
            StateMismatchError,
        )
        sources = state.get("sources")
        if not isinstance(sources, list | tuple) or len(sources) != len(self._sources):
            raise StateMismatchError(
                f"mixed-loader state: 'sources' must be a list of {len(self._sources)} states"
            )
        progress = []
        for i, (s, st) in enumerate(zip(self._sources, sources, strict=True)):
            try:
                progress.append(s.ds.check_state(st))
            except StateMismatchError as exc:
                raise StateMismatchError(f"mixed-loader state, source {i}: {exc}") from None
        for s, p in zip(self._sources, progress, strict=True):
            s.close()
            s.ds.resume(p)
            s.progress, s.taken, s.buffer, s.offset, s.exhausted = None, 0, [], 0, False
        self.position = position

    def _check_weights(self, weights: Any) -> None:
        """A state's weights: one finite real number per source, equal to ours."""
        ok = (
            isinstance(weights, list | tuple)
            and len(weights) == len(self.weights)
            and all(
                isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)
                for x in weights
            )
        )
        if not ok or not np.allclose(weights, self.weights):
            raise StateMismatchError(
                f"mixed-loader state was made with other weights ({short_repr(weights)})"
            )

    def stats(self) -> dict[str, Any]:
        return self.metrics.snapshot()


def _check_same_fields(datasets: Sequence[StreamingDataset]) -> None:
    """Mixed datasets must have the same fields, each of the same kind, dtype and shape (a
    batch column holds items of every source: nothing is cast); ValueError naming the field."""
    for d in datasets:
        if not isinstance(d, StreamingDataset):
            raise TypeError(
                "MixedLoader takes StreamingDatasets (or TokenDatasets), got"
                f" {type(d).__name__}: open the data with StreamingDataset(uri) first"
            )
    names = [sorted(f.name for f in d.fields) for d in datasets]
    if any(n != names[0] for n in names) or len({type(d) for d in datasets}) != 1:
        raise ValueError(f"mixed datasets must have the same fields and mode, got {names}")
    first = datasets[0].item_fields()
    for i, d in enumerate(datasets[1:], 1):
        for name, what in d.item_fields().items():
            if what != first[name]:
                raise ValueError(
                    f"mixed datasets must have the same field types: field {name!r} is"
                    f" {first[name]} in dataset 0 ({datasets[0].uri}) but {what} in dataset"
                    f" {i} ({d.uri})"
                )


def _interleave(choice: np.ndarray, parts: dict[int, Batch | None]) -> Batch:
    present = {k: p for k, p in parts.items() if p is not None}
    first = next(iter(present.values()))
    out: Batch = {}
    masks = {k: choice == k for k in present}
    for key, val in first.items():
        if isinstance(val, np.ndarray):
            arr = np.empty((len(choice), *val.shape[1:]), dtype=val.dtype)
            for k, p in present.items():
                if p[key].shape[1:] != val.shape[1:]:
                    raise ValueError(f"field {key!r} has different shapes across mixed datasets")
                arr[masks[k]] = p[key]
            out[key] = arr
        else:
            lst: list[Any] = [None] * len(choice)
            for k, p in present.items():
                for pos, v in zip(np.flatnonzero(masks[k]), p[key], strict=True):
                    lst[pos] = v
            out[key] = lst
    out["_source"] = choice.copy()
    return out
