"""Per-rank plain state (a dataloader's position, a trainer's counters) as rows of one tensor.

A collective checkpoint keeps one tree, rank 0's (training/distributed.py): a value that
differs between ranks and is not a tensor would come back as rank 0's on every rank. The
integrations (ckptstore.torchtitan, ckptstore.accelerate) therefore store such state as one
JSON document per rank, each the row of a `(world_size, width)` uint8 tensor (a
`ckptstore.Shard` row per rank, padded with spaces), and each rank reads back its own row.

The JSON is plain (no pickle): dicts with str keys, lists, str, int, float (NaN and infinities
included), bool and None as themselves; tuples, dicts with other keys, bytes, numpy arrays and
scalars and CPU torch tensors tagged (`{"__ckpt__": kind, ...}`). Bytes that start like a
pickle are refused, and so is anything else, with an UnsupportedTypeError naming its key.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..errors import FormatError, UnsupportedTypeError
from ..format.shard import Shard

TAG = "__ckpt__"


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def looks_pickled(data: bytes) -> bool:
    """True for bytes that start as a pickle of protocol 2 or later does (b"\\x80" + version)."""
    return len(data) >= 2 and data[0] == 0x80 and 2 <= data[1] <= 5


def encode(value: Any, path: str) -> Any:
    """`value` as a JSON-able document (see the module docstring); `path` names it in errors."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, (np.generic, bool)):
        return int(value) if isinstance(value, int) else float(value)
    if isinstance(value, Mapping):
        if all(isinstance(k, str) for k in value) and TAG not in value:
            return {k: encode(v, f"{path}.{k}") for k, v in value.items()}
        return {TAG: "dict", "items": [[encode(k, f"{path}.<key {k!r}>"),
                                        encode(v, f"{path}.{k}")] for k, v in value.items()]}
    if isinstance(value, list):
        return [encode(v, f"{path}.{i}") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {TAG: "tuple", "items": [encode(v, f"{path}.{i}") for i, v in enumerate(value)]}
    if isinstance(value, (bytes, bytearray)):
        if looks_pickled(bytes(value)):
            raise UnsupportedTypeError(f"{path}: holds pickled bytes; ckptstore stores no "
                                       "pickle (return the state itself, not pickle.dumps of it)")
        return {TAG: "bytes", "b64": _b64(bytes(value))}
    if isinstance(value, torch.Tensor):
        if type(value) is not torch.Tensor and not isinstance(value, torch.nn.Parameter):
            raise UnsupportedTypeError(f"{path}: a {type(value).__name__} cannot be stored as "
                                       "per-rank state; only plain CPU tensors")
        t = value.detach().cpu().contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        return {TAG: "tensor", "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape), "b64": _b64(data)}
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            raise UnsupportedTypeError(f"{path}: numpy arrays of objects cannot be stored")
        a = np.ascontiguousarray(value)
        return {TAG: "ndarray", "dtype": a.dtype.str, "shape": list(a.shape),
                "b64": _b64(a.tobytes())}
    if isinstance(value, np.generic) and not isinstance(value, np.object_):
        return {TAG: "npscalar", "dtype": value.dtype.str,
                "b64": _b64(np.asarray(value).tobytes())}
    raise UnsupportedTypeError(f"{path}: cannot store a {type(value).__module__}."
                               f"{type(value).__qualname__} (no pickle): per-rank state may hold "
                               "dicts, lists, tuples, str, int, float, bool, None, bytes, numpy "
                               "arrays and CPU tensors")


def decode(doc: Any) -> Any:
    """The value `encode` made `doc` from."""
    if isinstance(doc, list):
        return [decode(v) for v in doc]
    if not isinstance(doc, dict):
        return doc
    kind = doc.get(TAG)
    if kind is None:
        return {k: decode(v) for k, v in doc.items()}
    if kind == "dict":
        return {decode(k): decode(v) for k, v in doc["items"]}
    if kind == "tuple":
        return tuple(decode(v) for v in doc["items"])
    if kind == "bytes":
        return base64.b64decode(doc["b64"])
    if kind == "ndarray":
        return np.frombuffer(base64.b64decode(doc["b64"]), dtype=np.dtype(doc["dtype"])).reshape(
            doc["shape"]).copy()
    if kind == "npscalar":
        return np.frombuffer(base64.b64decode(doc["b64"]), dtype=np.dtype(doc["dtype"]))[0]
    if kind == "tensor":
        dtype = getattr(torch, str(doc["dtype"]))
        data = bytearray(base64.b64decode(doc["b64"]))
        shape = [int(s) for s in doc["shape"]]
        flat = (torch.frombuffer(data, dtype=torch.uint8).view(dtype) if data
                else torch.empty(0, dtype=dtype))
        return flat.reshape(shape).clone()
    raise FormatError(f"unknown per-rank state tag {kind!r}")


def to_bytes(value: Any, path: str) -> bytes:
    """The JSON bytes of `encode(value, path)`."""
    return json.dumps(encode(value, path), separators=(",", ":"), ensure_ascii=True,
                      allow_nan=True).encode("ascii")


def from_bytes(row: bytes) -> Any:
    """The value of one row (trailing padding ignored)."""
    try:
        return decode(json.loads(row.rstrip(b" ") or b"null"))
    except (ValueError, KeyError, TypeError) as exc:
        raise FormatError(f"per-rank state row is not a valid document: {exc}") from None


def world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def make_group() -> Any:
    """A gloo group of all ranks for the width exchange (collective), or None on one process."""
    return dist.new_group(backend="gloo") if world()[1] > 1 else None


def rows_to_save(docs: Mapping[str, bytes], group: Any) -> tuple[dict[str, Any], dict[str, int]]:
    """{key: {"rows": this rank's row}} for the keys of `docs` (every rank passes the same keys,
    in the same order), and {key: width}. Collective over `group` when there are many ranks:
    one all-reduce of the lengths."""
    rank, size = world()
    keys = list(docs)
    lengths = torch.tensor([max(1, len(docs[k])) for k in keys], dtype=torch.int64)
    if size > 1 and keys:
        dist.all_reduce(lengths, op=dist.ReduceOp.MAX, group=group)
    out: dict[str, Any] = {}
    widths: dict[str, int] = {}
    for k, width in zip(keys, lengths.tolist()):
        row = torch.full((1, width), ord(" "), dtype=torch.uint8)
        data = docs[k]
        if data:
            row[0, : len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out[k] = {"rows": Shard(row, rank, (size, width)) if size > 1 else row}
        widths[k] = int(width)
    return out, widths


class AllRows:
    """Restore target for rows saved on another world size: loaded whole (every rank's row),
    handed over by `load_state_dict`."""

    def __init__(self) -> None:
        self.rows: list[bytes] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        array = torch.as_tensor(state["rows"])
        self.rows = [bytes(array[i].numpy().tobytes()) for i in range(array.shape[0])]


def restore_target(width: int, saved_world: int) -> tuple[Any, AllRows | None]:
    """(the value to put in the state to restore, and the AllRows that receives the rows when
    they are read whole). Same world size: only this rank's row is read (in place)."""
    rank, size = world()
    if size == saved_world:
        row = torch.zeros((1, width), dtype=torch.uint8)
        return {"rows": Shard(row, rank, (size, width)) if size > 1 else row}, None
    sink = AllRows()
    return sink, sink


def rows_restored(target: Any, sink: AllRows | None) -> list[bytes | None]:
    """Per saved rank, its row (None for the rows this rank did not read)."""
    if sink is not None:
        assert sink.rows is not None, "rows were not loaded"
        return list(sink.rows)
    rank, size = world()
    value = target["rows"]
    row = value.data if isinstance(value, Shard) else value
    out: list[bytes | None] = [None] * size
    out[rank] = bytes(row[0].numpy().tobytes())
    return out


def same_everywhere(rows: Sequence[bytes | None], what: str) -> Any:
    """The one value all saved rows hold (for state saved on another world size)."""
    values = {r.rstrip(b" ") for r in rows if r is not None}
    if len(values) != 1:
        raise UnsupportedTypeError(f"{what} differs between the {len(rows)} ranks that saved it "
                                   "and cannot be restored on another number of ranks")
    return from_bytes(values.pop())
