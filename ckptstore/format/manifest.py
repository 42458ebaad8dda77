"""Manifests: the commit record of one checkpoint, as canonical JSON (docs/format.md).

`Manifest.to_bytes` writes it; `parse_manifest` reads untrusted bytes and either returns a fully
validated Manifest or raises FormatError naming the first thing wrong. Every tensor entry is a
zarr v3 array metadata document whose `attributes["ckptstore"]` holds what ckptstore needs.
"""

from __future__ import annotations

import json
import json.encoder
import math
import re
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

from ..collector import paused_collector
from ..errors import FormatError
from .canonical import SEAL_FIELD, canonical_str, check_seal, is_sealed, seal
from .codecs import Codec, parse_codec
from .dtypes import DTYPES, DType, by_name
from .hashing import ALGORITHMS, HASH_NAME, XXH3_128, HashAlgorithm, check_digest, hash_algorithm
from .names import validate_name

_json_str = json.encoder.encode_basestring  # json.dumps' string writer (ensure_ascii=False)
FORMAT_NAME = "ckptstore.manifest"
#: Version 2 = version 1 + a self-digest (canonical.seal) as the last field.
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
MAX_MANIFEST_BYTES = 1 << 30
MAX_TREE_DEPTH = 256
MAX_DIMS = 64
#: No chunk may declare more raw bytes than this (bounds any single allocation on read).
MAX_CHUNK_BYTES = 1 << 34
#: No tensor or shared storage may declare more bytes than this (1 PiB), counting every
#: dimension as at least 1, so that shape arithmetic never overflows an allocator.
MAX_TENSOR_BYTES = 1 << 50
TENSOR_KINDS = ("torch", "numpy", "bytes")


@dataclass(frozen=True)
class ChunkRef:
    """Where one row block's bytes live: `size` stored bytes at `offset` in blob `blob`, which
    decode to `nbytes` raw bytes whose digest is `digest`."""

    blob: str
    offset: int
    size: int
    nbytes: int
    digest: str

    def to_json(self) -> dict[str, Any]:
        return {"blob": self.blob, "offset": self.offset, "size": self.size,
                "nbytes": self.nbytes, "digest": self.digest}


@dataclass(frozen=True)
class StorageRef:
    """Tensors sharing one torch storage: the view's element offset and strides into a storage
    of `nbytes` bytes identified by `id` within the manifest."""

    id: int
    nbytes: int
    offset: int
    stride: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "nbytes": self.nbytes, "offset": self.offset,
                "stride": list(self.stride)}


@dataclass(frozen=True)
class TensorEntry:
    """One stored array. `chunk_rows` rows of dim 0 per chunk (0-d arrays: one chunk)."""

    key: str
    kind: str
    dtype: DType
    shape: tuple[int, ...]
    chunk_rows: int
    codec: Codec | None
    chunks: tuple[ChunkRef, ...]
    requires_grad: bool = False
    parameter: bool = False
    storage: StorageRef | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.dtype.itemsize

    def chunk_count(self) -> int:
        return expected_chunk_count(self.shape, self.chunk_rows, self.dtype.itemsize)

    def chunk_rows_range(self, index: int) -> tuple[int, int]:
        """Rows [start, stop) of dim 0 held by chunk `index` (0-d: (0, 1))."""
        if not self.shape:
            return (0, 1)
        start = index * self.chunk_rows
        return (start, min(self.shape[0], start + self.chunk_rows))

    def zarr_chunk_shape(self) -> list[int]:
        if not self.shape:
            return []
        return [max(1, self.chunk_rows)] + [max(1, d) for d in self.shape[1:]]

    def to_json(self) -> dict[str, Any]:
        """Zarr v3 array metadata carrying ckptstore's fields in attributes."""
        itemsize = self.dtype.itemsize
        bytes_codec: dict[str, Any] = {"name": "bytes"}
        if itemsize > 1:
            bytes_codec["configuration"] = {"endian": "little"}
        codecs = [bytes_codec]
        if self.codec is not None:
            codecs.append(self.codec.zarr_codec(itemsize))
        kind = self.dtype.numpy_dtype.kind
        fill: Any = False if kind == "b" else ([0.0, 0.0] if kind == "c" else 0)
        attrs: dict[str, Any] = {
            "key": self.key, "kind": self.kind, "dtype": self.dtype.name,
            "chunk_rows": self.chunk_rows,
            "codec": None if self.codec is None else self.codec.to_json(),
            "chunks": [c.to_json() for c in self.chunks],
        }
        if self.kind == "torch":
            attrs["requires_grad"] = self.requires_grad
            attrs["parameter"] = self.parameter
        if self.storage is not None:
            attrs["storage"] = self.storage.to_json()
        return {
            "zarr_format": 3, "node_type": "array", "shape": list(self.shape),
            "data_type": self.dtype.zarr_data_type,
            "chunk_grid": {"name": "regular",
                           "configuration": {"chunk_shape": self.zarr_chunk_shape()}},
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
            "fill_value": fill, "codecs": codecs, "attributes": {"ckptstore": attrs},
        }


