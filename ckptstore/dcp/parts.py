"""The parts one rank writes in a DCP save: every chunk of its write items, as ckptstore
array leaves handed to the ckptstore writer together (`CheckpointWriter.write_blobs`: one
thread pool, packing of small arrays, deduplication, the memory budget).

A tensor item becomes one part per chunk of its grid (dcp/layout.py), each a view of the
tensor `resolve_data` returned (no copy unless a block is strided, or the tensor is on
another device); a non-tensor value becomes the array leaves inside it (bytes, arrays),
planned as a single-process save plans them. The parts are flushed early when tensors had
to be copied to host memory beyond the writer's memory budget. Each item's result document
(dcp/results.py) gets its chunk references at the flush.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..deps import missing

try:
    import torch
    from torch.distributed.checkpoint.planner import SavePlanner, WriteItem
except ModuleNotFoundError as _exc:
    raise missing(_exc) from None

from ..errors import CkptStoreError, UnsupportedTypeError
from ..format import dtypes
from ..format.leaf import ArrayLeaf
from ..format.torch_types import tensor_leaf
from ..pipeline.planning import LeafPlan, TensorSpec, plan_leaves
from ..pipeline.writer import CheckpointWriter, build_entries
from . import plain
from .layout import Layout
from .results import OPAQUE, PLAIN, TENSOR, entry_to_wire, ref_to_wire


class Parts:
    """The parts a rank writes (module docstring): `add_tensor` / `add_value` per write item,
    then `flush`; every item's result document is filled in by the flush."""

    def __init__(self, writer: CheckpointWriter) -> None:
        self.writer = writer
        self.parts: list[ArrayLeaf] = []
        self.plans: list[LeafPlan] = []
        self.targets: list[tuple[dict[str, Any], int, int]] = []  # (doc, chunk index, part index)
        self.copied = 0
        self.values: list[tuple[dict[str, Any], list[ArrayLeaf], list[LeafPlan], int]] = []

    def add_tensor(self, item: WriteItem, planner: SavePlanner, layout: Layout,
                   doc: dict[str, Any]) -> None:
        fqn = item.index.fqn
        td = item.tensor_data
        assert td is not None
        tensor = planner.resolve_data(item)
        if not isinstance(tensor, torch.Tensor):
            raise UnsupportedTypeError(f"{fqn}: the planner resolved a tensor item to a "
                                       f"{type(tensor).__name__}")
        leaf = tensor_leaf(tensor, fqn)
        if leaf.dtype.name != layout.dtype:
            raise CkptStoreError(f"{fqn}: the planner resolved a {leaf.dtype.name} tensor, "
                                 f"the plan says {layout.dtype}")
        offsets = tuple(int(n) for n in td.chunk.offsets)
        sizes = tuple(int(n) for n in td.chunk.sizes)
        if tuple(leaf.array.shape) != sizes:
            raise CkptStoreError(f"{fqn}: the planner resolved a tensor of "
                                 f"{list(leaf.array.shape)} for a write item of {list(sizes)}")
        doc["_nbytes"] = leaf.nbytes
        if not tensor.is_cpu:
            self.copied += leaf.nbytes
        packed = layout.packed or layout.small
        for c, region in layout.chunks_in(offsets, sizes):
            if region:
                view = leaf.array[tuple(slice(lo - o, hi - o)
                                        for (lo, hi), o in zip(region, offsets))]
                rows = max(1, region[0][1] - region[0][0])
            else:
                view, rows = leaf.array, 1
            self.targets.append((doc, c, len(self.parts)))
            self.parts.append(leaf.with_array(view))
            self.plans.append(LeafPlan(rows, packed=packed))
        if self.copied >= self.writer.options.max_inflight_bytes:
            self.flush()

    def add_value(self, item: WriteItem, kind: str, value: Any) -> dict[str, Any]:
        fqn = item.index.fqn
        if kind == OPAQUE:
            leaves = [ArrayLeaf(fqn, "bytes", dtypes.DTYPES["uint8"],
                                np.frombuffer(value, np.uint8))]
            doc: dict[str, Any] = {"kind": OPAQUE, "_nbytes": len(value)}
        else:
            node, leaves = plain.encode(value, (fqn,))
            doc = {"kind": PLAIN, "node": node, "_nbytes": sum(x.nbytes for x in leaves)}
        plans = plan_leaves(leaves, self.writer.options)
        self.values.append((doc, leaves, plans, len(self.parts)))
        self.parts.extend(leaves)
        self.plans.extend(plans)
        return doc

    def flush(self) -> None:
        if not self.parts and not self.values:
            return
        # values without arrays or bytes inside (an int, a string) have no parts, yet their
        # documents still need their (empty) entries: a rank may hold nothing else
        refs = self.writer.write_blobs(self.parts, self.plans) if self.parts else {}
        for doc, c, j in self.targets:
            doc["chunks"].append([c, ref_to_wire(refs[(j, 0)])])
        compression = self.writer.options.compression
        for doc, leaves, plans, first in self.values:
            mine = {(j - first, c): ref for (j, c), ref in refs.items()
                    if first <= j < first + len(leaves)}
            entries = build_entries([TensorSpec.of(leaf) for leaf in leaves], plans, mine,
                                    compression)
            wires = [entry_to_wire(e) for e in entries]
            if doc["kind"] == OPAQUE:
                doc["entry"] = wires[0]
            else:
                doc["entries"] = wires
        self.parts, self.plans, self.targets, self.values = [], [], [], []
        self.copied = 0

    @staticmethod
    def finish_doc(doc: dict[str, Any]) -> None:
        if doc.get("kind") == TENSOR:
            doc["chunks"].sort(key=lambda x: x[0])
