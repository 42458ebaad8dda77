"""Reading N-D regions of stored tensors: a DTensor's local shard of any placement, or any
tensor whose chunks form an N-D grid (docs/format.md, chunk_shape).

For each region only the chunks overlapping it are read, each verified by the reader like any
other chunk. A chunk that covers whole rows of the destination (its extents on dims 1.. equal
the region's, and it lies inside the region) is read straight into the destination bytes;
any other is read whole into a scratch buffer and its overlap copied into place. Scratch
buffers are bounded: regions are read in batches of at most `max_scratch_bytes` of them.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

import numpy as np

from ..format.manifest import TensorEntry
from .reader import CheckpointReader, ReadTarget

MiB = 1 << 20


@dataclass(frozen=True)
class _Copy:
    """Read chunk entry `one` into scratch, then `dest[dst] = scratch (as the chunk)[src]`."""

    one: TensorEntry
    chunk_shape: tuple[int, ...]
    dest: np.ndarray  # the region's bytes shaped (*local_shape, itemsize)
    dst: tuple[slice, ...]
    src: tuple[slice, ...]


def _single_chunk(entry: TensorEntry, index: int, extents: tuple[int, ...]) -> TensorEntry:
    """An entry describing chunk `index` alone, as a tensor of its own shape."""
    return replace(entry, shape=extents, chunk_rows=max(1, extents[0]) if extents else 1,
                   chunks=(entry.chunks[index],), storage=None, chunk_shape=None)


class RegionReads:
    """Collects regions to fill, then `run()` reads them (see the module docstring)."""

    def __init__(self, reader: CheckpointReader, max_scratch_bytes: int = 256 * MiB) -> None:
        self.reader = reader
        self.max_scratch_bytes = max_scratch_bytes
        self._batches: list[tuple[list[ReadTarget], list[_Copy]]] = [([], [])]
        self._scratch = 0

    def add(self, entry: TensorEntry, buffer: np.ndarray, local_shape: tuple[int, ...],
            offset: tuple[int, ...] | None) -> None:
        """Fill `buffer` (flat uint8, C order) with the elements of `entry` in the region of
        shape `local_shape` starting at global index `offset` (None: the whole tensor)."""
        itemsize = entry.dtype.itemsize
        if not entry.shape:  # 0-d: one chunk, the whole tensor
            self._batches[-1][0].append(ReadTarget(entry, buffer))
            return
        offset = offset if offset is not None else (0,) * len(entry.shape)
        region = [(o, o + n) for o, n in zip(offset, local_shape)]
        dest = buffer.reshape(*local_shape, itemsize)
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
            one = _single_chunk(entry, index, extents)
            whole_rows = inter == list(creg) and extents[1:] == tuple(local_shape[1:])
            if whole_rows:  # contiguous in the destination: read in place
                row = math.prod(local_shape[1:]) * itemsize
                lo = (creg[0][0] - offset[0]) * row
                self._batches[-1][0].append(ReadTarget(one, buffer[lo : lo + extents[0] * row]))
                continue
            dst = tuple(slice(a - o, b - o) for (a, b), o in zip(inter, offset))
            src = tuple(slice(a - s, b - s) for (a, b), (s, _e) in zip(inter, creg))
            self._batches[-1][1].append(_Copy(one, extents, dest, dst, src))
            self._scratch += one.nbytes
            if self._scratch >= self.max_scratch_bytes:
                self._flush_later()

    def _flush_later(self) -> None:
        self._batches.append(([], []))
        self._scratch = 0

    def run(self) -> None:
        """Read every region added; raises the reader's IntegrityError on any bad chunk."""
        batches, self._batches = self._batches, [([], [])]
        self._scratch = 0
        for targets, copies in batches:
            scratch = [np.empty(cp.one.nbytes, np.uint8) for cp in copies]
            wanted = targets + [ReadTarget(cp.one, buf) for cp, buf in zip(copies, scratch)]
            if wanted:
                self.reader.read_tensors(wanted)
            for cp, buf in zip(copies, scratch):
                cp.dest[cp.dst] = buf.reshape(*cp.chunk_shape, -1)[cp.src]