def extent_ok(shape: tuple[int, ...], itemsize: int, storage_nbytes: int = 0) -> bool:
    """The size rule for tensors: every dimension counted as at least 1, the tensor (and its
    storage) stays within MAX_TENSOR_BYTES."""
    return (math.prod(max(1, n) for n in shape) * itemsize <= MAX_TENSOR_BYTES
            and storage_nbytes <= MAX_TENSOR_BYTES)


def expected_chunk_count(shape: tuple[int, ...], chunk_rows: int, itemsize: int) -> int:
    if not shape:
        return 1
    if math.prod(shape) * itemsize == 0:
        return 0
    return -(-shape[0] // chunk_rows)


@dataclass(frozen=True)
class Manifest:
    """A committed checkpoint. `tree` is the typed state tree (see tree.py); tensor leaves point
    into `tensors` by index."""

    name: str
    created: float  # POSIX seconds, UTC
    metadata: dict[str, Any]
    tree: Any
    tensors: tuple[TensorEntry, ...]
    parent: str | None = None
    version: int = FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)
    hash: str = HASH_NAME  # the repository's hash algorithm: chunk digests and the seal

    @property
    def logical_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def blob_digests(self) -> set[str]:
        return {c.blob for t in self.tensors for c in t.chunks}

    def to_bytes(self) -> bytes:
        with paused_collector():
            return self._to_bytes()

    def _to_bytes(self) -> bytes:
        """canonical_json of the whole document, assembled from three parts (the keys sort as
        head < "tensors" < tail) so that each tensor entry can be written by `_entry_json`,
        then sealed (version 2; a version-1 manifest is written unsealed, as it was)."""
        head = canonical_str({
            "created": self.created, "format": FORMAT_NAME, "hash": self.hash,
            "metadata": self.metadata, "name": self.name, "parent": self.parent})
        tail = canonical_str({"tree": self.tree, "version": self.version})
        tensors = ",".join(_entry_json(t) if ok else canonical_str(t.to_json())
                           for t, ok in zip(self.tensors, self.entries_ok()))
        body = f'{head[:-1]},"tensors":[{tensors}],{tail[1:]}'.encode()
        return seal(body, hash_algorithm(self.hash).digest) if self.version >= 2 else body

    def entries_ok(self) -> list[bool]:
        """`_entry_ok` of every tensor entry, computed once per Manifest (serializing and
        `parses_back_equal` both need it; entries are frozen)."""
        ok = self.__dict__.get("_entries_ok")
        if ok is None:
            ok = [_entry_ok(t) for t in self.tensors]
            object.__setattr__(self, "_entries_ok", ok)
        return ok


# ---------------------------------------------------------------- parsing untrusted bytes
def _fail(where: str, what: str) -> FormatError:
    return FormatError(f"{where}: {what}")


def _int(value: Any, where: str, lo: int = 0, hi: int = 1 << 62) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise _fail(where, f"expected an integer in [{lo}, {hi}], got {value!r:.80}")
    return value


def _bool(value: Any, where: str) -> bool:
    if type(value) is not bool:
        raise _fail(where, f"expected true/false, got {value!r:.80}")
    return value


