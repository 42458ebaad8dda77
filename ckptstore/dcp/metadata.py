"""DCP's `Metadata` as JSON inside a ckptstore manifest (`metadata["dcp"]`), rebuilt exactly on
read; and the Metadata of a checkpoint that `CheckpointStore.save` wrote (no DCP metadata),
derived from its state tree by DCP's own flattening rules.

The JSON (`to_json` / `from_json`), compact because a model has thousands of tensors:

    {"format": "ckptstore.dcp", "version": 1, "dcp_version": str | null,
     "entries": [[fqn, dtype, size, chunks] | [fqn, dtype, size, chunks, properties]
                 | [fqn, "bytes"], ...],            # state_dict_metadata, in its order
     "planner_data": null | {"mappings": [[fqn, [path item, ...]], ...]} | {"node": node},
     "storage_data": null | {"node": node},
     "storage_meta": {"checkpoint_id", "save_id", "load_id", "modules"} | null}

A tensor's `dtype` is torch's name (`bfloat16`), `chunks` its `[[offsets], [sizes]]`, and
`properties` (only when one differs from DCP's defaults) `{"requires_grad", "layout",
"memory_format", "pin_memory"}`. DCP's planner_data is its flattening map (fqn -> tuple of
str keys and int positions), kept as `mappings`; any other planner_data, and storage_data,
are kept as plain-state tree nodes (format/tree.py), so tuples, int keys and floats come
back as they were. `storage_data` of a ckptstore DCP checkpoint is
`{"format": "ckptstore", "values": {fqn: "plain" | "opaque"}}`: how each non-tensor value is
held (a plain tree node, or the bytes of a planner that serializes values itself).
"""

from __future__ import annotations

from typing import Any

from ..deps import missing

try:
    import torch
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )
except ModuleNotFoundError as _exc:
    raise missing(_exc) from None

from ..collector import paused_collector
from ..errors import FormatError, UnsupportedTypeError
from ..format import tree as tree_mod
from ..format.manifest import Manifest
from . import plain

FORMAT = "ckptstore.dcp"
VERSION = 1
#: `Metadata.storage_data["format"]` of checkpoints this package wrote
STORAGE_FORMAT = "ckptstore"
PLAIN, OPAQUE = "plain", "opaque"
Path = tuple[str | int, ...]


def storage_data(values: dict[str, str]) -> dict[str, Any]:
    """The `Metadata.storage_data` of a ckptstore DCP checkpoint."""
    return {"format": STORAGE_FORMAT, "values": dict(values)}


def value_kinds(md: Metadata) -> dict[str, str]:
    """{fqn: "plain" | "opaque"} of the non-tensor values (every one "plain" when the
    storage_data is not ours)."""
    sd = md.storage_data
    if isinstance(sd, dict) and sd.get("format") == STORAGE_FORMAT:
        values = sd.get("values")
        if isinstance(values, dict):
            return {str(k): str(v) for k, v in values.items()}
    return {}


# ------------------------------------------------------------------------------ to JSON
def _torch_name(value: Any, kind: type, what: str) -> str:
    if not isinstance(value, kind):
        raise UnsupportedTypeError(f"DCP metadata: {what} {value!r} is not a {kind.__name__}")
    name = str(value).removeprefix("torch.")
    if getattr(torch, name, None) != value:
        raise UnsupportedTypeError(f"DCP metadata: {what} {value!r} has no torch name")
    return name


_DEFAULT_PROPS: dict[str, Any] = {"requires_grad": False, "layout": "strided",
                  "memory_format": "contiguous_format", "pin_memory": False}


def _tensor_json(fqn: str, md: TensorStorageMetadata) -> list[Any]:
    p = md.properties
    props = {
        "requires_grad": bool(p.requires_grad),
        "layout": _torch_name(p.layout, torch.layout, "layout"),
        "memory_format": _torch_name(p.memory_format, torch.memory_format, "memory_format"),
        "pin_memory": bool(p.pin_memory),
    }
    out: list[Any] = [fqn, _torch_name(p.dtype, torch.dtype, "dtype"),
                      [int(n) for n in md.size],
                      [[[int(x) for x in c.offsets], [int(x) for x in c.sizes]]
                       for c in md.chunks]]
    if props != _DEFAULT_PROPS:
        out.append(props)
    return out


