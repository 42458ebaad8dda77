"""Index segments built where the chunk references land (step 5 of the collective save of
training/rank_save.py): each rank sends the builder of every segment the references of its
chunks there as fixed-size binary rows (`ROW`, `outgoing`); a builder assembles the entries
of its segments from every rank's rows, checks that every chunk is there exactly once (and
that copies of one chunk agree), encodes and writes them (`build_segments`). The segments are
the ordinary version-3 index segments of docs/format.md, cut as a single-process save cuts
them (`rank_planning.segment_spans`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import CkptStoreError
from ..format.codecs import Codec
from ..format.leaf import ArrayLeaf
from ..format.manifest import (
    ROWS_ABOVE,
    ChunkRef,
    ChunkRows,
    HexNames,
    StorageRef,
    TensorEntry,
    entry_problem,
)
from ..format.segment_encoding import encode_columns
from .rank_planning import RankPlan, builder_of
from .writer import CheckpointWriter, storage_refs

#: One chunk reference as a writer sends it to a segment's builder (56 bytes).
ROW = np.dtype([("tensor", "<u4"), ("chunk", "<u4"), ("offset", "<u8"), ("size", "<u8"),
                ("nbytes", "<u8"), ("blob", "u1", (16,)), ("digest", "u1", (16,))])


def _rows_for(refs: dict[tuple[int, int], ChunkRef]) -> np.ndarray:
    out = np.zeros(len(refs), dtype=ROW)
    if not refs:
        return out
    keys = list(refs)
    out["tensor"] = [i for i, _c in keys]
    out["chunk"] = [c for _i, c in keys]
    values = list(refs.values())
    out["offset"] = [r.offset for r in values]
    out["size"] = [r.size for r in values]
    out["nbytes"] = [r.nbytes for r in values]
    out["blob"] = np.frombuffer(bytes.fromhex("".join(r.blob for r in values)),
                                dtype=np.uint8).reshape(-1, 16)
    out["digest"] = np.frombuffer(bytes.fromhex("".join(r.digest for r in values)),
                                  dtype=np.uint8).reshape(-1, 16)
    return out


def outgoing(refs: dict[tuple[int, int], ChunkRef], plan: RankPlan, world: int
             ) -> list[bytes]:
    """Step 4 on this rank: the rows of its chunk references for each rank (those of the
    segments that rank builds; empty for most)."""
    rows = _rows_for(refs)
    dest = np.array([builder_of(int(s), world) for s in range(len(plan.spans))],
                    dtype=np.int64)[plan.segment_of()[rows["tensor"].astype(np.int64)]]
    order = np.argsort(dest, kind="stable")
    rows, dest = rows[order], dest[order]
    bounds = np.searchsorted(dest, np.arange(world + 1))
    return [rows[bounds[r]:bounds[r + 1]].tobytes() for r in range(world)]


def _hex(column: np.ndarray) -> list[str]:
    h = column.tobytes().hex()
    return [h[k:k + 32] for k in range(0, len(h), 32)]


def _chunks(rows: np.ndarray) -> tuple[ChunkRef, ...] | ChunkRows:
    """The chunk references of one entry from its rows: columns when there are many (no
    object per chunk, see ChunkRows), ChunkRefs when few."""
    if len(rows) > ROWS_ABOVE:
        return ChunkRows(HexNames(rows["blob"].tobytes()),
                         [np.arange(len(rows)), rows["offset"], rows["size"], rows["nbytes"]],
                         rows["digest"].tobytes())
    return tuple(ChunkRef(blob, offset, size, nbytes, digest)
                 for blob, offset, size, nbytes, digest in zip(
                     _hex(rows["blob"]), rows["offset"].tolist(), rows["size"].tolist(),
                     rows["nbytes"].tolist(), _hex(rows["digest"])))


def _build_segment(s: int, span: range, rows: np.ndarray, plan: RankPlan,
                   leaves: list[ArrayLeaf], storage: list[StorageRef | None],
                   compression: Codec | None) -> tuple[list[TensorEntry], np.ndarray]:
    """The entries of segment `s` from every rank's rows of its tensors (step 5), and the
    rows of their chunks in order."""
    mine = rows[(rows["tensor"] >= span.start) & (rows["tensor"] < span.stop)]
    order = np.lexsort((mine["chunk"], mine["tensor"]))  # stable: lowest rank first
    mine = mine[order]
    key = mine["tensor"].astype(np.int64) << 32 | mine["chunk"].astype(np.int64)
    first = np.ones(len(mine), dtype=bool)
    first[1:] = key[1:] != key[:-1]
    copies = ~first
    if copies.any():  # the same chunk from ranks holding the same elements: must be equal
        dup = np.flatnonzero(copies)
        differ = (mine["digest"][dup] != mine["digest"][dup - 1]).any(axis=1) | (
            mine["nbytes"][dup] != mine["nbytes"][dup - 1])
        if differ.any():
            j = int(dup[np.flatnonzero(differ)[0]])
            i, c = int(mine["tensor"][j]), int(mine["chunk"][j])
            raise CkptStoreError(f"{leaves[i].key}: ranks holding chunk {c} "
                                 f"{list(plan.grids[i].region(c))} hold different values")
        mine = mine[first]
    counts = np.bincount(mine["tensor"].astype(np.int64) - span.start, minlength=len(span))
    entries = []
    at = 0
    for k, i in enumerate(span):
        g, leaf = plan.grids[i], leaves[i]
        n = int(counts[k])
        if n != g.chunks:
            held = set(mine["chunk"][at:at + n].tolist())
            gap = next(c for c in range(g.chunks) if c not in held)
            raise CkptStoreError(f"{leaf.key}: no rank holds the elements "
                                 f"{list(g.region(gap))} of the global shape "
                                 f"{list(g.shape)}: the ranks' shards do not cover the tensor")
        entry = TensorEntry(
            key=leaf.key, kind=leaf.kind, dtype=leaf.dtype, shape=g.shape,
            chunk_rows=g.chunk_rows, codec=None if g.packed or g.small else compression,
            chunks=_chunks(mine[at:at + n]), requires_grad=leaf.requires_grad,
            parameter=leaf.parameter, storage=storage[i], chunk_shape=g.chunk_shape)
        at += n
        problem = entry_problem(entry)
        if problem is not None:
            raise CkptStoreError(f"{leaf.key}: {problem}")
        entries.append(entry)
    return entries, mine


def build_segments(writer: CheckpointWriter, rows: np.ndarray, plan: RankPlan,
                   leaves: list[ArrayLeaf], rank: int, world: int) -> list[list[Any]]:
    """Step 5 on this rank: build, write and make durable the segments it builds from
    every rank's `rows` of them. Returns [segment, digest, size, tensors, nbytes] of each."""
    storage = [None if geo.sharded else ref
               for geo, ref in zip(plan.geometry, storage_refs(leaves))]
    algorithm = writer.options.hash
    out = []
    blobs: list[tuple[str, bytes]] = []
    parts: set[str] = set()
    for s, span in enumerate(plan.spans):
        if builder_of(s, world) != rank:
            continue
        entries, mine = _build_segment(s, span, rows, plan, leaves, storage,
                                       writer.options.compression)
        encoded = encode_columns(entries, mine["blob"], mine["offset"], mine["size"],
                                 mine["nbytes"], mine["digest"], algorithm)
        for part, data in encoded.parts:  # named by the head alone: never taken as known
            blobs.append((part.digest, data))  # (rank 0 confirms none)
            parts.add(part.digest)
        blobs.append((encoded.ref.digest, encoded.head))
        ref = encoded.ref
        out.append([s, ref.digest, ref.size, ref.tensors, ref.nbytes])
    writer.put_index_blobs(blobs, always=parts)  # side by side, durable on return
    return out
