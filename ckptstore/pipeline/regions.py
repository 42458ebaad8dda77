"""Reading N-D regions of stored tensors: a DTensor's local shard of any placement, or any
tensor whose chunks form an N-D grid (docs/format.md, chunk_shape).

For each region only the chunks overlapping it are read, each verified by the reader like any
other chunk. A chunk that covers whole rows of the destination (its extents on dims 1.. equal
the region's, and it lies inside the region) is read straight into the destination bytes;
any other is read whole into a scratch buffer and its overlap copied into place, one chunk
per job on the reader's number of threads, so at most that many scratch chunks exist at once.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ..concurrency import completed
from ..format.manifest import LazyChunks, TensorEntry, chunks_meeting
from ..format.regions import Box, Runs, boxes
from ..format.segments import prefetch_chunks
from .reader import CheckpointReader, ReadTarget


@dataclass(frozen=True)
class _Copy:
    """Read chunk entry `one` into scratch once, then `dest[dst] = scratch (as the
    chunk)[src]` for every (dst, src) of `parts` (one per box of the region it overlaps)."""

    one: TensorEntry
    chunk_shape: tuple[int, ...]
    dest: np.ndarray  # the region's bytes shaped (*local_shape, itemsize)
    parts: list[tuple[tuple[slice, ...], tuple[slice, ...]]]


class RegionReads:
    """Collects regions to fill, then `run()` reads them (see the module docstring)."""

    def __init__(self, reader: CheckpointReader) -> None:
        self.reader = reader
        self._pending: list[tuple[TensorEntry, np.ndarray, tuple[int, ...], Runs | None]] = []
        self._direct: list[ReadTarget] = []
        self._copies: list[_Copy] = []

    def add(self, entry: TensorEntry, buffer: np.ndarray, local_shape: tuple[int, ...],
            runs: Runs | None) -> None:
        """Fill `buffer` (flat uint8, C order, of `local_shape`) with the elements of `entry`
        that `runs` place there (None: the whole tensor), when `run()` is called."""
        self._pending.append((entry, buffer, local_shape, runs))

    def _plan(self, entry: TensorEntry, buffer: np.ndarray, local_shape: tuple[int, ...],
              runs: Runs | None) -> None:
        if not entry.shape:  # 0-d: one chunk, the whole tensor
            self._direct.append(ReadTarget(entry, buffer))
            return
        parts = _boxes(entry, runs)
        dest = buffer.reshape(*local_shape, entry.dtype.itemsize)
        in_place = len(parts) == 1 and not any(parts[0].local)
        copies: dict[int, _Copy] = {}  # by chunk: a chunk several boxes overlap is read once
        for box in parts:
            self._add_box(entry, buffer, dest, local_shape, box, in_place, copies)
        self._copies.extend(copies.values())

    def _add_box(self, entry: TensorEntry, buffer: np.ndarray, dest: np.ndarray,
                 local_shape: tuple[int, ...], box: Box, in_place: bool,
                 copies: dict[int, _Copy]) -> None:
        itemsize = entry.dtype.itemsize
        region = list(zip(box.start, box.stop))
        block = entry.block_shape()
        per_dim = [range(lo // c, -(-hi // c)) for (lo, hi), c in zip(region, block)]
        grid = [max(1, -(-n // c)) for n, c in zip(entry.shape, block)]
        for pos in itertools.product(*per_dim):
            index = 0
            for p, g in zip(pos, grid):
                index = index * g + p
            creg = entry.chunk_region(index)
            extents = tuple(b - a for a, b in creg)
            inter = [(max(a, lo), min(b, hi)) for (a, b), (lo, hi) in zip(creg, region)]
            if any(a >= b for a, b in inter):
                continue
            if in_place and inter == list(creg) and extents[1:] == tuple(local_shape[1:]):
                row = math.prod(local_shape[1:]) * itemsize  # whole local rows: read in place
                lo = (creg[0][0] - box.start[0]) * row
                self._direct.append(ReadTarget(entry.chunk_alone(index, extents),
                                               buffer[lo : lo + extents[0] * row]))
                continue
            dst = tuple(slice(a - s + loc, b - s + loc)
                        for (a, b), s, loc in zip(inter, box.start, box.local))
            src = tuple(slice(a - s, b - s) for (a, b), (s, _e) in zip(inter, creg))
            if index not in copies:
                copies[index] = _Copy(entry.chunk_alone(index, extents), extents, dest, [])
            copies[index].parts.append((dst, src))

    def run(self) -> None:
        """Read every region added; raises the reader's IntegrityError on any bad chunk."""
        pending, self._pending = self._pending, []
        prefetch_chunks(_lazy_chunks(pending), self.reader.options.workers)  # parted index
        for args in pending:
            self._plan(*args)
        direct, self._direct = self._direct, []
        copies, self._copies = self._copies, []
        if direct:
            self.reader.read_tensors(direct)
        if not copies:
            return
        copies.sort(key=lambda cp: -cp.one.nbytes)
        workers = min(self.reader.options.workers, len(copies))
        with cf.ThreadPoolExecutor(workers, thread_name_prefix="ckpt-region") as pool:
            for _ in completed(pool.submit(self._read_copy, cp) for cp in copies):
                pass

    def _read_copy(self, cp: _Copy) -> None:
        scratch = np.empty(cp.one.nbytes, np.uint8)
        self.reader.read_tensors([ReadTarget(cp.one, scratch)])
        block = scratch.reshape(*cp.chunk_shape, -1)
        for dst, src in cp.parts:
            cp.dest[dst] = block[src]


def _boxes(entry: TensorEntry, runs: Runs | None) -> list[Box]:
    """The boxes `runs` place in the local tensor (None: the whole tensor, one box)."""
    ndim = len(entry.shape)
    return boxes(runs) if runs is not None else [Box((0,) * ndim, (0,) * ndim, entry.shape)]


def _lazy_chunks(pending: list[tuple[TensorEntry, np.ndarray, tuple[int, ...], Runs | None]]
                 ) -> Iterator[tuple[TensorEntry, int]]:
    """(entry, chunk index) of every chunk the regions meet whose reference is read where it
    is used (LazyChunks: a parted segment's)."""
    for entry, _buffer, _shape, runs in pending:
        if entry.shape and isinstance(entry.chunks, LazyChunks):
            for box in _boxes(entry, runs):
                region = list(zip(box.start, box.stop))
                for index in chunks_meeting(entry.shape, entry.block_shape(), region):
                    yield entry, index
