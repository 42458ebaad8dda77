"""What each rank reports to the coordinator about the items it wrote, as plain JSON values
(`WriteResult.storage_data`; DCP gathers them on the coordinator for `finish`):

    tensor item   {"kind": "tensor", "layout": Layout wire, "codec": codec | null,
                   "chunks": [[chunk index, chunk ref], ...]}
    plain value   {"kind": "plain", "node": tree node, "entries": [entry, ...]}
                  (the node's tensor indexes refer to `entries`: arrays and bytes inside it)
    opaque bytes  {"kind": "opaque", "entry": entry}   (a planner's own serialization)

and, on the first result of a rank, `"stats"`: what that rank wrote and reused.
"""

from __future__ import annotations

from typing import Any

from ..errors import CkptStoreError
from ..format.codecs import parse_codec
from ..format.dtypes import by_name
from ..format.manifest import ChunkRef, TensorEntry

TENSOR, PLAIN, OPAQUE = "tensor", "plain", "opaque"
STAT_FIELDS = ("written", "reused", "chunks_written", "chunks_reused")


def ref_to_wire(ref: ChunkRef) -> list[Any]:
    return [ref.blob, ref.offset, ref.size, ref.nbytes, ref.digest]


def ref_from_wire(doc: Any) -> ChunkRef:
    blob, offset, size, nbytes, digest = doc
    return ChunkRef(str(blob), int(offset), int(size), int(nbytes), str(digest))


def entry_to_wire(e: TensorEntry) -> dict[str, Any]:
    """A tensor entry without shared storage (values inside a non-tensor value)."""
    return {"key": e.key, "kind": e.kind, "dtype": e.dtype.name, "shape": list(e.shape),
            "chunk_rows": e.chunk_rows, "codec": None if e.codec is None else e.codec.to_json(),
            "chunks": [ref_to_wire(c) for c in e.chunks], "requires_grad": e.requires_grad,
            "parameter": e.parameter}


def entry_from_wire(doc: Any) -> TensorEntry:
    try:
        return TensorEntry(
            key=str(doc["key"]), kind=str(doc["kind"]), dtype=by_name(doc["dtype"]),
            shape=tuple(int(n) for n in doc["shape"]), chunk_rows=int(doc["chunk_rows"]),
            codec=parse_codec(doc["codec"]),
            chunks=tuple(ref_from_wire(c) for c in doc["chunks"]),
            requires_grad=bool(doc["requires_grad"]), parameter=bool(doc["parameter"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise CkptStoreError(f"a rank reported a malformed tensor entry: {exc}") from None


def sum_stats(results: list[list[Any]]) -> dict[str, int]:
    """The stats of every rank, summed."""
    total = dict.fromkeys(STAT_FIELDS, 0)
    for rank_results in results:
        for result in rank_results[:1]:
            stats = result.storage_data.get("stats") if isinstance(
                result.storage_data, dict) else None
            if isinstance(stats, dict):
                for k in STAT_FIELDS:
                    total[k] += int(stats.get(k, 0))
    return total