def _dict(value: Any, where: str, required: AbstractSet[str],
          optional: AbstractSet[str] = frozenset()) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _fail(where, f"expected an object, got {type(value).__name__}")
    missing = required - value.keys()
    if missing:
        raise _fail(where, f"missing field(s) {sorted(missing)}")
    unknown = value.keys() - required - optional
    if unknown:
        raise _fail(where, f"unknown field(s) {sorted(unknown)[:5]}")
    return value


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise _fail(where, f"expected a list, got {type(value).__name__}")
    return value


def _parse_chunk(doc: Any, where: str) -> ChunkRef:
    d = _dict(doc, where, {"blob", "offset", "size", "nbytes", "digest"})
    return ChunkRef(
        blob=check_digest(d["blob"], f"{where}.blob"),
        offset=_int(d["offset"], f"{where}.offset"),
        size=_int(d["size"], f"{where}.size", 0, 2 * MAX_CHUNK_BYTES),
        nbytes=_int(d["nbytes"], f"{where}.nbytes", 0, MAX_CHUNK_BYTES),
        digest=check_digest(d["digest"], f"{where}.digest"),
    )


# Fast path. `_fast_tensor` accepts a tensor entry only in exactly the form `to_json` writes and
# only if `_entry_ok` passes, which makes every check `_parse_tensor` makes; anything else goes to
# `_parse_tensor`, which accepts it or raises a FormatError naming what is wrong. So the fast path
# changes speed, never the verdict or the message (tests/test_small_tensors_fast.py checks this).
_HI = 1 << 62  # `_int`'s default upper bound
_HEX_RUN = re.compile(r"[0-9a-f]*")
_TENSOR_FIELDS = frozenset({"zarr_format", "node_type", "shape", "data_type", "chunk_grid",
                            "chunk_key_encoding", "fill_value", "codecs", "attributes"})
_CHUNK_FIELDS = frozenset({"blob", "offset", "size", "nbytes", "digest"})
_STORAGE_FIELDS = frozenset({"id", "nbytes", "offset", "stride"})
_BASE_ATTRS = frozenset({"key", "kind", "dtype", "chunk_rows", "codec", "chunks"})
_TORCH_ATTRS = _BASE_ATTRS | {"requires_grad", "parameter"}
#: (kind, has storage) -> the exact attribute fields `to_json` writes
_ATTR_FIELDS = {("torch", False): _TORCH_ATTRS, ("torch", True): _TORCH_ATTRS | {"storage"},
                ("numpy", False): _BASE_ATTRS, ("bytes", False): _BASE_ATTRS}
#: zarr fields that depend only on (dtype, codec), computed once by `to_json` itself
_ZARR_FIXED = ("zarr_format", "node_type", "data_type", "chunk_key_encoding", "fill_value",
               "codecs")
_zarr_fixed_cache: dict[tuple[str, Codec | None], tuple[Any, ...]] = {}


def _zarr_fixed(dtype: DType, codec: Codec | None) -> tuple[Any, ...]:
    """Values of the `_ZARR_FIXED` fields `to_json` writes for this dtype and codec."""
    key = (dtype.name, codec)
    fixed = _zarr_fixed_cache.get(key)
    if fixed is None:
        doc = TensorEntry("", "numpy", dtype, (), 1, codec, ()).to_json()
        fixed = _zarr_fixed_cache[key] = tuple(doc[f] for f in _ZARR_FIXED)
    return fixed


def _storage_ok(e: TensorEntry) -> bool:
    """The storage checks of `_parse_tensor`, on exact types."""
    st = e.storage
    if type(st) is not StorageRef or e.kind != "torch":
        return False
    sid, nbytes, offset, stride = st.id, st.nbytes, st.offset, st.stride
    if (type(sid) is not int or type(nbytes) is not int or type(offset) is not int
            or type(stride) is not tuple or len(stride) != len(e.shape)
            or not (0 <= sid <= _HI and 0 <= nbytes <= _HI and 0 <= offset <= _HI)):
        return False
    for x in stride:
        if type(x) is not int or not 0 <= x <= _HI:
            return False
    if math.prod(e.shape):
        extent = offset + sum((n - 1) * x for n, x in zip(e.shape, stride)) + 1
        if extent * e.dtype.itemsize > nbytes:
            return False
    return True