def _mappings(value: Any) -> list[Any] | None:
    """DCP's flattening map as [[fqn, [path...]], ...], or None if `value` is not one."""
    if not isinstance(value, dict):
        return None
    out = []
    for fqn, path in value.items():
        if not isinstance(fqn, str) or type(path) is not tuple or not all(
                type(p) in (str, int) for p in path):
            return None
        out.append([fqn, list(path)])
    return out


def to_json(md: Metadata) -> dict[str, Any]:
    """The JSON form of `md` (module docstring). UnsupportedTypeError if a part of it is not
    plain state (a custom planner's planner_data holding objects: it would need a pickle)."""
    entries: list[Any] = []
    for fqn, smd in md.state_dict_metadata.items():
        if isinstance(smd, TensorStorageMetadata):
            entries.append(_tensor_json(fqn, smd))
        elif isinstance(smd, BytesStorageMetadata):
            entries.append([fqn, "bytes"])
        else:
            raise UnsupportedTypeError(f"DCP metadata of {fqn!r} is a {type(smd).__name__}")
    planner_data: Any = None
    if md.planner_data is not None:
        mappings = _mappings(md.planner_data)
        planner_data = ({"mappings": mappings} if mappings is not None else
                        {"node": plain.encode_json_only(md.planner_data, "DCP planner_data")})
    meta = md.storage_meta
    return {
        "format": FORMAT, "version": VERSION, "dcp_version": md.version,
        "entries": entries, "planner_data": planner_data,
        "storage_data": None if md.storage_data is None else {
            "node": plain.encode_json_only(md.storage_data, "DCP storage_data")},
        "storage_meta": None if meta is None else {
            "checkpoint_id": None if meta.checkpoint_id is None else str(meta.checkpoint_id),
            "save_id": meta.save_id, "load_id": meta.load_id,
            "modules": [str(m) for m in meta.modules]},
    }


# ------------------------------------------------------------------------------ from JSON
def _bad(what: str) -> FormatError:
    return FormatError(f"DCP metadata: {what}")


def _need(cond: bool, what: str) -> None:
    if not cond:
        raise _bad(what)


def _ints(value: Any, what: str) -> list[int]:
    if not (isinstance(value, list) and all(type(x) is int and x >= 0 for x in value)):
        raise _bad(f"{what} must be a list of non-negative integers")
    return value


_TORCH_NAMES: dict[tuple[str, type], Any] = {}


def _from_torch(name: Any, kind: type, what: str) -> Any:
    found = _TORCH_NAMES.get((name, kind)) if isinstance(name, str) else None
    if found is None:
        value = getattr(torch, name, None) if isinstance(name, str) else None
        if not isinstance(value, kind):
            raise _bad(f"unknown {what} {name!r:.40}")
        found = _TORCH_NAMES[(name, kind)] = value
    return found


