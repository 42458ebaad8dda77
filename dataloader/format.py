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

The index is untrusted input: `DatasetIndex.from_bytes` checks every field (exact key sets,
exact int types, the dtypes and limits below, each array against its field) before anything
is sized from it, and `load_index` refuses an object over MAX_INDEX_BYTES from its size alone.
Every failure is a FormatError naming the field.

A partitioned dataset (format version 2, written by `commit_dataset`) lists partitions, each
the layout above under its own prefix ``parts/<index>/`` and each validated as a v1 index of
its own arrays; blocks are numbered across partitions in order, and a partition's last block
may be short (see partitions.py and docs/dataloader.md).

Why one module of ~860 lines: the index schema and every validator of untrusted index
fields, kept together so that each rule is stated once next to the field it guards.
"""

from __future__ import annotations

import json
import math
import re
import reprlib
from concurrent.futures import Executor
from dataclasses import dataclass, replace
from typing import Any, TypeGuard

import numpy as np

from ckptstore.errors import FormatError, ObjectNotFoundError
from ckptstore.format.canonical import canonical_json
from ckptstore.format.hashing import HASH_NAME, digest, is_digest
from ckptstore.stores import Store

FORMAT_NAME = "ckptstore.dataloader"
FORMAT_VERSION = 1
#: Version of an index made of partitions (`commit_dataset`): each partition is a v1-shaped
#: set of arrays under ``parts/<index>/``; the index lists them in order.
PARTITIONED_VERSION = 2
PARTITION_PREFIX = "parts/"
_PARTITION_RE = re.compile(r"parts/[0-9]{6,12}")
INDEX_KEY = "dataset.json"
KINDS = ("scalar", "fixed", "ragged", "bytes", "str")
COMPRESSORS = (None, "zstd")
EMPTY = 2**64 - 1  # zarr's marker for an absent chunk in a shard index
_FIELD_RE = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")

# -- limits (documented in docs/dataloader.md) -------------------------------------------
INT64_MAX = 2**63 - 1
#: A dataset.json larger than this is refused from its size alone, before it is read.
MAX_INDEX_BYTES = 256 << 20
#: Likewise for an array's zarr.json (a few hundred bytes in practice).
MAX_ZARR_JSON_BYTES = 1 << 20
#: Nesting depth of the free-form `metadata` object.
MAX_METADATA_DEPTH = 32
#: Dimensions of one sample of a field.
MAX_NDIM = 32
#: Samples per block (the writer's own default is at most 65,536).
MAX_ROWS_PER_CHUNK = 1 << 20
#: Decoded bytes of one chunk: bounds every buffer the reader sizes from the index.
MAX_CHUNK_NBYTES = 1 << 30
#: The dtypes a dataset may hold, spelled as the index spells them (little endian), mapped to
#: their zarr v3 `data_type` names. Anything else, other byte orders included, is refused.
DTYPES: dict[str, str] = {
    np.dtype(name).newbyteorder("<").str: name
    for name in (
        "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
        "float16", "float32", "float64", "complex64", "complex128",
    )
}  # fmt: skip
_OFFSETS_DTYPE = "<i8"  # offsets and shapes arrays
_BYTES_DTYPE = "|u1"  # bytes and str fields
_INDEX_KEYS = (
    "format", "version", "hash", "num_samples", "rows_per_chunk", "fields", "arrays",
    "metadata", "fingerprint",
)  # fmt: skip

_PARTITIONED_KEYS = (
    "format", "version", "hash", "num_samples", "rows_per_chunk", "partitions", "metadata",
    "fingerprint",
)  # fmt: skip
_PART_KEYS = ("prefix", "num_samples", "rows_per_chunk", "fields", "arrays")


def partition_prefix(index: int) -> str:
    """Key prefix (no trailing slash) of partition `index`."""
    return f"{PARTITION_PREFIX}{index:06d}"


_repr = reprlib.Repr()
_repr.maxlevel, _repr.maxstring, _repr.maxother, _repr.maxlong = 3, 40, 40, 40
_repr.maxlist = _repr.maxtuple = _repr.maxdict = 6


def short_repr(value: object) -> str:
    """repr() cut to a few dozen characters and three levels: safe for any hostile value."""
    return _repr.repr(value)


def is_int(value: object) -> TypeGuard[int | np.integer[Any]]:
    """An exact integer (int or numpy integer): never a bool, a float or a numeric string."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def check_int(
    value: object,
    where: str,
    lo: int = 0,
    hi: int | None = INT64_MAX,
    error: type[Exception] = FormatError,
) -> int:
    """`value` as an int if it is an exact int in [lo, hi] (hi None: unbounded), else
    raise `error` naming `where`."""
    if is_int(value):
        v = int(value)
        if lo <= v and (hi is None or v <= hi):
            return v
    span = f">= {lo}" if hi is None else f"in [{lo}, {'2**63-1' if hi == INT64_MAX else hi}]"
    raise error(f"{where}: expected an int {span}, got {short_repr(value)}")