def _chunks_ok(e: TensorEntry) -> bool:
    """The chunk-list checks of `_parse_tensor` (count, declared sizes, extents, digests)."""
    shape, rows, codec, chunks = e.shape, e.chunk_rows, e.codec, e.chunks
    itemsize = e.dtype.itemsize
    if type(chunks) is not tuple or len(chunks) != expected_chunk_count(shape, rows, itemsize):
        return False
    row_bytes = math.prod(shape[1:]) * itemsize
    digests = []
    for i, c in enumerate(chunks):
        if type(c) is not ChunkRef:
            return False
        blob, dg, offset, size, nbytes = c.blob, c.digest, c.offset, c.size, c.nbytes
        if (type(blob) is not str or type(dg) is not str or len(blob) != 32 or len(dg) != 32
                or type(offset) is not int or type(size) is not int or type(nbytes) is not int
                or not (0 <= offset <= _HI and 0 <= size <= 2 * MAX_CHUNK_BYTES
                        and 0 <= nbytes <= MAX_CHUNK_BYTES)):
            return False
        if shape:
            start = i * rows
            want = (min(shape[0], start + rows) - start) * row_bytes
        else:
            want = itemsize
        if nbytes != want:
            return False
        if codec is None:
            if size != nbytes:
                return False
        elif offset != 0 or size > 2 * nbytes + 65536:
            return False
        digests.append(blob)
        digests.append(dg)
    return _HEX_RUN.fullmatch("".join(digests)) is not None


def _entry_ok(e: TensorEntry) -> bool:
    """True if `e` passes every check `_parse_tensor` makes on the ckptstore attributes and
    holds exactly the types parsing produces (str, int, bool, tuples, the DTYPES object,
    Codec/ChunkRef/StorageRef)."""
    shape, rows, codec, dtype = e.shape, e.chunk_rows, e.codec, e.dtype
    if (type(e.key) is not str or type(e.kind) is not str or e.kind not in TENSOR_KINDS
            or type(dtype) is not DType or DTYPES.get(dtype.name) is not dtype
            or type(shape) is not tuple or len(shape) > MAX_DIMS
            or type(rows) is not int or not (1 if shape else 0) <= rows <= _HI
            or type(e.requires_grad) is not bool or type(e.parameter) is not bool):
        return False
    for n in shape:
        if type(n) is not int or not 0 <= n <= _HI:
            return False
    if codec is not None and (type(codec) is not Codec or type(codec.id) is not str
                              or type(codec.level) is not int
                              or not -100 <= codec.level <= 100):
        return False
    if e.storage is not None and not _storage_ok(e):
        return False
    if not extent_ok(shape, dtype.itemsize, 0 if e.storage is None else e.storage.nbytes):
        return False
    if e.kind != "torch" and (e.requires_grad or e.parameter):
        return False
    if e.kind == "bytes" and (dtype.name != "uint8" or len(shape) != 1):
        return False
    return _chunks_ok(e)


def _fast_tensor(doc: Any) -> TensorEntry | None:
    """The entry `doc` describes if `doc` is exactly what `TensorEntry.to_json` writes for an
    entry passing `_entry_ok`; None otherwise (then `_parse_tensor` decides)."""
    if type(doc) is not dict or doc.keys() != _TENSOR_FIELDS:
        return None
    attrs = doc["attributes"]
    if type(attrs) is not dict or len(attrs) != 1 or type(a := attrs.get("ckptstore")) is not dict:
        return None
    kind, storage_doc = a.get("kind"), a.get("storage")
    if type(kind) is not str or a.keys() != _ATTR_FIELDS.get((kind, storage_doc is not None)):
        return None
    shape, chunk_docs, dtype_name = doc["shape"], a["chunks"], a["dtype"]
    if type(shape) is not list or type(chunk_docs) is not list or type(dtype_name) is not str:
        return None
    dtype = DTYPES.get(dtype_name)
    chunks = []
    for c in chunk_docs:
        if type(c) is not dict or c.keys() != _CHUNK_FIELDS:
            return None
        chunks.append(ChunkRef(c["blob"], c["offset"], c["size"], c["nbytes"], c["digest"]))
    storage = None
    if storage_doc is not None:
        if (type(storage_doc) is not dict or storage_doc.keys() != _STORAGE_FIELDS
                or type(storage_doc["stride"]) is not list):
            return None
        storage = StorageRef(storage_doc["id"], storage_doc["nbytes"], storage_doc["offset"],
                             tuple(storage_doc["stride"]))
    try:
        codec = parse_codec(a["codec"])
    except FormatError:
        return None
    if dtype is None:
        return None
    entry = TensorEntry(a["key"], kind, dtype, tuple(shape), a["chunk_rows"], codec,
                        tuple(chunks), a.get("requires_grad", False), a.get("parameter", False),
                        storage)
    if not _entry_ok(entry):
        return None
    if (doc["zarr_format"], doc["node_type"], doc["data_type"], doc["chunk_key_encoding"],
            doc["fill_value"], doc["codecs"]) != _zarr_fixed(dtype, codec):
        return None
    grid = {"name": "regular", "configuration": {"chunk_shape": entry.zarr_chunk_shape()}}
    return entry if doc["chunk_grid"] == grid else None


