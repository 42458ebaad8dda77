"""Writing datasets: samples (dicts of numpy arrays, ints, floats, bools, bytes, str) become one
sharded zarr v3 array per field (variable-length fields as data + offsets), each written by an
ArrayWriter (array_writer.py) through a thin adapter over a ckptstore Store, then
``dataset.json`` is created last.

Contract: a dataset is whole or invisible. Until `close()` creates the index, readers see no
dataset; a failed or abandoned write leaves arrays but no index. Chunk digests are taken from the
encoded bytes before they are put (no read-back). Bad samples raise TypeError/ValueError naming
the sample index and field, before anything of that sample is written.

Why one module of ~580 lines: sample validation, the choice of chunking and the index are one
write; the field writers share the block bookkeeping that the index records.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptstore.errors import FormatError, ObjectExistsError
from ckptstore.stores import Store, is_local_uri, open_store

from .array_writer import ArrayWriter, ObjectWrites
from .format import (
    INDEX_KEY,
    KINDS,
    MAX_CHUNK_NBYTES,
    MAX_INDEX_BYTES,
    MAX_METADATA_DEPTH,
    MAX_NDIM,
    MAX_ROWS_PER_CHUNK,
    DatasetIndex,
    FieldInfo,
    check_int,
    json_depth,
    load_index,
    validate_field_name,
)
from .zarr_encoding import group_metadata

__all__ = ["DatasetWriter", "write_dataset"]

_PROBE_SAMPLES = 1024
_PROBE_BYTES = 32 << 20
_MAX_CHUNKS_PER_SHARD = 1024
_COMMIT_BYTES = 256 << 20  # a deferred batch is committed once this much waits (memory, fds)


@dataclass
class _Spec:
    """A field's inferred (or declared) type."""

    name: str
    kind: str
    dtype: np.dtype
    shape: tuple[int, ...] | None = None
    ndim: int = 0


def _bad(i: int, name: str, msg: str, exc: type[Exception] = TypeError) -> Exception:
    return exc(f"sample {i}, field {name!r}: {msg}")


def _infer(i: int, name: str, value: Any, declared: str | None) -> _Spec:
    """Infer a field's spec from its first value (and an optional declared kind)."""
    if declared is not None and declared not in KINDS:
        raise ValueError(
            f"schema for field {name!r}: unknown kind {declared!r} (use one of {KINDS})"
        )
    if isinstance(value, bool | int | float | np.generic) or (
        isinstance(value, np.ndarray) and value.ndim == 0
    ):
        if isinstance(value, int) and not isinstance(value, bool):
            if not _fits_int64(value):
                raise _bad(i, name, f"int {value} does not fit in int64", ValueError)
            arr = np.asarray(value, dtype=np.int64)
        else:
            arr = np.asarray(value)
        _check_dtype(i, name, arr.dtype)
        kind = declared or "scalar"
        if kind != "scalar":
            raise _bad(i, name, f"declared {kind!r} but the value is a scalar")
        return _Spec(name, "scalar", arr.dtype)
    if isinstance(value, np.ndarray):
        _check_dtype(i, name, value.dtype)
        kind = declared or "ragged"
        if value.ndim > MAX_NDIM:
            raise _bad(i, name, f"{value.ndim} dimensions (at most {MAX_NDIM})", ValueError)
        if kind == "fixed" and 0 in value.shape:
            raise _bad(
                i, name, f"fixed shape {value.shape} is empty (declare it 'ragged')", ValueError
            )
        if kind == "fixed":
            return _Spec(name, "fixed", value.dtype, tuple(value.shape), value.ndim)
        if kind == "ragged":
            return _Spec(name, "ragged", value.dtype, None, value.ndim)
        raise _bad(i, name, f"declared {kind!r} but the value is a numpy array")
    if isinstance(value, bytes | bytearray | memoryview):
        if declared not in (None, "bytes"):
            raise _bad(i, name, f"declared {declared!r} but the value is bytes")
        return _Spec(name, "bytes", np.dtype(np.uint8), None, 1)
    if isinstance(value, str):
        if declared not in (None, "str"):
            raise _bad(i, name, f"declared {declared!r} but the value is a str")
        return _Spec(name, "str", np.dtype(np.uint8), None, 1)
    raise _bad(
        i,
        name,
        f"unsupported type {type(value).__name__} (use numpy arrays, int, float, bool, bytes, str)",
    )


