"""Reading manifests: `parse_manifest` takes untrusted bytes and returns a fully validated
Manifest or raises FormatError naming the first thing wrong. The rules themselves are
`manifest.entry_problem` (tensor entries) and `check_tree` (the state tree); this module
checks the JSON structure around them, the seal and the header fields.
"""

from __future__ import annotations

import json
import math
from collections.abc import Set as AbstractSet
from typing import Any

from ..collector import paused_collector
from ..errors import FormatError
from .canonical import SEAL_FIELD, check_seal, is_sealed, reject_constant
from .codecs import parse_codec
from .dtypes import DTYPES, by_name
from .hashing import ALGORITHMS, XXH3_128, HashAlgorithm, hash_algorithm, is_digest
from .manifest import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MAX_MANIFEST_BYTES,
    MAX_TREE_DEPTH,
    READABLE_VERSIONS,
    SEGMENTED_VERSION,
    ChunkRef,
    LazyTree,
    Manifest,
    StorageRef,
    TensorEntry,
    _zarr_fixed,
    entry_problem,
)
from .names import validate_name
from .segment_encoding import SegmentRef, TreeRef
from .segments import MAX_SEGMENT_BYTES, SegmentedEntries, SegmentSource
from .tree_pages import PageSet

# Two parsers, one set of rules (`entry_problem`). The fast path `_fast_tensor` accepts a tensor
# entry only in exactly the form `to_json` writes and only if `entry_problem` finds nothing;
# anything else goes to `_parse_tensor`, which accepts it or raises a FormatError naming what is
# wrong. So the fast path changes speed, never the verdict or the message.
_TENSOR_FIELDS = frozenset({"zarr_format", "node_type", "shape", "data_type", "chunk_grid",
                            "chunk_key_encoding", "fill_value", "codecs", "attributes"})
_CHUNK_FIELDS = frozenset({"blob", "offset", "size", "nbytes", "digest"})
_STORAGE_FIELDS = frozenset({"id", "nbytes", "offset", "stride"})
_BASE_ATTRS = frozenset({"key", "kind", "dtype", "chunk_rows", "codec", "chunks"})
_TORCH_ATTRS = _BASE_ATTRS | {"requires_grad", "parameter"}
_GRID_ATTR = frozenset({"chunk_shape"})  # present only for an N-D chunk grid
#: (kind, has storage) -> the exact attribute fields `to_json` writes
_ATTR_FIELDS = {("torch", False): _TORCH_ATTRS, ("torch", True): _TORCH_ATTRS | {"storage"},
                ("numpy", False): _BASE_ATTRS, ("bytes", False): _BASE_ATTRS}
#: zarr fields that depend only on (dtype, codec), computed once by `to_json` itself
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


def _fast_tensor(doc: Any) -> TensorEntry | None:
    """The entry `doc` describes if `doc` is exactly what `TensorEntry.to_json` writes for an
    entry `entry_problem` passes; None otherwise (then `_parse_tensor` decides)."""
    if type(doc) is not dict or doc.keys() != _TENSOR_FIELDS:
        return None
    attrs = doc["attributes"]
    if type(attrs) is not dict or len(attrs) != 1 or type(a := attrs.get("ckptstore")) is not dict:
        return None
    kind, storage_doc, grid_doc = a.get("kind"), a.get("storage"), a.get("chunk_shape")
    if type(kind) is not str:
        return None
    fields = _ATTR_FIELDS.get((kind, storage_doc is not None))
    if fields is None or a.keys() != (fields if grid_doc is None else fields | _GRID_ATTR):
        return None
    if grid_doc is not None and type(grid_doc) is not list:
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
                        storage, None if grid_doc is None else tuple(grid_doc))
    if entry_problem(entry) is not None:
        return None
    if (doc["zarr_format"], doc["node_type"], doc["data_type"], doc["chunk_key_encoding"],
            doc["fill_value"], doc["codecs"]) != _zarr_fixed(dtype, codec):
        return None
    grid = {"name": "regular", "configuration": {"chunk_shape": entry.zarr_chunk_shape()}}
    return entry if doc["chunk_grid"] == grid else None


