"""Reading what DCP's read items ask for straight into the tensors its planner resolves.

A read item names a box of a saved tensor (the saved chunk's offset plus `storage_offsets`,
`lengths`) and a destination view of that box's shape (`planner.resolve_tensor`). Every
box is read with the project's region reads (pipeline/regions.py): only the ckptstore
chunks overlapping it, each verified against its digest by the CheckpointReader; chunks that
hold whole rows of a contiguous destination go straight into its memory, others through one
scratch chunk at a time. Destinations that are strided views (a box narrowed on dim >= 1)
get each overlapping chunk copied into the view in place. Only a destination of another
dtype or device goes through a temporary of the box's size, copied with `copy_` (as DCP's
FileSystemReader does). No full-tensor temporaries either way.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable
from typing import Any

import numpy as np

from ..deps import missing

try:
    import torch
except ModuleNotFoundError as _exc:
    raise missing(_exc) from None

from ..concurrency import completed
from ..errors import CkptStoreError
from ..format.manifest import TensorEntry
from ..format.regions import block_runs
from ..format.torch_types import byte_view, dtype_name, raw_numpy, torch_dtype
from ..pipeline.reader import CheckpointReader, ReadTarget
from ..pipeline.regions import RegionReads

Slices = tuple[slice, ...]


class TensorReads:
    """Collects boxes to read (`add`), then reads them all in parallel (`run`)."""

    def __init__(self, reader: CheckpointReader) -> None:
        self.reader = reader
        self.regions = RegionReads(reader)
        self.targets: list[ReadTarget] = []  # whole rows of row-block tensors, contiguous
        #: (entry, chunk index) -> [(typed destination view, dst slices, src slices)]
        self.strided: dict[tuple[int, int], tuple[TensorEntry, list[tuple[Any, Slices,
                                                                          Slices]]]] = {}
        self.after: list[Callable[[], None]] = []
        self.bytes = 0

    def add(self, entry: TensorEntry, start: tuple[int, ...], lengths: tuple[int, ...],
            dest: torch.Tensor) -> None:
        """Fill `dest` (shape `lengths`) with the box of `entry` starting at `start`."""
        key = entry.key
        if tuple(dest.shape) != lengths:
            raise CkptStoreError(f"{key}: the destination holds {list(dest.shape)}, the read "
                                 f"item asks for {list(lengths)}")
        if len(start) != len(entry.shape) or any(
                s < 0 or s + n > g for s, n, g in zip(start, lengths, entry.shape)):
            raise CkptStoreError(f"{key}: the box {list(lengths)} at {list(start)} is outside "
                                 f"the stored shape {list(entry.shape)}")
        if dest.numel() == 0:
            return
        self.bytes += dest.numel() * entry.dtype.itemsize
        target = dest.detach()
        same = (target.device.type == "cpu" and dtype_name(target.dtype) == entry.dtype.name
                and not target.is_conj() and not target.is_neg())
        if same:
            view = byte_view(target)
            if view is not None:
                self._add_contiguous(entry, view, start, lengths)
                return
            self._add_strided(entry, raw_numpy(target), start, lengths)
            return
        tmp = torch.empty(lengths, dtype=torch_dtype(entry.dtype.name))
        tmp_view = byte_view(tmp)
        assert tmp_view is not None
        self._add_contiguous(entry, tmp_view, start, lengths)

        def finish(target: torch.Tensor = target, tmp: torch.Tensor = tmp) -> None:
            with torch.no_grad():
                target.copy_(tmp)
        self.after.append(finish)

    def _add_contiguous(self, entry: TensorEntry, buffer: Any, start: tuple[int, ...],
                        lengths: tuple[int, ...]) -> None:
        """Whole rows of a row-block tensor (the common case: a tensor read whole, or a
        Shard(0) part of it) go to the reader as they are; anything else by region."""
        if not entry.is_grid and (not entry.shape or (
                all(s == 0 for s in start[1:]) and lengths[1:] == entry.shape[1:])):
            whole = not entry.shape or lengths[0] == entry.shape[0]
            rows = None if whole else (start[0], start[0] + lengths[0])
            self.targets.append(ReadTarget(entry, buffer, rows))
            return
        self.regions.add(entry, buffer, lengths, block_runs(start, lengths))

    def _add_strided(self, entry: TensorEntry, dest: Any, start: tuple[int, ...],
                     lengths: tuple[int, ...]) -> None:
        region = [(s, s + n) for s, n in zip(start, lengths)]
        for index, inter, src in entry.chunks_over(region):
            dst = tuple(slice(a - s, b - s) for (a, b), s in zip(inter, start))
            _e, parts = self.strided.setdefault((id(entry), index), (entry, []))
            parts.append((dest, dst, src))

    def run(self) -> None:
        """Read every box added; raises the reader's IntegrityError on any bad chunk (the
        destinations may then hold partial data)."""
        targets, self.targets = self.targets, []
        if targets:
            self.reader.read_tensors(targets)
        self.regions.run()
        jobs = list(self.strided.items())
        self.strided = {}
        if jobs:
            jobs.sort(key=lambda j: -j[1][0].chunks[j[0][1]].nbytes)
            workers = min(self.reader.options.workers, len(jobs))
            with cf.ThreadPoolExecutor(workers, thread_name_prefix="ckpt-dcp-read") as pool:
                for _ in completed(pool.submit(self._read_strided, entry, index, parts)
                                   for (_id, index), (entry, parts) in jobs):
                    pass
        after, self.after = self.after, []
        for finish in after:
            finish()

    def _read_strided(self, entry: TensorEntry, index: int,
                      parts: list[tuple[Any, Slices, Slices]]) -> None:
        extents = tuple(b - a for a, b in entry.chunk_region(index))
        one = entry.chunk_alone(index, extents)
        scratch = np.empty(one.nbytes, np.uint8)
        self.reader.read_tensors([ReadTarget(one, scratch)])
        block = scratch.view(entry.dtype.numpy_dtype).reshape(extents)
        for dest, dst, src in parts:
            dest[dst] = block[src]