def _tensor_md(entry: list[Any]) -> TensorStorageMetadata:
    fqn = entry[0]
    if len(entry) not in (4, 5):
        raise _bad(f"{fqn}: a tensor entry is [fqn, dtype, size, chunks, properties?]")
    size = _ints(entry[2], "size")
    if not isinstance(entry[3], list):
        raise _bad(f"{fqn}: chunks must be a list")
    chunks = []
    for c in entry[3]:
        if not (isinstance(c, list) and len(c) == 2):
            raise _bad(f"{fqn}: a chunk is [offsets, sizes]")
        offsets, sizes = _ints(c[0], f"{fqn}: offsets"), _ints(c[1], f"{fqn}: sizes")
        if not (len(offsets) == len(sizes) == len(size) and all(
                o + n <= m for o, n, m in zip(offsets, sizes, size))):
            raise _bad(f"{fqn}: chunk {c} does not fit the size {size}")
        chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
    props: dict[str, Any] = entry[4] if len(entry) == 5 else _DEFAULT_PROPS
    if props is not _DEFAULT_PROPS:
        if not (isinstance(props, dict) and set(props) == set(_DEFAULT_PROPS)):
            raise _bad(f"{fqn}: properties need {sorted(_DEFAULT_PROPS)}")
        if type(props["requires_grad"]) is not bool or type(props["pin_memory"]) is not bool:
            raise _bad(f"{fqn}: requires_grad and pin_memory must be true or false")
    properties = TensorProperties(
        dtype=_from_torch(entry[1], torch.dtype, "dtype"),
        layout=_from_torch(props["layout"], torch.layout, "layout"),
        requires_grad=props["requires_grad"],
        memory_format=_from_torch(props["memory_format"], torch.memory_format,
                                  "memory_format"),
        pin_memory=props["pin_memory"])
    return TensorStorageMetadata(properties=properties, size=torch.Size(size), chunks=chunks)


def _planner_data(doc: Any) -> Any:
    if doc is None:
        return None
    _need(isinstance(doc, dict) and len(doc) == 1 and ("mappings" in doc or "node" in doc),
          "planner_data must be {\"mappings\": ...} or {\"node\": ...}")
    if "node" in doc:
        return plain.decode_json_only(doc["node"], "DCP planner_data")
    mappings = doc["mappings"]
    _need(isinstance(mappings, list), "planner_data mappings must be a list")
    out: dict[str, tuple[str | int, ...]] = {}
    for m in mappings:
        if not (isinstance(m, list) and len(m) == 2 and isinstance(m[0], str)
                and isinstance(m[1], list) and all(type(p) in (str, int) for p in m[1])):
            raise _bad("a mapping is [fqn, [str or int, ...]]")
        out[m[0]] = tuple(m[1])
    return out


def from_json(doc: Any) -> Metadata:
    """Rebuild the Metadata `to_json` wrote; FormatError for anything malformed."""
    keys = {"format", "version", "dcp_version", "entries", "planner_data", "storage_data",
            "storage_meta"}
    _need(isinstance(doc, dict) and set(doc) == keys, f"expected the fields {sorted(keys)}")
    _need(doc["format"] == FORMAT, f"format {doc['format']!r:.40} is not {FORMAT!r}")
    _need(doc["version"] == VERSION, f"version {doc['version']!r:.20} is not {VERSION}")
    _need(doc["dcp_version"] is None or isinstance(doc["dcp_version"], str),
          "dcp_version must be a string or null")
    _need(isinstance(doc["entries"], list), "entries must be a list")
    sdm: dict[str, Any] = {}
    for entry in doc["entries"]:
        if not (isinstance(entry, list) and len(entry) >= 2 and isinstance(entry[0], str)):
            raise _bad("an entry is [fqn, ...]")
        fqn = entry[0]
        if fqn in sdm:
            raise _bad(f"{fqn!r:.80} listed twice")
        if len(entry) == 2 and entry[1] == "bytes":
            sdm[fqn] = BytesStorageMetadata()
        else:
            sdm[fqn] = _tensor_md(entry)
    sd_doc = doc["storage_data"]
    _need(sd_doc is None or (isinstance(sd_doc, dict) and set(sd_doc) == {"node"}),
          "storage_data must be {\"node\": ...}")
    sd = None if sd_doc is None else plain.decode_json_only(sd_doc["node"], "DCP storage_data")
    meta = doc["storage_meta"]
    storage_meta = None
    if meta is not None:
        mkeys = {"checkpoint_id", "save_id", "load_id", "modules"}
        _need(isinstance(meta, dict) and set(meta) == mkeys, f"storage_meta needs {sorted(mkeys)}")
        for k in ("checkpoint_id", "save_id", "load_id"):
            _need(meta[k] is None or isinstance(meta[k], str), f"storage_meta.{k}: a string")
        _need(isinstance(meta["modules"], list) and all(isinstance(m, str)
                                                        for m in meta["modules"]),
              "storage_meta.modules must be a list of strings")
        storage_meta = StorageMeta(checkpoint_id=meta["checkpoint_id"], save_id=meta["save_id"],
                                   load_id=meta["load_id"], modules=list(meta["modules"]))
    return Metadata(state_dict_metadata=sdm, planner_data=_planner_data(doc["planner_data"]),
                    storage_data=sd, storage_meta=storage_meta, version=doc["dcp_version"])


