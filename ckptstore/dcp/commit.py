"""The coordinator's commit of a DCP save: one ckptstore manifest of the global tensors.

`build` turns DCP's global `Metadata` and every rank's write results (dcp/results.py) into
tensor entries (one per global tensor, its chunks the grid of dcp/layout.py) and a state
tree whose dotted keys are DCP's flattened names; `DcpCommitter` commits it through the
repository's ordinary save seam (pipeline/commit.py), so names, commit order, pending
replication records and the create-only manifest are the repository's own.
"""

from __future__ import annotations

from typing import Any

from ..errors import CkptStoreError, FormatError, ReusedBlobsMissingError
from ..format.codecs import parse_codec
from ..format.dtypes import by_name
from ..format.manifest import Manifest, TensorEntry, entry_problem
from ..format.manifest_parse import check_tree
from ..format.segments import version_for
from ..layout import missing_blobs
from ..maintenance.leases import Lease
from ..pipeline.commit import SaveRequest
from ..pipeline.options import METADATA_THREADS, SaveInfo
from ..pipeline.writer import CheckpointWriter, KnownChunks
from ..stores.base import Store
from . import plain
from .layout import Layout
from .results import OPAQUE, PLAIN, TENSOR, entry_from_wire, ref_from_wire

_EMPTY_DICT: dict[str, Any] = {"dict": []}


