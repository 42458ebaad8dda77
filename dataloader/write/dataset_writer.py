"""Writing one dataset (or one partition) as a stream: checked samples (samples.py) become one
sharded zarr v3 array per field (variable-length fields as data + offsets), each written by an
ArrayWriter (array_writer.py) through a thin adapter over a ckptstore Store, then
``dataset.json`` is created last.

Contract: a dataset is whole or invisible. Until `close()` creates the index, readers see no
dataset; a failed or abandoned write leaves arrays but no index. Chunk digests are taken from the
encoded bytes before they are put (no read-back). Bad samples raise TypeError/ValueError naming
the sample index and field, before anything of that sample is written.

Why one module of ~340 lines: the choice of chunking, the field writers and the index are one
write; the field writers share the block bookkeeping that the index records.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from ckptstore.errors import FormatError, ObjectExistsError
from ckptstore.stores import Store, is_local_uri, open_store

from ..format.fields import FieldInfo
from ..format.index import DatasetIndex, load_index
from ..format.spec import (
    INDEX_KEY,
    MAX_CHUNK_NBYTES,
    MAX_INDEX_BYTES,
    MAX_METADATA_DEPTH,
    MAX_ROWS_PER_CHUNK,
    validate_field_name,
)
from ..format.validate import check_int, json_depth
from ..format.zarr_encoding import group_metadata
from .array_writer import ArrayWriter, ObjectWrites
from .samples import (
    PROBE_BYTES,
    PROBE_SAMPLES,
    Spec,
    as_stored,
    check_sample,
    choose_rows_per_chunk,
    infer_specs,
    value_nbytes,
)

__all__ = ["DatasetWriter", "clear_target", "open_target"]

_MAX_CHUNKS_PER_SHARD = 1024
_COMMIT_BYTES = 256 << 20  # a deferred batch is committed once this much waits (memory, fds)


class DatasetWriter:
    """Streaming writer: `add()` samples, then `close()` (or leave the `with` block) commits.

    Options: `schema` maps field -> kind ('scalar', 'fixed', 'ragged', 'bytes', 'str'); numpy
    arrays default to 'ragged' (any shape per sample; declare 'fixed' for one shape, which stores
    them as an (N, *shape) array). `rows_per_chunk` (samples per block, the read unit) defaults to
    about `chunk_bytes` of data; data arrays of variable-length fields use chunks of about a
    quarter block (or `data_chunk_bytes`); shards hold about `shard_bytes`. `compression`: None
    or 'zstd'.
    """

    def __init__(
        self,
        uri: str | Store,
        *,
        schema: Mapping[str, str] | None = None,
        rows_per_chunk: int | None = None,
        chunk_bytes: int = 4 << 20,
        shard_bytes: int = 16 << 20,
        data_chunk_bytes: int | None = None,
        compression: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        overwrite: bool = False,
        store_options: Mapping[str, Any] | None = None,
        prefix: str = "",
    ) -> None:
        if compression not in (None, "zstd"):
            raise ValueError(f"compression must be None or 'zstd', got {compression!r}")
        if rows_per_chunk is not None:
            check_int(rows_per_chunk, "rows_per_chunk", 1, MAX_ROWS_PER_CHUNK, ValueError)
        if json_depth(metadata or {}, MAX_METADATA_DEPTH) > MAX_METADATA_DEPTH:
            raise ValueError(f"metadata nested deeper than {MAX_METADATA_DEPTH} levels")
        self.store = open_target(uri, store_options)
        self._owns_store = not isinstance(uri, Store)
        self.schema = {validate_field_name(k): v for k, v in (schema or {}).items()}
        self.rows_per_chunk = rows_per_chunk
        self.chunk_bytes, self.shard_bytes = chunk_bytes, shard_bytes
        self.data_chunk_bytes = data_chunk_bytes
        self.compression = compression
        self.metadata = dict(metadata or {})
        # prefix: write a partition's arrays under it (see partitions.py); nothing is committed
        # and nothing outside the prefix is touched.
        self._prefix = prefix.strip("/")
        if not self._prefix:
            self._check_target(overwrite)
        self._arrays: dict[str, ArrayWriter] = {}
        self._writes = ObjectWrites(self.store, self._prefix)
        self._specs: dict[str, Spec] | None = None
        self._probe_specs: dict[str, Spec] | None = None
        self._probe: list[dict[str, Any]] = []
        self._probe_bytes = 0
        self._block: list[dict[str, Any]] = []
        self._R = 0
        self._count = 0
        self.first_sample = 0  # number of the first sample, in error messages (partitions)
        self._bounds: dict[str, list[int]] = {}
        self._data_len: dict[str, int] = {}
        self._closed = False

    def _check_target(self, overwrite: bool) -> None:
        clear_target(self.store, overwrite)

    # -- adding samples -------------------------------------------------------------------
    def add(self, sample: Mapping[str, Any]) -> None:
        """Validate and buffer one sample; whole shards are written as they fill."""
        if self._closed:
            raise ValueError("writer is closed")
        i = self._count + self.first_sample
        if not isinstance(sample, Mapping):
            raise TypeError(
                f"sample {i}: expected a dict of field -> value, got {type(sample).__name__}"
            )
        if self._specs is None:
            specs = self._probe_specs
            if specs is None:
                specs = infer_specs(i, sample, self.schema)
                self._probe_specs = specs
        else:
            specs = self._specs
        row = self._check_sample(i, sample, specs)
        self._count += 1
        if self._specs is None:
            self._probe.append(row)
            self._probe_bytes += sum(value_nbytes(specs[k], v) for k, v in row.items())
            if len(self._probe) >= PROBE_SAMPLES or self._probe_bytes >= PROBE_BYTES:
                self._start()
        else:
            self._push(row)

    def _check_sample(
        self, i: int, sample: Mapping[str, Any], specs: dict[str, Spec]
    ) -> dict[str, Any]:
        return check_sample(i, sample, specs)

    def _start(self, final: bool = False) -> None:
        """Decide the chunking from the probe, create the arrays, push the probe samples.
        `final`: the probe holds every sample, so nothing is sized beyond what it needs (a
        small dataset is not padded to a default-sized block, chunk or shard)."""
        specs = self._probe_specs or {}
        self._specs = specs
        total = len(self._probe)
        R = self.rows_per_chunk or choose_rows_per_chunk(
            specs, self._probe, self.chunk_bytes, final
        )
        self._R = R
        n = max(1, total)
        per_field = {
            k: sum(value_nbytes(s, r[k]) for r in self._probe) / n for k, s in specs.items()
        }

        def shards(chunk_nbytes: int, chunks_needed: int | None = None) -> int:
            per = int(min(max(1, self.shard_bytes // max(1, chunk_nbytes)), _MAX_CHUNKS_PER_SHARD))
            return min(per, max(1, chunks_needed)) if final and chunks_needed is not None else per

        row_chunks = -(-(total + 1) // R)  # offsets arrays hold N+1 rows
        for name, spec in specs.items():
            if spec.kind in ("scalar", "fixed"):
                inner = spec.shape or ()
                nb = R * math.prod(inner) * spec.dtype.itemsize
                self._add_array(name, spec.dtype, inner, R, shards(nb, row_chunks))
                continue
            item = spec.dtype.itemsize
            block_data = max(1.0, per_field[name] - 8) * R
            chunk_b = self.data_chunk_bytes or int(
                min(max(4 << 10, block_data / 4), self.chunk_bytes)
            )
            ce = max(1, chunk_b // item)
            elems = sum(value_nbytes(spec, r[name]) - 8 for r in self._probe) // item
            if final and self.data_chunk_bytes is None:
                ce = min(ce, max(1, elems))
            self._add_array(
                f"{name}/data", spec.dtype, (), ce, shards(ce * item, -(-elems // ce))
            )
            self._add_array(f"{name}/offsets", np.dtype(np.int64), (), R, shards(8 * R, row_chunks))
            if spec.kind == "ragged" and spec.ndim > 1:
                self._add_array(
                    f"{name}/shapes",
                    np.dtype(np.int64),
                    (spec.ndim,),
                    R,
                    shards(8 * R * spec.ndim, row_chunks),
                )
            self._bounds[name] = [0]
            self._data_len[name] = 0
        probe, self._probe = self._probe, []
        for row in probe:
            self._push(row)

    def _add_array(
        self, path: str, dtype: np.dtype, inner: tuple[int, ...], chunk_len: int, per_shard: int
    ) -> None:
        nbytes = chunk_len * math.prod(inner) * dtype.itemsize
        if nbytes > MAX_CHUNK_NBYTES:
            raise ValueError(
                f"array {path!r}: chunks of {nbytes:,} bytes, over the {MAX_CHUNK_NBYTES:,}-byte "
                "limit (lower rows_per_chunk, chunk_bytes or data_chunk_bytes)"
            )
        self._arrays[path] = ArrayWriter(
            self._writes, path, dtype, inner, chunk_len, per_shard, self.compression
        )

    def _push(self, row: dict[str, Any]) -> None:
        self._block.append(row)
        if len(self._block) == self._R:
            self._flush_block()

    def _flush_block(self) -> None:
        rows, self._block = self._block, []
        if not rows:
            return
        assert self._specs is not None
        for name, spec in self._specs.items():
            vals = [r[name] for r in rows]
            if spec.kind == "scalar":
                self._arrays[name].append(np.asarray(vals, dtype=spec.dtype))
                continue
            if spec.kind == "fixed":  # shapes were checked by _coerce
                self._arrays[name].append_parts(as_stored(v, spec.dtype) for v in vals)
                continue
            data = self._arrays[f"{name}/data"]
            if spec.kind == "ragged":
                lengths = np.fromiter((v.size for v in vals), dtype=np.int64, count=len(vals))
                data.append_parts(as_stored(v, spec.dtype) for v in vals)
                if spec.ndim > 1:
                    self._arrays[f"{name}/shapes"].append(
                        np.asarray([v.shape for v in vals], dtype=np.int64).reshape(
                            len(vals), spec.ndim
                        )
                    )
            else:  # bytes, str (already UTF-8 bytes)
                lengths = np.fromiter((len(v) for v in vals), dtype=np.int64, count=len(vals))
                data.append_parts(vals)
            start = self._data_len[name]
            offs = start + np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
            self._arrays[f"{name}/offsets"].append(offs)
            self._data_len[name] = start + int(lengths.sum())
            self._bounds[name].append(self._data_len[name])
        if self._writes.nbytes >= _COMMIT_BYTES:  # bound what waits for a commit
            self._writes.commit()

    # -- commit ---------------------------------------------------------------------------
    def close(self) -> DatasetIndex:
        """Write the remaining rows and the index (create-only). Returns the index."""
        index = self.finish_arrays()
        raw = index.to_bytes()
        if len(raw) > MAX_INDEX_BYTES:
            raise ValueError(
                f"the dataset index would be {len(raw):,} bytes, over the {MAX_INDEX_BYTES:,}-byte"
                " limit readers accept (use larger chunks and shards)"
            )
        self.commit_writes()
        self.store.create(INDEX_KEY, raw)
        self._closed = True
        if self._owns_store:
            self.store.close()
        return index

    def finish_arrays(self) -> DatasetIndex:
        """Write the remaining rows; return the index of what was written, creating nothing
        visible (a partition's arrays: `close` and `commit_dataset` make datasets visible)."""
        if self._closed:
            raise ValueError("writer is closed")
        if self._specs is None:
            if self._probe_specs is None:
                raise ValueError("no samples were written (a dataset needs at least one sample)")
            self._start(final=True)
        self._flush_block()
        assert self._specs is not None
        for name, spec in self._specs.items():
            if spec.kind in ("ragged", "bytes", "str"):  # final offset: N+1 rows
                self._arrays[f"{name}/offsets"].append(np.asarray([self._data_len[name]], np.int64))
        arrays = {path: w.finish() for path, w in self._arrays.items()}
        self._writes.put("zarr.json", group_metadata({"dataloader": 1}))
        for group in sorted({p.rpartition("/")[0] for p in arrays} - {""}):  # a field's group
            self._writes.put(f"{group}/zarr.json", group_metadata({}))
        fields = []
        for name, spec in self._specs.items():
            if spec.kind in ("scalar", "fixed"):
                roles = {"values": name}
                bounds = None
            else:
                roles = {"data": f"{name}/data", "offsets": f"{name}/offsets"}
                if f"{name}/shapes" in arrays:
                    roles["shapes"] = f"{name}/shapes"
                bounds = tuple(self._bounds[name])
            fields.append(
                FieldInfo(
                    name,
                    spec.kind,
                    spec.dtype.newbyteorder("<").str,
                    spec.shape,
                    spec.ndim,
                    roles,
                    bounds,
                )
            )
        partial = DatasetIndex(self._count, self._R, tuple(fields), arrays, self.metadata, "0" * 32)
        body = partial.body()
        index = DatasetIndex(
            self._count,
            self._R,
            tuple(fields),
            arrays,
            self.metadata,
            DatasetIndex.compute_fingerprint(body),
        )
        return index

    def commit_writes(self) -> None:
        """Make every object written so far durable: the writer puts through a deferred batch
        (`Store.deferred`), so a partition or dataset pays for its fsyncs once, together."""
        self._writes.commit()

    def abandon(self) -> None:
        """Stop without committing (closes the store if this writer opened it); objects not
        yet made durable by `commit_writes` are dropped."""
        if not self._closed:
            self._closed = True
            self._writes.abandon()
            if self._owns_store:
                self.store.close()

    def __enter__(self) -> DatasetWriter:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None and not self._closed:
            self.close()
        else:
            self.abandon()  # no index: the dataset stays invisible


def clear_target(store: Store, overwrite: bool) -> None:
    """Refuse (or, with overwrite, make invisible and delete) a dataset already there."""
    if not store.exists(INDEX_KEY):
        return
    if not overwrite:
        raise ObjectExistsError(
            f"{store.uri}: a dataset exists here already (pass overwrite=True to replace it)"
        )
    try:
        paths = list(load_index(store).arrays)
    except FormatError:
        paths = []
    store.delete(INDEX_KEY)  # the old dataset becomes invisible first
    for path in paths:
        for info in list(store.list(path + "/")):
            store.delete(info.key)


def open_target(uri: str | Store, store_options: Mapping[str, Any] | None) -> Store:
    """The store a dataset is written to. Local folders get ``direct_io`` unless
    `store_options` say otherwise: raw shards, built in page-aligned buffers, then go to the
    device with O_DIRECT (ckptstore/stores/direct_io.py) instead of being copied into freshly
    allocated page cache, which costs more than the write itself on the machines measured
    (docs/performance.md)."""
    options = dict(store_options or {})
    if not isinstance(uri, Store) and is_local_uri(uri):
        options.setdefault("direct_io", True)
    return open_store(uri, **options)