# ------------------------------------------------------------------ checkpoints saved as such
def _terminal_list(node: Any) -> bool:
    """DCP's `_traverse` rule for a list: terminal (one value) unless it holds a mapping, a
    tensor, or a list that is not terminal."""
    for child in node["list"]:
        kind, _value = tree_mod.node_kind(child)
        if kind in ("dict", "odict", "tensor"):
            return False
        if kind == "list" and not _terminal_list(child):
            return False
    return True


def flatten(manifest: Manifest) -> list[tuple[str, Path, Any]]:
    """(fqn, path, node) of every value DCP's flattening would produce for the saved state:
    mappings are entered (keys as strings), lists only when they hold mappings or tensors,
    everything else (tuples, scalars, bytes, terminal lists, tensors) is one value."""
    out: list[tuple[str, Path, Any]] = []

    def walk(node: Any, path: Path) -> None:
        kind, value = tree_mod.node_kind(node)
        if kind in ("dict", "odict"):
            for (_t, key), child in value:
                walk(child, (*path, str(key)))
        elif kind == "list" and path and not _terminal_list(node):
            for i, child in enumerate(value):
                walk(child, (*path, i))
        elif path:
            out.append((".".join(map(str, path)), path, node))

    root_kind, _root = tree_mod.node_kind(manifest.tree)
    if root_kind not in ("dict", "odict"):
        raise FormatError(f"checkpoint {manifest.name!r} holds a {root_kind}, not a dict: DCP "
                          "loads only dict states")
    walk(manifest.tree, ())
    return out


def synthesize(manifest: Manifest) -> Metadata:
    """The DCP Metadata of a checkpoint saved by `CheckpointStore.save`: every tensor one
    chunk of its whole shape (reads take any region of it), every other value plain."""
    from ..format.torch_types import torch_dtype

    sdm: dict[str, Any] = {}
    mappings: dict[str, Path] = {}
    values: dict[str, str] = {}
    for fqn, path, node in flatten(manifest):
        if fqn in sdm:
            raise FormatError(f"checkpoint {manifest.name!r}: two values flatten to the DCP "
                              f"key {fqn!r}")
        kind, index = tree_mod.node_kind(node)
        if kind == "tensor":
            entry = manifest.tensors[index]
            size = torch.Size(entry.shape)
            sdm[fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=torch_dtype(entry.dtype.name),
                                            requires_grad=entry.requires_grad),
                size=size, chunks=[ChunkStorageMetadata(offsets=torch.Size([0] * len(size)),
                                                        sizes=size)])
        else:
            sdm[fqn] = BytesStorageMetadata()
            values[fqn] = PLAIN
        mappings[fqn] = path
    return Metadata(state_dict_metadata=sdm, planner_data=mappings,
                    storage_data=storage_data(values),
                    storage_meta=StorageMeta(checkpoint_id=manifest.name))


def of_manifest(manifest: Manifest) -> Metadata:
    """The Metadata of any checkpoint: rebuilt from `metadata["dcp"]` when DCP wrote it, else
    derived from its tree (`synthesize`)."""
    doc = manifest.metadata.get("dcp") if isinstance(manifest.metadata, dict) else None
    with paused_collector():  # thousands of small objects: a CPU-bound step
        if isinstance(doc, dict) and doc.get("format") == FORMAT:
            try:
                return from_json(doc)
            except FormatError as exc:
                raise FormatError(f"checkpoint {manifest.name!r}: {exc}") from None
        return synthesize(manifest)