_fixed_json_cache: dict[tuple[str, Codec | None], tuple[str, str]] = {}


def _fixed_json(dtype: DType, codec: Codec | None) -> tuple[str, str]:
    """(canonical JSON of the codec attribute, canonical JSON of the fixed zarr fields that sort
    between "chunk_grid" and "node_type", without braces) for this dtype and codec."""
    key = (dtype.name, codec)
    fixed = _fixed_json_cache.get(key)
    if fixed is None:
        doc = dict(zip(_ZARR_FIXED, _zarr_fixed(dtype, codec)))
        later = {k: doc[k] for k in ("chunk_key_encoding", "codecs", "data_type", "fill_value")}
        fixed = (canonical_str(None if codec is None else codec.to_json()),
                 canonical_str(later)[1:-1])
        _fixed_json_cache[key] = fixed
    return fixed


def _entry_json(e: TensorEntry) -> str:
    """`canonical_str(e.to_json())`, written directly (a third of the time of `json.dumps`).
    Only for an entry passing `_entry_ok`: its digests are hex and its numbers exact ints, so
    they need no escaping; tests/test_small_tensors_fast.py checks the equality."""
    codec_json, fixed = _fixed_json(e.dtype, e.codec)
    chunks = ",".join(
        f'{{"blob":"{c.blob}","digest":"{c.digest}","nbytes":{c.nbytes},'
        f'"offset":{c.offset},"size":{c.size}}}' for c in e.chunks)
    torch_attrs = ""
    if e.kind == "torch":
        torch_attrs = (f',"parameter":{"true" if e.parameter else "false"}'
                       f',"requires_grad":{"true" if e.requires_grad else "false"}')
    st = e.storage
    if st is not None:
        torch_attrs += (f',"storage":{{"id":{st.id},"nbytes":{st.nbytes},"offset":{st.offset},'
                        f'"stride":[{",".join(map(str, st.stride))}]}}')
    grid = ",".join(map(str, e.zarr_chunk_shape()))
    return (f'{{"attributes":{{"ckptstore":{{"chunk_rows":{e.chunk_rows},"chunks":[{chunks}],'
            f'"codec":{codec_json},"dtype":"{e.dtype.name}","key":{_json_str(e.key)},'
            f'"kind":"{e.kind}"{torch_attrs}}}}},'
            f'"chunk_grid":{{"configuration":{{"chunk_shape":[{grid}]}},"name":"regular"}},'
            f'{fixed},"node_type":"array","shape":[{",".join(map(str, e.shape))}],'
            f'"zarr_format":3}}')


def _parse_tensors(docs: list[Any]) -> tuple[TensorEntry, ...]:
    """Every tensor entry, validated; FormatError names the first one wrong."""
    out = []
    for i, doc in enumerate(docs):
        entry = _fast_tensor(doc)
        out.append(entry if entry is not None else _parse_tensor(doc, i))
    return tuple(out)


