"""The dataset index document (``dataset.json``): what a dataset holds and where.

Layout of a dataset under its store root::

    zarr.json                    zarr v3 group (root)
    <field>/...                  fixed/scalar field: one zarr array, rows along dim 0
    <field>/data, <field>/offsets[, <field>/shapes]
                                 variable-length field: flat data + int64 offsets (N+1)
    dataset.json                 this index, written last and create-only (the commit)

Every zarr array is sharded; chunks are stored raw (``bytes`` codec) or zstd-compressed. All
row-indexed arrays (fixed, scalar, offsets, shapes) share ``rows_per_chunk`` (R): chunk ``b``
of each of them holds the rows of *block* ``b`` (samples ``[b*R, (b+1)*R)``). Data arrays of
variable-length fields are chunked by element count; the index keeps each block's element
bounds (``block_bounds``), so a reader needs no offsets from a neighbouring block.

The index records per shard its size, the digest of its shard-index tail, and the xxh3-128
digest of every stored chunk. ``fingerprint`` = digest of the canonical JSON of everything
else: two datasets with equal content have equal fingerprints. JSON only, never pickle.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptstore.errors import FormatError
from ckptstore.hashing import HASH_NAME, check_digest, digest

FORMAT_NAME = "ckptstore.dataloader"
FORMAT_VERSION = 1
INDEX_KEY = "dataset.json"
KINDS = ("scalar", "fixed", "ragged", "bytes", "str")
COMPRESSORS = (None, "zstd")
EMPTY = 2**64 - 1  # zarr's marker for an absent chunk in a shard index
_FIELD_RE = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")


def validate_field_name(name: object) -> str:
    """Return `name` if usable as a field (and store key part), else raise ValueError."""
    if not isinstance(name, str) or _FIELD_RE.fullmatch(name) is None:
        raise ValueError(
            f"invalid field name {name!r}: use 1-64 characters [A-Za-z0-9_-],"
            " starting with a letter"
        )
    return name


def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


@dataclass(frozen=True)
class ShardInfo:
    """One shard object: total size, digest of its index tail, digest per chunk (None = absent)."""

    nbytes: int
    index_digest: str
    chunks: tuple[str | None, ...]

    def to_json(self) -> dict[str, Any]:
        return {"nbytes": self.nbytes, "index": self.index_digest, "chunks": list(self.chunks)}

    @classmethod
    def from_json(cls, d: Any, where: str) -> ShardInfo:
        _need(d, dict, where)
        chunks = tuple(
            None if c is None else check_digest(c, f"{where}.chunks")
            for c in _get(d, "chunks", list, where)
        )
        return cls(_int(d, "nbytes", where), check_digest(d.get("index"), f"{where}.index"), chunks)


@dataclass(frozen=True)
class ArrayInfo:
    """One zarr array of the dataset: its path, dtype, shape, chunking and shards."""

    path: str
    dtype: str
    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    chunks_per_shard: int
    compressor: str | None
    shards: tuple[ShardInfo, ...]

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(self.dtype)

    @property
    def chunk_nbytes(self) -> int:
        """Decoded size of one chunk (every chunk is stored at full size, the last padded)."""
        return math.prod(self.chunk_shape) * self.np_dtype.itemsize

    @property
    def num_chunks(self) -> int:
        return -(-self.shape[0] // self.chunk_shape[0]) if self.shape[0] else 0

    @property
    def index_nbytes(self) -> int:
        return 16 * self.chunks_per_shard + 4  # (offset, nbytes) uint64 pairs + crc32c

    def shard_key(self, shard: int) -> str:
        return f"{self.path}/c/{shard}" + "/0" * (len(self.shape) - 1)

    def chunk_digest(self, chunk: int) -> str:
        s, i = divmod(chunk, self.chunks_per_shard)
        d = self.shards[s].chunks[i]
        if d is None:
            raise FormatError(f"array {self.path!r}: chunk {chunk} is recorded as absent")
        return d

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "chunk_shape": list(self.chunk_shape),
            "chunks_per_shard": self.chunks_per_shard,
            "compressor": self.compressor,
            "shards": [s.to_json() for s in self.shards],
        }

    @classmethod
    def from_json(cls, d: Any, where: str) -> ArrayInfo:
        _need(d, dict, where)
        info = cls(
            path=_get(d, "path", str, where),
            dtype=_dtype(d.get("dtype"), where),
            shape=tuple(_ints(d, "shape", where)),
            chunk_shape=tuple(_ints(d, "chunk_shape", where)),
            chunks_per_shard=_int(d, "chunks_per_shard", where),
            compressor=d.get("compressor"),
            shards=tuple(
                ShardInfo.from_json(s, f"{where}.shards[{i}]")
                for i, s in enumerate(_get(d, "shards", list, where))
            ),
        )
        if info.compressor not in COMPRESSORS:
            raise FormatError(f"{where}: unknown compressor {info.compressor!r}")
        if len(info.chunk_shape) != len(info.shape) or info.chunks_per_shard < 1:
            raise FormatError(f"{where}: inconsistent chunk shape or shard size")
        want = -(-info.num_chunks // info.chunks_per_shard)
        if len(info.shards) != want or any(
            len(s.chunks) != info.chunks_per_shard for s in info.shards
        ):
            raise FormatError(f"{where}: expected {want} shards of {info.chunks_per_shard} chunks")
        return info


@dataclass(frozen=True)
class FieldInfo:
    """One sample field. `arrays` maps role -> array path: 'values' for scalar/fixed fields;
    'data', 'offsets' (and 'shapes' for ragged ndim > 1) for variable-length ones."""

    name: str
    kind: str
    dtype: str
    shape: tuple[int, ...] | None  # fixed: per-sample shape
    ndim: int  # per-sample number of dimensions (0 for scalar; 1 for bytes/str)
    arrays: dict[str, str]
    block_bounds: tuple[int, ...] | None  # variable: data element index at each block start

    @property
    def variable(self) -> bool:
        return self.kind in ("ragged", "bytes", "str")

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "name": self.name,
            "kind": self.kind,
            "dtype": self.dtype,
            "ndim": self.ndim,
            "arrays": dict(self.arrays),
        }
        if self.shape is not None:
            d["shape"] = list(self.shape)
        if self.block_bounds is not None:
            d["block_bounds"] = list(self.block_bounds)
        return d

    @classmethod
    def from_json(cls, d: Any, where: str) -> FieldInfo:
        _need(d, dict, where)
        kind = _get(d, "kind", str, where)
        if kind not in KINDS:
            raise FormatError(f"{where}: unknown field kind {kind!r}")
        arrays = _get(d, "arrays", dict, where)
        roles = {"values"} if kind in ("scalar", "fixed") else {"data", "offsets"}
        if not roles <= set(arrays) or not all(isinstance(v, str) for v in arrays.values()):
            raise FormatError(f"{where}: arrays must name {sorted(roles)}")
        shape = tuple(_ints(d, "shape", where)) if "shape" in d else None
        bounds = tuple(_ints(d, "block_bounds", where)) if "block_bounds" in d else None
        if kind == "fixed" and shape is None:
            raise FormatError(f"{where}: a fixed field needs 'shape'")
        if kind in ("ragged", "bytes", "str") and bounds is None:
            raise FormatError(f"{where}: a variable-length field needs 'block_bounds'")
        return cls(
            name=validate_field_name(_get(d, "name", str, where)),
            kind=kind,
            dtype=_dtype(d.get("dtype"), where),
            shape=shape,
            ndim=_int(d, "ndim", where),
            arrays=dict(arrays),
            block_bounds=bounds,
        )


@dataclass(frozen=True)
class DatasetIndex:
    """The parsed, validated ``dataset.json``."""

    num_samples: int
    rows_per_chunk: int
    fields: tuple[FieldInfo, ...]
    arrays: dict[str, ArrayInfo]
    metadata: dict[str, Any]
    fingerprint: str

    @property
    def num_blocks(self) -> int:
        return -(-self.num_samples // self.rows_per_chunk) if self.num_samples else 0

    def block_rows(self) -> np.ndarray:
        """Samples per block (all R except possibly the last)."""
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

    def body(self) -> dict[str, Any]:
        """Everything the fingerprint covers."""
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
    def from_bytes(cls, raw: bytes, where: str = INDEX_KEY) -> DatasetIndex:
        try:
            d = json.loads(raw)
        except (UnicodeDecodeError, ValueError) as exc:
            raise FormatError(f"{where}: not valid JSON ({exc})") from None
        _need(d, dict, where)
        if d.get("format") != FORMAT_NAME:
            raise FormatError(
                f"{where}: not a dataloader dataset index (format={d.get('format')!r})"
            )
        if d.get("version") != FORMAT_VERSION:
            raise FormatError(
                f"{where}: unsupported version {d.get('version')!r} (want {FORMAT_VERSION})"
            )
        if d.get("hash") != HASH_NAME:
            raise FormatError(f"{where}: unsupported hash {d.get('hash')!r}")
        arrays = {
            k: ArrayInfo.from_json(v, f"{where}.arrays.{k}")
            for k, v in _get(d, "arrays", dict, where).items()
        }
        fields = tuple(
            FieldInfo.from_json(f, f"{where}.fields[{i}]")
            for i, f in enumerate(_get(d, "fields", list, where))
        )
        metadata = d.get("metadata", {})
        _need(metadata, dict, f"{where}.metadata")
        idx = cls(
            num_samples=_int(d, "num_samples", where),
            rows_per_chunk=_int(d, "rows_per_chunk", where),
            fields=fields,
            arrays=arrays,
            metadata=metadata,
            fingerprint=check_digest(d.get("fingerprint"), f"{where}.fingerprint"),
        )
        if idx.rows_per_chunk < 1:
            raise FormatError(f"{where}: rows_per_chunk must be >= 1")
        if cls.compute_fingerprint(idx.body()) != idx.fingerprint:
            raise FormatError(f"{where}: fingerprint does not match the index content (corrupt?)")
        idx._check_consistency(where)
        return idx

    def _check_consistency(self, where: str) -> None:
        n, nb = self.num_samples, self.num_blocks
        for f in self.fields:
            for role, path in f.arrays.items():
                a = self.arrays.get(path)
                if a is None:
                    raise FormatError(f"{where}: field {f.name!r} names unknown array {path!r}")
                if role != "data":
                    rows = n + 1 if role == "offsets" else n
                    if a.shape[0] != rows or a.chunk_shape[0] != self.rows_per_chunk:
                        raise FormatError(f"{where}: array {path!r} has the wrong row count/chunks")
            if f.block_bounds is not None:
                b = f.block_bounds
                data = self.arrays[f.arrays["data"]]
                if (
                    len(b) != nb + 1
                    or b[0] != 0
                    or b[-1] != data.shape[0]
                    or any(x > y for x, y in zip(b, b[1:], strict=False))
                ):
                    raise FormatError(f"{where}: field {f.name!r} has bad block_bounds")


# -- small JSON validation helpers -------------------------------------------------------
def _need(value: Any, typ: type, where: str) -> None:
    if not isinstance(value, typ):
        raise FormatError(f"{where}: expected {typ.__name__}, got {type(value).__name__}")


def _get(d: dict, key: str, typ: type, where: str) -> Any:
    if key not in d:
        raise FormatError(f"{where}: missing {key!r}")
    _need(d[key], typ, f"{where}.{key}")
    return d[key]


def _int(d: dict, key: str, where: str) -> int:
    v = d.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise FormatError(f"{where}.{key}: expected a non-negative int, got {v!r}")
    return v


def _ints(d: dict, key: str, where: str) -> list[int]:
    v = _get(d, key, list, where)
    if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
        raise FormatError(f"{where}.{key}: expected a list of non-negative ints")
    return v


def _dtype(v: Any, where: str) -> str:
    try:
        dt = np.dtype(v)
    except TypeError:
        raise FormatError(f"{where}: bad dtype {v!r}") from None
    if dt.kind not in "biufc" or dt.hasobject:
        raise FormatError(f"{where}: unsupported dtype {v!r}")
    return dt.str