def _fits_int64(v: int) -> bool:
    return -(2**63) <= v < 2**63


def _check_dtype(i: int, name: str, dt: np.dtype) -> None:
    if dt.kind not in "biufc" or dt.hasobject or dt.fields is not None:
        raise _bad(i, name, f"unsupported dtype {dt} (numeric and bool dtypes only)")


def _coerce(i: int, spec: _Spec, value: Any) -> Any:
    """Check one value against its field's spec; return what the column buffer keeps."""
    name, kind = spec.name, spec.kind
    if kind == "scalar":
        if isinstance(value, np.ndarray) and value.ndim == 0:
            value = value[()]
        if isinstance(value, bool | np.bool_):
            ok = spec.dtype.kind == "b"
        elif isinstance(value, int):
            ok = spec.dtype.kind in "iuf"
            if ok and spec.dtype.kind in "iu":
                info = np.iinfo(spec.dtype)
                if not info.min <= value <= info.max:
                    raise _bad(i, name, f"int {value} does not fit in {spec.dtype}", ValueError)
        elif isinstance(value, float):
            ok = spec.dtype.kind in "fc"
        elif isinstance(value, np.generic):
            ok = np.can_cast(value.dtype, spec.dtype, "safe")
        else:
            ok = False
        if not ok:
            raise _bad(
                i, name, f"expected a {spec.dtype} scalar, got {type(value).__name__} {value!r:.40}"
            )
        return value
    if kind in ("fixed", "ragged"):
        if not isinstance(value, np.ndarray):
            raise _bad(
                i, name, f"expected a numpy array of {spec.dtype}, got {type(value).__name__}"
            )
        if not np.can_cast(value.dtype, spec.dtype, "safe"):
            raise _bad(i, name, f"expected dtype {spec.dtype}, got {value.dtype}")
        if kind == "fixed" and value.shape != spec.shape:
            raise _bad(
                i,
                name,
                f"expected shape {spec.shape}, got {value.shape} (declare the field "
                "'ragged' in schema= for variable shapes)",
                ValueError,
            )
        if kind == "ragged" and value.ndim != spec.ndim:
            raise _bad(
                i, name, f"expected {spec.ndim} dimensions, got shape {value.shape}", ValueError
            )
        return value
    if kind == "bytes":
        if not isinstance(value, bytes | bytearray | memoryview):
            raise _bad(i, name, f"expected bytes, got {type(value).__name__}")
        return bytes(value)
    if not isinstance(value, str):
        raise _bad(i, name, f"expected str, got {type(value).__name__}")
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _bad(i, name, f"str is not encodable as UTF-8 ({exc.reason})", ValueError) from None