def _parse_tensor(doc: Any, index: int) -> TensorEntry:
    where = f"tensors[{index}]"
    d = _dict(doc, where, {"zarr_format", "node_type", "shape", "data_type", "chunk_grid",
                           "chunk_key_encoding", "fill_value", "codecs", "attributes"})
    if d["zarr_format"] != 3 or d["node_type"] != "array":
        raise _fail(where, "not zarr v3 array metadata")
    attrs = _dict(d["attributes"], f"{where}.attributes", {"ckptstore"})
    a = _dict(attrs["ckptstore"], f"{where}.attributes.ckptstore",
              {"key", "kind", "dtype", "chunk_rows", "codec", "chunks"},
              {"requires_grad", "parameter", "storage"})
    if not isinstance(a["key"], str):
        raise _fail(where, "key must be a string")
    where = f"tensor {a['key']!r:.200}"
    if a["kind"] not in TENSOR_KINDS:
        raise _fail(where, f"unknown kind {a['kind']!r:.40}")
    dtype = by_name(a["dtype"])
    if d["data_type"] != dtype.zarr_data_type:
        raise _fail(where, f"data_type {d['data_type']!r:.40} does not match dtype {dtype.name}")
    shape_doc = _list(d["shape"], f"{where}.shape")
    if len(shape_doc) > MAX_DIMS:
        raise _fail(where, f"more than {MAX_DIMS} dimensions")
    shape = tuple(_int(s, f"{where}.shape") for s in shape_doc)
    if not extent_ok(shape, dtype.itemsize):
        raise _fail(where, f"shape {list(shape)} of {dtype.name} declares more than "
                           f"{MAX_TENSOR_BYTES} bytes")
    nbytes = math.prod(shape) * dtype.itemsize
    chunk_rows = _int(a["chunk_rows"], f"{where}.chunk_rows", 1 if shape else 0)
    codec = parse_codec(a["codec"])
    chunks = tuple(_parse_chunk(c, f"{where}.chunks[{i}]")
                   for i, c in enumerate(_list(a["chunks"], f"{where}.chunks")))
    storage = None
    if "storage" in a:
        s = _dict(a["storage"], f"{where}.storage", {"id", "nbytes", "offset", "stride"})
        stride = tuple(_int(x, f"{where}.storage.stride") for x in _list(s["stride"], where))
        storage = StorageRef(_int(s["id"], where), _int(s["nbytes"], where),
                             _int(s["offset"], where), stride)
        if len(stride) != len(shape):
            raise _fail(where, "storage stride rank differs from shape")
        if not extent_ok((), 1, storage.nbytes):
            raise _fail(where, f"storage declares more than {MAX_TENSOR_BYTES} bytes")
        if nbytes:
            extent = storage.offset + sum((n - 1) * st for n, st in zip(shape, stride)) + 1
            if extent * dtype.itemsize > storage.nbytes:
                raise _fail(where, "view reaches past the end of its storage")
    entry = TensorEntry(
        key=a["key"], kind=a["kind"], dtype=dtype, shape=shape, chunk_rows=chunk_rows,
        codec=codec, chunks=chunks,
        requires_grad=_bool(a.get("requires_grad", False), where),
        parameter=_bool(a.get("parameter", False), where), storage=storage,
    )
    if a["kind"] != "torch" and (entry.requires_grad or entry.parameter or storage):
        raise _fail(where, "torch-only fields on a non-torch tensor")
    if a["kind"] == "bytes" and (dtype.name != "uint8" or len(shape) != 1):
        raise _fail(where, "bytes must be 1-d uint8")
    if len(chunks) != entry.chunk_count():
        raise _fail(where, f"{len(chunks)} chunks listed, shape and chunk_rows give "
                           f"{entry.chunk_count()}")
    for i, c in enumerate(chunks):
        start, stop = entry.chunk_rows_range(i)
        want = (stop - start) * entry.row_bytes if shape else dtype.itemsize
        if c.nbytes != want:
            raise _fail(where, f"chunk {i} declares {c.nbytes} bytes, its rows hold {want}")
        if codec is None and c.size != c.nbytes:
            raise _fail(where, f"chunk {i}: stored size differs from raw size without a codec")
        if codec is not None and (c.offset != 0 or c.size > 2 * c.nbytes + 65536):
            raise _fail(where, f"chunk {i}: implausible compressed extent")
    if entry.to_json() != doc:
        raise _fail(where, "zarr metadata disagrees with the ckptstore attributes")
    return entry


