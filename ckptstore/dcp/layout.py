"""The chunk grid of every tensor of a DCP save, decided once by the coordinator.

DCP hands each rank write items: boxes (offsets, sizes) of global tensors, after its own
deduplication, so every element of a tensor lies in exactly one item. A ckptstore manifest
needs one regular grid of chunks per global tensor (docs/format.md, `chunk_shape`). The grid
is the one a ckptstore collective save would choose (`pipeline.planning.plan_collective`,
with every item as a holder): chunk boundaries fall on every item's boundary on every
dimension, so each chunk lies whole inside one item and is written by that item's rank from
its own memory. Small tensors held whole are packed; a tensor held whole by one item gets
the row blocks of a single-process save, so a save on one rank is chunked as
`CheckpointStore.save` would chunk it, and repeated saves of the same plan chunk alike
(which is what lets unchanged chunks be reused).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import CkptStoreError, UnsupportedTypeError
from ..format.dtypes import by_name
from ..format.manifest import chunk_region
from ..format.regions import block_runs
from ..pipeline.options import SaveOptions
from ..pipeline.planning import plan_collective, rows_per_chunk

Region = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Layout:
    """The grid of one tensor: row blocks of `chunk_rows` rows (`chunk_shape` None) or an N-D
    grid; `packed`: one chunk, the whole (small) tensor, packed with others; `small`: the
    chunks of a small sharded tensor are packed too (never compressed)."""

    shape: tuple[int, ...]
    dtype: str  # ckptstore dtype name
    chunk_rows: int
    chunk_shape: tuple[int, ...] | None
    packed: bool = False
    small: bool = False

    def block(self) -> tuple[int, ...]:
        if self.chunk_shape is not None:
            return self.chunk_shape
        return (self.chunk_rows, *self.shape[1:]) if self.shape else ()

    def count(self) -> int:
        if not self.shape:
            return 1
        if math.prod(self.shape) == 0:
            return 0
        if self.packed:
            return 1
        return math.prod(-(-n // c) for n, c in zip(self.shape, self.block()))

    def region(self, c: int) -> Region:
        if self.packed or not self.shape:
            return tuple((0, n) for n in self.shape)
        return chunk_region(self.shape, self.block(), c)

    def chunks_in(self, offsets: Sequence[int], sizes: Sequence[int]) -> Iterator[
            tuple[int, Region]]:
        """(chunk index, global region) of every chunk inside the box at `offsets` of
        `sizes` (which the grid was aligned to: each chunk lies whole inside or outside)."""
        if self.count() == 0 or any(n == 0 for n in sizes):
            return
        if self.packed or not self.shape:
            if tuple(offsets) != (0,) * len(self.shape) or tuple(sizes) != self.shape:
                raise CkptStoreError(f"a write item of {list(sizes)} at {list(offsets)} does "
                                     f"not hold the whole packed tensor {list(self.shape)}")
            yield 0, self.region(0)
            return
        block = self.block()
        grid = [-(-n // c) for n, c in zip(self.shape, block)]
        spans = [range(o // c, -(-(o + s) // c)) for o, s, c in zip(offsets, sizes, block)]
        total = 0
        for pos in _product(spans):
            index = 0
            for p, g in zip(pos, grid):
                index = index * g + p
            region = self.region(index)
            if any(lo < o or hi > o + s for (lo, hi), o, s in zip(region, offsets, sizes)):
                raise CkptStoreError(f"chunk {index} {list(region)} of the grid "
                                     f"{list(block)} is not inside the write item of "
                                     f"{list(sizes)} at {list(offsets)}")
            total += math.prod(hi - lo for lo, hi in region)
            yield index, region
        if total != math.prod(sizes):
            raise CkptStoreError(f"the grid {list(block)} does not cover the write item of "
                                 f"{list(sizes)} at {list(offsets)}")

    def to_wire(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": self.dtype, "chunk_rows": self.chunk_rows,
                "chunk_shape": None if self.chunk_shape is None else list(self.chunk_shape),
                "packed": self.packed, "small": self.small}

    @staticmethod
    def from_wire(doc: dict[str, Any]) -> Layout:
        grid = doc["chunk_shape"]
        return Layout(tuple(int(n) for n in doc["shape"]), str(doc["dtype"]),
                      int(doc["chunk_rows"]), None if grid is None else tuple(
                          int(n) for n in grid), bool(doc["packed"]), bool(doc["small"]))


def _product(spans: list[range]) -> Iterator[tuple[int, ...]]:
    if not spans:
        yield ()
        return
    first, rest = spans[0], spans[1:]
    for p in first:
        for tail in _product(rest):
            yield (p, *tail)


Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) of one write item


def plan_layout(fqn: str, shape: tuple[int, ...], dtype: str, items: list[Box],
                options: SaveOptions) -> Layout:
    """The grid of one tensor from every write item's box (module docstring)."""
    itemsize = by_name(dtype).itemsize
    nbytes = math.prod(shape) * itemsize
    whole = len(items) == 1 and items[0] == ((0,) * len(shape), shape)
    if whole or not shape or nbytes == 0:
        if 0 < nbytes <= options.pack_threshold:
            return Layout(shape, dtype, max(1, shape[0]) if shape else 1, None, packed=True)
        return Layout(shape, dtype, rows_per_chunk(shape, itemsize, options.chunk_bytes), None)
    descs = [[{"key": fqn, "kind": "torch", "dtype": dtype, "shape": list(sizes),
               "global": list(shape), "partial": True,
               "runs": [list(map(list, r)) for r in block_runs(offsets, sizes)]}]
             for offsets, sizes in items]
    [lay], _load = plan_collective(descs, options)
    if lay.packed:  # held whole by one item among empty ones
        return Layout(shape, dtype, lay.chunk_rows, None, packed=True)
    return Layout(shape, dtype, lay.chunk_rows, lay.chunk_shape, small=lay.small)


def plan_layouts(plans: Sequence[Any], options: SaveOptions) -> dict[str, Layout]:
    """{fqn: Layout} of every tensor the DCP save plans write (write items of the tensor
    and shard kinds)."""
    from ..format.torch_types import dtype_name

    boxes: dict[str, list[Box]] = {}
    geometry: dict[str, tuple[tuple[int, ...], str]] = {}
    for plan in plans:
        for item in plan.items:
            td = item.tensor_data
            if td is None:
                continue
            fqn = item.index.fqn
            name = dtype_name(td.properties.dtype)
            if name is None:
                raise UnsupportedTypeError(f"{fqn}: tensors of dtype {td.properties.dtype} "
                                           "cannot be stored")
            shape = tuple(int(n) for n in td.size)
            if geometry.setdefault(fqn, (shape, name)) != (shape, name):
                raise CkptStoreError(f"{fqn}: write items disagree on the tensor's size or "
                                     "dtype")
            boxes.setdefault(fqn, []).append((tuple(int(n) for n in td.chunk.offsets),
                                              tuple(int(n) for n in td.chunk.sizes)))
    return {fqn: plan_layout(fqn, *geometry[fqn], items, options)
            for fqn, items in boxes.items()}
