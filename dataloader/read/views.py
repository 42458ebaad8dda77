"""Window views: the decoded blocks of one window, concatenated, and how items are cut from them.

A view turns window-local item numbers into collated numpy columns:

* PlainView (one item = one sample): scalar/fixed fields -> arrays stacked along dim 0
  (fresh arrays); ragged -> list of read-only arrays (views into decoded blocks that caches
  keep and serve again: copy one to change it); bytes -> list of bytes; str -> list of str.
  ``_index`` holds the global sample numbers.
* TokenView (one item = one packed sequence of `seq_len` tokens cut from the window's documents
  in shuffled order): ``tokens`` (n, L), ``position_ids`` (n, L) restarting at 0 at every
  document start and at every sequence start; `finish_tokens` adds ``cu_seqlens`` (int32,
  boundaries over the flattened batch) and ``max_seqlen``. ``_index`` holds the items' global
  order positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..format.fields import FieldInfo
from .blocks import Block

Batch = dict[str, Any]


def _concat_columns(f: FieldInfo, blocks: Sequence[Block]) -> Any:
    cols: list[Any] = [blk[f.name] for blk in blocks]
    if not f.variable:
        return cols[0] if len(cols) == 1 else np.concatenate(cols)
    if len(cols) == 1:
        return cols[0]
    datas = [c[0] for c in cols]
    offs, base = [], 0
    for c in cols:
        offs.append(c[1][:-1] + base)
        base += int(c[1][-1])
    offsets = np.concatenate([*offs, np.asarray([base], dtype=np.int64)])
    shapes = np.concatenate([c[2] for c in cols]) if cols[0][2] is not None else None
    return (np.concatenate(datas), offsets, shapes)


class PlainView:
    """Items are samples, in the window's permuted order. Columns stay in their blocks (no
    window-sized copy): a batch gathers its rows block by block."""

    def __init__(
        self,
        fields: Sequence[FieldInfo],
        blocks: Sequence[int],
        data: Sequence[Block],
        block_starts: np.ndarray,
        perm: np.ndarray,
    ) -> None:
        self.fields = tuple(fields)
        self.data = list(data)
        lens = np.asarray([len(_first(blk, self.fields)) for blk in data], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        n = int(starts[-1])
        local = np.arange(n, dtype=np.int64)
        self.block_of = np.searchsorted(starts, local, side="right") - 1
        self.row_of = local - starts[self.block_of]
        first = np.asarray(block_starts, dtype=np.int64)[np.asarray(blocks, dtype=np.int64)]
        self.ids = first[self.block_of] + self.row_of
        self.perm = perm

    def gather(self, start: int, stop: int) -> Batch:
        local = self.perm[start:stop]
        bi, rows = self.block_of[local], self.row_of[local]
        out: Batch = {"_index": self.ids[local]}
        groups = None
        for f in self.fields:
            cols: list[Any] = [blk[f.name] for blk in self.data]
            if not f.variable:
                first = cols[0]
                if len(cols) == 1:
                    out[f.name] = np.take(first, rows, axis=0)
                    continue
                arr = np.empty((len(local), *first.shape[1:]), dtype=first.dtype)
                if len(local) <= 16:
                    for j, (b, r) in enumerate(zip(bi, rows, strict=True)):
                        arr[j] = cols[b][r]
                else:
                    if groups is None:
                        groups = [(int(b), bi == b) for b in np.unique(bi)]
                    for b, m in groups:
                        arr[m] = np.take(cols[b], rows[m], axis=0)
                out[f.name] = arr
                continue
            items = []
            for b, r in zip(bi, rows, strict=True):
                data, off, shapes = cols[b]
                v = data[off[r] : off[r + 1]]
                if f.kind == "ragged":  # a read-only view: the block is kept and served again
                    v = v.reshape(shapes[r]) if shapes is not None else v
                    v.flags.writeable = False
                    items.append(v)
                elif f.kind == "bytes":
                    items.append(v.tobytes())
                else:
                    items.append(v.tobytes().decode("utf-8"))
            out[f.name] = items
        return out

    def sample(self, item: int) -> dict[str, Any]:
        """One item as a sample dict (fields as written; scalars as numpy scalars)."""
        b = self.gather(item, item + 1)
        return {k: v[0] for k, v in b.items()}


class GatheredView:
    """Items are the rows of an already gathered batch, served in the order `perm` (the
    full-permutation order: a window's samples gathered block group by block group)."""

    def __init__(self, batch: Batch, perm: np.ndarray) -> None:
        self.batch, self.perm = batch, perm

    def gather(self, start: int, stop: int) -> Batch:
        rows = self.perm[start:stop]
        return {
            k: v[rows] if isinstance(v, np.ndarray) else [v[int(j)] for j in rows]
            for k, v in self.batch.items()
        }

    def sample(self, item: int) -> dict[str, Any]:
        b = self.gather(item, item + 1)
        return {k: v[0] for k, v in b.items()}


def _first(blk: Block, fields: Sequence[FieldInfo]) -> np.ndarray:
    col = blk[fields[0].name]
    return col if isinstance(col, np.ndarray) else col[1][:-1]


class TokenView:
    """Items are `seq_len`-token sequences cut from the window's documents in permuted order."""

    def __init__(
        self,
        f: FieldInfo,
        data: Sequence[Block],
        perm: np.ndarray,
        seq_len: int,
        items: int,
        item_base: int,
        pad_id: int,
    ) -> None:
        col = _concat_columns(f, data)
        if isinstance(col, np.ndarray):  # fixed (N, D) token rows
            rows = col.reshape(len(col), -1)
            flat, lengths = rows.reshape(-1), np.full(len(rows), rows.shape[1], np.int64)
            starts = np.arange(len(rows), dtype=np.int64) * rows.shape[1]
        else:
            flat, off, _ = col
            lengths, starts = np.diff(off), off[:-1]
        lengths, starts = lengths[perm], starts[perm]
        total = int(lengths.sum())
        need = items * seq_len
        take = min(total, need)
        # gather the documents in permuted order into one stream (vectorised)
        doc_pos = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        stream = np.full(need, pad_id, dtype=flat.dtype)
        if take:
            src = np.repeat(starts - doc_pos[:-1], lengths)[:take] + np.arange(take, dtype=np.int64)
            stream[:take] = flat[src]
        self.stream = stream
        self.doc_starts = np.unique(np.concatenate([doc_pos[doc_pos < need], [take]]))
        self.seq_len, self.item_base = seq_len, item_base

    def gather(self, start: int, stop: int) -> Batch:
        L = self.seq_len
        tokens = self.stream[start * L : stop * L].reshape(stop - start, L).copy()
        p = np.arange(start * L, stop * L, dtype=np.int64)
        d = np.searchsorted(self.doc_starts, p, side="right") - 1
        seq_start = (p // L) * L
        pos = p - np.maximum(self.doc_starts[d], seq_start)
        return {
            "_index": np.arange(start, stop, dtype=np.int64) + self.item_base,
            "tokens": tokens,
            "position_ids": pos.reshape(stop - start, L),
        }

    def sample(self, item: int) -> dict[str, Any]:
        b = self.gather(item, item + 1)
        s = {k: v[0] for k, v in b.items()}
        pos = s["position_ids"]
        s["cu_seqlens"] = np.concatenate([np.flatnonzero(pos == 0), [len(pos)]]).astype(np.int32)
        return s


# -- batches -------------------------------------------------------------------------------
def merge_parts(parts: Sequence[Batch]) -> Batch:
    """Concatenate partial batches (arrays along dim 0, lists extended)."""
    if len(parts) == 1:
        return parts[0]
    out: Batch = {}
    for key, first in parts[0].items():
        if isinstance(first, np.ndarray):
            out[key] = np.concatenate([p[key] for p in parts])
        else:
            merged: list[Any] = []
            for p in parts:
                merged.extend(p[key])
            out[key] = merged
    return out


def finish_tokens(batch: Batch) -> Batch:
    """Add cu_seqlens/max_seqlen (document boundaries over the flattened batch)."""
    pos = batch.get("position_ids")
    if isinstance(pos, np.ndarray) and pos.ndim == 2:
        flat = pos.reshape(-1)
        cu = np.concatenate([np.flatnonzero(flat == 0), [flat.size]]).astype(np.int32)
        batch["cu_seqlens"] = cu
        batch["max_seqlen"] = int(np.diff(cu).max()) if len(cu) > 1 else 0
    return batch


def slice_batch(batch: Batch, start: int, stop: int) -> Batch:
    return {k: v[start:stop] for k, v in batch.items()}


def batch_len(batch: Batch) -> int:
    return len(batch["_index"])