def _check_tree(node: Any, n_tensors: int, depth: int = 0) -> None:
    """Validate the typed state tree (forms listed in tree.py)."""
    if depth > MAX_TREE_DEPTH:
        raise FormatError(f"state tree nested deeper than {MAX_TREE_DEPTH}")
    if not isinstance(node, dict) or not 1 <= len(node) <= 2:
        raise FormatError(f"tree node must be a one-field object, got {node!r:.80}")
    kind = next((k for k in node if k != "meta"), "meta")
    value = node[kind]
    if kind in ("dict", "odict"):
        extra = set(node) - {kind, "meta"}
        if extra or (kind == "dict" and len(node) != 1):
            raise FormatError(f"tree node has unknown fields {sorted(extra)}")
        for item in _list(value, "tree"):
            if not isinstance(item, list) or len(item) != 2:
                raise FormatError("tree dict item must be [key, node]")
            key = item[0]
            if not (isinstance(key, list) and len(key) == 2 and
                    ((key[0] == "s" and isinstance(key[1], str)) or
                     (key[0] == "i" and type(key[1]) is int))):
                raise FormatError("tree dict key must be ['s', str] or ['i', int], "
                                  f"got {key!r:.80}")
            _check_tree(item[1], n_tensors, depth + 1)
        if "meta" in node:
            _check_tree(node["meta"], n_tensors, depth + 1)
        return
    if len(node) != 1:
        raise FormatError(f"tree node {kind!r:.40} has extra fields")
    if kind in ("list", "tuple"):
        for item in _list(value, "tree"):
            _check_tree(item, n_tensors, depth + 1)
    elif kind == "none":
        if value is not None:
            raise FormatError("tree 'none' node must hold null")
    elif kind == "bool":
        _bool(value, "tree bool")
    elif kind == "int":
        if type(value) is not int:
            raise FormatError("tree 'int' node must hold an integer")
    elif kind == "float":
        if not isinstance(value, str):
            raise FormatError("tree 'float' node must hold a hex string")
        try:
            float.fromhex(value)
        except (ValueError, OverflowError):
            raise FormatError(f"tree 'float' node holds {value!r:.40}") from None
    elif kind == "str":
        if not isinstance(value, str):
            raise FormatError("tree 'str' node must hold a string")
    elif kind in ("tensor", "bytes"):
        _int(value, f"tree {kind} index", 0, n_tensors - 1)
    elif kind == "np_scalar":
        if not (isinstance(value, list) and len(value) == 2 and isinstance(value[1], str)):
            raise FormatError("tree 'np_scalar' must be [dtype, hex]")
        dtype = by_name(value[0])
        if not dtype.numpy_native:
            raise FormatError(f"numpy has no scalar type {dtype.name}")
        try:
            raw = bytes.fromhex(value[1])
        except ValueError:
            raise FormatError("tree 'np_scalar' data is not hex") from None
        if len(raw) != dtype.itemsize:
            raise FormatError("tree 'np_scalar' data has the wrong size")
    else:
        raise FormatError(f"unknown tree node kind {kind!r:.40}")


def parse_manifest(data: bytes, expected_name: str | None = None,
                   algorithm: HashAlgorithm = XXH3_128) -> Manifest:
    """Parse and validate untrusted manifest bytes of a repository whose hash algorithm is
    `algorithm` (the manifest must name the same). Raises FormatError on anything wrong."""
    with paused_collector():
        return _parse_manifest(data, expected_name, algorithm)