def build(metadata: Any, results: list[list[Any]]
          ) -> tuple[Any, tuple[TensorEntry, ...], dict[str, str]]:
    """(state tree, tensor entries, {fqn: "plain" | "opaque"}) of a save."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    docs: dict[str, list[Any]] = {}
    for rank_results in results:
        for result in rank_results:
            sd = result.storage_data
            if not isinstance(sd, dict) or "kind" not in sd:
                raise CkptStoreError(f"{result.index.fqn}: written by a storage writer that is "
                                     "not ckptstore's (no chunk references)")
            docs.setdefault(result.index.fqn, []).append(sd)
    entries: list[TensorEntry] = []
    nodes: dict[str, Any] = {}
    values: dict[str, str] = {}
    for fqn, smd in metadata.state_dict_metadata.items():
        found = docs.pop(fqn, None)
        if not found:
            raise CkptStoreError(f"{fqn}: no rank wrote it")
        if isinstance(smd, TensorStorageMetadata):
            nodes[fqn] = {"tensor": len(entries)}
            entries.append(_tensor_entry(fqn, smd, found))
            continue
        if len(found) != 1 or found[0]["kind"] not in (PLAIN, OPAQUE):
            raise CkptStoreError(f"{fqn}: a non-tensor value must be written once, as a value")
        doc = found[0]
        values[fqn] = doc["kind"]
        if doc["kind"] == OPAQUE:
            nodes[fqn] = {"bytes": len(entries)}
            entries.append(entry_from_wire(doc["entry"]))
            continue
        inner = [entry_from_wire(e) for e in doc["entries"]]
        try:
            check_tree(doc["node"], len(inner))
        except FormatError as exc:
            raise CkptStoreError(f"{fqn}: a rank reported a malformed value: {exc}") from None
        nodes[fqn] = plain.remap(doc["node"], {i: len(entries) + i for i in range(len(inner))})
        entries.extend(inner)
    if docs:
        raise CkptStoreError(f"written but not in the checkpoint's metadata: {sorted(docs)[:5]}")
    for e in entries:
        problem = entry_problem(e)
        if problem is not None:
            raise CkptStoreError(f"{e.key}: {problem}")
    tree = build_tree(nodes, metadata.planner_data)
    check_tree(tree, len(entries))
    return tree, tuple(entries), values


def _tensor_entry(fqn: str, smd: Any, docs: list[Any]) -> TensorEntry:
    if any(d["kind"] != TENSOR for d in docs):
        raise CkptStoreError(f"{fqn}: written both as a tensor and as a value")
    layout = Layout.from_wire(docs[0]["layout"])
    codec = docs[0]["codec"]
    if any(d["layout"] != docs[0]["layout"] or d["codec"] != codec for d in docs[1:]):
        raise CkptStoreError(f"{fqn}: ranks wrote it with different chunk grids or codecs")
    if layout.shape != tuple(int(n) for n in smd.size):
        raise CkptStoreError(f"{fqn}: written as {list(layout.shape)}, the metadata says "
                             f"{list(smd.size)}")
    refs: dict[int, Any] = {}
    for d in docs:
        for c, ref in d["chunks"]:
            if c in refs:
                raise CkptStoreError(f"{fqn}: chunk {c} was written twice")
            refs[int(c)] = ref_from_wire(ref)
    n = layout.count()
    missing = [c for c in range(n) if c not in refs]
    if missing or len(refs) != n:
        raise CkptStoreError(f"{fqn}: chunks {missing[:5]} of {n} were written by no rank")
    return TensorEntry(key=fqn, kind="torch", dtype=by_name(layout.dtype), shape=layout.shape,
                       chunk_rows=layout.chunk_rows, codec=parse_codec(codec),
                       chunks=tuple(refs[c] for c in range(n)),
                       chunk_shape=layout.chunk_shape)


# ------------------------------------------------------------------------------ the tree
Path = tuple[str | int, ...]


def _paths(fqns: list[str], mappings: Any) -> dict[str, Path] | None:
    """fqn -> its path in the saved state (DCP's flatten mappings), or None when the
    mappings do not describe every fqn exactly (no planner_data, a custom planner)."""
    if not isinstance(mappings, dict):
        return None
    out: dict[str, Path] = {}
    for fqn in fqns:
        path = mappings.get(fqn)
        if not isinstance(path, (tuple, list)) or not path or not isinstance(path[0], str):
            return None
        if not all(type(p) in (str, int) for p in path):
            return None
        if ".".join(map(str, path)) != fqn:
            return None
        out[fqn] = tuple(path)
    return out


class _Conflict(Exception):
    pass


def build_tree(nodes: dict[str, Any], mappings: Any) -> Any:
    """The state tree holding `nodes` ({fqn: node}) where DCP's mappings place them: dicts
    by string keys, lists by position (a position DCP skipped, an empty mapping, is an empty
    dict). Falls back to a flat dict {fqn: node} when the mappings cannot place them all."""
    paths = _paths(list(nodes), mappings)
    if paths is not None:
        try:
            return _nested(nodes, paths)
        except _Conflict:
            pass
    return {"dict": [[["s", fqn], node] for fqn, node in nodes.items()]}


def _nested(nodes: dict[str, Any], paths: dict[str, Path]) -> Any:
    root: dict[str | int, Any] = {}
    kinds: dict[int, str] = {id(root): "dict"}
    for fqn, node in nodes.items():
        path = paths[fqn]
        cur = root
        for i, key in enumerate(path[:-1]):
            want = "list" if type(path[i + 1]) is int else "dict"
            child = cur.get(key)
            if child is None:
                child = {}
                kinds[id(child)] = want
                cur[key] = child
            elif not isinstance(child, dict) or kinds.get(id(child)) != want:
                raise _Conflict
            cur = child
        if path[-1] in cur:
            raise _Conflict
        cur[path[-1]] = ("leaf", node)

    def to_node(obj: Any) -> Any:
        if isinstance(obj, tuple):
            return obj[1]
        if kinds[id(obj)] == "dict":
            return {"dict": [[["s", str(k)], to_node(v)] for k, v in obj.items()]}
        size = max(obj) + 1 if obj else 0
        return {"list": [to_node(obj[i]) if i in obj else _EMPTY_DICT for i in range(size)]}

    return to_node(root)


def node_index(tree: Any) -> dict[Path, Any]:
    """{path: node} of every node of a validated tree: dict children by their key as a
    string (DCP's spelling), list and tuple children by position. One walk; lookups by a
    DCP path are then O(1)."""
    out: dict[Path, Any] = {}
    stack: list[tuple[Path, Any]] = [((), tree)]
    while stack:
        path, node = stack.pop()
        out.setdefault(path, node)
        kind = next(k for k in node if k != "meta")
        value = node[kind]
        if kind in ("dict", "odict"):
            stack.extend(((*path, str(k)), child) for (_t, k), child in value)
        elif kind in ("list", "tuple"):
            stack.extend(((*path, i), child) for i, child in enumerate(value))
    return out


# ------------------------------------------------------------------------------ commit
def confirm_blobs(store: Store, blobs: set[str]) -> None:
    """Raise ReusedBlobsMissingError unless every blob exists (HEAD each, in parallel)."""
    missing = missing_blobs(store, blobs, METADATA_THREADS)
    if missing:
        raise ReusedBlobsMissingError(missing)


#: ranks whose first blob the coordinator looks for before its commit (evenly spaced)
SHARED_PROBES = 64


def shared_probes(results: list[list[Any]]) -> dict[str, int]:
    """{blob: rank}: the first blob each of up to SHARED_PROBES ranks (evenly spaced, rank 0
    left out) wrote, from their write results: what the coordinator looks for in its store
    before it commits (`check_shared`)."""
    world = len(results)
    step = max(1, -(-(world - 1) // SHARED_PROBES))
    probes: dict[str, int] = {}
    for rank in range(1, world, step):
        for result in results[rank]:
            blob = _first_blob(result.storage_data)
            if blob is not None:
                probes.setdefault(blob, rank)
                break
    return probes


def _first_blob(doc: Any) -> str | None:
    """The blob of the first chunk a write result names, or None (no chunk: an empty
    tensor)."""
    if not isinstance(doc, dict):
        return None
    for _index, ref in doc.get("chunks", ()):  # a tensor's part: [chunk index, ref]
        return ref_from_wire(ref).blob
    for entry in ([doc["entry"]] if "entry" in doc else doc.get("entries", ())):
        for ref in entry.get("chunks", ()):
            return ref_from_wire(ref).blob
    return None


def check_shared(store: Store, probes: dict[str, int]) -> None:
    """Raise CkptStoreError unless the blobs of `probes` are all in `store`: ranks that wrote
    them elsewhere (a node-local folder on every node) did not share it, and the checkpoint
    committed there would name blobs it lacks."""
    lost = missing_blobs(store, probes, METADATA_THREADS)
    if lost:
        raise CkptStoreError(
            f"a blob rank {probes[lost[0]]} wrote ({lost[0]}) is not in {store.uri}, where the "
            "coordinator commits: every rank must save to the same location (one folder or "
            "bucket all ranks reach); nothing was committed")


class DcpCommitter:
    """Commits the manifest `build` made, through `CheckpointStore.save(..., committer=)`.
    `lease` is the save lease the coordinator took before any rank read a parent manifest
    (prepare_global_plan): if a gc may have run since, every blob is confirmed first."""

    def __init__(self, tree: Any, entries: tuple[TensorEntry, ...], lease: Lease | None,
                 probes: dict[str, int] | None = None) -> None:
        self.tree = tree
        self.entries = entries
        self.lease = lease
        #: blobs other ranks wrote, looked for before the commit (`check_shared`)
        self.probes = probes or {}
        self.info: SaveInfo | None = None

    def prepare_failed(self, name: str, error: str) -> None:
        """Nothing to tell: every rank's part is written; the repository raises."""

    def known_chunks(self, parent: str) -> KnownChunks | None:
        """Nothing remembered: the ranks' chunks are written already."""
        return None

    def commit(self, writer: CheckpointWriter, request: SaveRequest) -> Manifest:
        manifest = Manifest(name=request.name, created=writer.creation_time(),
                            metadata=request.metadata, tree=self.tree, tensors=self.entries,
                            parent=request.parent, hash=writer.options.hash.name,
                            version=version_for(self.entries))
        check_shared(writer.store, self.probes)
        if self.lease is not None:
            self.lease.check()
            if self.lease.sweep_may_have_run():
                confirm_blobs(writer.store, manifest.blob_digests())
        writer.commit(manifest, request.manifest_key)
        return manifest

    def committed(self, info: SaveInfo) -> None:
        self.info = info
