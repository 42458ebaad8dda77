"""The dataset index document (``dataset.json``): what a dataset holds and where.

The layout of a dataset under its store root is in spec.py. Every zarr array is sharded;
chunks are stored raw (``bytes`` codec) or zstd-compressed. All row-indexed arrays (fixed,
scalar, offsets, shapes) share ``rows_per_chunk`` (R): chunk ``b`` of each of them holds the
rows of *block* ``b`` (samples ``[b*R, (b+1)*R)``). Data arrays of variable-length fields are
chunked by element count; the index keeps each block's element bounds (``block_bounds``), so a
reader needs no offsets from a neighbouring block.

The index records per shard its size, the digest of its shard-index tail, and the xxh3-128
digest of every stored chunk (arrays.py). ``fingerprint`` = digest of the canonical JSON of
everything else: two datasets with equal content have equal fingerprints. JSON only, never
pickle.

The index is untrusted input: `DatasetIndex.from_bytes` checks every field (exact key sets,
exact int types, the dtypes and limits of spec.py, each array against its field) before
anything is sized from it, and `load_index` refuses an object over MAX_INDEX_BYTES from its
size alone. Every failure is a FormatError naming the field.

A partitioned dataset (format version 2, written by `commit_dataset`) lists partitions, each
the layout above under its own prefix ``parts/<index>/`` and each validated as a v1 index of
its own arrays; blocks are numbered across partitions in order, and a partition's last block
may be short (see write/partitions.py and docs/dataloader.md).

Why one module of ~400 lines: the index schema, its two versions and the cross-checks between
its fields and arrays, kept together so that each rule is stated once.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import Executor
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ckptstore.errors import FormatError, ObjectNotFoundError
from ckptstore.stores import Store
from ckptstore.toolkit import HASH_NAME, canonical_json, digest

from .arrays import ArrayInfo
from .fields import FieldInfo
from .spec import (
    FORMAT_NAME,
    FORMAT_VERSION,
    INDEX_KEY,
    MAX_INDEX_BYTES,
    MAX_METADATA_DEPTH,
    MAX_ROWS_PER_CHUNK,
    MAX_ZARR_JSON_BYTES,
    PARTITION_PREFIX,
    PARTITIONED_VERSION,
    partition_prefix,
)
from .validate import (
    check_digest,
    check_int,
    check_keys,
    get_int,
    get_typed,
    json_depth,
    parse_json,
    read_capped,
    same_json,
    short_repr,
)

_PARTITION_RE = re.compile(r"parts/[0-9]{6,12}")
_INDEX_KEYS = (
    "format", "version", "hash", "num_samples", "rows_per_chunk", "fields", "arrays",
    "metadata", "fingerprint",
)  # fmt: skip

_PARTITIONED_KEYS = (
    "format", "version", "hash", "num_samples", "rows_per_chunk", "partitions", "metadata",
    "fingerprint",
)  # fmt: skip
_PART_KEYS = ("prefix", "num_samples", "rows_per_chunk", "fields", "arrays")


def _legacy_canonical_json(obj: Any) -> bytes:
    """The canonical JSON of indexes written before the dataloader shared ckptstore's (it
    escaped non-ASCII characters): kept only to check those indexes' fingerprints."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def load_index(store: Store) -> DatasetIndex:
    """Read and validate the store's dataset.json (ObjectNotFoundError if it is missing)."""
    where = f"{store.uri}/{INDEX_KEY}"
    return DatasetIndex.from_bytes(read_capped(store, INDEX_KEY, MAX_INDEX_BYTES, where), where)


def check_zarr_metadata(
    store: Store, index: DatasetIndex, paths: list[str], prefix: str = "",
    executor: Executor | None = None,
) -> None:
    """Check that the zarr metadata (``<prefix><path>/zarr.json``) of each array agrees with
    the index: a forged index must not make the reader reinterpret stored bytes. With an
    `executor` the reads run concurrently (the first failure is raised)."""

    def check(path: str) -> None:
        key = f"{prefix}{path}/zarr.json"
        where = f"{store.uri}/{key}"
        try:
            raw = read_capped(store, key, MAX_ZARR_JSON_BYTES, where)
        except ObjectNotFoundError:
            raise FormatError(f"{where}: missing (the dataset is incomplete)") from None
        index.arrays[path].check_zarr(parse_json(raw, where), where)

    if executor is None:
        for path in paths:
            check(path)
        return
    for fut in [executor.submit(check, path) for path in paths]:
        fut.result()