def _parse_manifest(data: bytes, expected_name: str | None,
                    algorithm: HashAlgorithm) -> Manifest:
    if len(data) > MAX_MANIFEST_BYTES:
        raise FormatError(f"manifest larger than {MAX_MANIFEST_BYTES} bytes")
    sealed = is_sealed(data)
    if sealed:  # checked on the raw bytes, before anything is parsed
        check_seal(data, "manifest", algorithm.digest)
    try:
        doc = json.loads(data.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise FormatError(f"manifest is not valid JSON: {exc}") from None
    d = _dict(doc, "manifest", {"format", "version", "hash", "name", "created", "parent",
                                "metadata", "tree", "tensors"}, {SEAL_FIELD})
    if d["format"] != FORMAT_NAME:
        raise FormatError(f"not a ckptstore manifest (format {d['format']!r:.40})")
    version = d["version"]
    if type(version) is not int or version not in READABLE_VERSIONS:
        raise FormatError(f"unsupported manifest version {version!r:.40}; this ckptstore "
                          f"reads versions {list(READABLE_VERSIONS)}")
    if (version >= 2) != sealed or (version < 2 and SEAL_FIELD in d):
        raise FormatError(f"manifest version {version} must {'' if version >= 2 else 'not '}"
                          f"carry a {SEAL_FIELD}")
    if d["hash"] != algorithm.name:
        raise FormatError(f"manifest hash {d['hash']!r:.40} differs from the repository's "
                          f"{algorithm.name!r}")
    try:
        name = validate_name(d["name"])
        # a parent is informational, and may predate the reservation of "latest"
        parent = None if d["parent"] is None else validate_name(d["parent"],
                                                                 allow_reserved=True)
    except ValueError as exc:
        raise FormatError(f"manifest: {exc}") from None
    if expected_name is not None and name != expected_name:
        raise FormatError(f"manifest names {name!r}, expected {expected_name!r}")
    created = d["created"]
    if type(created) not in (int, float) or not 0 <= created < 1e11:
        raise FormatError(f"manifest created time {created!r:.40} is invalid")
    if not isinstance(d["metadata"], dict):
        raise FormatError("manifest metadata must be an object")
    tensors = _parse_tensors(_list(d["tensors"], "tensors"))
    try:
        _check_tree(d["tree"], len(tensors))
    except RecursionError:
        raise FormatError("state tree nested too deeply") from None
    return Manifest(name=name, created=float(created), metadata=d["metadata"], tree=d["tree"],
                    tensors=tensors, parent=parent, version=version, hash=algorithm.name)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed in a manifest")


# ------------------------------------------------------------ a writer's own Manifest
def committed_manifest(manifest: Manifest, data: bytes, expected_name: str) -> Manifest:
    """What `parse_manifest(data, expected_name)` returns, given `data == manifest.to_bytes()`
    (the bytes a writer committed for `manifest`): `manifest` itself when
    `parses_back_equal` proves the parse would equal it, else the parse of `data` (FormatError
    if `data` is invalid). Saves the re-parse of a manifest just written."""
    if len(data) <= MAX_MANIFEST_BYTES and parses_back_equal(manifest, expected_name):
        return manifest
    return parse_manifest(data, expected_name, hash_algorithm(manifest.hash))


def parses_back_equal(m: Manifest, expected_name: str | None = None) -> bool:
    """True if `parse_manifest(m.to_bytes(), expected_name)` would succeed and return a
    Manifest equal to `m` with the same types and dict order in every field: `m` passes every
    check parsing makes and holds only what `json.loads` produces. Assumes `m.to_bytes()`
    succeeds (no cycles, NaN or unencodable strings) and is at most MAX_MANIFEST_BYTES."""
    if (type(m.version) is not int or m.version != FORMAT_VERSION
            or type(m.extra) is not dict or m.extra
            or type(m.name) is not str or (m.parent is not None and type(m.parent) is not str)
            or type(m.created) is not float or not 0 <= m.created < 1e11
            or type(m.metadata) is not dict or type(m.tensors) is not tuple
            or type(m.hash) is not str or m.hash not in ALGORITHMS
            or (expected_name is not None and m.name != expected_name)):
        return False
    try:
        validate_name(m.name)
        if m.parent is not None:
            validate_name(m.parent)
        _check_tree(m.tree, len(m.tensors))
    except (ValueError, RecursionError):  # FormatError and InvalidNameError are ValueErrors
        return False
    if not (_json_native(m.metadata) and _json_native(m.tree)):
        return False
    return all(m.entries_ok())


def _json_native(value: Any) -> bool:
    """True if `value` is made only of what `json.loads` of its canonical JSON returns, equal
    and in the same order: dict (str keys, sorted), list, str, int, bool, None, finite float.
    `value` must be acyclic (canonical_json refuses cycles)."""
    stack = [value]
    while stack:
        v = stack.pop()
        t = type(v)
        if t is dict:
            keys = list(v)
            for k in keys:
                if type(k) is not str:
                    return False
            if len(keys) > 1 and keys != sorted(keys):
                return False
            stack.extend(v.values())
        elif t is list:
            stack.extend(v)
        elif t is float:
            if not math.isfinite(v):
                return False
        elif t is not str and t is not int and t is not bool and v is not None:
            return False
    return True