def _parse_tensors(docs: list[Any]) -> tuple[TensorEntry, ...]:
    """Every tensor entry, validated; FormatError names the first one wrong."""
    out = []
    for i, doc in enumerate(docs):
        entry = _fast_tensor(doc)
        out.append(entry if entry is not None else _parse_tensor(doc, i))
    return tuple(out)


def _parse_tensor(doc: Any, index: int) -> TensorEntry:
    """The reference parser of one tensor entry: checks the JSON structure, builds the entry,
    applies `entry_problem`, and checks that the zarr fields are what the entry implies.
    Raises FormatError naming the tensor and the first thing wrong."""
    where = f"tensors[{index}]"
    d = _dict(doc, where, _TENSOR_FIELDS)
    if d["zarr_format"] != 3 or d["node_type"] != "array":
        raise _fail(where, "not zarr v3 array metadata")
    attrs = _dict(d["attributes"], f"{where}.attributes", {"ckptstore"})
    a = _dict(attrs["ckptstore"], f"{where}.attributes.ckptstore", _BASE_ATTRS,
              {"requires_grad", "parameter", "storage", "chunk_shape"})
    if isinstance(a["key"], str):
        where = f"tensor {a['key']!r:.200}"
    dtype = by_name(a["dtype"])
    if d["data_type"] != dtype.zarr_data_type:
        raise _fail(where, f"data_type {d['data_type']!r:.40} does not match dtype {dtype.name}")
    chunks = []
    for i, c in enumerate(_list(a["chunks"], f"{where}.chunks")):
        c = _dict(c, f"{where}.chunks[{i}]", _CHUNK_FIELDS)
        chunks.append(ChunkRef(c["blob"], c["offset"], c["size"], c["nbytes"], c["digest"]))
    storage = None
    if "storage" in a:
        st = _dict(a["storage"], f"{where}.storage", _STORAGE_FIELDS)
        storage = StorageRef(st["id"], st["nbytes"], st["offset"],
                             tuple(_list(st["stride"], f"{where}.storage.stride")))
    entry = TensorEntry(
        key=a["key"], kind=a["kind"], dtype=dtype,
        shape=tuple(_list(d["shape"], f"{where}.shape")), chunk_rows=a["chunk_rows"],
        codec=parse_codec(a["codec"]), chunks=tuple(chunks),
        requires_grad=a.get("requires_grad", False), parameter=a.get("parameter", False),
        storage=storage,
        chunk_shape=(None if "chunk_shape" not in a else
                     tuple(_list(a["chunk_shape"], f"{where}.chunk_shape"))))
    problem = entry_problem(entry)
    if problem is not None:
        raise _fail(where, problem)
    if entry.to_json() != doc:
        raise _fail(where, "zarr metadata disagrees with the ckptstore attributes")
    return entry


def check_tree(node: Any, n_tensors: int, depth: int = 0, pages: PageSet | None = None
               ) -> None:
    """Validate the typed state tree (forms listed in tree.py). With `pages` (a version-3
    tree), a paged node is validated and resolved in place (tree_pages.PageSet.resolve); its
    pages are validated when they are read. Without, a paged node is refused."""
    if depth > MAX_TREE_DEPTH:
        raise FormatError(f"state tree nested deeper than {MAX_TREE_DEPTH}")
    if not isinstance(node, dict) or not 1 <= len(node) <= 2:
        raise FormatError(f"tree node must be a one-field object, got {node!r:.80}")
    kind = next((k for k in node if k != "meta"), "meta")
    if kind == "paged":
        if pages is None:
            raise FormatError("paged tree node outside a version-3 state tree")
        pages.resolve(node, depth)
        if "meta" in node:
            check_tree(node["meta"], n_tensors, depth + 1, pages)
        return
    value = node[kind]
    if kind in ("dict", "odict"):
        extra = set(node) - {kind, "meta"}
        if extra or (kind == "dict" and len(node) != 1):
            raise FormatError(f"tree node has unknown fields {sorted(extra)}")
        for item in _list(value, "tree"):
            if not isinstance(item, list) or len(item) != 2:
                raise FormatError("tree dict item must be [key, node]")
            key, child = item
            if not (isinstance(key, list) and len(key) == 2 and
                    ((key[0] == "s" and isinstance(key[1], str)) or
                     (key[0] == "i" and type(key[1]) is int))):
                raise FormatError("tree dict key must be ['s', str] or ['i', int], "
                                  f"got {key!r:.80}")
            # the common leaves (tensors; ints: an optimizer state's step), checked inline (a
            # call per leaf was most of the time)
            if type(child) is dict and len(child) == 1 and (
                    (type(t := child.get("tensor")) is int and 0 <= t < n_tensors)
                    or type(child.get("int")) is int):
                continue
            check_tree(child, n_tensors, depth + 1, pages)
        if "meta" in node:
            check_tree(node["meta"], n_tensors, depth + 1, pages)
        return
    if len(node) != 1:
        raise FormatError(f"tree node {kind!r:.40} has extra fields")
    if kind in ("list", "tuple"):
        for item in _list(value, "tree"):
            check_tree(item, n_tensors, depth + 1, pages)
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
                   algorithm: HashAlgorithm = XXH3_128,
                   segments: SegmentSource | None = None) -> Manifest:
    """Parse and validate untrusted manifest bytes of a repository whose hash algorithm is
    `algorithm` (the manifest must name the same). Raises FormatError on anything wrong.

    Version 3 (a root): the root is validated here; its tensors are a SegmentedEntries that
    reads each index segment through `segments` when first used and validates it then
    (None: only the root can be used, e.g. to check one before its blobs arrive)."""
    with paused_collector():
        return _parse_manifest(data, expected_name, algorithm, segments)


