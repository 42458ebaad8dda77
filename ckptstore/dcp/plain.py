"""Non-tensor values of a DCP state as ckptstore plain state, never a pickle.

DCP's default planners turn every value that is not a tensor (an optimizer's `lr`, a step
count, a data loader's state) into `torch.save` bytes and read it back with
`torch.load` with `weights_only=False`. Here such a value is a node of ckptstore's state tree
(format/tree.py: dict, OrderedDict, list, tuple, None, bool, int, float, str, bytes, numpy
scalars; tensors too where the value lives in a ckptstore manifest), so a checkpoint holds
it as what it is and `CheckpointStore.load` returns it.

Where a value must travel as DCP bytes (`SavePlanner` used with another storage writer, or a
planner that overrides `load_bytes`), it is a *payload*: `MAGIC` followed by the canonical
JSON `{"bytes": [hex, ...], "node": node}` (the node's `{"bytes": i}` leaves index that
list). A payload never starts like a pickle (0x80) or a zip archive (`PK`).
"""

from __future__ import annotations

import json
from typing import Any

from ..errors import FormatError, UnsupportedTypeError
from ..format import tree as tree_mod
from ..format.canonical import canonical_json
from ..format.leaf import ArrayLeaf
from ..format.manifest_parse import check_tree

#: The first bytes of every plain-value payload.
MAGIC = b"ckptstore.plain/1\n"
#: A payload larger than this is refused when read (what one non-tensor value may take).
MAX_PAYLOAD = 1 << 30


def encode(value: Any, path: tuple[str | int, ...] = ()) -> tuple[Any, list[ArrayLeaf]]:
    """(tree node, array leaves) of `value`; leaf keys are dotted from `path`. Raises
    UnsupportedTypeError naming the key of anything that is not plain state or an array."""
    encoder = tree_mod.TreeEncoder()
    node = encoder.encode(value, path)
    return node, encoder.leaves


def encode_json_only(value: Any, what: str) -> Any:
    """The tree node of a value that must hold no array nor bytes (DCP's planner_data and
    storage_data kept in a manifest's metadata)."""
    node, leaves = encode(value)
    if leaves:
        raise UnsupportedTypeError(f"{what}: holds {leaves[0].kind} data at "
                                   f"{leaves[0].key or '<root>'}; only plain values (dict, "
                                   "list, tuple, str, int, float, bool, None) can be kept")
    return node


def decode_json_only(node: Any, what: str) -> Any:
    """The value of a node written by `encode_json_only` (validated first)."""
    try:
        check_tree(node, 0)
    except FormatError as exc:
        raise FormatError(f"{what}: {exc}") from None
    return tree_mod.decode(node, _no_leaf)


def _no_leaf(index: int) -> Any:
    raise FormatError(f"leaf {index} in a plain value that holds none")


def payload(value: Any, key: str) -> bytes:
    """The payload of `value` (module docstring). Tensors and arrays cannot be payloads:
    UnsupportedTypeError naming where they are (save such values with ckptstore's
    StorageWriter, which stores them as tensors)."""
    node, leaves = encode(value, (key,))
    data: list[str] = []
    for leaf in leaves:
        if leaf.kind != "bytes":
            raise UnsupportedTypeError(
                f"{leaf.key}: a {leaf.kind} array inside a non-tensor value cannot be a DCP "
                "bytes payload; save it with ckptstore.dcp.StorageWriter (it stores such "
                "values as tensors) or keep tensors as values of their own")
        data.append(leaf.array.tobytes().hex())
    return MAGIC + canonical_json({"bytes": data, "node": node})


def is_payload(data: bytes) -> bool:
    return data.startswith(MAGIC)


def from_payload(data: bytes, key: str) -> Any:
    """The value of a payload; FormatError (naming `key`) for anything malformed."""
    if not is_payload(data):
        raise FormatError(f"{key}: not a ckptstore plain-value payload")
    if len(data) > MAX_PAYLOAD:
        raise FormatError(f"{key}: plain-value payload of {len(data)} bytes is too large")
    try:
        doc = json.loads(data[len(MAGIC):].decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise FormatError(f"{key}: plain-value payload is not valid JSON: {exc}") from None
    if not isinstance(doc, dict) or set(doc) != {"bytes", "node"} or not isinstance(
            doc["bytes"], list) or not all(isinstance(b, str) for b in doc["bytes"]):
        raise FormatError(f"{key}: plain-value payload must be {{\"bytes\": [hex], \"node\"}}")
    try:
        blobs = [bytes.fromhex(b) for b in doc["bytes"]]
    except ValueError:
        raise FormatError(f"{key}: plain-value payload holds bytes that are not hex") from None
    node = doc["node"]
    try:
        check_tree(node, len(blobs))
    except FormatError as exc:
        raise FormatError(f"{key}: plain-value payload: {exc}") from None
    if has_kind(node, "tensor"):
        raise FormatError(f"{key}: plain-value payload refers to a tensor")
    return tree_mod.decode(node, blobs.__getitem__)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def has_kind(node: Any, kind: str) -> bool:
    """True if a validated node holds a node of `kind` (e.g. "tensor") anywhere."""
    stack = [node]
    while stack:
        n = stack.pop()
        k, value = tree_mod.node_kind(n)
        if k == kind:
            return True
        if k in ("dict", "odict"):
            stack.extend(child for _key, child in value)
            if "meta" in n:
                stack.append(n["meta"])
        elif k in ("list", "tuple"):
            stack.extend(value)
    return False


def leaf_indexes(node: Any) -> list[int]:
    """The tensor indexes ({"tensor": i} and {"bytes": i}) under a validated node, in order."""
    out: list[int] = []
    stack = [node]
    while stack:
        n = stack.pop()
        k, value = tree_mod.node_kind(n)
        if k in ("tensor", "bytes"):
            out.append(value)
        elif k in ("dict", "odict"):
            stack.extend(reversed([child for _key, child in value]))
            if "meta" in n:
                stack.append(n["meta"])
        elif k in ("list", "tuple"):
            stack.extend(reversed(value))
    return out


def remap(node: Any, index: dict[int, int]) -> Any:
    """A copy of `node` whose tensor indexes are mapped through `index`."""
    k, value = tree_mod.node_kind(node)
    if k in ("tensor", "bytes"):
        return {k: index[value]}
    if k in ("dict", "odict"):
        out: dict[str, Any] = {k: [[key, remap(child, index)] for key, child in value]}
        if "meta" in node:
            out["meta"] = remap(node["meta"], index)
        return out
    if k in ("list", "tuple"):
        return {k: [remap(child, index) for child in value]}
    return node