def _as_stored(value: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """`value`'s elements in the field's (little-endian) dtype, C-contiguous: a view when
    they already are."""
    return np.ascontiguousarray(value, dtype=np.dtype(dtype).newbyteorder("<"))


def _value_nbytes(spec: _Spec, v: Any) -> int:
    if spec.kind == "scalar":
        return spec.dtype.itemsize
    if spec.kind in ("fixed", "ragged"):
        return int(v.size) * spec.dtype.itemsize + (8 if spec.kind == "ragged" else 0)
    return len(v) + 8


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
        self._specs: dict[str, _Spec] | None = None
        self._probe_specs: dict[str, _Spec] | None = None
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
        if not self.store.exists(INDEX_KEY):
            return
        if not overwrite:
            raise ObjectExistsError(
                f"{self.store.uri}: a dataset exists here already"
                " (pass overwrite=True to replace it)"
            )
        try:
            paths = list(load_index(self.store).arrays)
        except FormatError:
            paths = []
        self.store.delete(INDEX_KEY)  # the old dataset becomes invisible first
        for path in paths:
            for info in list(self.store.list(path + "/")):
                self.store.delete(info.key)

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
            self._probe_bytes += sum(_value_nbytes(specs[k], v) for k, v in row.items())
            if len(self._probe) >= _PROBE_SAMPLES or self._probe_bytes >= _PROBE_BYTES:
                self._start()
        else:
            self._push(row)

    def _check_sample(
        self, i: int, sample: Mapping[str, Any], specs: dict[str, _Spec]
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
            k: sum(_value_nbytes(s, r[k]) for r in self._probe) / n for k, s in specs.items()
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
            elems = sum(_value_nbytes(spec, r[name]) - 8 for r in self._probe) // item
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
                self._arrays[name].append_parts(_as_stored(v, spec.dtype) for v in vals)
                continue
            data = self._arrays[f"{name}/data"]
            if spec.kind == "ragged":
                lengths = np.fromiter((v.size for v in vals), dtype=np.int64, count=len(vals))
                data.append_parts(_as_stored(v, spec.dtype) for v in vals)
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


def infer_specs(i: int, sample: Mapping[str, Any], schema: Mapping[str, str]) -> dict[str, _Spec]:
    """The fields' specs, from sample `i` (the first) and the declared kinds."""
    if not sample:
        raise ValueError(f"sample {i}: a sample needs at least one field")
    specs = {}
    for name, value in sample.items():
        validate_field_name(name)
        specs[name] = _infer(i, name, value, schema.get(name))
    unknown = set(schema) - set(specs)
    if unknown:
        raise ValueError(f"sample {i}: schema names fields {sorted(unknown)} not in the sample")
    return specs


def check_sample(i: int, sample: Mapping[str, Any], specs: dict[str, _Spec]) -> dict[str, Any]:
    """Check sample `i` against the specs; return its values as the writer keeps them."""
    keys = set(sample)
    if keys != set(specs):
        missing, extra = sorted(set(specs) - keys), sorted(keys - set(specs))
        parts = ([f"missing field(s) {missing}"] if missing else []) + (
            [f"unexpected field(s) {extra}"] if extra else []
        )
        raise ValueError(f"sample {i}: {', '.join(parts)} (fields are {sorted(specs)})")
    return {name: _coerce(i, spec, sample[name]) for name, spec in specs.items()}


def choose_rows_per_chunk(
    specs: Mapping[str, _Spec], probe: list[dict[str, Any]], chunk_bytes: int, final: bool
) -> int:
    """Samples per block: about `chunk_bytes` of the probe's average row, at most 65,536, and
    (when the probe is the whole dataset) at most the number of samples."""
    n = max(1, len(probe))
    per_field = {k: sum(_value_nbytes(s, r[k]) for r in probe) / n for k, s in specs.items()}
    row_bytes = max(1.0, sum(per_field.values()))
    R = int(min(max(1, chunk_bytes // row_bytes), 1 << 16))
    return max(1, min(R, len(probe))) if final else R


def as_samples(samples: Any) -> Any:
    """`samples` as an iterable of sample dicts: a Hugging Face dataset object, a source path
    or a Source is read through dataloader.sources; anything else is returned as it is."""
    from .sources import Source, open_source
    from .sources.hf import dataset_samples, is_hf_dataset

    if is_hf_dataset(samples):
        return dataset_samples(samples)
    if isinstance(samples, os.PathLike):
        return open_source(os.fspath(samples)).samples()
    if isinstance(samples, Source):
        return samples.samples()
    return samples


def write_dataset(
    uri: str | Store,
    samples: Iterable[Mapping[str, Any]] | os.PathLike[str] | Any,
    *,
    workers: int | None = None,
    partition_rows: int | None = None,
    **options: Any,
) -> DatasetIndex:
    """Write `samples` as a dataset at `uri` and return its index. See DatasetWriter for
    options (schema, rows_per_chunk, chunk_bytes, shard_bytes, compression, metadata,
    overwrite, store_options).

    `workers`: None writes one stream (a v1 dataset, arrays at the root). An int (0: the
    number of cores) encodes and writes partitions of `partition_rows` samples on that many
    threads and commits them (a partitioned dataset, see partitions.py); the result is the
    same, byte for byte, for every number of workers. `executor="processes"` uses forked
    processes instead of threads (see partitions.write_dataset_parallel).

    `samples` may also be a Hugging Face ``datasets.Dataset`` / ``IterableDataset`` (its
    rows, read as Arrow batches), a path (``pathlib.Path``) of any source `ckpt-data convert`
    reads (format detected), or a `dataloader.sources.Source` (``open_source(path, ...)``)."""
    samples = as_samples(samples)
    if workers is not None or partition_rows is not None or "executor" in options:
        from .partitions import write_dataset_parallel

        return write_dataset_parallel(
            uri, samples, workers=workers or None, partition_rows=partition_rows, **options
        )
    with DatasetWriter(uri, **options) as writer:
        for sample in samples:
            writer.add(sample)
        return writer.close()