def _parse_manifest(data: bytes, expected_name: str | None, algorithm: HashAlgorithm,
                    segments: SegmentSource | None) -> Manifest:
    if len(data) > MAX_MANIFEST_BYTES:
        raise FormatError(f"manifest larger than {MAX_MANIFEST_BYTES} bytes")
    sealed = is_sealed(data)
    if sealed:  # checked on the raw bytes, before anything is parsed
        check_seal(data, "manifest", algorithm.digest)
    try:
        doc = json.loads(data.decode("utf-8"), parse_constant=reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise FormatError(f"manifest is not valid JSON: {exc}") from None
    version = doc.get("version") if isinstance(doc, dict) else None
    segmented = type(version) is int and version >= SEGMENTED_VERSION
    parts = _SEGMENTED_PARTS if segmented else _DOCUMENT_PARTS
    d = _dict(doc, "manifest", _ROOT_FIELDS | parts,
              {SEAL_FIELD, *(_SEGMENTED_OPTIONAL if segmented else ())})
    if d["format"] != FORMAT_NAME:
        raise FormatError(f"not a ckptstore manifest (format {d['format']!r:.40})")
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
    tensors: tuple[TensorEntry, ...] | SegmentedEntries
    tree: Any
    if version >= SEGMENTED_VERSION:
        where = f"checkpoint {name!r}"
        tensors = SegmentedEntries(_parse_segment_refs(d["segments"]), segments, where)
        ref = _parse_tree_ref(d["tree_blob"], "tree_blob")
        page_refs = [_parse_tree_ref(p, f"tree_pages[{i}]")
                     for i, p in enumerate(_list(d.get("tree_pages", []), "tree_pages"))]
        tree = LazyTree(ref, lambda: _read_tree(segments, ref, page_refs, len(tensors), where),
                        page_refs)
    else:
        tensors = _parse_tensors(_list(d["tensors"], "tensors"))
        tree = d["tree"]
        _check_whole_tree(tree, len(tensors))
    return Manifest(name=name, created=float(created), metadata=d["metadata"], tree=tree,
                    tensors=tensors, parent=parent, version=version, hash=algorithm.name)


def _check_whole_tree(tree: Any, n_tensors: int) -> None:
    try:
        check_tree(tree, n_tensors)
    except RecursionError:
        raise FormatError("state tree nested too deeply") from None


def _read_tree(source: SegmentSource | None, ref: TreeRef, page_refs: list[TreeRef],
               n_tensors: int, where: str) -> Any:
    """The state tree of a version-3 manifest from its blob (digest-checked by `source`),
    validated as a version-2 manifest's tree is; its paged containers read their pages from
    `source` when they are used (tree_pages.py)."""
    if source is None:
        raise FormatError(f"{where}: its state tree is not available here (only the manifest "
                          "root was read)")
    data = source(ref)
    pages = PageSet(page_refs, source, n_tensors, where, check_tree)
    try:
        with paused_collector():
            tree = json.loads(data.decode("utf-8"), parse_constant=reject_constant)
            check_tree(tree, n_tensors, 0, pages)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise FormatError(f"{where}: state tree {ref.digest}: {exc}") from None
    return tree


def _parse_tree_ref(doc: Any, where: str) -> TreeRef:
    d = _dict(doc, where, frozenset({"digest", "size"}))
    if not is_digest(d["digest"]):
        raise _fail(where, f"{d['digest']!r:.40} is not a hex digest")
    return TreeRef(d["digest"], _int(d["size"], f"{where}.size", 2, MAX_MANIFEST_BYTES))


_ROOT_FIELDS = frozenset({"format", "version", "hash", "name", "created", "parent",
                          "metadata"})
_DOCUMENT_PARTS = frozenset({"tensors", "tree"})  # versions 1 and 2: one document
_SEGMENTED_PARTS = frozenset({"segments", "tree_blob"})  # version 3: a root naming blobs
_SEGMENTED_OPTIONAL = frozenset({"tree_pages"})  # version 3, where the tree has paged nodes
_SEGMENT_FIELDS = frozenset({"digest", "nbytes", "size", "tensors"})


def _parse_segment_refs(docs: Any) -> list[SegmentRef]:
    refs = []
    for i, doc in enumerate(_list(docs, "segments")):
        where = f"segments[{i}]"
        d = _dict(doc, where, _SEGMENT_FIELDS)
        digest = d["digest"]
        if not is_digest(digest):
            raise _fail(where, f"{digest!r:.40} is not a hex digest")
        refs.append(SegmentRef(digest, _int(d["size"], f"{where}.size", 1, MAX_SEGMENT_BYTES),
                               _int(d["tensors"], f"{where}.tensors", 1),
                               _int(d["nbytes"], f"{where}.nbytes")))
    return refs



# ------------------------------------------------------------ a writer's own Manifest
def committed_manifest(manifest: Manifest, data: bytes, expected_name: str,
                       segments: SegmentSource | None = None) -> Manifest:
    """What `parse_manifest(data, expected_name, segments=segments)` returns, given
    `data == manifest.to_bytes()` (the bytes a writer committed for `manifest`).

    A version-3 manifest with `segments`: that parse itself. `data` is only the root, and
    the parse reads its index blobs through `segments` when they are first used; the
    writer's entries and tree (gigabytes at a million tensors) are not kept, and no proof
    as long as they are is made. Earlier versions (every entry in `data`): `manifest` itself
    when `parses_back_equal` proves the parse would equal it, else the parse of `data`
    (FormatError if `data` is invalid), which saves the re-parse of a manifest just
    written."""
    if manifest.version >= SEGMENTED_VERSION and segments is not None:
        return parse_manifest(data, expected_name, hash_algorithm(manifest.hash), segments)
    if len(data) <= MAX_MANIFEST_BYTES and parses_back_equal(manifest, expected_name):
        return manifest
    return parse_manifest(data, expected_name, hash_algorithm(manifest.hash), segments)


def parses_back_equal(m: Manifest, expected_name: str | None = None) -> bool:
    """True if `parse_manifest(m.to_bytes(), expected_name)` would succeed and return a
    Manifest equal to `m` with the same types and dict order in every field: `m` passes every
    check parsing makes and holds only what `json.loads` produces. Assumes `m.to_bytes()`
    succeeds (no cycles, NaN or unencodable strings) and is at most MAX_MANIFEST_BYTES."""
    if (type(m.version) is not int or m.version not in (FORMAT_VERSION, SEGMENTED_VERSION)
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
        check_tree(m.tree, len(m.tensors))
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
            items: Any = v.values()
        elif t is list:
            items = v
        else:
            items = (v,)
        for x in items:  # strings and ints inline: most of a state tree's values
            tx = type(x)
            if tx is str or tx is int:
                continue
            if tx is dict or tx is list:
                stack.append(x)
            elif tx is float:
                if not math.isfinite(x):
                    return False
            elif tx is not bool and x is not None:
                return False
    return True