@dataclass(frozen=True)
class DatasetIndex:
    """The parsed, validated ``dataset.json``."""

    num_samples: int
    rows_per_chunk: int
    fields: tuple[FieldInfo, ...]
    arrays: dict[str, ArrayInfo]
    metadata: dict[str, Any]
    fingerprint: str
    #: (prefix, sub-index) per partition, in order; empty for a v1 (single-stream) dataset.
    #: A sub-index is a v1 index of the partition's own arrays (paths relative to its prefix).
    partitions: tuple[tuple[str, DatasetIndex], ...] = ()

    @property
    def num_blocks(self) -> int:
        if self.partitions:
            return sum(p.num_blocks for _, p in self.partitions)
        return -(-self.num_samples // self.rows_per_chunk) if self.num_samples else 0

    def block_starts(self) -> np.ndarray:
        """First sample id of each block (b*R for a v1 dataset; a partition's last block may
        be short, so a partitioned dataset's blocks need not all hold R samples)."""
        rows = self.block_rows()
        return np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(np.int64)

    def block_rows(self) -> np.ndarray:
        """Samples per block (all R except possibly the last of each partition)."""
        if self.partitions:
            return np.concatenate(
                [np.zeros(0, np.int64)] + [p.block_rows() for _, p in self.partitions]
            )
        n, r = self.num_samples, self.rows_per_chunk
        rows = np.full(self.num_blocks, r, dtype=np.int64)
        if n % r:
            rows[-1] = n % r
        return rows

    def field(self, name: str) -> FieldInfo:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(f"dataset has no field {name!r} (fields: {[f.name for f in self.fields]})")

    def block_nbytes(self, fields: tuple[FieldInfo, ...] | None = None) -> np.ndarray:
        """Approximate decoded bytes per block over the fields' arrays (for prefetch budgets)."""
        if self.partitions:
            names = [f.name for f in (fields if fields is not None else self.fields)]
            return np.concatenate(
                [np.zeros(0, np.int64)]
                + [p.block_nbytes(tuple(p.field(n) for n in names)) for _, p in self.partitions]
            )
        rows = self.block_rows()
        total = np.zeros(self.num_blocks, dtype=np.int64)
        for f in fields if fields is not None else self.fields:
            if f.variable:
                item = np.dtype(f.dtype).itemsize
                bounds = np.asarray(f.block_bounds, dtype=np.int64)
                total += np.diff(bounds) * item + 8 * rows
                if "shapes" in f.arrays:
                    total += 8 * f.ndim * rows
            else:
                a = self.arrays[f.arrays["values"]]
                total += rows * (a.chunk_nbytes // a.chunk_shape[0])
        return total

    def part_body(self) -> dict[str, Any]:
        """A partition's entry in a partitioned index (without its prefix)."""
        return {
            "num_samples": self.num_samples,
            "rows_per_chunk": self.rows_per_chunk,
            "fields": [f.to_json() for f in self.fields],
            "arrays": {k: a.to_json() for k, a in sorted(self.arrays.items())},
        }

    def body(self) -> dict[str, Any]:
        """Everything the fingerprint covers."""
        if self.partitions:
            return {
                "format": FORMAT_NAME,
                "version": PARTITIONED_VERSION,
                "hash": HASH_NAME,
                "num_samples": self.num_samples,
                "rows_per_chunk": self.rows_per_chunk,
                "partitions": [{"prefix": k, **p.part_body()} for k, p in self.partitions],
                "metadata": self.metadata,
            }
        return {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "hash": HASH_NAME,
            "num_samples": self.num_samples,
            "rows_per_chunk": self.rows_per_chunk,
            "fields": [f.to_json() for f in self.fields],
            "arrays": {k: a.to_json() for k, a in sorted(self.arrays.items())},
            "metadata": self.metadata,
        }

    def to_bytes(self) -> bytes:
        return canonical_json({**self.body(), "fingerprint": self.fingerprint})

    @staticmethod
    def compute_fingerprint(body: dict[str, Any]) -> str:
        return digest(canonical_json(body))

    @classmethod
    def from_bytes(
        cls, raw: bytes | bytearray | memoryview, where: str = INDEX_KEY
    ) -> DatasetIndex:
        """Parse and validate untrusted index bytes; FormatError naming the field if any
        check fails (structure and types, limits, fingerprint, then cross-references)."""
        if len(raw) > MAX_INDEX_BYTES:
            raise FormatError(f"{where}: larger than the {MAX_INDEX_BYTES:,}-byte limit")
        d = parse_json(raw, where)
        partitioned = isinstance(d, dict) and same_json(d.get("version"), PARTITIONED_VERSION)
        check_keys(d, where, _PARTITIONED_KEYS if partitioned else _INDEX_KEYS)
        version = PARTITIONED_VERSION if partitioned else FORMAT_VERSION
        for key, want in (("format", FORMAT_NAME), ("version", version)):
            if not same_json(d[key], want):
                raise FormatError(
                    f"{where}: {key} {short_repr(d[key])} is not supported (want {want!r}; "
                    "is this a dataloader dataset index?)"
                )
        if d["hash"] != HASH_NAME:
            raise FormatError(f"{where}: unsupported hash {short_repr(d['hash'])}")
        metadata = get_typed(d, "metadata", dict, where)
        if json_depth(metadata, MAX_METADATA_DEPTH) > MAX_METADATA_DEPTH:
            raise FormatError(f"{where}.metadata: nested deeper than {MAX_METADATA_DEPTH} levels")
        num_samples = get_int(d, "num_samples", where)
        rows_per_chunk = check_int(
            d["rows_per_chunk"], f"{where}.rows_per_chunk", 1, MAX_ROWS_PER_CHUNK
        )
        if partitioned:
            idx = cls.parse_partitioned(d, where, num_samples, rows_per_chunk, metadata)
        else:
            idx = cls._single(d, where, num_samples, rows_per_chunk, metadata)
        try:
            fingerprint = cls.compute_fingerprint(idx.body())
        except (ValueError, RecursionError) as exc:  # cannot happen after the checks above
            raise FormatError(f"{where}: cannot compute the fingerprint ({exc})") from None
        if fingerprint != idx.fingerprint and (
                digest(_legacy_canonical_json(idx.body())) != idx.fingerprint):
            raise FormatError(f"{where}: fingerprint does not match the index content (corrupt?)")
        if not partitioned:
            idx._check_consistency(where)
        return idx

    @classmethod
    def parse_partitioned(
        cls, d: dict[str, Any], where: str, n: int, r: int, metadata: dict[str, Any]
    ) -> DatasetIndex:
        """A v2 index: each partition is checked as a v1 index of its own arrays; together
        they must have one schema, strictly increasing prefixes and add up to the totals."""
        raw_parts = get_typed(d, "partitions", list, where)
        if not raw_parts:
            raise FormatError(f"{where}.partitions: a dataset needs at least one partition")
        parts: list[tuple[str, DatasetIndex]] = []
        for i, p in enumerate(raw_parts):
            at = f"{where}.partitions[{i}]"
            check_keys(p, at, _PART_KEYS)
            prefix = get_typed(p, "prefix", str, at)
            if _PARTITION_RE.fullmatch(prefix) is None or prefix != partition_prefix(
                int(prefix[len(PARTITION_PREFIX) :])
            ):
                raise FormatError(f"{at}.prefix: {short_repr(prefix)} is not parts/<number>")
            number = int(prefix[len(PARTITION_PREFIX) :])
            if parts and number <= int(parts[-1][0][len(PARTITION_PREFIX) :]):
                raise FormatError(f"{at}.prefix: partitions must be in increasing order")
            sub = cls._single(
                p,
                at,
                get_int(p, "num_samples", at),
                check_int(p["rows_per_chunk"], f"{at}.rows_per_chunk", 1, MAX_ROWS_PER_CHUNK),
                {},
            )
            sub._check_consistency(at)
            if sub.num_samples == 0:
                raise FormatError(f"{at}.num_samples: an empty partition is not listed")
            if parts and schema_of(sub) != schema_of(parts[0][1]):
                raise FormatError(f"{at}.fields: the schema differs from partition 0's")
            parts.append((prefix, sub))
        if n != sum(p.num_samples for _, p in parts):
            raise FormatError(f"{where}.num_samples: {n} is not the partitions' total")
        if r != max(p.rows_per_chunk for _, p in parts):
            raise FormatError(f"{where}.rows_per_chunk: {r} is not the partitions' largest")
        return cls.stitch(parts, metadata, check_digest(d["fingerprint"], f"{where}.fingerprint"))

    @classmethod
    def stitch(
        cls, parts: list[tuple[str, DatasetIndex]], metadata: dict[str, Any], fingerprint: str
    ) -> DatasetIndex:
        """The dataset-level view of partitions: fields with global block_bounds (role paths
        relative, as in a partition), arrays under their full prefixed paths."""
        fields = []
        for f in parts[0][1].fields:
            bounds = None
            if f.variable:
                acc, out = 0, [0]
                for _, p in parts:
                    b = p.field(f.name).block_bounds
                    assert b is not None
                    out += [acc + x for x in b[1:]]
                    acc += b[-1]
                bounds = tuple(out)
            fields.append(replace(f, block_bounds=bounds))
        arrays = {
            f"{k}/{path}": replace(a, path=f"{k}/{path}")
            for k, p in parts
            for path, a in p.arrays.items()
        }
        return cls(
            num_samples=sum(p.num_samples for _, p in parts),
            rows_per_chunk=max(p.rows_per_chunk for _, p in parts),
            fields=tuple(fields),
            arrays=arrays,
            metadata=metadata,
            fingerprint=fingerprint,
            partitions=tuple(parts),
        )

    def array_paths(self, fields: tuple[FieldInfo, ...]) -> list[str]:
        """Full paths of the arrays the given fields read (in every partition)."""
        if self.partitions:
            return sorted(
                f"{k}/{path}"
                for k, p in self.partitions
                for f in fields
                for path in p.field(f.name).arrays.values()
            )
        return sorted(path for f in fields for path in f.arrays.values())

    @classmethod
    def _single(
        cls, d: dict[str, Any], where: str, num_samples: int, rows_per_chunk: int,
        metadata: dict[str, Any],
    ) -> DatasetIndex:
        arrays: dict[str, ArrayInfo] = {}
        for k, v in get_typed(d, "arrays", dict, where).items():
            at = f"{where}.arrays[{short_repr(k)}]"
            arrays[k] = ArrayInfo.from_json(v, at)
            if arrays[k].path != k:
                raise FormatError(f"{at}.path: {short_repr(arrays[k].path)} differs from its key")
        fields = tuple(
            FieldInfo.from_json(f, f"{where}.fields[{i}]")
            for i, f in enumerate(get_typed(d, "fields", list, where))
        )
        fp = d.get("fingerprint", "0" * 32)
        return cls(
            num_samples=num_samples,
            rows_per_chunk=rows_per_chunk,
            fields=fields,
            arrays=arrays,
            metadata=metadata,
            fingerprint=check_digest(fp, f"{where}.fingerprint"),
        )

    def _check_consistency(self, where: str) -> None:
        """Cross-references: unique fields, each field's arrays present with the dtype, shape
        and chunking the field implies, every array used, block_bounds matching the data."""
        if not self.fields:
            raise FormatError(f"{where}.fields: a dataset needs at least one field")
        names = [f.name for f in self.fields]
        if len(set(names)) != len(names):
            raise FormatError(f"{where}.fields: duplicate field names in {short_repr(names)}")
        n, nb, used = self.num_samples, self.num_blocks, set()
        for f in self.fields:
            at = f"{where}: field {f.name!r}"
            for role, (dtype, shape, chunks) in f.array_layout(n, self.rows_per_chunk).items():
                path = f.arrays[role]
                a = self.arrays.get(path)
                if a is None:
                    raise FormatError(f"{at} names unknown array {path!r}")
                used.add(path)
                if a.dtype != dtype:
                    raise FormatError(f"{at}: array {path!r} has dtype {a.dtype}, expected {dtype}")
                if shape is None:
                    shape, chunks = (a.shape[0],), (a.chunk_shape[0],)  # 1-D data array
                if a.shape != shape or a.chunk_shape != chunks:
                    raise FormatError(
                        f"{at}: array {path!r} has shape {a.shape} in chunks {a.chunk_shape}, "
                        f"expected {shape} in chunks {chunks} (rows must match num_samples)"
                    )
            if f.block_bounds is not None:
                b = f.block_bounds
                data = self.arrays[f.arrays["data"]]
                if (
                    len(b) != nb + 1
                    or b[0] != 0
                    or b[-1] != data.shape[0]
                    or any(x > y for x, y in zip(b, b[1:], strict=False))
                ):
                    raise FormatError(f"{at} has bad block_bounds")
        unused = sorted(set(self.arrays) - used)
        if unused:
            raise FormatError(f"{where}.arrays: {short_repr(unused)} not used by any field")


def schema_of(index: DatasetIndex) -> list[tuple[Any, ...]]:
    """What partitions must share: each field's name, kind, dtype, shape and ndim."""
    return [(f.name, f.kind, f.dtype, f.shape, f.ndim) for f in index.fields]