def json_depth(value: object, limit: int) -> int:
    """Nesting depth of a parsed JSON value (0 for a scalar, 1 for a flat list or object),
    measured level by level without recursion; stops counting past `limit`."""
    depth, level = 0, [value]
    while depth <= limit:
        containers = [v for v in level if isinstance(v, dict | list)]
        if not containers:
            break
        depth += 1
        level = [x for c in containers for x in (c.values() if isinstance(c, dict) else c)]
    return depth


def validate_field_name(name: object) -> str:
    """Return `name` if usable as a field (and store key part), else raise ValueError."""
    if not isinstance(name, str) or _FIELD_RE.fullmatch(name) is None:
        raise ValueError(
            f"invalid field name {short_repr(name)}: use 1-64 characters [A-Za-z0-9_-],"
            " starting with a letter"
        )
    return name


def _legacy_canonical_json(obj: Any) -> bytes:
    """The canonical JSON of indexes written before the dataloader shared ckptstore's (it
    escaped non-ASCII characters): kept only to check those indexes' fingerprints."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def parse_json(raw: bytes | bytearray | memoryview, where: str) -> Any:
    """Parse untrusted JSON bytes (UTF-8, finite numbers only); FormatError on anything
    malformed, nested too deeply for the parser included."""
    try:
        text = str(raw, "utf-8")
        return json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except RecursionError:
        raise FormatError(f"{where}: JSON nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise FormatError(f"{where}: not valid JSON ({str(exc)[:200]})") from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a finite number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} is not a finite number")
    return value


def read_capped(store: Store, key: str, limit: int, where: str) -> bytearray:
    """The whole object `key`, refused with FormatError from its size (`stat`) alone if it
    is over `limit` bytes; the read is bounded by that size even if the object grows."""
    size = store.stat(key).size
    if size > limit:
        raise FormatError(
            f"{where}: object of {size:,} bytes, larger than the {limit:,}-byte limit "
            "(refused without reading it)"
        )
    buf = bytearray(size)
    if size:
        store.read_into(key, 0, memoryview(buf))
    return buf


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
class ShardInfo:
    """One shard object: total size, digest of its index tail, digest per chunk (None = absent),
    and optionally its shard index itself (`table`: (offset, nbytes) per chunk, None = absent),
    which spares readers a request per shard (format.md section 7.1)."""

    nbytes: int
    index_digest: str
    chunks: tuple[str | None, ...]
    table: tuple[tuple[int, int] | None, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "nbytes": self.nbytes, "index": self.index_digest, "chunks": list(self.chunks)
        }
        if self.table is not None:
            out["table"] = [None if t is None else list(t) for t in self.table]
        return out

    @classmethod
    def from_json(cls, d: Any, where: str) -> ShardInfo:
        _keys(d, where, ("nbytes", "index", "chunks"), ("table",))
        chunks = tuple(
            None if c is None else _digest(c, f"{where}.chunks[{i}]")
            for i, c in enumerate(_get(d, "chunks", list, where))
        )
        table = None
        if "table" in d:
            table = tuple(
                _table_entry(t, f"{where}.table[{i}]")
                for i, t in enumerate(_get(d, "table", list, where))
            )
        return cls(_int(d, "nbytes", where), _digest(d["index"], f"{where}.index"), chunks, table)

    @staticmethod
    def table_of(
        raw: bytes | memoryview, chunks_per_shard: int
    ) -> tuple[tuple[int, int] | None, ...]:
        """The (offset, nbytes) entries of a shard-index tail (None for an absent chunk)."""
        index = np.frombuffer(raw[: 16 * chunks_per_shard], dtype="<u8").reshape(-1, 2)
        return tuple(
            None if int(off) == EMPTY else (int(off), int(n)) for off, n in index.tolist()
        )


def _table_entry(t: Any, where: str) -> tuple[int, int] | None:
    if t is None:
        return None
    if not isinstance(t, list) or len(t) != 2:
        raise FormatError(f"{where}: expected null or [offset, nbytes]")
    return check_int(t[0], f"{where}[0]"), check_int(t[1], f"{where}[1]")


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
    def max_stored_nbytes(self) -> int:
        """Largest stored (encoded) size a chunk can have: exact when raw, zstd's bound (with
        room to spare) when compressed."""
        n = self.chunk_nbytes
        return n if self.compressor is None else n + (n >> 7) + 4096

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
        keys = ("path", "dtype", "shape", "chunk_shape", "chunks_per_shard", "compressor")
        _keys(d, where, (*keys, "shards"))
        shape = _ints(d, "shape", where, 0, 1, MAX_NDIM + 1)
        chunk_shape = _ints(d, "chunk_shape", where, 1, len(shape), len(shape))
        compressor = d["compressor"]
        if compressor not in COMPRESSORS:
            raise FormatError(f"{where}.compressor: unknown compressor {short_repr(compressor)}")
        head = cls(
            path=_get(d, "path", str, where),
            dtype=_dtype(d["dtype"], f"{where}.dtype"),
            shape=tuple(shape),
            chunk_shape=tuple(chunk_shape),
            chunks_per_shard=check_int(d["chunks_per_shard"], f"{where}.chunks_per_shard", 1),
            compressor=compressor,
            shards=(),
        )
        if head.chunk_nbytes > MAX_CHUNK_NBYTES:
            raise FormatError(
                f"{where}.chunk_shape: chunks of {head.chunk_nbytes:,} bytes, over the "
                f"{MAX_CHUNK_NBYTES:,}-byte limit"
            )
        raw_shards = _get(d, "shards", list, where)
        want = -(-head.num_chunks // head.chunks_per_shard)
        if len(raw_shards) != want:
            raise FormatError(f"{where}.shards: expected {want} shards, got {len(raw_shards)}")
        shards = tuple(
            ShardInfo.from_json(s, f"{where}.shards[{i}]") for i, s in enumerate(raw_shards)
        )
        info = replace(head, shards=shards)
        info._check_shards(where)
        return info

    def _check_shards(self, where: str) -> None:
        """Each shard lists chunks_per_shard chunks: a digest for every chunk inside the
        shape (the writer stores them all), None past it; its size fits what it holds."""
        per, n = self.chunks_per_shard, self.num_chunks
        low, high = self.index_nbytes, per * self.max_stored_nbytes + self.index_nbytes
        for s, shard in enumerate(self.shards):
            at = f"{where}.shards[{s}]"
            if len(shard.chunks) != per:
                raise FormatError(f"{at}.chunks: expected {per} chunks, got {len(shard.chunks)}")
            inside = min(per, n - s * per)  # chunks of this shard inside the array's shape
            if None in shard.chunks[:inside]:
                i = shard.chunks.index(None)
                raise FormatError(f"{at}.chunks[{i}]: chunk {s * per + i} is recorded as absent")
            if any(c is not None for c in shard.chunks[inside:]):
                i = next(i for i in range(inside, per) if shard.chunks[i] is not None)
                raise FormatError(
                    f"{at}.chunks[{i}]: chunk {s * per + i} is listed outside the shape"
                )
            if not low <= shard.nbytes <= high:
                raise FormatError(
                    f"{at}.nbytes: {shard.nbytes:,} bytes cannot hold {per} chunks of at most "
                    f"{self.max_stored_nbytes:,} bytes and a {low}-byte index"
                )
            if shard.table is not None:
                self._check_table(shard, at)

    def _check_table(self, shard: ShardInfo, at: str) -> None:
        """A recorded shard index: one entry per chunk, absent exactly where the chunk is,
        each inside the shard's data (before its index tail) and at most a stored chunk."""
        assert shard.table is not None
        if len(shard.table) != len(shard.chunks):
            raise FormatError(f"{at}.table: expected {len(shard.chunks)} entries")
        end = shard.nbytes - self.index_nbytes
        for i, (t, c) in enumerate(zip(shard.table, shard.chunks, strict=True)):
            if (t is None) != (c is None):
                raise FormatError(f"{at}.table[{i}]: present/absent unlike chunks[{i}]")
            if t is not None and (t[0] + t[1] > end or t[1] > self.max_stored_nbytes):
                raise FormatError(f"{at}.table[{i}]: {t} is outside the shard's chunk data")

    def check_zarr(self, z: Any, where: str) -> None:
        """Compare this array with its parsed zarr.json (as zarr-python writes it for the
        dataloader: a regular grid of shards, little-endian bytes, optional zstd)."""
        _need(z, dict, where)
        item = np.dtype(self.dtype).itemsize
        endian = [{"name": "bytes", "configuration": {"endian": "little"}}]
        inner_bytes = endian + [{"name": "bytes"}] if item == 1 else endian
        shard = [self.chunk_shape[0] * self.chunks_per_shard, *self.chunk_shape[1:]]
        want: dict[str, Any] = {
            "zarr_format": 3,
            "node_type": "array",
            "shape": list(self.shape),
            "data_type": DTYPES[self.dtype],
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": shard}},
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        }
        for key, value in want.items():
            if not _same_json(z.get(key), value):
                raise FormatError(
                    f"{where}: {key} is {short_repr(z.get(key))}, the index says {value!r}"
                )
        if z.get("storage_transformers", []) != []:
            raise FormatError(f"{where}: storage_transformers are not supported")
        codecs = z.get("codecs")
        if not (isinstance(codecs, list) and len(codecs) == 1 and isinstance(codecs[0], dict)):
            raise FormatError(f"{where}: codecs must be one sharding_indexed codec")
        conf = codecs[0].get("configuration")
        if codecs[0].get("name") != "sharding_indexed" or not isinstance(conf, dict):
            raise FormatError(f"{where}: codecs must be one sharding_indexed codec")
        if not _same_json(conf.get("chunk_shape"), list(self.chunk_shape)):
            raise FormatError(
                f"{where}: chunk_shape is {short_repr(conf.get('chunk_shape'))}, the index says "
                f"{list(self.chunk_shape)}"
            )
        inner = conf.get("codecs")
        if not isinstance(inner, list) or not inner or inner[0] not in inner_bytes:
            raise FormatError(
                f"{where}: chunks are not stored as little-endian bytes (the endian of every "
                f"chunk must be 'little'; got codecs {short_repr(inner)})"
            )
        names = [c.get("name") if isinstance(c, dict) else c for c in inner[1:]]
        if names != ([] if self.compressor is None else [self.compressor]):
            raise FormatError(
                f"{where}: codecs after 'bytes' are {short_repr(names)}, the index says "
                f"compressor {self.compressor!r}"
            )
        index_codecs = [*endian, {"name": "crc32c"}]
        if conf.get("index_location") != "end" or conf.get("index_codecs") != index_codecs:
            raise FormatError(f"{where}: the shard index must be little-endian + crc32c at the end")


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
        _keys(d, where, ("name", "kind", "dtype", "ndim", "arrays"), ("shape", "block_bounds"))
        try:
            name = validate_field_name(d["name"])
        except ValueError as exc:
            raise FormatError(f"{where}.name: {exc}") from None
        where = f"{where} (field {name!r})"
        kind = d["kind"]
        if not isinstance(kind, str) or kind not in KINDS:
            raise FormatError(f"{where}.kind: unknown field kind {short_repr(kind)}")
        dtype = _dtype(d["dtype"], f"{where}.dtype")
        ndim = check_int(d["ndim"], f"{where}.ndim", 0, MAX_NDIM)
        want_ndim = {"scalar": (0, 0), "bytes": (1, 1), "str": (1, 1)}.get(kind, (1, MAX_NDIM))
        if not want_ndim[0] <= ndim <= want_ndim[1]:
            raise FormatError(f"{where}.ndim: {ndim} is not valid for a {kind} field")
        if kind in ("bytes", "str") and dtype != _BYTES_DTYPE:
            raise FormatError(f"{where}.dtype: a {kind} field holds {_BYTES_DTYPE}, not {dtype}")
        if ("shape" in d) != (kind == "fixed"):
            raise FormatError(f"{where}: 'shape' is given for fixed fields, and only for them")
        if ("block_bounds" in d) != (kind in ("ragged", "bytes", "str")):
            raise FormatError(
                f"{where}: 'block_bounds' is given for variable-length fields, and only for them"
            )
        shape = _ints(d, "shape", where, 1, 1, MAX_NDIM) if kind == "fixed" else None
        if shape is not None and len(shape) != ndim:
            raise FormatError(f"{where}.ndim: {ndim}, but 'shape' has {len(shape)} dimensions")
        bounds = _ints(d, "block_bounds", where, 0, 1) if "block_bounds" in d else None
        arrays = _get(d, "arrays", dict, where)
        want = _array_paths(name, kind, ndim)
        if arrays != want:
            raise FormatError(
                f"{where}.arrays: expected {want}, got {short_repr(arrays)} (array path "
                "and role names are fixed by the layout)"
            )
        return cls(
            name=name,
            kind=kind,
            dtype=dtype,
            shape=None if shape is None else tuple(shape),
            ndim=ndim,
            arrays=dict(arrays),
            block_bounds=None if bounds is None else tuple(bounds),
        )

    def array_layout(self, n: int, rows_per_chunk: int) -> dict[str, tuple[Any, ...]]:
        """role -> (dtype, shape, chunk_shape) the field's arrays must have for n samples in
        blocks of rows_per_chunk (None: not fixed by the field; the data array's length and
        chunking are checked against block_bounds instead)."""
        r = rows_per_chunk
        if not self.variable:
            inner = self.shape or ()
            return {"values": (self.dtype, (n, *inner), (r, *inner))}
        out: dict[str, tuple[Any, ...]] = {
            "data": (self.dtype, None, None),
            "offsets": (_OFFSETS_DTYPE, (n + 1,), (r,)),
        }
        if "shapes" in self.arrays:
            out["shapes"] = (_OFFSETS_DTYPE, (n, self.ndim), (r, self.ndim))
        return out


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
        partitioned = isinstance(d, dict) and _same_json(d.get("version"), PARTITIONED_VERSION)
        _keys(d, where, _PARTITIONED_KEYS if partitioned else _INDEX_KEYS)
        version = PARTITIONED_VERSION if partitioned else FORMAT_VERSION
        for key, want in (("format", FORMAT_NAME), ("version", version)):
            if not _same_json(d[key], want):
                raise FormatError(
                    f"{where}: {key} {short_repr(d[key])} is not supported (want {want!r}; "
                    "is this a dataloader dataset index?)"
                )
        if d["hash"] != HASH_NAME:
            raise FormatError(f"{where}: unsupported hash {short_repr(d['hash'])}")
        metadata = _get(d, "metadata", dict, where)
        if json_depth(metadata, MAX_METADATA_DEPTH) > MAX_METADATA_DEPTH:
            raise FormatError(f"{where}.metadata: nested deeper than {MAX_METADATA_DEPTH} levels")
        num_samples = _int(d, "num_samples", where)
        rows_per_chunk = check_int(
            d["rows_per_chunk"], f"{where}.rows_per_chunk", 1, MAX_ROWS_PER_CHUNK
        )
        if partitioned:
            idx = cls._partitioned(d, where, num_samples, rows_per_chunk, metadata)
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
    def _partitioned(
        cls, d: dict[str, Any], where: str, n: int, r: int, metadata: dict[str, Any]
    ) -> DatasetIndex:
        """A v2 index: each partition is checked as a v1 index of its own arrays; together
        they must have one schema, strictly increasing prefixes and add up to the totals."""
        raw_parts = _get(d, "partitions", list, where)
        if not raw_parts:
            raise FormatError(f"{where}.partitions: a dataset needs at least one partition")
        parts: list[tuple[str, DatasetIndex]] = []
        for i, p in enumerate(raw_parts):
            at = f"{where}.partitions[{i}]"
            _keys(p, at, _PART_KEYS)
            prefix = _get(p, "prefix", str, at)
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
                _int(p, "num_samples", at),
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
        return cls.stitch(parts, metadata, _digest(d["fingerprint"], f"{where}.fingerprint"))

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
        for k, v in _get(d, "arrays", dict, where).items():
            at = f"{where}.arrays[{short_repr(k)}]"
            arrays[k] = ArrayInfo.from_json(v, at)
            if arrays[k].path != k:
                raise FormatError(f"{at}.path: {short_repr(arrays[k].path)} differs from its key")
        fields = tuple(
            FieldInfo.from_json(f, f"{where}.fields[{i}]")
            for i, f in enumerate(_get(d, "fields", list, where))
        )
        fp = d.get("fingerprint", "0" * 32)
        return cls(
            num_samples=num_samples,
            rows_per_chunk=rows_per_chunk,
            fields=fields,
            arrays=arrays,
            metadata=metadata,
            fingerprint=_digest(fp, f"{where}.fingerprint"),
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


def _array_paths(name: str, kind: str, ndim: int) -> dict[str, str]:
    """role -> array path of a field, as the layout fixes them."""
    if kind in ("scalar", "fixed"):
        return {"values": name}
    roles = ("data", "offsets", "shapes") if kind == "ragged" and ndim > 1 else ("data", "offsets")
    return {role: f"{name}/{role}" for role in roles}


# -- small JSON validation helpers -------------------------------------------------------
def _need(value: Any, typ: type, where: str) -> None:
    if not isinstance(value, typ):
        raise FormatError(f"{where}: expected {typ.__name__}, got {type(value).__name__}")


def _keys(d: Any, where: str, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> None:
    """`d` is a JSON object with every `required` key and nothing outside `optional`."""
    _need(d, dict, where)
    for key in required:
        if key not in d:
            raise FormatError(f"{where}: missing {key!r}")
    unknown = [k for k in d if k not in required and k not in optional]
    if unknown:
        raise FormatError(f"{where}: unknown key {short_repr(unknown[0])}")


def _get(d: dict[str, Any], key: str, typ: type, where: str) -> Any:
    if key not in d:
        raise FormatError(f"{where}: missing {key!r}")
    _need(d[key], typ, f"{where}.{key}")
    return d[key]


def _int(d: dict[str, Any], key: str, where: str) -> int:
    return check_int(d.get(key), f"{where}.{key}")


def _ints(
    d: dict[str, Any], key: str, where: str, lo: int, min_len: int, max_len: int | None = None
) -> list[int]:
    """d[key]: a list of exact ints >= lo (each at most 2**63-1), of length in range."""
    v = _get(d, key, list, where)
    if len(v) < min_len or (max_len is not None and len(v) > max_len):
        span = f"{min_len}..{max_len}" if max_len is not None else f">= {min_len}"
        raise FormatError(f"{where}.{key}: expected {span} entries, got {len(v)}")
    if not all(is_int(x) and lo <= x <= INT64_MAX for x in v):
        bad = next(x for x in v if not (is_int(x) and lo <= x <= INT64_MAX))
        raise FormatError(f"{where}.{key}: expected ints >= {lo}, got {short_repr(bad)}")
    return [int(x) for x in v]


def _dtype(v: Any, where: str) -> str:
    """One of DTYPES, spelled exactly (no byte-order variants, no numpy parsing)."""
    if not isinstance(v, str) or v not in DTYPES:
        raise FormatError(
            f"{where}: unsupported dtype {short_repr(v)} (want one of {', '.join(DTYPES)})"
        )
    return v


def _digest(v: Any, where: str) -> str:
    if not is_digest(v):
        raise FormatError(f"{where}: {short_repr(v)} is not an {HASH_NAME} hex digest")
    return str(v)


def _same_json(a: Any, b: Any) -> bool:
    """Equality of JSON values that also tells bool from int and int from float."""
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(_same_json(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_json(a[k], b[k]) for k in a)
    return bool(a == b)
